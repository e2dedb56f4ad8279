"""Live late binding: a bounded queue of requests held while no replica has room (`router serve --late-binding`).

The rule is router.policy.late_binding's `decide`, the one the simulator runs: a request arriving while no
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from routewise_vllm.router.batch_limit import UNKNOWN_LIMIT
from routewise_vllm.router.models import no_replica_message
from routewise_vllm.router.policy.held_queue import HeldQueue
from routewise_vllm.router.policy.late_binding import DISPATCH_REASONS, LateBindingConfig, ReplicaLimit, decide, replica_limit, restrict
from routewise_vllm.router.policy.types import ClusterView, NoHealthyReplica, RequestInfo
from routewise_vllm.router.replicas import ReplicaSet
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.telemetry import RouterMetrics


class Dispatched(Protocol):
    """What the queue needs of a routed request (router.routing.Route): where it records the hold."""

    late: str | None
    held_s: float | None
    wall_s: float


R = TypeVar("R", bound=Dispatched)

log = logging.getLogger("router.hold_queue")

#: Why a request left the late-binding path: the rule's reasons plus the live-only ones (bounded labels).
LATE_REASONS: tuple[str, ...] = (*DISPATCH_REASONS, "no_healthy", "shutdown", "error")
_TIMER_SLACK_S = 0.001  # the loop may run a timer up to its clock resolution early: re-armed if so


@dataclass(slots=True, eq=False)
class _Held:
    info: RequestInfo
    arrived_s: float
    future: asyncio.Future
    deadline_s: float = math.inf  # arrival + TTFT target (inf: none)
    seq: int = 0  # arrival order, the tie-break


def late_binding_config(settings: RouterSettings) -> LateBindingConfig:
    return LateBindingConfig(settings.late_binding_timeout_s, settings.late_binding_queue_per_replica,
                             settings.late_binding_tokens_per_request, settings.late_binding_room_in_time)


class HoldQueue(Generic[R]):
    """`route(info)` routes now or holds; `wake()` offers the head again; `close()` lets everything go.
    `dispatch(info, only, view, started)` routes for real (Router.route on `view`, restricted to `only`, None = every
    healthy replica; `started`: when the view was built, for the decision latency metric); `release(route)` undoes
    one whose client left in the instant it was routed."""

    def __init__(
        self, settings: RouterSettings, replicas: ReplicaSet, metrics: RouterMetrics, clock: Callable[[], float],
        dispatch: Callable[[RequestInfo, tuple[int, ...] | None, ClusterView | None, float | None], R],
        release: Callable[[R], None],
    ) -> None:
        self.config = late_binding_config(settings)
        self._max_batched = settings.late_binding_max_batched_tokens
        self.replicas = replicas
        self._dispatch = dispatch
        self._release = release
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

    def view(self, info: RequestInfo) -> ClusterView:
        """The view the rule and the policy judge for `info`: its model's replicas only (the others not candidates)."""
        view = self.replicas.cluster.view(self.clock(), info)
        members = self.replicas.members(info.model)
        return view if members is None else restrict(view, members)


    def limits(self, view: ClusterView) -> list[ReplicaLimit]:
        cache = self._limits
        out = []
        batch_limit = self.replicas.batch_limit
        for r in view.replicas:
            cap = batch_limit(r.replica_id)[0]  # the operator's, else inferred from its /metrics (router.batch_limit)
            key = (UNKNOWN_LIMIT if cap is None else cap, r.kv_capacity_tokens)
            lim = cache.get(key)
            if lim is None:
                lim = cache[key] = replica_limit(key[0], key[1], self._max_batched, self.config.tokens_per_request)
            out.append(lim)
        return out

    def route_now(self, info: RequestInfo) -> R | None:
        """The request's Route when the rule lets it go at once, else None (`route` then holds it). Raises
        NoHealthyReplica. The proxy asks this before the request's task runs, as it decides without late binding."""
        started = time.perf_counter()  # the decision latency metric counts the view built here
        view = self.view(info)
        if not any(r.healthy for r in view.replicas):
            self._dispatches["no_healthy"].inc()
            raise NoHealthyReplica(no_replica_message(info.model))
        if self.closed:
            return self._go(info, "shutdown", None, None, view, started)
        queue = self._queues.get(info.model)
        d = decide(view, self.limits(view), len(queue) if queue else 0, False, 0.0, self.config)
        if d.reason != "hold":
            return self._go(info, d.reason, self._only(d.reason, d.candidates, view), None, view, started)
        return None

    async def route(self, info: RequestInfo) -> R:
        """The request's Route (router.routing), now or once the rule lets it go. Raises NoHealthyReplica."""
        if (route := self.route_now(info)) is not None:
            return route
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
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result())  # routed in the same instant: release it, nothing stays counted
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

    @staticmethod
    def _only(reason: str, candidates: Sequence[int], view: ClusterView) -> tuple[int, ...] | None:
        """The replicas the policy may pick from, None for any healthy one (also when every healthy one has room:
        restricting to all of them would change nothing but the cost)."""
        if reason in ("idle", "full", "timeout"):
            return None
        if len(candidates) == sum(r.healthy for r in view.replicas):
            return None
        return tuple(candidates)

    def _go(self, info: RequestInfo, reason: str, only: tuple[int, ...] | None, held_s: float | None,
            view: ClusterView | None, started: float | None = None) -> R:
        self._dispatches[reason].inc()
        if held_s is not None:
            self.metrics.hold_duration.observe(held_s)
        route = self._dispatch(info, only, view, started)
        route.late, route.held_s = reason, held_s or 0.0
        route.wall_s -= route.held_s  # the decision log's `t` stays the arrival (replays read it as such)
        return route

    def _let_go(self, queue: HeldQueue[_Held], head: _Held, reason: str, only: tuple[int, ...] | None,
                 view: ClusterView | None, started: float | None = None) -> None:
        queue.take(head.seq)
        self._held -= 1
        if reason == "no_healthy":
            self._dispatches[reason].inc()
            head.future.set_exception(NoHealthyReplica(no_replica_message(head.info.model)))
            return
        try:
            head.future.set_result(self._go(head.info, reason, only, self.clock() - head.arrived_s, view, started))
        except Exception as exc:  # noqa: BLE001 - NoHealthyReplica, or any failure: the handler answers it
            head.future.set_exception(exc)

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
                        self._let_go(queue, head, "error", None, None)
        finally:
            for model in [m for m, q in self._queues.items() if not q]:
                del self._queues[model]
            self.metrics.held_requests.set(self._held)
            self._arm()

    def _pump_queue(self, queue: HeldQueue[_Held]) -> None:
        """Offers one model's head until the rule holds it (the view: that model's replicas). The head is the
        earliest deadline, or the oldest request once it has waited the queue timeout (HeldQueue.head)."""
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
            view = self.view(head.info)
            if not any(r.healthy for r in view.replicas):
                self._let_go(queue, head, "no_healthy", None, view)
                continue
            if self.closed:
                self._let_go(queue, head, "shutdown", None, view, started)
                continue
            d = decide(view, self.limits(view), len(queue) - 1, True, now - head.arrived_s, self.config)
            if d.reason == "hold":
                break
            self._let_go(queue, head, d.reason, self._only(d.reason, d.candidates, view), view, started)

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
