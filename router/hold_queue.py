"""Live late binding: a bounded queue of requests held while no replica has room (`router serve --late-binding`).

The rule is the decision pipeline's room stage (router.policy.pipeline, late binding's `decide`), the one the
simulator runs: a request arriving while no
healthy replica is below its concurrency limit waits here, and the head is offered again whenever an event
can have freed room: a first token or a release (completion, failure, cancel) in this worker, a health probe
or drain/restore, membership changes, a scrape, and a timer at the head's queue timeout. Nothing polls.
The policy then picks among the replicas with room (a timeout goes to its pick over every healthy replica, a
full queue or an idle fleet to the policy's pick over every healthy one).

Late binding holds per model: each model has its own queue, and the rule judges the view of that model's replicas
only (router.policy.model_routing), so a held request waits for room on a replica of its own model and never
behind, or for, requests of another.

Deadline first: when a replica has room, the held request with the earliest TTFT deadline (arrival + its target,
router.slo) goes, not the oldest; requests without a target go after every one with, oldest first (so a fleet
without targets is FIFO). The queue timeout still goes by arrival: the oldest held request that has waited
late_binding_timeout_s goes at once, whatever the deadlines.

Nothing is dropped or left hanging: a client that disconnects while held leaves the queue (its future is
cancelled); with no healthy replica a held request is answered at once as without late binding (503); at
shutdown every held request is dispatched (`shutdown`); if the rule itself fails, the queue lets every held
request go rather than hold it (`error`, logged).

The queue keeps the requests and asks; the router decides (`Router.decide`, the pipeline's stages with this queue's
`Room`) and dispatches, so a request let go is routed in the instant the queue asks, as without late binding.
It takes `HoldConfig`, the late-binding flags the router's settings carry, built at the edge (`late_binding_config`).

Limits per replica: `replica_limit(batch limit, scraped KV capacity, late_binding_max_batched_tokens,
late_binding_tokens_per_request)`; vLLM does not export max_num_seqs, so the batch limit is the operator's
(late_binding_max_num_seqs for every replica, or per replica: late_binding_replica_max_num_seqs, keyed by
host:port), else inferred from the replica's /metrics (router.batch_limit; until then no count limit), lowered
per replica to what its scraped KV cache (vllm:cache_config_info) holds. The rule scales the awaiting-prefill limit by the replica's observed speed
(`speed_scales`; late_binding_room_in_time). With `--workers N` each worker holds its own queue;
the outstanding counts it compares with the limits are the host's (router.scale.shared), and another worker's
completions reach it through the worker-sync tick (0.1 s) or the next scrape.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from routewise_vllm.router.batch_limit import UNKNOWN_LIMIT
from routewise_vllm.router.policy.held_queue import HeldQueue
from routewise_vllm.router.policy.late_binding import DISPATCH_REASONS, LateBindingConfig, ReplicaLimit, replica_limit
from routewise_vllm.router.policy.pipeline import POLICY_ROUTES, Held, NoneHealthy, Room, forced
from routewise_vllm.router.policy.types import ClusterView, RequestInfo
from routewise_vllm.router.replicas import ReplicaSet
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.telemetry import RouterMetrics


class Dispatched(Protocol):
    """What the queue reads of a routed request (router.routing.Route): why it went."""

    @property
    def late(self) -> str | None: ...


R = TypeVar("R", bound=Dispatched)


class Decides(Protocol[R]):
    """What the queue needs of the router (router.routing.Router): a decision on the view it built (the pipeline's
    stages with its Room; `started`: the perf_counter reading before the view, for the decision latency metric;
    `held_s`: the time held, recorded with the route), and the release of a route whose client left as it went."""

    def decide(self, request: RequestInfo, *, view: ClusterView, room: Room, started: float,
               held_s: float | None = None) -> R | Held | NoneHealthy: ...

    def release(self, route: R) -> None: ...


log = logging.getLogger("router.hold_queue")

#: Why a request left the late-binding path: the rule's reasons plus the live-only ones (bounded labels).
LATE_REASONS: tuple[str, ...] = (*DISPATCH_REASONS, POLICY_ROUTES, "no_healthy", "shutdown", "error")
_TIMER_SLACK_S = 0.001  # the loop may run a timer up to its clock resolution early: re-armed if so


@dataclass(frozen=True, slots=True)
class HoldConfig:
    """The queue's settings: the rule's (router.policy.late_binding) and the per-replica token budget."""

    rule: LateBindingConfig
    max_batched_tokens: int


def late_binding_config(settings: RouterSettings) -> HoldConfig:
    """The hold queue's config from the router's flags (--late-binding-timeout and the others)."""
    return HoldConfig(LateBindingConfig(settings.late_binding_timeout_s, settings.late_binding_queue_per_replica,
                                        settings.late_binding_tokens_per_request, settings.late_binding_room_in_time),
                      settings.late_binding_max_batched_tokens)


@dataclass(slots=True, eq=False)
class _Held:
    info: RequestInfo
    arrived_s: float
    future: asyncio.Future
    deadline_s: float = math.inf  # arrival + TTFT target (inf: none)
    seq: int = 0  # arrival order, the tie-break


class HoldQueue(Generic[R]):
    """`route(info)` routes now or holds; `wake()` offers the head again; `close()` lets everything go. The router
    (`Decides`) routes what the queue lets go."""

    def __init__(self, config: HoldConfig, replicas: ReplicaSet, metrics: RouterMetrics, clock: Callable[[], float],
                 router: Decides[R]) -> None:
        self.config = config.rule
        self._max_batched = config.max_batched_tokens
        self.replicas = replicas
        self._router = router
        self.metrics = metrics
        self.clock = clock
        self._queues: dict[str | None, HeldQueue[_Held]] = {}  # by model
        self._seq = itertools.count()
        self._held = 0  # requests held, over every model
        self._timer: asyncio.TimerHandle | None = None
        self._scheduled = False
        self.closed = False
        self._limits: dict[tuple[int, int | None], ReplicaLimit] = {}  # by (batch cap, scraped KV capacity)
        self._dispatches = {r: metrics.late_dispatches.labels(r) for r in LATE_REASONS}  # exported at 0
        metrics.held_requests.set(0)

    def __len__(self) -> int:
        return self._held

    def limits(self, view: ClusterView) -> list[ReplicaLimit]:
        cache = self._limits
        out = []
        batch_cap = self.replicas.batch_cap
        for r in view.replicas:
            cap = batch_cap(r.replica_id)  # the operator's, else inferred from its /metrics (router.batch_limit)
            key = (UNKNOWN_LIMIT if cap is None else cap, r.kv_capacity_tokens)
            lim = cache.get(key)
            if lim is None:
                lim = cache[key] = replica_limit(key[0], key[1], self._max_batched, self.config.tokens_per_request)
            out.append(lim)
        return out

    def route_now(self, info: RequestInfo) -> R | Held | NoneHealthy:
        """The request's Route when the rule lets it go at once, Held when it must wait (`route` then holds it),
        NoneHealthy when none of its model's replicas is healthy. The proxy asks this before the request's task
        runs, as it decides without late binding."""
        started = time.perf_counter()  # the decision latency metric counts the view built here
        view = self.replicas.cluster.view(self.clock(), info)
        if self.closed:
            room = forced("shutdown")
        else:
            queue = self._queues.get(info.model)
            room = Room(self.limits(view), len(queue) if queue else 0, False, 0.0, self.config)
        return self._count(self._router.decide(info, view=view, room=room, started=started))

    async def route(self, info: RequestInfo) -> R | NoneHealthy:
        """The request's Route (router.routing), now or once the rule lets it go; NoneHealthy when none of its
        model's replicas is healthy."""
        out = self.route_now(info)
        if type(out) is not Held:
            return out  # type: ignore[return-value]
        queue = self._queues.get(info.model)
        now = self.clock()
        target = info.ttft_target_s
        held = _Held(info, now, asyncio.get_running_loop().create_future(),
                     math.inf if target is None else now + target, next(self._seq))
        if queue is None:
            queue = self._queues[info.model] = HeldQueue()
        queue.push(held.seq, held, held.arrived_s, held.deadline_s)
        self._held += 1
        self.metrics.held_requests.set(self._held)
        self._arm()
        try:
            return await held.future
        except asyncio.CancelledError:  # the client went away (or the router stops)
            fut = held.future
            if fut.done() and not fut.cancelled() and fut.exception() is None and type(fut.result()) is not NoneHealthy:
                self._router.release(fut.result())  # routed in the same instant: release it, nothing stays counted
            else:
                self._remove(held)
            raise

    def wake(self) -> None:
        """An event that can have freed room: offer the head (once, soon, whatever the number of events)."""
        if self._held and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def close(self) -> None:
        """Shutdown: every held request is dispatched now, later arrivals go straight through."""
        self.closed = True
        self._pump()

    # --- internals ---------------------------------------------------------------------------------

    def _count(self, out: R | Held | NoneHealthy, held_s: float | None = None) -> R | Held | NoneHealthy:
        """Counts why a request left the late-binding path (and how long it was held)."""
        if type(out) is NoneHealthy:
            self._dispatches["no_healthy"].inc()
        elif type(out) is not Held:
            self._dispatches[out.late].inc()  # type: ignore[union-attr,index]
            if held_s is not None:
                self.metrics.hold_duration.observe(held_s)
        return out

    def _let_go(self, queue: HeldQueue[_Held], head: _Held, room: Room | None, started: float | None = None,
                view: ClusterView | None = None) -> bool:
        """Offers a held head with `room` (None: the rule failed, it goes with reason "error"); False when the rule
        holds it still."""
        held_s = self.clock() - head.arrived_s
        if view is None:
            started, view = time.perf_counter(), self.replicas.cluster.view(self.clock(), head.info)
        try:
            out = self._router.decide(head.info, view=view, room=room or forced("error"), started=started,  # type: ignore[arg-type]
                                      held_s=held_s)
        except Exception as exc:  # noqa: BLE001 - any failure: the handler answers it
            queue.take(head.seq)
            self._held -= 1
            head.future.set_exception(exc)
            return True
        if type(out) is Held:
            return False
        queue.take(head.seq)
        self._held -= 1
        head.future.set_result(self._count(out, held_s))
        return True

    def _pump(self) -> None:
        self._scheduled = False
        try:
            for queue in list(self._queues.values()):
                self._pump_queue(queue)
        except Exception:  # noqa: BLE001 - never hold a request because the rule failed
            log.exception("late binding failed; dispatching every held request")
            for queue in self._queues.values():
                while (oldest := queue.oldest()) is not None:
                    head = oldest[0]
                    if head.future.done():
                        queue.take(head.seq)
                        self._held -= 1
                    else:
                        self._let_go(queue, head, None)
        finally:
            for model in [m for m, q in self._queues.items() if not q]:
                del self._queues[model]
            self.metrics.held_requests.set(self._held)
            self._arm()

    def _pump_queue(self, queue: HeldQueue[_Held]) -> None:
        """Offers one model's head until the rule holds it. The head is the earliest deadline, or the oldest request
        once it has waited the queue timeout (HeldQueue.head)."""
        while True:
            now = self.clock()
            head = queue.head(now, self.config.timeout_s)
            if head is None:
                break
            if head.future.done():  # cancelled, not yet removed
                queue.take(head.seq)
                self._held -= 1
                continue
            started = time.perf_counter()
            view = self.replicas.cluster.view(self.clock(), head.info)
            room = forced("shutdown") if self.closed else Room(
                self.limits(view), len(queue) - 1, True, now - head.arrived_s, self.config)
            if not self._let_go(queue, head, room, started, view):
                break

    def _arm(self) -> None:
        """One timer, at the earliest head's queue timeout (a head that is not due yet holds its model's later ones
        back)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        heads = [h[1] for q in self._queues.values() if (h := q.oldest()) is not None]
        if heads:
            delay = min(heads) + self.config.timeout_s - self.clock()
            self._timer = asyncio.get_running_loop().call_later(max(0.0, delay) + _TIMER_SLACK_S, self._pump)

    def _remove(self, held: _Held) -> None:
        queue = self._queues.get(held.info.model)
        if queue is None or not queue.take(held.seq):
            return
        self._held -= 1
        self.metrics.held_requests.set(self._held)
        self.wake()  # the next head may be due (or have room) now
        self._arm()
