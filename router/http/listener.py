"""The client side of the listener: what aiohttp does not bound or shape by itself, through aiohttp's public interface
only (aiohttp from 3.13.4 to 3.x: pyproject's range, tests/router/test_aiohttp_range.py).

- `RouterRunner` (use it instead of `web.AppRunner`) serves its sites from its own protocol factory (`Listener`, the
  runner's `server`), which makes every connection a `GuardedHandler` (router.http.guarded: a `web.RequestHandler`
  whose public methods it extends; where requests begin and end it reads itself, router.http.framing):
  request line and headers must arrive within header_timeout_s (slow-loris) and fit in max_header_bytes (else a
  431), connections are admitted by the listener's `ClientConnections` (router.http.connections: a cap derived from
  the open-file limit, a per-client cap, idle ones closed first, probe slots for /health and /ready at the cap),
  and malformed HTTP gets a 400 in the OpenAI error shape with one log line (aiohttp logs a traceback and
  answers in plain text).
- With a Proxy given and the lean listener on (ListenerConfig.lean), every connection starts on the lean listener
  (router.http.server: the generation endpoints without aiohttp's server side) and is handed to a GuardedHandler
  at its first request that is not a plain generation request.
- `openai_errors` (a middleware) turns aiohttp's own HTTP errors (404, 405, 413, ...) into the same shape.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from routewise_vllm.router.errors import error_response
from routewise_vllm.router.http.connections import (OPS_CAP, ClientConnections, ListenerConfig, connection_caps,
                                                    raise_open_file_limit)
from routewise_vllm.router.http.guarded import GuardedHandler
from routewise_vllm.router.http.server import LeanConnection

if TYPE_CHECKING:
    from routewise_vllm.router.proxy import Proxy
    from routewise_vllm.router.telemetry import RouterMetrics

log = logging.getLogger("router.listener")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
        return error_response(exc.status, exc.reason if exc.status != 404 else f"unknown path {request.path[:200]!r}",
                              code=code, headers=headers or None)


class Listener:
    """The protocol factory of a RouterRunner's sites (its `server`): a lean connection for each client when the lean
    listener is on, else a GuardedHandler. It holds the listener's connection table (`conns`) and its open lean
    connections, which the runner's cleanup drains (aiohttp's server drains the GuardedHandlers)."""

    def __init__(self, aiohttp_server: web.Server, config: ListenerConfig, conns: ClientConnections,
                 handler_kwargs: dict[str, Any], lean: Proxy | None) -> None:
        self.aiohttp_server = aiohttp_server
        self.config = config
        self.conns = conns
        self.max_header_bytes = config.max_header_bytes
        self.handler_kwargs = handler_kwargs
        self.lean: set[LeanConnection] = set()
        self._generate = None if lean is None else lean.generate
        self._limits = (config.header_timeout_s, config.body_timeout_s, config.keepalive_timeout_s)

    def guarded(self, admission: str | None = None) -> GuardedHandler:
        return GuardedHandler(self, admission)

    def __call__(self) -> asyncio.Protocol:
        if self._generate is None:
            return self.guarded()
        return LeanConnection(self, self._generate, self._limits, self.guarded, self.config.max_body_bytes)

    def opened(self, conn: LeanConnection) -> None:
        self.lean.add(conn)

    def closed(self, conn: LeanConnection) -> None:
        self.conns.release(conn)
        self.lean.discard(conn)

    async def drain(self, timeout: float | None) -> None:
        """Lean connections: the idle ones closed now, a request in progress waited for up to `timeout`."""
        conns = list(self.lean)
        for conn in conns:
            conn.close()
        await asyncio.gather(*(conn.shutdown(timeout) for conn in conns))


_RUNNER_ONLY = frozenset({"handle_signals", "shutdown_timeout", "handler_cancellation", "request_factory", "loop"})


class RouterRunner(web.AppRunner):
    """An AppRunner whose sites serve `Listener` connections, limited by the config's header_timeout_s,
    max_header_bytes and connection caps; with `proxy` (and the lean listener on: it writes no access log) they start
    on the lean listener. Its construction raises the soft open-file limit to the hard one and derives the caps from
    it (router.http.connections); without a proxy (the ops listener) the cap is OPS_CAP. Refusals are counted in
    `metrics` (default: the proxy's)."""

    def __init__(self, app: web.Application, *, config: ListenerConfig, proxy: Proxy | None = None,
                 metrics: RouterMetrics | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        before, nofile = raise_open_file_limit()
        cap, per_client = connection_caps(config, nofile)
        if proxy is None:
            cap, per_client = min(cap, OPS_CAP), min(per_client, OPS_CAP)
        else:
            log.info("open-file limit %d%s: up to %d client connections, %d per client address", nofile,
                     f" (raised from {before})" if nofile > before else "", cap, per_client)
        metrics = metrics if metrics is not None or proxy is None else proxy.metrics
        self.conns = ClientConnections(
            cap, per_client, name="client" if proxy is not None else "ops listener",
            refused=None if metrics is None else metrics.connections_refused,
            idle_closed=None if metrics is None else metrics.idle_connections_closed)
        self.config = config
        self._lean = proxy if proxy is not None and config.lean else None
        # aiohttp's connection handlers take the runner's arguments, the app's handler_args as aiohttp gives them
        self._handler_kwargs = {**{k: v for k, v in kwargs.items() if k not in _RUNNER_ONLY}, **config.handler_args()}
        self._drain_timeout: float | None = kwargs.get("shutdown_timeout", 60.0)
        self._listener: Listener | None = None

    @property
    def server(self) -> Listener | None:  # type: ignore[override]
        """The sites' protocol factory (a Listener), once set up."""
        return self._listener

    async def setup(self) -> None:
        await super().setup()
        aiohttp_server = super().server
        assert aiohttp_server is not None
        self._listener = Listener(aiohttp_server, self.config, self.conns, self._handler_kwargs, self._lean)

    async def cleanup(self) -> None:
        """aiohttp's cleanup (sites stopped, idle connections closed, the app's on_shutdown, requests in progress
        waited for up to shutdown_timeout, the app's cleanup), with the lean connections drained alongside."""
        listener = self._listener
        for site in list(self.sites):
            await site.stop()
        if listener is None:
            await super().cleanup()
            return
        await asyncio.sleep(0)  # requests that arrived before the sites stopped begin (as aiohttp's cleanup)
        lean = asyncio.ensure_future(listener.drain(self._drain_timeout))
        try:
            await super().cleanup()
        finally:
            await lean
            self._listener = None
