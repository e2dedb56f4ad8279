"""Client connections the listener holds: how many, from whom, and which to let go first.

Every socket the router holds, clients' and replicas' alike, counts against the open-file limit. At start the
soft RLIMIT_NOFILE is raised to the hard limit (`raise_open_file_limit`) and the client-connection cap derived
from what it leaves (`connection_caps`). `ClientConnections.admit` decides on each new connection:
- an address at its per-client cap, or the listener at its cap, first closes the longest-idle connection (of that
  address, or any) that has no request in progress and no byte of one buffered;
- with nothing idle to close, a connection over the cap takes one of PROBE_SLOTS probe slots: its request is read,
  /health and /ready are answered, anything else gets a 503 (a listener at its cap stays observable);
- otherwise (the per-client cap, or the probe slots taken) it gets a 503 before anything is read.
Each refusal is counted (llm_router_connections_refused_total{reason}); an episode of refusals is logged when it
starts and when it ends (EPISODE_QUIET_S without one), not per connection.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from routewise_vllm.router.errors import BadRequest

if TYPE_CHECKING:
    from prometheus_client import Counter

    from routewise_vllm.router.settings import RouterSettings

log = logging.getLogger("router.connections")

RESERVED_FDS = 64  # listening sockets, logs, decision-log files, the model, DNS: what is not a connection
PROBE_SLOTS = 16  # connections over the cap still read for /health and /ready
PROBE_HEADER_TIMEOUT_S = 2.0  # a probe slot waits this long at most for its request head
PROBE_PATHS = frozenset({"/health", "/ready"})
OPS_CAP = 64  # the ops listener's cap (/metrics, /admin, probes: a few scrapers and operators)
MAX_DERIVED_CAP = 65536  # the derived cap's ceiling (memory per connection); an explicit setting may go higher
EPISODE_QUIET_S = 10.0  # a refusal episode ends after this long without a refusal

ADMITTED, PROBE = "admitted", "probe"
GLOBAL_CAP, PER_CLIENT_CAP = "global_cap", "per_client_cap"  # the refusal reasons (a bounded label)
REFUSAL_REASONS = (GLOBAL_CAP, PER_CLIENT_CAP)


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """What the listener (router.http.listener, router.http.server) takes of the settings of the same names
    (`of` builds it)."""

    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    max_header_bytes: int
    max_body_bytes: int
    lean: bool  # plain generation requests on the lean listener (lean_listener on, access_log off)
    max_client_connections: int | None
    max_connections_per_client: int | None
    upstream_connections: int  # the upstream pool's size (max_connections), 0: unbounded
    ops_listener: bool  # an ops listener (ops_port) holds file descriptors too

    @classmethod
    def of(cls, settings: RouterSettings) -> ListenerConfig:
        return cls(header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                   keepalive_timeout_s=settings.keepalive_timeout_s, max_header_bytes=settings.max_header_bytes,
                   max_body_bytes=settings.max_body_bytes, lean=settings.lean_listener and not settings.access_log,
                   max_client_connections=settings.max_client_connections,
                   max_connections_per_client=settings.max_connections_per_client,
                   upstream_connections=settings.max_connections, ops_listener=settings.ops_port is not None)

    def handler_args(self) -> dict[str, Any]:
        """aiohttp's connection handler's limits. lingering: after refusing a request whose body was not read, its
        rest is drained for at most 1 s (aiohttp: 10 s), so a slow body cannot hold the connection long after its
        408. max_field_size: a header line as long as the whole head may be (a longer head gets a 431). max_headers:
        aiohttp's own default since 3.10 (3.9's allowed 32,768 header lines in a pipelined head)."""
        return {"max_field_size": self.max_header_bytes, "max_headers": 128, "keepalive_timeout": self.keepalive_timeout_s,
                "lingering_time": 1.0}


def raise_open_file_limit() -> tuple[int, int]:
    """Raises the soft RLIMIT_NOFILE to the hard limit; returns the soft limit before and after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    target = hard if hard != infinite else 1 << 20
    if soft != infinite and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # macOS: no higher than OPEN_MAX; the soft limit stays
            pass
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft, (now if now != infinite else 1 << 20)


def connection_caps(config: ListenerConfig, nofile: int) -> tuple[int, int]:
    """(client connections, connections per client address) of the public listener under an open-file limit of
    `nofile`: what the reserve, the probe slots and the ops listener leave, less the upstream side (the upstream
    pool's size if bounded, else one replica connection per client connection)."""
    spare = nofile - RESERVED_FDS - PROBE_SLOTS - (OPS_CAP + PROBE_SLOTS if config.ops_listener else 0)
    upstream = min(config.upstream_connections or spare, spare // 2)
    allowed = max(1, spare - upstream)
    cap = config.max_client_connections
    if cap is None:
        cap = min(allowed, MAX_DERIVED_CAP)
    elif cap > allowed:
        log.warning("max_client_connections=%d is more than the open-file limit of %d leaves for client connections: "
                    "using %d", cap, nofile, allowed)
        cap = allowed
    per_client = config.max_connections_per_client
    return cap, max(1, cap // 2) if per_client is None else min(per_client, cap)


def head_too_large(limit: int) -> BadRequest:
    return BadRequest(f"request line and headers larger than {limit} bytes (max_header_bytes)", status=431,
                      code="request_header_fields_too_large")


def peer_address(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, (tuple, list)) and peer else None


class _Episode:
    __slots__ = ("start", "last", "count", "address")

    def __init__(self, now: float, address: Hashable) -> None:
        self.start = self.last = now
        self.count = 1
        self.address = address


class ClientConnections:
    """The open client connections of one listener, by address, with the idle ones in the order they went idle.

    A connection is anything with a `transport`; it reports `idle` (no request in progress, nothing buffered) and
    `busy` (a byte arrived) and is `release`d when it closes. Closing an idle one to make room closes its transport
    (what the keep-alive timeout would do later) and releases it at once."""

    def __init__(self, cap: int, per_client: int, *, refused: Counter | None = None,
                 idle_closed: Counter | None = None, name: str = "client",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.per_client = per_client
        self.name = name
        self._refused = refused
        self._idle_closed = idle_closed
        self._clock = clock
        self._where: dict[Any, Hashable] = {}  # open connection (probe slots included) -> client address
        self._per_address: dict[Hashable, int] = {}
        self._probes: set[Any] = set()
        self._idle: dict[Any, None] = {}  # longest idle first
        self._idle_by_address: dict[Hashable, dict[Any, None]] = {}
        self._episodes: dict[str, _Episode] = {}
        self.lingering: set[Any] = set()  # refused connections still read (and dropped) before they close

    @property
    def open(self) -> int:
        """Open connections, probe slots not counted."""
        return len(self._where) - len(self._probes)

    @property
    def probes(self) -> int:
        return len(self._probes)

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def admit(self, address: Hashable) -> str:
        """ADMITTED, PROBE (a probe slot: /health and /ready only) or the refusal's reason; `register` the admitted."""
        if (self._per_address.get(address, 0) >= self.per_client
                and not self._close_idle(self._idle_by_address.get(address))):
            return self.refused(PER_CLIENT_CAP, address)
        if self.open >= self.cap and not self._close_idle(self._idle):
            return PROBE if len(self._probes) < PROBE_SLOTS else self.refused(GLOBAL_CAP, address)
        return ADMITTED

    def register(self, conn: Any, address: Hashable, probe: bool = False) -> None:
        self._where[conn] = address
        self._per_address[address] = self._per_address.get(address, 0) + 1
        if probe:
            self._probes.add(conn)
        else:
            self.idle(conn)

    def release(self, conn: Any) -> None:
        address = self._where.get(conn, self)
        if address is self:
            return
        self.busy(conn)
        del self._where[conn]
        self._probes.discard(conn)
        n = self._per_address[address] - 1
        if n:
            self._per_address[address] = n
        else:
            del self._per_address[address]

    def idle(self, conn: Any) -> None:
        address = self._where.get(conn, self)
        if address is self or conn in self._probes:
            return
        self.busy(conn)  # to the end: the most recently idle
        self._idle[conn] = None
        self._idle_by_address.setdefault(address, {})[conn] = None

    def busy(self, conn: Any) -> None:
        if self._idle.pop(conn, self) is self:
            return
        address = self._where[conn]
        by_address = self._idle_by_address[address]
        del by_address[conn]
        if not by_address:
            del self._idle_by_address[address]

    def _close_idle(self, idle: dict[Any, None] | None) -> bool:
        if not idle:
            return False
        conn = next(iter(idle))
        self.release(conn)
        transport = getattr(conn, "transport", None)
        if transport is not None:
            transport.close()
        if self._idle_closed is not None:
            self._idle_closed.inc()
        return True

    def refused(self, reason: str, address: Hashable) -> str:
        """Counts a refusal; the first of an episode is logged."""
        if self._refused is not None:
            self._refused.labels(reason).inc()
        now = self._clock()
        episode = self._episodes.get(reason)
        if episode is not None:
            episode.last = now
            episode.count += 1
            return reason
        episode = self._episodes[reason] = _Episode(now, address)
        if reason == PER_CLIENT_CAP:
            why = f"{address} holds {self.per_client}, the per-client cap (max_connections_per_client)"
        else:
            why = f"{self.open} open, the cap (max_client_connections), and no idle one to close"
        log.warning("%s connections: refusing new ones with a 503: %s; logged once per episode, counted in "
                    "llm_router_connections_refused_total{reason=%r}", self.name, why, reason)
        asyncio.get_running_loop().call_later(EPISODE_QUIET_S, self._episode_check, reason, episode)
        return reason

    def _episode_check(self, reason: str, episode: _Episode) -> None:
        quiet = self._clock() - episode.last
        if quiet < EPISODE_QUIET_S:
            asyncio.get_running_loop().call_later(EPISODE_QUIET_S - quiet, self._episode_check, reason, episode)
            return
        del self._episodes[reason]
        log.warning("%s connections: %d refused (%s, first from %s) over %.1f s; none since %.0f s", self.name,
                    episode.count, reason, episode.address, episode.last - episode.start, quiet)
