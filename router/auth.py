"""Bearer tokens: the clients' API keys on /v1/* (as vLLM's --api-key) and the admin token on /admin/*.

A request carries exactly one `Authorization: Bearer <key>` header; more than one is refused rather than judged
by its first. The comparison is constant-time on the bytes sent (aiohttp and the lean listener keep undecodable
header bytes as surrogates: encoded back, never a UnicodeEncodeError).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from aiohttp import web
from multidict import CIMultiDictProxy, MultiMapping

from routewise_vllm.router.errors import error_response

CLIENT_PREFIX = "/v1"  # vLLM checks the key on every path under it, not on /health, /metrics or /ready


class BearerTokens:
    """The tokens that open a door; `allows(headers)` is the check."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._expected = [f"Bearer {t}".encode() for t in tokens]
        if not self._expected:
            raise ValueError("no tokens")

    def allows(self, headers: MultiMapping[str] | CIMultiDictProxy[str]) -> bool:
        got = headers.getall("Authorization", [])
        sent = got[0].encode("utf-8", "surrogateescape") if len(got) == 1 else b""
        ok = False
        for expected in self._expected:  # every key compared, so the time does not say which one matched
            ok |= hmac.compare_digest(sent, expected)
        return ok


def client_keys(settings) -> BearerTokens | None:
    """The clients' API keys of `settings` (RouterSettings: api_key, or api_key_file's lines), None when unset."""
    if settings.api_key is None:
        return None
    return BearerTokens(settings.api_key.get_secret_value().split("\n"))


def unauthorized(what: str, code: str | None = None) -> web.Response:
    return error_response(401, f"missing or wrong {what}", "authentication_error", code=code,
                          headers={"WWW-Authenticate": "Bearer"})


def client_key_middleware(keys: BearerTokens):
    """aiohttp middleware: /v1/* needs a client API key (the lean listener checks its own requests in the proxy)."""

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith(CLIENT_PREFIX) and request.method != "OPTIONS" and not keys.allows(request.headers):
            return unauthorized("API key", "invalid_api_key")
        return await handler(request)

    return check
