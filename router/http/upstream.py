"""The upstream side: one shared client session, header filtering, error classification."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import http_exceptions
from multidict import CIMultiDict, CIMultiDictProxy

from routewise_vllm.router.http.client import MALFORMED_REASONS, H1Client, MalformedResponse, UpstreamConnectError
from routewise_vllm.router.logsafe import safe
from routewise_vllm.router.settings import RouterSettings, replica_tls_context

log = logging.getLogger("router.upstream")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
# Also recomputed by aiohttp on each side. The router forwards the body it read, which aiohttp has
# already decompressed: a Content-Encoding left on it would make the replica fail the request.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect", "content-encoding"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "server", "date"}


def _filter(headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str]) -> CIMultiDict[str]:
    named = headers.get("connection")
    extra = {t.strip().lower() for t in named.split(",")} if named else ()
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk not in drop and lk not in extra:
            out.add(k, v)
    return out


def request_headers(headers: CIMultiDictProxy[str], peer: str | None = None) -> CIMultiDict[str]:
    """The client's headers for the replica, with the client's address appended to X-Forwarded-For."""
    out = _filter(headers, _REQUEST_DROP)
    if peer:
        prior = out.getall("x-forwarded-for", ())
        if prior:
            del out["x-forwarded-for"]
        out["X-Forwarded-For"] = ", ".join([*prior, peer])
    return out


def response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return _filter(headers, _RESPONSE_DROP)


class UpstreamError(Exception):
    """An attempt that failed before any byte reached the client (so it may be retried)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # connect | timeout | reset | http_5xx | stalled | stale_model | malformed | other: a label

    @property
    def status(self) -> int:
        return 504 if self.kind == "timeout" else 404 if self.kind == "stale_model" else 502


def classify(exc: BaseException) -> str:
    """The `kind` label of an upstream failure. `malformed`: an answer that is not well-formed HTTP (the lean client's
    MalformedResponse, or a head aiohttp's parser refused), which no request can make a sound replica send."""
    if isinstance(exc, (MalformedResponse, aiohttp.ClientResponseError)):
        return "malformed"
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, UpstreamConnectError)):
        return "connect"
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return "timeout"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError, ConnectionError)):
        return "reset"
    return "other"


def malformed_reason(exc: BaseException) -> str:
    """The `reason` label (client.MALFORMED_REASONS) of a `malformed` failure."""
    if isinstance(exc, MalformedResponse):
        return exc.reason
    # aiohttp's C parser raises a plain HttpProcessingError: its message's first words tell what it refused (what
    # follows the colon quotes the replica's bytes)
    cause = exc.__cause__
    text = str(getattr(cause, "message", "")).split("\n", 1)[0].split(":", 1)[0]
    if isinstance(cause, http_exceptions.LineTooLong) or "Got more than" in text or "too long" in text.lower():
        return "head_too_large"
    if isinstance(cause, http_exceptions.BadStatusLine) or "status" in text.lower():
        return "status"
    if "Too many headers" in text:
        return "too_many_headers"
    if "Transfer-Encoding" in text:
        return "transfer_encoding"
    if "Content-Length" in text:
        return "content_length"
    if "chunk" in text:
        return "chunk"
    if isinstance(cause, http_exceptions.InvalidHeader) or "header" in text.lower():
        return "header"
    return "other"


_LOGGED: dict[str, float] = {}  # replica -> when its last malformed answer was logged
LOG_EVERY_S = 60.0


def malformed(counter, replica: str, exc: BaseException) -> MalformedResponse:
    """Counts a malformed answer by replica and reason (`counter`: llm_router_upstream_malformed_total) and logs
    it, one line per replica a minute at most (a replica that keeps answering so does not flood the log). Returns
    the failure the client's 502 names: its reason, none of the replica's bytes (those go to the log, escaped)."""
    reason = malformed_reason(exc)
    counter.labels(replica, reason).inc()
    now, last = time.monotonic(), _LOGGED.get(replica)
    if last is None or now - last >= LOG_EVERY_S:
        _LOGGED[replica] = now
        log.warning("replica %s sent a malformed answer (%s), answered 502: %s (the next one logged in %g s at "
                    "the earliest)", replica, reason, safe(exc), LOG_EVERY_S)
    return MalformedResponse(reason, MALFORMED_REASONS[reason])


def client_timeout(settings: RouterSettings) -> aiohttp.ClientTimeout:
    """Per-phase timeouts, no total: a long generation is never cut while it keeps producing."""
    return aiohttp.ClientTimeout(
        total=None, connect=None, sock_connect=settings.connect_timeout_s, sock_read=settings.idle_timeout_s
    )


def make_session(settings: RouterSettings) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=settings.max_connections, ttl_dns_cache=10, enable_cleanup_closed=True,
                                     ssl=replica_tls_context(settings.replica_ca_file))
    return aiohttp.ClientSession(
        connector=connector, timeout=client_timeout(settings), auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        raise_for_status=False,
        # Clients' cookies pass through in their headers; a jar would replay one replica's Set-Cookie to
        # every later client (and costs a cookie filter per request).
        cookie_jar=aiohttp.DummyCookieJar(),
    )


def make_h1_client(settings: RouterSettings) -> H1Client:
    """The proxy's lean client for plain-http replicas: same pool limit and per-phase timeouts as the session."""
    return H1Client(limit=settings.max_connections, connect_timeout_s=settings.connect_timeout_s,
                    read_timeout_s=settings.idle_timeout_s)
