"""Router-side state per replica, kept identically by the live router and the simulator.

Both worlds call the same hooks (dispatch, first token, completion, scrape) and build
snapshots with the same code, which is what makes their features bit-identical.
Times are passed in by the caller (this package never reads a clock).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from routewise_vllm.router.policy.estimate import DEFAULT_PREFIX_BLOCK_TOKENS, PrefixIndex
from routewise_vllm.router.policy.kv_view import KVView, TokenBlocks
from routewise_vllm.router.policy.types import ClusterView, LoraState, ReplicaSnapshot, RequestInfo, make_view, slot_builder

try:
    from routewise_vllm.router.policy import _fastnet as _compiled
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
        "_tpot_low", "_tpot_samples", "lora",
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
        self.lora: LoraState | None = None
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
        lora: LoraState | None = None,
    ) -> None:
        """A successful scrape. A metric missing from the page stays None (flagged, not zero)."""
        self.lora = lora
        self.waiting = waiting
        self.running = running
        self.kv_cache_usage = kv_cache_usage
        if kv_capacity_tokens is not None:
            self.kv_capacity_tokens = kv_capacity_tokens
        self.last_scrape_s = now_s
        self.dispatched_since_scrape = 0

    def snapshot(self, now_s: float, prefix_match_blocks: int = 0) -> ReplicaSnapshot:
        return _Snapshot(self, now_s, prefix_match_blocks)


# How a view fills each ReplicaSnapshot field from its tracker, for the Python builder below and the compiled one
# alike (bound at the end of this module): from the tracker attribute of the same name, except these.
SNAPSHOT_SOURCES: dict[str, tuple[str, str | None]] = {
    "stats_age_s": ("since", "last_scrape_s"),  # max(0, now - last_scrape_s); inf before the first scrape
    "prefix_match_blocks": ("match", None),  # this request's prefix match, from the cluster's index
}


def _snapshot_table(snapshot_cls: type = ReplicaSnapshot) -> tuple[tuple[str, str, str | None], ...]:
    """(field, kind, tracker attribute) for every field of the snapshot class, in order: _fastnet.bind_view's table."""
    return tuple((f.name, *SNAPSHOT_SOURCES.get(f.name, ("copy", f.name))) for f in dataclasses.fields(snapshot_cls))


def _snapshot_values(table) -> dict[str, str]:
    """The Python expression of each field over `t` (the tracker), `now_s` and `match`."""
    expr = {
        "copy": lambda a: f"t.{a}",
        "since": lambda a: f"_INF if (_last := t.{a}) is None else (now_s - _last if now_s > _last else 0.0)",
        "match": lambda a: "match",
    }
    return {name: expr[kind](attr) for name, kind, attr in table}


# _Snapshot(tracker, now_s, match) is ReplicaSnapshot(...) of a tracker, built with plain slot stores (see
# types.slot_builder): it runs for every replica at every decision.
_Snapshot = slot_builder(ReplicaSnapshot, ("t", "now_s", "match"), _snapshot_values(_snapshot_table()), {"_INF": _INF})


# Where a decision's prefix matches came from (ClusterTracker.match_sources, by these indices): every replica's from
# its KV view (precise), none (guess: the approximate index), or some of each (mixed: the stale replicas guessed)
MATCH_SOURCES = ("precise", "guess", "mixed")
_PRECISE, _GUESS, _MIXED = 0, 1, 2


def _no_lora(model: str | None) -> str | None:
    return None


class ClusterTracker:
    """All replicas' trackers plus the shared approximate prefix index, and the replicas' own reports of their
    caches (`kv_view`, set by the live router when KV events are on) preferred where fresh."""

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
        self.kv_view: KVView | None = None
        self.kv_lora: Callable[[str | None], str | None] = _no_lora  # the request's model -> its LoRA adapter
        self.match_sources = [0, 0, 0]  # decisions by MATCH_SOURCES

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
        matches = self._matches(now_s, request, blocks) if blocks else None
        if _compiled is not None:  # the same snapshots, built in C (tests/policy/test_fast_types.py)
            return make_view(_compiled.snapshots(trackers, now_s, matches))
        # ReplicaTracker.snapshot(now_s, match), inlined: this runs for every replica at every decision
        if matches is not None:
            return make_view(tuple([_Snapshot(t, now_s, m) for t, m in zip(trackers, matches)]))
        return make_view(tuple([_Snapshot(t, now_s, 0) for t in trackers]))

    def _matches(self, now_s: float, request: RequestInfo, blocks: tuple[int, ...]) -> list[int]:
        """Each replica's prefix match: from its KV view when fresh and the request's blocks are token blocks (the
        only ones a view can match), else the approximate index's guess."""
        ids = [t.replica_id for t in self.trackers]
        kv = self.kv_view
        if kv is None or type(blocks) is not TokenBlocks:
            self.match_sources[_GUESS] += 1
            return self.prefix_index.match_many(ids, blocks)
        fresh = kv.fresh_many(ids, now_s)
        if all(fresh):
            self.match_sources[_PRECISE] += 1
            return self._with_inflight(kv, ids, blocks, now_s, kv.match_many(ids, blocks, self.kv_lora(request.model)))
        guess = self.prefix_index.match_many(ids, blocks)
        if not any(fresh):
            self.match_sources[_GUESS] += 1
            return guess
        self.match_sources[_MIXED] += 1
        precise = self._with_inflight(kv, ids, blocks, now_s, kv.match_many(ids, blocks, self.kv_lora(request.model)))
        return [p if f else g for p, g, f in zip(precise, guess, fresh)]

    def _with_inflight(self, kv: KVView, ids: list[str], blocks: tuple[int, ...], now_s: float,
                       precise: list[int]) -> list[int]:
        """The KV view's matches, raised to what was sent to each replica in the view's last `inflight_s`: a
        request routed a moment ago has not been prefilled, so no event reports its blocks yet, and a burst of
        requests on one document would otherwise each see it cached nowhere (llm-d's speculative entries)."""
        if kv.inflight_s <= 0:
            return precise
        return self.prefix_index.extend_recent(ids, blocks, precise, now_s - kv.inflight_s)

    def dispatch(self, replica_index: int, request: RequestInfo, now_s: float = -math.inf) -> ReplicaTracker:
        t = self.trackers[replica_index]
        t.on_dispatch(request)
        blocks = request.prefix_blocks
        if blocks:
            # bound the index by the replica's scraped cache size, in the request's prefix blocks
            block_tokens = blocks.block_tokens if type(blocks) is TokenBlocks else self.prefix_block_tokens
            cap = max(1, t.kv_capacity_tokens // block_tokens) if t.kv_capacity_tokens else None
            self.prefix_index.insert(t.replica_id, blocks, cap, now_s)
        return t


def bind_compiled(compiled, snapshot_cls: type = ReplicaSnapshot, tracker_cls: type = ReplicaTracker) -> str | None:
    """Bind the C view builder to SNAPSHOT_SOURCES for `snapshot_cls` and `tracker_cls`, read and written by slot;
    None if bound, else why not (a field of the snapshot, or the tracker attribute it comes from, is not a plain
    slot; the earlier binding then stays in place)."""
    missing = compiled.bind_view(snapshot_cls, tracker_cls, _snapshot_table(snapshot_cls))
    if missing is None:
        return None
    return (f"router.policy._fastnet cannot bind {snapshot_cls.__qualname__} / {tracker_cls.__qualname__}: {missing} "
            "is not a plain slot")


# The compiled views follow the table above; an extension that cannot (built from other sources) or classes it cannot
# read by slot stop the import here rather than silently building every view in Python.
if _compiled is not None:
    try:
        _problem = bind_compiled(_compiled)
    except (AttributeError, TypeError, ValueError) as exc:
        _problem = (f"router.policy._fastnet cannot build the views ({exc}): it was built from other sources than "
                    "router/policy/fastnet_c; rebuild it (pip install -e .)")
    if _problem is not None:
        raise ImportError(_problem)
