"""A fleet view shared by router processes on several hosts, on Redis or Valkey (setting `shared_state`).

Every `shared_state_interval_s` (10 ms), off the requests' path, one round trip per router (one Lua script,
SYNC_SCRIPT: one command to pack and one reply to parse, which is most of what a sync costs the router's CPU):
  - publish: the entries of this router's own in-flight counts per replica (router.policy.remote_load) that
    changed since the last batch, into the hash routewise:{fleet}:load:<router id>, whose TTL
    (`shared_state_ttl_s`) every tick renews: the heartbeat. A router that dies stops renewing it and its share
    expires, and the next router to read drops it from the set of routers.
  - read: every other router's hash (the set routewise:{fleet}:routers names them); their sums per replica are
    folded into this router's trackers, so it decides on its own counts (instant) plus the others' (as of the
    last tick).
A tick that fails or takes longer than `shared_state_timeout_s` drops the others' counts at once (this router
decides on its own, as without shared state), counts llm_router_shared_state_errors_total and logs once per
episode; ticks go on with a backoff up to 1 s until Redis answers. llm_router_shared_state_age_seconds is the
age of the others' counts in use. No request ever waits for Redis.

With `--workers N` the host's workers already share their counts (router.scale.shared): worker 0 publishes the
host's sums under the host's id, which every worker of the host shares (the parent sets it before forking), and
each worker reads the other hosts only. One writer per host keeps Redis's load per host that of one router, and
a restarted worker 0 publishes under the same id, so the host's share never counts twice.

What is read from Redis is screened before it counts (`parse_counts`, SYNC_SCRIPT's bounds): a value that is not
five ASCII decimal integers, a negative one, one above what one router host could hold (MAX_IN_FLIGHT,
MAX_TOKENS), a key of another type, a hash of more than MAX_FIELDS fields or a set of more than MAX_ROUTERS
routers is ignored and counted in llm_router_shared_state_rejected_total{reason} (REJECT_REASONS), logged once
per episode. Within those bounds a writer is trusted: docs/multi-router.md says who must be.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, CollectorRegistry
from yarl import URL

from routewise_vllm.router.logsafe import safe, safe_exc
from routewise_vllm.router.policy.remote_load import SHARED_FIELDS, ZERO, Counts, RemoteLoad, own_counts
from routewise_vllm.router.scale.shared import FIELDS as HOST_FIELDS
from routewise_vllm.router.scale.shared import SharedClusterTracker, SharedReplicaTracker

log = logging.getLogger("router.fleet_view")

KEY_PREFIX = "routewise:{fleet}"  # {fleet}: a Redis Cluster hash tag, every key in one slot
ROUTERS_KEY = f"{KEY_PREFIX}:routers"
HEARTBEAT_FIELD = "_hb"  # always written: the hash exists while its router lives
HOST_ID_ENV = "_ROUTEWISE_FLEET_HOST_ID"  # set by `router serve --workers N` before forking (router.cli)
MAX_BACKOFF_S = 1.0
_HOST_INDEX = [HOST_FIELDS.index(f) for f in SHARED_FIELDS]

# What one router host can contribute, the bounds of a value read from Redis. Requests in flight to one replica:
# each holds its own TCP connection from the host to the replica (HTTP/1.1, no pipelining), and one source
# address has at most 65,536 ports towards one replica address.
MAX_IN_FLIGHT = 1 << 16
# Tokens: MAX_IN_FLIGHT requests of 2**26 (67 million, beyond any context window and max_tokens x n a client
# would mean) each. MAX_ROUTERS such values still sum within a float's exact integers (2**53), so no view,
# metric or feature overflows or rounds.
MAX_TOKENS = MAX_IN_FLIGHT << 26
_BOUNDS: Counts = (MAX_IN_FLIGHT, MAX_TOKENS, MAX_TOKENS, MAX_IN_FLIGHT, MAX_TOKENS)
_MAX_DIGITS = len(str(MAX_TOKENS))
_MAX_VALUE_CHARS = len(SHARED_FIELDS) * (_MAX_DIGITS + 2)
# A router publishes one field per replica it tracks, plus the heartbeat: 256 at most with --workers (the shared
# memory's columns); a single process has no cap, and 4,096 is far above any fleet one router fronts.
MAX_FIELDS = 4096 + 1
# Every router reads every other's hash each tick: a fleet of more routers is not one this design serves.
MAX_ROUTERS = 1024
# llm_router_shared_state_rejected_total{reason}: a value that is not five ASCII decimal integers, one below 0, one
# above the bounds, another router's key that is not a hash, a hash of more than MAX_FIELDS fields, a set of more
# than MAX_ROUTERS routers (then no other router's counts are read: this router decides on its own)
REJECT_REASONS = ("malformed", "negative", "out_of_range", "wrong_type", "too_many_fields", "too_many_routers")


# One tick, one command, atomic: publish (when ARGV[3] is 1: the changed fields, the fields to delete, the TTL, the
# set of routers), then every other router's hash; a router in the set whose hash expired is dropped from it.
# KEYS: the set of routers, this router's hash. ARGV: router id, TTL (ms), publish?, [n, field, value..., n, field...],
# the hashes' key prefix, MAX_ROUTERS, MAX_FIELDS. Returns {fields HSET added (-1: no write), routers in the set
# when more than MAX_ROUTERS (then nothing else) else 0, then for each other router: its id, its hash (flat) or -1
# (its key is not a hash) or -2 (more than MAX_FIELDS fields)}. Nothing over the bounds leaves Redis.
SYNC_SCRIPT = """
local rid, i, added = ARGV[1], 4, -1
if ARGV[3] == '1' then
  local n = tonumber(ARGV[i])
  added = redis.call('HSET', KEYS[2], unpack(ARGV, i + 1, i + 2 * n))
  i = i + 2 * n + 1
  local g = tonumber(ARGV[i])
  if g > 0 then redis.call('HDEL', KEYS[2], unpack(ARGV, i + 1, i + g)) end
  i = i + g + 1
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('SADD', KEYS[1], rid)
end
local routers = redis.call('SCARD', KEYS[1])
if routers > tonumber(ARGV[i + 1]) then return {added, routers} end
local out, max_fields = {added, 0}, tonumber(ARGV[i + 2])
for _, peer in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if peer ~= rid then
    local key = ARGV[i] .. peer
    local n = redis.pcall('HLEN', key)
    if type(n) == 'table' then
      out[#out + 1] = peer
      out[#out + 1] = -1
    elseif n == 0 then
      redis.call('SREM', KEYS[1], peer)
    elseif n > max_fields then
      out[#out + 1] = peer
      out[#out + 1] = -2
    else
      out[#out + 1] = peer
      out[#out + 1] = redis.call('HGETALL', key)
    end
  end
end
return out
"""


def load_key(router_id: str) -> str:
    return f"{KEY_PREFIX}:load:{router_id}"


def new_host_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def router_id(worker: bool) -> str:
    """This router's id in the fleet view: a worker of `--workers N` takes its host's (the parent's); a single
    process makes its own (never from the environment, which a child process may have inherited)."""
    if worker:
        return os.environ.get(HOST_ID_ENV) or f"{socket.gethostname()}-{os.getppid()}"
    return new_host_id()


def encode(c: Counts) -> str:
    return " ".join(map(str, c))


def parse_counts(value: object) -> Counts | str:
    """The counts in one field's value (what `encode` writes), or the reason (REJECT_REASONS) it is refused."""
    if not isinstance(value, str):
        return "malformed"
    if len(value) > _MAX_VALUE_CHARS:
        return "out_of_range"
    parts = value.split(" ")
    if len(parts) != len(SHARED_FIELDS):
        return "malformed"
    counts = []
    for p, bound in zip(parts, _BOUNDS):
        negative = p[:1] == "-"
        digits = p[1:] if negative else p
        if not (digits.isascii() and digits.isdigit()):  # no sign, space, underscore or other script's digits
            return "malformed"
        if negative:
            return "negative"
        if len(digits) > _MAX_DIGITS or int(digits) > bound:
            return "out_of_range"
        counts.append(int(digits))
    return tuple(counts)  # type: ignore[return-value]


def decode(value: str) -> Counts | None:
    c = parse_counts(value)
    return None if isinstance(c, str) else c


class Screened:
    """The other routers' sums from one tick's reply, and what was refused in it."""

    __slots__ = ("sums", "rejected", "culprit")

    def __init__(self) -> None:
        self.sums: dict[str, list[int]] = {}
        self.rejected: dict[str, int] = {}  # reason -> records refused
        self.culprit: str | None = None  # the first router a refused record came from

    def refuse(self, reason: str, peer: str | None, n: int = 1) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + n
        if self.culprit is None:
            self.culprit = peer

    def add(self, h: Any, peer: str | None = None) -> None:
        """One router's hash (a flat field, value list), or SYNC_SCRIPT's code for one it did not send."""
        if h == -1:
            return self.refuse("wrong_type", peer)
        if h == -2:
            return self.refuse("too_many_fields", peer)
        if not isinstance(h, list):
            return self.refuse("malformed", peer)
        sums = self.sums
        for j in range(0, len(h) - 1, 2):
            rid = h[j]
            if rid == HEARTBEAT_FIELD:
                continue
            c = parse_counts(h[j + 1])
            if isinstance(c, str):
                self.refuse(c, peer)
                continue
            acc = sums.get(rid)
            if acc is None:
                sums[rid] = list(c)
            else:
                for i, v in enumerate(c):
                    acc[i] += v
        return None

    def result(self) -> dict[str, Counts]:
        return {rid: tuple(v) for rid, v in self.sums.items()}  # type: ignore[misc]


def screen(reply: list[Any]) -> Screened:
    """SYNC_SCRIPT's reply after its first element: the routers-set status, then (router id, hash or code) pairs."""
    out = Screened()
    if not reply:
        return out
    if reply[0] != 0:
        out.refuse("too_many_routers", None)
        return out
    for j in range(1, len(reply) - 1, 2):
        out.add(reply[j + 1], reply[j] if isinstance(reply[j], str) else None)
    return out


@dataclass(frozen=True, slots=True)
class FleetViewConfig:
    """The settings of the same names (RouterSettings.fleet_view_config builds it when shared_state is set)."""

    shared_state: str  # redis://, rediss:// or unix:// URL, validated
    shared_state_interval_s: float
    shared_state_ttl_s: float  # above interval + timeout
    shared_state_timeout_s: float


def redact_url(url: str) -> str:
    """`url` with its password (if any: in the authority, or redis-py's `?password=`) shown as "<redacted>"."""
    u = URL(url)
    if u.password:
        url = str(u.with_password("REDACTED")).replace("REDACTED", "<redacted>")
    return re.sub(r"([?&]password=)[^&#]*", r"\1<redacted>", url)


class LoadSource(Protocol):
    def own(self) -> dict[str, Counts]: ...
    def apply(self, sums: Mapping[str, Counts]) -> bool: ...


class FleetState:
    """The sync's bookkeeping, no I/O (tests drive it with a fake clock): what to publish, the merge of the other
    routers' hashes, error episodes, backoff and the view's age."""

    def __init__(self, router_id: str, interval_s: float, clock: Callable[[], float], heartbeat_s: float = 0.5) -> None:
        self.router_id = router_id
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.last_write: float | None = None
        self.published: dict[str, Counts] = {}  # what Redis holds of ours (cleared when it may have lost it)
        self.last_ok: float | None = None
        self.started = clock()
        self.failing_since: float | None = None
        self.failures = 0  # in the current episode

    def batch(self, own: Mapping[str, Counts]) -> tuple[dict[str, str], list[str], int] | None:
        """(fields to write: the entries that changed plus the heartbeat, fields to delete: replicas this router
        no longer has, how many written fields are new to Redis); None when nothing changed and the heartbeat (which
        renews the TTL) is not due."""
        pub = self.published
        fields = {rid: encode(c) for rid, c in own.items() if pub.get(rid) != c}
        gone = [rid for rid in pub if rid not in own]
        now = self.clock()
        if (not fields and not gone and pub and self.last_write is not None
                and now - self.last_write < self.heartbeat_s):
            return None
        new = sum(1 for rid in fields if rid not in pub) + (0 if pub else 1)  # the heartbeat is new on a full write
        fields[HEARTBEAT_FIELD] = f"{time.time():.3f}"
        return fields, gone, new

    def wrote(self, own: Mapping[str, Counts], added: int, expected_new: int) -> None:
        """The batch from `own` was written; Redis said `added` of its fields were new. More than expected: the
        hash had expired or Redis restarted empty, so the next batch is a full one."""
        self.published = dict(own) if added <= expected_new else {}
        self.last_write = self.clock()

    @staticmethod
    def merge(hashes: list[Any]) -> dict[str, Counts]:
        """The other routers' sums per replica, from their hashes (flat field, value lists). A value out of range
        or that this version cannot read (another version's) is skipped."""
        out = Screened()
        for h in hashes:
            out.add(h)
        return out.result()

    def succeeded(self) -> float | None:
        """A tick went through; the length of the failure episode it ends, if any."""
        now = self.clock()
        self.last_ok = now
        if self.failing_since is None:
            return None
        episode, self.failing_since, self.failures = now - self.failing_since, None, 0
        return episode

    def failed(self) -> bool:
        """A tick failed: True if it starts an episode (log it). Redis may have lost our hash meanwhile."""
        self.failures += 1
        self.published = {}
        if self.failing_since is None:
            self.failing_since = self.clock()
            return True
        return False

    def next_delay(self, tick_started: float) -> float:
        """Seconds to wait before the next tick: the interval from the last start, or a doubling backoff while
        failing (at most MAX_BACKOFF_S)."""
        if self.failing_since is None:
            return max(0.0, tick_started + self.interval_s - self.clock())
        return min(MAX_BACKOFF_S, self.interval_s * 2 ** min(self.failures, 20))

    def age(self) -> float:
        """Age of the others' counts in use (since the start, before the first good tick)."""
        return self.clock() - (self.last_ok if self.last_ok is not None else self.started)


class FleetSharedClusterTracker(SharedClusterTracker):
    """`--workers N` with shared state: views read the host's sums (router.scale.shared) plus the other hosts' (the
    fleet view's latest), added at each refresh."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.remote: dict[str, Counts] = {}
        super().__init__(*args, **kwargs)

    def refresh(self) -> None:
        super().refresh()
        remote = self.remote
        if not remote:
            return
        for t in self.trackers:
            r = remote.get(t.replica_id)
            if r is not None and isinstance(t, SharedReplicaTracker):
                total = list(t._total)
                for i, v in zip(_HOST_INDEX, r):
                    total[i] += v
                t._total = total

    def own(self) -> dict[str, Counts]:
        """The host's counts (every worker's)."""
        self.refresh()
        remote = self.remote
        return {t.replica_id: own_counts(t, remote.get(t.replica_id, ZERO)) for t in self.trackers
                if isinstance(t, SharedReplicaTracker)}

    def apply(self, sums: Mapping[str, Counts]) -> bool:
        if sums == self.remote:
            return False
        self.remote = dict(sums)
        self.refresh()
        return True


def load_source(cluster: Any) -> LoadSource:
    return cluster if isinstance(cluster, FleetSharedClusterTracker) else RemoteLoad(cluster)


def check_client() -> str | None:
    """Why shared_state cannot work here (one line), or None."""
    try:
        import redis.asyncio  # noqa: F401
    except ImportError:
        return "shared_state needs the redis package: pip install 'routewise-vllm[redis]'"
    return None


class FleetSync:
    """The sync loop of one router process (see the module's docstring)."""

    def __init__(self, config: FleetViewConfig, source: LoadSource, registry: CollectorRegistry, *, router_id: str,
                 publisher: bool, on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, multiprocess: bool = False) -> None:
        from redis.asyncio import from_url
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        url, interval_s = config.shared_state, config.shared_state_interval_s
        ttl_s, timeout_s = config.shared_state_ttl_s, config.shared_state_timeout_s
        self.url, self.source, self.publisher = url, source, publisher
        self.router_id, self.key = router_id, load_key(router_id)
        self.ttl_ms, self.timeout_s = max(1, int(ttl_s * 1000)), timeout_s
        self.on_change = on_change
        self.clock = clock
        # the heartbeat renews the TTL 4 times per TTL when nothing changed (a write that changes counts renews it too)
        self.state = FleetState(router_id, interval_s, clock, heartbeat_s=ttl_s / 4)
        # no retries inside the client: a failed tick is the retry unit, and it must never take longer than timeout_s
        # the URL as redis-py reads it: redis://[user:password@]host:port/db, rediss:// (TLS, ?ssl_cert_reqs=...),
        # unix://[user@]/path?password=...; bytes that are not UTF-8 (someone else's) cannot fail a whole tick
        self.client = from_url(url, decode_responses=True, encoding_errors="replace", socket_timeout=timeout_s,
                               socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0,
                               client_name="routewise", protocol=2)
        self.script = self.client.register_script(SYNC_SCRIPT)  # EVALSHA, loaded again after a Redis restart
        self.errors = Counter("llm_router_shared_state_errors", "Syncs with the shared fleet view (shared_state) that "
                              "failed or timed out; until one succeeds the router decides on its own in-flight counts.",
                              registry=registry)
        self.age = Gauge("llm_router_shared_state_age_seconds", "Age of the other routers' in-flight counts this "
                         "router decides on (time since its last successful sync with shared_state).",
                         registry=registry, multiprocess_mode="livemax")
        self.rejected = Counter("llm_router_shared_state_rejected", "Records read from shared_state that were "
                                "ignored, by reason: malformed, negative, out_of_range (above what one router could "
                                "hold), wrong_type (a key that is not a hash), too_many_fields, too_many_routers.",
                                ["reason"], registry=registry)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self._rejecting = False  # an episode of refused records is under way (logged once)

    async def tick(self) -> None:
        """One round trip: publish, read, fold. Never raises (but CancelledError)."""
        st = self.state
        try:
            batch = st.batch(own := self.source.own()) if self.publisher else None
            args: list[Any] = [self.router_id, self.ttl_ms]
            if batch is None:
                args.append(0)
            else:
                fields, gone, expected_new = batch
                args += [1, len(fields), *(x for kv in fields.items() for x in kv), len(gone), *gone]
            args += [load_key(""), MAX_ROUTERS, MAX_FIELDS]
            res = await asyncio.wait_for(self.script(keys=[ROUTERS_KEY, self.key], args=args), self.timeout_s)
            screened = screen(res[1:])
            sums = screened.result()
            if batch is not None:
                st.wrote(own, int(res[0]), expected_new)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Redis down, slow, or answering garbage: the local view
            self.errors.inc()
            if st.failed():
                log.warning("shared state %s: %s; deciding on this router's own in-flight counts until it answers",
                            redact_url(self.url), safe_exc(exc))
            sums = {}
        else:
            episode = st.succeeded()
            if episode is not None:
                log.info("shared state %s answers again after %.1f s: deciding on the fleet's in-flight counts",
                         redact_url(self.url), episode)
            self._refused(screened)
        if self.source.apply(sums):
            self.on_change()  # others' completions may free room a held request waits for
        self.age.set(st.age())

    def _refused(self, screened: Screened) -> None:
        """Counts the records a good tick ignored; one line when such an episode starts and one when it ends."""
        for reason, n in screened.rejected.items():
            self.rejected.labels(reason).inc(n)
        if screened.rejected and not self._rejecting:
            self._rejecting = True
            what = ", ".join(f"{n} {reason}" for reason, n in sorted(screened.rejected.items()))
            log.warning("shared state %s: ignoring records that cannot be another router's counts (%s%s); counted "
                        "in llm_router_shared_state_rejected_total until they stop (logged once)", redact_url(self.url),
                        what, "" if screened.culprit is None else f", first under router id '{safe(screened.culprit, 80)}'")
        elif not screened.rejected and self._rejecting:
            self._rejecting = False
            log.info("shared state %s: no record ignored any more", redact_url(self.url))

    async def run(self) -> None:
        while True:
            started = self.clock()
            await self.tick()
            await asyncio.sleep(self.state.next_delay(started))

    async def close(self) -> None:
        """Leaves the fleet view at once (a router that stops cleanly does not wait for its TTL)."""
        try:
            if self.publisher:
                pipe = self.client.pipeline(transaction=False)
                pipe.delete(self.key)
                pipe.srem(ROUTERS_KEY, self.router_id)
                await asyncio.wait_for(pipe.execute(), self.timeout_s)
        except Exception:  # noqa: BLE001 - best effort: the TTL removes it anyway
            pass
        finally:
            try:
                await self.client.aclose()
            except Exception:  # noqa: BLE001
                pass
