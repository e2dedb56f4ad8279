"""Heuristic late binding: the one rule for "dispatch now, or hold in the router-side queue".

Pure (router.policy.types only): the live router's hold queue (router/hold_queue.py) and the simulator's
driver (simulator/late_binding.py, over `ClusterSim.hold()`) call the same `decide`, wrapping any
per-request policy: the policy still picks the replica, but only among those the rule allows.

Rule, in order: with nothing in flight anywhere (no completion could release the queue) it dispatches at
once; a queue timeout (the head waited `timeout_s`) and a full queue dispatch the request at once, to the
policy's pick over every healthy replica (formerly a timeout went to the least-loaded replica by
outstanding count: on a fleet of mixed speeds that is the slowest one, and the policy's pick lowered p99 TTFT
behind late binding by 0.1-0.3x of the best heuristic's on the code mixes, docs/model-card.md); FIFO: a new arrival queues
behind held requests; a replica has room while its outstanding count is below its concurrency limit and the
prompt tokens awaiting their first token there would clear in the time the slowest replica clears its limit
(`speed_scales`; formerly the same token limit held for every replica, which on a ~8x speed mix sent
requests to the slow replicas while the fast ones were far from full); the policy picks among those (callers
pass it `restrict(view, candidates)`, and a scoring policy behind FallbackPolicy also the whole view as its
context, so a learned policy scores the fleet it was trained on); otherwise hold. Nothing is ever dropped. The
timeout is checked when the head is offered (at first tokens and completions, live also on a timer), so a held
request can overrun it by up to one inter-event gap in the simulator. Callers handle a view with no healthy replica themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot, make_view, unhealthy

Reason = Literal["room", "hold", "full", "timeout", "idle"]
#: Why the rule let a request go (every Reason but "hold"): a bounded metric label.
DISPATCH_REASONS: tuple[str, ...] = ("room", "idle", "full", "timeout")


@dataclass(frozen=True)
class LateBindingConfig:
    timeout_s: float = 2.0  # a held request waits at most this long (checked at the next event)
    queue_per_replica: int = 32  # queue capacity = this x replicas
    tokens_per_request: int = 2048  # KV tokens one request is assumed to hold, for the KV-derived limit
    room_in_time: bool = True  # scale each replica's awaiting-prefill limit by its observed speed (speed_scales)
    max_speed_scale: int = 2  # the most that scaling may multiply a limit by (4: no better on the ~8x mixes)


@dataclass(frozen=True)
class ReplicaLimit:
    max_outstanding: int  # requests in flight before the router holds
    max_prefill_tokens: int  # prompt tokens awaiting their first token (prefill queued) before the router holds


def replica_limit(
    max_num_seqs: int, kv_capacity_tokens: int | None, max_num_batched_tokens: int, tokens_per_request: int
) -> ReplicaLimit:
    """A replica has room while in flight < vLLM's batch cap (or what its KV cache holds, if fewer) and the
    prompts still awaiting a first token fit one scheduler step's token budget."""
    limit = max_num_seqs
    if kv_capacity_tokens:
        limit = min(limit, kv_capacity_tokens // max(1, tokens_per_request))
    return ReplicaLimit(max(1, limit), max(1, max_num_batched_tokens))


def has_room(r: ReplicaSnapshot, limit: ReplicaLimit, speed_scale: int = 1) -> bool:
    return r.outstanding < limit.max_outstanding and r.awaiting_prompt_tokens < limit.max_prefill_tokens * speed_scale


def speed_scales(view: ClusterView, cap: int) -> list[int]:
    """Room in time, not tokens: how many times faster than the fleet's slowest healthy replica each one runs, by
    the router's TPOT floors (`tpot_floor_s`: speed, where the TPOT average also moves with load), floored (1 on a
    uniform fleet), 1 for a replica not yet measured, at most `cap`. A replica k times faster clears k times the
    awaiting prompt tokens in the time the slowest clears its limit, so its limit is k times as many tokens."""
    floors = [r.tpot_floor_s for r in view.replicas]
    slowest = max((f for f, r in zip(floors, view.replicas) if f and r.healthy), default=None)
    if slowest is None:
        return [1] * len(floors)
    return [min(cap, max(1, int(slowest / f))) if f else 1 for f in floors]


@dataclass(frozen=True)
class Decision:
    reason: Reason
    candidates: tuple[int, ...]  # replicas the request may go to now; empty when held


def decide(
    view: ClusterView,
    limits: Sequence[ReplicaLimit],
    queued: int,
    is_head: bool,
    waited_s: float,
    config: LateBindingConfig,
) -> Decision:
    """Hold or dispatch the request being decided. `queued`: requests already held (not counting it);
    `is_head`: it is the held head being offered again; `waited_s`: time since it arrived."""
    healthy = tuple(i for i, r in enumerate(view.replicas) if r.healthy)
    if not any(r.outstanding for r in view.replicas):
        return Decision("idle", healthy)
    if is_head and waited_s >= config.timeout_s:
        return Decision("timeout", healthy)
    if not is_head and queued >= config.queue_per_replica * len(view.replicas):
        return Decision("full", healthy)
    if queued and not is_head:
        return Decision("hold", ())
    reps = view.replicas
    room: list[int] = []
    over: list[int] = []  # below their request limit, over their token limit alone: room in time may take them
    for i in healthy:
        r, lim = reps[i], limits[i]
        if r.outstanding < lim.max_outstanding:
            if r.awaiting_prompt_tokens < lim.max_prefill_tokens:
                room.append(i)
            else:
                over.append(i)
    if over and config.room_in_time:  # the scales only when they can matter: most decisions have no such replica
        scales = speed_scales(view, config.max_speed_scale)
        room = sorted(room + [i for i in over if has_room(reps[i], limits[i], scales[i])])
    return Decision("room", tuple(room)) if room else Decision("hold", ())


def restrict(view: ClusterView, candidates: Sequence[int]) -> ClusterView:
    """The view with every replica outside `candidates` marked unhealthy, so a per-request policy picks among them."""
    keep = set(candidates)
    return make_view(tuple(r if i in keep or not r.healthy else unhealthy(r) for i, r in enumerate(view.replicas)))
