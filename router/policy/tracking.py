"""Router-side state per replica, kept identically by the live router and the simulator.

Both worlds call the same hooks (dispatch, first token, completion, scrape) and build
snapshots with the same code, which is what makes their features bit-identical.
Times are passed in by the caller (this package never reads a clock).
"""

from __future__ import annotations

import logging
import math

from router.policy.estimate import DEFAULT_PREFIX_BLOCK_TOKENS, PrefixIndex
from router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo, make_view

try:
    from router.policy import _fastnet as _compiled
except ImportError:  # built without a C compiler: the Python snapshots below
    _compiled = None

# Expected decode length when a request carries no max_tokens.
DEFAULT_DECODE_TOKENS_EST = 256
EMA_ALPHA = 0.2
# tpot_floor_s: a low percentile of the TPOTs measured, tracked without a window: it rises by TPOT_FLOOR_RISE per
# completion above it and drops by at most TPOT_FLOOR_DROP per completion below (never past the sample), so it
# settles where about RISE / (RISE + DROP) = 10 % of the samples lie below: one burst of tokens that arrived in
# a single read (a TPOT near zero: live streams do that) moves it 9 %, not to zero; a replica that slows for good
# is seen slow after ~100 completions. Published after TPOT_FLOOR_MIN_SAMPLES completions.
TPOT_FLOOR_RISE = 0.01
TPOT_FLOOR_DROP = 0.09
TPOT_FLOOR_MIN_SAMPLES = 16
_INF = math.inf


class ReplicaTracker:
    """Counters and last-scrape values of one replica, as the router knows them."""

    # slots: the compiled view reads them by offset (a subclass may add a __dict__ and properties)
    __slots__ = (
        "replica_id", "healthy", "outstanding", "outstanding_prompt_tokens", "outstanding_decode_tokens",
        "dispatched_since_scrape", "waiting", "running", "kv_cache_usage", "kv_capacity_tokens", "last_scrape_s",
        "ttft_ema_s", "tpot_ema_s", "awaiting_first_token", "awaiting_prompt_tokens", "tpot_floor_s", "_inflight",
        "_tpot_low", "_tpot_samples",
    )  # fmt: skip

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.healthy = True
        self.outstanding = 0
        self.outstanding_prompt_tokens = 0
        self.outstanding_decode_tokens = 0
        self.dispatched_since_scrape = 0
        self.waiting: int | None = None
        self.running: int | None = None
        self.kv_cache_usage: float | None = None
        self.kv_capacity_tokens: int | None = None
        self.last_scrape_s: float | None = None
        self.ttft_ema_s: float | None = None
        self.tpot_ema_s: float | None = None
        self.awaiting_first_token = 0
        self.awaiting_prompt_tokens = 0
        self.tpot_floor_s: float | None = None
        self._tpot_low = _INF
        self._tpot_samples = 0
        # request id -> [prompt tokens, decode tokens, 1 while its first token has not come back]
        self._inflight: dict[str, list[int]] = {}

    def on_dispatch(self, request: RequestInfo) -> None:
        decode = request.max_tokens
        if decode is None:
            decode = DEFAULT_DECODE_TOKENS_EST
        prompt = request.prompt_tokens_est
        self._inflight[request.request_id] = [prompt, decode, 1]
        self.outstanding += 1
        self.awaiting_first_token += 1
        self.awaiting_prompt_tokens += prompt
        self.outstanding_prompt_tokens += prompt
        self.outstanding_decode_tokens += decode
        self.dispatched_since_scrape += 1

    def on_first_token(self, request_id: str, ttft_s: float) -> None:
        entry = self._inflight.get(request_id)
        if entry is not None and entry[2]:  # a recomputed (preempted) request's later first token counts once
            entry[2] = 0
            self.awaiting_first_token -= 1
            self.awaiting_prompt_tokens -= entry[0]
        self.ttft_ema_s = ttft_s if self.ttft_ema_s is None else self.ttft_ema_s + EMA_ALPHA * (ttft_s - self.ttft_ema_s)

    def on_complete(self, request_id: str, tpot_s: float | None = None) -> None:
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return  # already released (e.g. cancelled, then completed): never double-count
        self.outstanding -= 1
        self.outstanding_prompt_tokens -= entry[0]
        self.outstanding_decode_tokens -= entry[1]
        if entry[2]:  # failed or cancelled before its first token
            self.awaiting_first_token -= 1
            self.awaiting_prompt_tokens -= entry[0]
        if tpot_s is not None:
            self.tpot_ema_s = tpot_s if self.tpot_ema_s is None else self.tpot_ema_s + EMA_ALPHA * (tpot_s - self.tpot_ema_s)
            if tpot_s > 0:
                low = self._tpot_low
                if low == _INF:
                    low = tpot_s
                elif tpot_s > low:
                    low = min(tpot_s, low * (1.0 + TPOT_FLOOR_RISE))
                else:
                    low = max(tpot_s, low * (1.0 - TPOT_FLOOR_DROP))
                self._tpot_low = low
                self._tpot_samples += 1
                if self._tpot_samples >= TPOT_FLOOR_MIN_SAMPLES:
                    self.tpot_floor_s = low

    def on_scrape(
        self,
        now_s: float,
        waiting: int | None,
        running: int | None,
        kv_cache_usage: float | None,
        kv_capacity_tokens: int | None = None,
    ) -> None:
        """A successful scrape. A metric missing from the page stays None (flagged, not zero)."""
        self.waiting = waiting
        self.running = running
        self.kv_cache_usage = kv_cache_usage
        if kv_capacity_tokens is not None:
            self.kv_capacity_tokens = kv_capacity_tokens
        self.last_scrape_s = now_s
        self.dispatched_since_scrape = 0

    def snapshot(self, now_s: float, prefix_match_blocks: int = 0) -> ReplicaSnapshot:
        last = self.last_scrape_s
        return _Snapshot(self, _INF if last is None else (now_s - last if now_s > last else 0.0), prefix_match_blocks)


class _Snapshot:
    """Builds ReplicaSnapshot(...) of a tracker with plain slot stores (see types.make_snapshot):
    it runs for every replica at every decision. `stats_age_s` is max(0, now - last scrape)."""

    __slots__ = ReplicaSnapshot.__slots__

    def __init__(self, t: ReplicaTracker, stats_age_s: float, prefix_match_blocks: int) -> None:
        self.replica_id = t.replica_id
        self.healthy = t.healthy
        self.outstanding = t.outstanding
        self.outstanding_prompt_tokens = t.outstanding_prompt_tokens
        self.outstanding_decode_tokens = t.outstanding_decode_tokens
        self.waiting = t.waiting
        self.running = t.running
        self.kv_cache_usage = t.kv_cache_usage
        self.kv_capacity_tokens = t.kv_capacity_tokens
        self.stats_age_s = stats_age_s
        self.dispatched_since_scrape = t.dispatched_since_scrape
        self.prefix_match_blocks = prefix_match_blocks
        self.ttft_ema_s = t.ttft_ema_s
        self.tpot_ema_s = t.tpot_ema_s
        self.awaiting_first_token = t.awaiting_first_token
        self.awaiting_prompt_tokens = t.awaiting_prompt_tokens
        self.tpot_floor_s = t.tpot_floor_s
        self.__class__ = ReplicaSnapshot  # type: ignore[assignment]


class ClusterTracker:
    """All replicas' trackers plus the shared approximate prefix index."""

    def __init__(
        self,
        replica_ids: list[str],
        prefix_capacity_blocks: int = 4096,
        prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
    ) -> None:
        self.prefix_block_tokens = prefix_block_tokens
        self.trackers: list[ReplicaTracker] = [ReplicaTracker(r) for r in replica_ids]
        self.by_id: dict[str, ReplicaTracker] = {t.replica_id: t for t in self.trackers}
        self.prefix_index = PrefixIndex(prefix_capacity_blocks)

    def add(self, replica_id: str) -> ReplicaTracker:
        if replica_id in self.by_id:
            return self.by_id[replica_id]
        t = ReplicaTracker(replica_id)
        self.trackers.append(t)
        self.by_id[replica_id] = t
        return t

    def remove(self, replica_id: str) -> None:
        t = self.by_id.pop(replica_id, None)
        if t is not None:
            self.trackers.remove(t)
            self.prefix_index.forget(replica_id)

    def view(self, now_s: float, request: RequestInfo) -> ClusterView:
        blocks = request.prefix_blocks
        trackers = self.trackers
        matches = self.prefix_index.match_many([t.replica_id for t in trackers], blocks) if blocks else None
        if _compiled is not None:  # the same snapshots, built in C (tests/policy/test_fast_types.py)
            return make_view(_compiled.snapshots(trackers, now_s, matches))
        # ReplicaTracker.snapshot(now_s, match), inlined: this runs for every replica at every decision
        if matches is not None:
            return make_view(
                tuple(
                    [
                        _Snapshot(t, _INF if (last := t.last_scrape_s) is None else (now_s - last if now_s > last else 0.0), m)
                        for t, m in zip(trackers, matches)
                    ]
                )
            )
        return make_view(
            tuple(
                [
                    _Snapshot(t, _INF if (last := t.last_scrape_s) is None else (now_s - last if now_s > last else 0.0), 0)
                    for t in trackers
                ]
            )
        )

    def dispatch(self, replica_index: int, request: RequestInfo) -> ReplicaTracker:
        t = self.trackers[replica_index]
        t.on_dispatch(request)
        if request.prefix_blocks:
            # bound the index by the replica's scraped cache size, in router prefix blocks
            cap = max(1, t.kv_capacity_tokens // self.prefix_block_tokens) if t.kv_capacity_tokens else None
            self.prefix_index.insert(t.replica_id, request.prefix_blocks, cap)
        return t


def bind_compiled(compiled, snapshot_cls: type = ReplicaSnapshot, tracker_cls: type = ReplicaTracker) -> str | None:
    """Bind the C view builder to read `snapshot_cls` and `tracker_cls` by slot; None if bound, else why not.

    Not bound means a field of _fastnet.c's table is not a plain slot of the class: the extension was built from
    an older or newer _fastnet.c than the Python fields (rebuild: pip install -e .), or a field was renamed on one
    side only. Either is a bug, not a missing compiler: the suite fails on it (tests/policy/test_fast_types.py). A
    class that does not bind leaves the earlier binding of its kind in place."""
    for kind, cls, bind in (("snapshot", snapshot_cls, compiled.bind_snapshot),
                            ("tracker", tracker_cls, compiled.bind_tracker)):
        if not bind(cls):
            return (f"router.policy._fastnet cannot bind {cls.__qualname__} as its {kind} type: a field of its table "
                    f"is not a plain slot of the class (extension built from another _fastnet.c? pip install -e .)")
    return None


# Why the C extension is built but does not build the views (None: it does, or it is not built at all).
COMPILED_UNBOUND: str | None = None
if _compiled is not None:
    COMPILED_UNBOUND = bind_compiled(_compiled)
    if COMPILED_UNBOUND is not None:
        logging.getLogger(__name__).error("%s; ClusterTracker.view builds the views in Python", COMPILED_UNBOUND)
        _compiled = None
