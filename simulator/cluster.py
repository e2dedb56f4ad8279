"""The simulated cluster: replicas, the router-side state the live router keeps, one event order.

One long module because it is one event loop (arrivals, replica events, scrapes, faults, retries, late binding's
offers) whose order is the determinism contract: split apart, that order would be scattered across modules. What
needs no event order is apart: the replica (replica.py), the KV feed (kv_feed.py), shared state (shared_state.py),
late binding's driver (late_binding.py), and the decision itself (router.policy.pipeline: the filters run here, in
`next_decision`; the room, policy and pick in the caller).

Router-side state lives only in `router.policy.tracking.ClusterTracker`, fed by the same hooks
the live router calls (dispatch, first token, completion, scrape), at the simulated times they
happen. The policy never reads replica internals: scraped values reach the tracker only at
scrape events (interval, jitter, lag, failures from `ScrapeConfig`).

Events are processed in `(time, priority, seq)` order; at equal times replica outputs come
first, then faults, scrape samples, scrape deliveries, health changes and finally routing
decisions. All randomness (scrape jitter and failures, the token estimator's error) comes from
one `np.random.Generator` per instance.

Late binding (opt-in, `hold()`): instead of routing the pending request now, the router keeps it in its
own queue (router.policy.held_queue, the one the live router keeps). The queue's head comes back as a fresh
decision at the next first token or completion (and the next head right after a held request is routed), so
holding time counts in TTFT and nothing is dropped.

Several routers (`ClusterConfig.routers` = N > 1): requests reach router `arrival index mod N` (a Service
in front of N router pods); each router has its own `ClusterTracker`, so it sees only the requests it
routed itself, while scrapes and health changes reach every router. With `shared_state_lag_s` the routers share
their in-flight counts, each seeing the others' as of that lag (simulator/shared_state.py).

Models: a replica group may list the models it serves (`ReplicaGroup.models`) and a request name one
(`SimRequest.model`); the view a decision returns then has every replica outside the model's marked unhealthy
(router.policy.model_routing.members and late_binding.restrict, as the live router does), so every policy decides
among the model's replicas only. Late binding holds per model, as the live router's queue: each model's held requests
are offered one at a time, a held request judged on its model's view; the head offered is the earliest TTFT deadline
(`hold_order` "deadline", the live router's) or the oldest ("fifo"), and the oldest once it has waited
`hold_timeout_s` either way.

KV view (`ClusterConfig.kv_view`): `guess` (default) matches prefixes on each router's approximate index only;
`precise` also feeds each router's KV view with the replicas' cache changes as events (simulator/kv_feed.py), and
the requests' prefix blocks are `TokenBlocks` (the replicas' own cache keys), so a fresh view gives the match.

Crashes: a crashed replica drops everything in flight. The router notices after
`health_check_delay_s`: the replica is marked unhealthy, its in-flight requests (including any
routed to it meanwhile) are released and routed again as fresh decisions, so no request is lost.

Admission, as vLLM's OpenAI server does it: a replica's context limit is its profile's
`max_model_len`, lowered to its KV capacity when that is smaller (vLLM will not start with a
limit one sequence cannot fill). A prompt of that many tokens or more is refused at once (HTTP
400): its record gets `error = "prompt_too_long"`, no first token and no finish time, so metrics
leave it out of latency percentiles and count it as a miss in goodput; the router releases it
with a failed `Outcome`. A shorter prompt whose output would cross the limit is served and its
generation stops at the limit (`finish_reason: length`); its record's `output_tokens` is what
was generated.
"""

from __future__ import annotations

import heapq
from operator import attrgetter
from typing import Callable, Sequence

import numpy as np

from routewise_vllm.router.policy.base import Policy
from routewise_vllm.router.policy.estimate import TokenEstimator, chain_hash
from routewise_vllm.router.policy.held_queue import HeldQueue
from routewise_vllm.router.policy.kv_view import TokenBlocks
from routewise_vllm.router.policy.model_routing import members
from routewise_vllm.router.policy.pipeline import Ask, Pipeline, make_choice
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import ClusterView, LoraState, Outcome, RequestInfo, make_request_info
from routewise_vllm.simulator.config import ClusterConfig
from routewise_vllm.simulator.costmodel import load_profile
from routewise_vllm.simulator.kv_feed import KVFeed
from routewise_vllm.simulator.replica import COMPLETE, ReqState, Replica
from routewise_vllm.simulator.shared_state import LaggedFleetView
from routewise_vllm.simulator.types import RequestRecord, SimRequest

REJECTED_PROMPT_TOO_LONG = "prompt_too_long"  # RequestRecord.error of a request vLLM refuses

# event priorities at equal times
P_REPLICA, P_FAULT, P_SAMPLE, P_SCRAPE, P_HEALTH, P_DECISION = range(6)
# event kinds
E_REPLICA, E_ARRIVAL, E_RETRY, E_SAMPLE, E_SCRAPE, E_CRASH, E_RECOVER, E_SLOW, E_HEALTH, E_KV, E_KV_REPLAY = range(11)

CompletionHook = Callable[[str, RequestInfo, Outcome], None]


class ClusterSim:
    def __init__(
        self,
        config: ClusterConfig,
        requests: Sequence[SimRequest],
        seed: int | None = None,
        *,
        closed_form: bool = True,  # False: one iteration at a time (reference for tests)
        pipeline: Pipeline | None = None,
    ) -> None:
        self.config = config
        # the decision's stages (router.policy.pipeline): its filters run here, the rest in the caller
        self.pipeline = pipeline or sim_pipeline()
        self.rng = np.random.default_rng(seed)
        self.replicas: list[Replica] = []
        profiles: dict[str, object] = {}
        for group in config.replicas:
            prof = profiles.get(group.profile) or profiles.setdefault(group.profile, load_profile(group.profile))
            for _ in range(group.count):
                i = len(self.replicas)
                self.replicas.append(Replica(f"r{i}-{group.profile}", group, prof, closed_form=closed_form))  # type: ignore[arg-type]
        self.replica_ids: list[str] = [r.replica_id for r in self.replicas]
        # the models each replica serves (None: any), and by model the view indices serving it (None: every replica)
        self._served = [g.served() or None for g in config.replicas for _ in range(g.count)]
        self._members: dict[str | None, tuple[int, ...] | None] = {None: None}
        n_rep = len(self.replicas)
        for f in config.faults:
            if f.replica >= n_rep:
                raise ValueError(f"fault {f.kind} at {f.at_s}s: replica index {f.replica} out of range (0..{n_rep - 1})")

        self.requests: list[SimRequest] = sorted(requests, key=attrgetter("arrival_s", "request_id"))
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        for model in {r.model for r in self.requests}:
            if self._members.setdefault(model, members(model, self._served)) == ():
                raise ValueError(f"no replica serves model {model!r} (replica groups' `models`)")
        self._asks = {model: Ask(m) for model, m in self._members.items()}  # the filters' question, by model
        block_tokens = self.requests[0].block_tokens if self.requests else 512
        self.routers = [ClusterTracker(list(self.replica_ids), prefix_block_tokens=block_tokens) for _ in range(config.routers)]
        self.tracker = self.routers[0]
        self._fleet: LaggedFleetView | None = None  # routers sharing their in-flight counts (simulator/shared_state.py)
        if config.routers > 1 and config.shared_state_lag_s is not None:
            self._fleet = LaggedFleetView(self.routers, config.shared_state_lag_s)
        self.estimator = TokenEstimator(rel_error_sigma=config.estimator_sigma)
        self.records: list[RequestRecord] = [
            RequestRecord(r.request_id, "", r.arrival_s, r.prompt_tokens, r.output_tokens, tenant=r.tenant)
            for r in self.requests
        ]
        self._infos: list[RequestInfo | None] = [None] * len(self.requests)
        self._chain_memo: dict[tuple[int, int], int] = {}
        self.on_complete_hook: CompletionHook | None = None  # e.g. Policy.on_complete

        self.now_s = 0.0
        self._heap: list[tuple] = []
        self._seq = 0
        self._rep_version = [0] * n_rep
        self._crashed = [False] * n_rep
        self._lost: list[list[int]] = [[] for _ in range(n_rep)]
        self._samples: list[list[tuple[int, int, float] | None]] = [[] for _ in range(n_rep)]
        self._pending: tuple[int, RequestInfo, float] | None = None
        self._held: dict[str | None, HeldQueue[int]] = {}  # late binding: the router-side queue of each model
        self._offered: dict[str | None, int] = {}  # by model, the held request currently offered as a decision
        self.hold_order = "deadline"  # which held request is offered: "deadline" (earliest TTFT deadline) or "fifo"
        self.hold_timeout_s = float("inf")  # a held request waiting this long is offered first (late binding's timeout)
        self.n_holds = 0
        self._next_arrival = 0
        self._decisions_queued = 0
        self._future_crashes = 0
        self._detections_due = 0  # crashes the router has not noticed yet (their requests come back)
        self.n_completed = 0
        self.n_dispatches = 0

        # reward integrals
        self._waiting_ft = 0
        self._int_t = 0.0
        self._wait_integral = 0.0
        self._waiting_arrivals: dict[int, float] = {}
        self._ft_pairs: list[tuple[float, float]] = []
        self._slo_cache: dict[float, list[float]] = {}
        self._completed: list[RequestRecord] = []  # in completion order, for the goodput terms of the reward
        self._decode_cache: dict[float, list[float]] = {}
        self._miss_cache: dict[tuple[float, float], list[int]] = {}

        # precise KV view: the replicas' cache changes reach each router's view as events (simulator/kv_feed.py)
        self._kv: KVFeed | None = None
        if config.kv_view.mode == "precise":
            self._kv = KVFeed(self, config.kv_view, seed, self._push_kv)

        self._push_arrival()
        sc = config.scrape
        for i in range(n_rep):
            self._schedule_sample(i, float(self.rng.uniform(0.0, sc.interval_s)))
        for f in config.faults:
            if f.kind == "crash":
                self._push(f.at_s, P_FAULT, E_CRASH, f.replica, f.duration_s)
                self._future_crashes += 1
            else:
                self._push(f.at_s, P_FAULT, E_SLOW, f.replica, f.factor)
                if f.duration_s is not None:
                    self._push(f.at_s + f.duration_s, P_FAULT, E_SLOW, f.replica, 1.0)

    # ---- public API ----------------------------------------------------------------------------

    def next_decision(self) -> tuple[ClusterView, RequestInfo] | None:
        """Process events up to the next routing decision; None when no decision remains."""
        if self._pending is not None:
            raise RuntimeError("the pending decision has not been dispatched yet")
        heap, versions, replicas = self._heap, self._rep_version, self.replicas
        heappop, heappush = heapq.heappop, heapq.heappush
        n_requests = len(self.requests)
        routers = self.routers
        n_routers = len(routers)
        trackers = self.tracker.trackers  # health is the same in every router's view
        while True:
            if not self._decisions_queued and not self._detections_due and (
                not self._future_crashes or self.n_completed == n_requests
            ):
                return None
            t, _, _, kind, x, y = heappop(heap)
            self.now_s = t
            if kind == E_REPLICA:  # the common case, inlined (_handle + _push_replica)
                if y == versions[x]:
                    rep = replicas[x]
                    rep.on_event(t)
                    if rep.outputs:
                        self._outputs(x, rep)
                    versions[x] = v = y + 1
                    te = rep.event_s
                    if te is not None:
                        self._seq = seq = self._seq + 1
                        heappush(heap, (te, P_REPLICA, seq, E_REPLICA, x, v))
            elif kind == E_ARRIVAL:
                self._decisions_queued -= 1
                self._on_arrival(x, t)
                i = self._next_arrival  # _push_arrival, inlined
                if i < n_requests:
                    self._next_arrival = i + 1
                    self._decisions_queued += 1
                    self._seq = seq = self._seq + 1
                    heappush(heap, (self.requests[i].arrival_s, P_DECISION, seq, E_ARRIVAL, i, None))
                info = self._infos[x]
                if self._members[info.model] is None:  # type: ignore[union-attr]
                    for tr in trackers:
                        if tr.healthy:  # the common case of _decide, inlined
                            self._pending = (x, info, t)  # type: ignore[assignment]
                            if self._fleet is not None:
                                self._fleet.before_view(x % n_routers, t)
                            d = self._filtered(x, info, routers[x % n_routers].view(t, info), t)  # type: ignore[arg-type]
                            if d is not None:
                                return d
                            break
                    else:
                        d = self._decide(x, t)
                        if d is not None:
                            return d
                    continue
                d = self._decide(x, t)
                if d is not None:
                    return d
            elif kind == E_RETRY:
                self._decisions_queued -= 1
                d = self._decide(x, t)
                if d is not None:
                    return d
            else:
                self._handle(kind, x, y, t)

    def dispatch(self, index: int) -> None:
        """Route the pending request to replica `index` (must be healthy in the router's view)."""
        if self._pending is None:
            raise RuntimeError("no pending decision: call next_decision() first")
        if not 0 <= index < len(self.replicas):
            raise ValueError(f"replica index {index} out of range (0..{len(self.replicas) - 1})")
        tr = self.tracker.trackers[index]
        if not tr.healthy:
            raise ValueError(f"replica {index} ({tr.replica_id}) is unhealthy in the router's view")
        idx, info, t = self._pending
        if (m := self._members[info.model]) is not None and index not in m:
            raise ValueError(f"replica {index} ({tr.replica_id}) does not serve model {info.model!r}")
        router = self._router_of(idx)
        self._pending = None
        model = info.model
        if self._offered.get(model) == idx:
            del self._offered[model]
            queue = self._held[model]
            queue.take(idx)
            if queue:
                self._offer(model, queue, t)
            else:
                del self._held[model]
        router.dispatch(index, info, t)
        self.records[idx].replica_id = self.replica_ids[index]
        self.n_dispatches += 1
        if self._crashed[index]:
            self._lost[index].append(idx)
            return
        rep = self.replicas[index]
        st = ReqState(self.requests[idx], idx, t, info.prefix_blocks)
        limit = rep.max_model_len
        if st.prompt + st.output > limit:
            if st.prompt >= limit:
                self._reject(index, idx, info, t)
                return
            st.output = limit - st.prompt  # generation stops at max_model_len (finish_reason "length")
        before = rep.event_s
        rep.add(st, t)
        if rep.event_s != before:
            self._push_replica(index)

    def hold(self) -> None:
        """Keep the pending request in the router-side queue (late binding) instead of routing it now.
        The offered head of the queue goes back to the head; anything else joins the tail."""
        if self._pending is None:
            raise RuntimeError("no pending decision: call next_decision() first")
        idx, _info, _t = self._pending
        if not (any(tr.outstanding for router in self.routers for tr in router.trackers) if self._fleet is None
                else self._fleet.own_in_flight()):
            raise RuntimeError(f"request {idx}: held with nothing in flight, so no completion would ever release it")
        self._pending = None
        self._decisions_queued += 1
        model = _info.model
        if self._offered.get(model) == idx:
            del self._offered[model]  # back in its queue, where it stayed
        else:
            self.n_holds += 1  # requests that entered the queue (the head offered back and held again is not new)
            req = self.requests[idx]
            deadline = float("inf") if req.ttft_target_s is None else req.arrival_s + req.ttft_target_s
            queue = self._held.get(model)
            if queue is None:
                queue = self._held[model] = HeldQueue()
            queue.push(idx, idx, req.arrival_s, deadline if self.hold_order == "deadline" else float("inf"))

    @property
    def held(self) -> int:
        """Requests in the router-side queues (late binding), those offered now not counted."""
        return sum(len(q) for q in self._held.values()) - len(self._offered)

    def held_besides(self, idx: int) -> int:
        """Requests held for the model of request `idx`, not counting it or the one offered now (late binding's
        `queued`: the live router's per-model queue)."""
        model = self._infos[idx].model  # type: ignore[union-attr]
        queue = self._held.get(model)
        if queue is None:
            return 0
        return len(queue) - (1 if model in self._offered else 0)

    def is_offered(self, idx: int) -> bool:
        """Request `idx` is a held one offered again (late binding's `is_head`)."""
        return self._offered.get(self._infos[idx].model) == idx  # type: ignore[union-attr]

    def _router_of(self, idx: int) -> ClusterTracker:
        """The router instance request `idx` arrived at."""
        return self.routers[idx % len(self.routers)]

    def _offer_held(self, t: float) -> None:
        """Offers the head of every model's queue that has none offered."""
        offered = self._offered
        for model, queue in self._held.items():
            if model not in offered:
                self._offer(model, queue, t)

    def _offer(self, model: str | None, queue: HeldQueue[int], t: float) -> None:
        idx = queue.head(t, self.hold_timeout_s)
        assert idx is not None  # offered only while the queue holds a request
        self._offered[model] = idx
        self._push(t, P_DECISION, E_RETRY, idx)

    def _reject(self, i: int, idx: int, info: RequestInfo, t: float) -> None:
        """vLLM's admission check: a prompt of max_model_len tokens or more gets HTTP 400 at once."""
        rec = self.records[idx]
        rec.error = REJECTED_PROMPT_TOO_LONG
        self._router_of(idx).trackers[i].on_complete(info.request_id, None)  # the router releases it on the 400
        self.n_completed += 1
        self._advance_integrals(t)
        self._waiting_ft -= 1  # it waits for no first token any more
        del self._waiting_arrivals[idx]
        if self.on_complete_hook is not None:
            self.on_complete_hook(
                self.replica_ids[i], info, Outcome(ok=False, ttft_s=None, e2e_s=t - rec.arrival_s, output_tokens=0)
            )

    def finish(self) -> list[RequestRecord]:
        """Run until every request completes; records in request_id order."""
        if self._pending is not None:
            raise RuntimeError("the pending decision has not been dispatched yet")
        if self._decisions_queued:
            raise RuntimeError("requests are still to be routed: call next_decision()/dispatch() until it returns None")
        heap = self._heap
        while self.n_completed < len(self.requests):
            if not heap:
                raise RuntimeError("simulation stalled with incomplete requests")  # pragma: no cover
            t, _, _, kind, x, y = heapq.heappop(heap)
            self.now_s = t
            if kind == E_RETRY:
                raise RuntimeError(
                    "a crash after the last arrival needs routing decisions: use simulate() or next_decision()"
                )
            self._handle(kind, x, y, t)
        self._advance_integrals(self.now_s)
        if self._fleet is not None:
            for load in self._fleet.loads:
                load.apply({})  # every router's own counts (0), not the others' last ones
        return sorted(self.records, key=attrgetter("request_id"))

    def waiting_for_first_token(self) -> int:
        return self._waiting_ft

    def first_token_wait_integral(self) -> float:
        self._advance_integrals(self.now_s)
        return self._wait_integral

    def slo_excess_integral(self, ttft_slo_s: float) -> float:
        """Integral over time of the number of requests waiting longer than `ttft_slo_s` for their first token."""
        acc = self._slo_cache.setdefault(ttft_slo_s, [0, 0.0])
        pairs = self._ft_pairs
        total = acc[1]
        for a, f in pairs[int(acc[0]) :]:
            over = f - a - ttft_slo_s
            if over > 0:
                total += over
        acc[0], acc[1] = len(pairs), total
        cutoff = self.now_s - ttft_slo_s
        live = 0.0
        for a in self._waiting_arrivals.values():
            if a < cutoff:
                live += cutoff - a
        return total + live

    def decode_excess(self, tpot_slo_s: float) -> float:
        """Seconds of decoding beyond the TPOT SLO's pace, summed over the requests completed so far: for each,
        max(0, finish - first token - (output tokens - 1) * tpot_slo_s), the same TPOT goodput scores."""
        acc = self._decode_cache.setdefault(tpot_slo_s, [0, 0.0])
        done = self._completed
        total = acc[1]
        for rec in done[int(acc[0]) :]:
            over = rec.tpot_s - tpot_slo_s
            if over > 0:
                total += over * (rec.output_tokens - 1)
        acc[0], acc[1] = len(done), total
        return total

    def slo_misses(self, ttft_slo_s: float, tpot_slo_s: float) -> int:
        """Requests known by now to miss the SLO as goodput scores it: waiting (or waited) longer than `ttft_slo_s`
        for their first token, or completed within it but at a TPOT above `tpot_slo_s`. Counted at the moment the
        miss becomes certain, so at the end it is the count goodput misses among finished requests."""
        acc = self._miss_cache.setdefault((ttft_slo_s, tpot_slo_s), [0, 0, 0, 0])  # pairs, late, decodes, slow
        pairs, done = self._ft_pairs, self._completed
        late_first = acc[1]
        for a, f in pairs[int(acc[0]) :]:
            if f - a > ttft_slo_s:
                late_first += 1
        slow_decode = acc[3]
        for rec in done[int(acc[2]) :]:
            if rec.ttft_s <= ttft_slo_s and rec.tpot_s > tpot_slo_s:
                slow_decode += 1
        acc[:] = [len(pairs), late_first, len(done), slow_decode]
        cutoff = self.now_s - ttft_slo_s
        waiting_late = sum(1 for a in self._waiting_arrivals.values() if a < cutoff)
        return late_first + slow_decode + waiting_late

    # ---- events --------------------------------------------------------------------------------

    def _push(self, t: float, prio: int, kind: int, x: object = None, y: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, prio, self._seq, kind, x, y))

    def _push_arrival(self) -> None:
        i = self._next_arrival
        if i < len(self.requests):
            self._next_arrival = i + 1
            self._decisions_queued += 1
            self._push(self.requests[i].arrival_s, P_DECISION, E_ARRIVAL, i)

    def _push_replica(self, i: int) -> None:
        self._rep_version[i] += 1
        t = self.replicas[i].event_s
        if t is not None:
            self._push(t, P_REPLICA, E_REPLICA, i, self._rep_version[i])

    def _handle(self, kind: int, x, y, t: float) -> None:
        if kind == E_REPLICA:
            if y == self._rep_version[x]:
                rep = self.replicas[x]
                rep.on_event(t)
                if rep.outputs:
                    self._outputs(x, rep)
                self._push_replica(x)
        elif kind == E_SAMPLE:
            self._on_sample(x, t, y)
        elif kind == E_SCRAPE:
            self._on_scrape(x, t)
        elif kind == E_HEALTH:
            self._on_health(x, y, t)
        elif kind == E_CRASH:
            self._on_crash(x, y, t)
        elif kind == E_RECOVER:
            self._crashed[x] = False
            self.replicas[x].recover()
            if self._kv is not None:
                self._kv.observe(x)  # recover() replaced the cache
        elif kind == E_SLOW:
            rep = self.replicas[x]
            before = rep.event_s
            rep.set_factor(t, y)
            if rep.event_s != before:
                self._push_replica(x)
        elif kind == E_KV:
            self._kv.deliver(x, y[0], y[1], t)  # type: ignore[union-attr]
        elif kind == E_KV_REPLAY:
            self._kv.replay(x, y[0], y[1], t)  # type: ignore[union-attr]

    def _push_kv(self, t: float, i: int, payload: tuple, replay: bool) -> None:
        """A KV-event batch (or a replay's answer) for replica i reaching the routers at t (with the scrapes)."""
        self._push(t, P_SCRAPE, E_KV_REPLAY if replay else E_KV, i, payload)

    def _outputs(self, i: int, rep: Replica) -> None:
        routers = self.routers
        n_routers = len(routers)
        tracker = routers[0].trackers[i]
        records = self.records
        hook = self.on_complete_hook
        overhead = rep.profile.request_overhead_s  # HTTP + tokenisation a real server adds (measured profiles)
        for kind, st, t in rep.outputs:
            if overhead:
                t += overhead
            idx = st.idx
            rec = records[idx]
            if n_routers > 1:
                tracker = routers[idx % n_routers].trackers[i]
            if kind == COMPLETE:
                rec.finish_s = t
                rec.replica_id = rep.replica_id
                rec.preemptions += st.preemptions
                rec.prefix_hit_tokens = st.prefix_hit_tokens
                q = rec.queue_delay_s
                if q != q:  # NaN: not set by an earlier attempt
                    rec.queue_delay_s = st.first_scheduled_s - rec.arrival_s
                out = st.output
                if out < rec.output_tokens:
                    rec.output_tokens = out  # what was generated: max_model_len cut it short
                self._completed.append(rec)
                info = self._infos[idx]
                tracker.on_complete(info.request_id, (t - st.first_token_s) / (out - 1) if out > 1 else None)  # type: ignore[union-attr]
                self.n_completed += 1
                if self._held and len(self._offered) < len(self._held):
                    self._offer_held(t)
                if hook is not None:
                    hook(
                        rep.replica_id,
                        info,  # type: ignore[arg-type]
                        Outcome(ok=True, ttft_s=rec.ttft_s, e2e_s=rec.e2e_s, output_tokens=rec.output_tokens),
                    )
            else:
                tracker.on_first_token(self._infos[idx].request_id, t - st.dispatch_s)  # type: ignore[union-attr]
                if self._held and len(self._offered) < len(self._held):
                    self._offer_held(t)
                ft = rec.first_token_s
                if ft != ft:  # NaN: the request's first first token
                    rec.first_token_s = t
                    if t > self._int_t:  # _advance_integrals(t)
                        self._wait_integral += self._waiting_ft * (t - self._int_t)
                        self._int_t = t
                    self._waiting_ft -= 1
                    del self._waiting_arrivals[idx]
                    self._ft_pairs.append((rec.arrival_s, t))
        rep.outputs.clear()

    def _on_arrival(self, idx: int, t: float) -> None:
        req = self.requests[idx]
        if t > self._int_t:  # _advance_integrals(t)
            self._wait_integral += self._waiting_ft * (t - self._int_t)
            self._int_t = t
        self._waiting_ft += 1
        self._waiting_arrivals[idx] = req.arrival_s
        estimate = self.estimator.from_true_tokens(req.prompt_tokens, self.rng)
        if self.config.estimator_scale != 1.0:
            estimate = max(1, round(estimate * self.config.estimator_scale))
        blocks = self._prefix_blocks(req.block_ids) if req.block_ids else ()
        if self._kv is not None and blocks:
            # the replicas key their cache by these hashes, and report them as events: the view can match them
            blocks = TokenBlocks(blocks, req.block_tokens)
        self._infos[idx] = make_request_info(str(req.request_id), estimate, req.max_tokens, blocks, None, req.model)

    def _prefix_blocks(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        """`id_prefix_blocks(block_ids)`, memoised per (parent, id) since prefixes repeat."""
        if not block_ids:
            return ()
        memo = self._chain_memo
        out = []
        parent = 0
        for b in block_ids:
            key = (parent, b)
            h = memo.get(key)
            if h is None:
                h = memo[key] = chain_hash(parent, int(b).to_bytes(8, "little", signed=True))
            out.append(h)
            parent = h
        return tuple(out)

    def _decide(self, idx: int, t: float) -> tuple[ClusterView, RequestInfo] | None:
        info = self._infos[idx]
        m = self._members[info.model]  # type: ignore[union-attr]
        trackers = self.tracker.trackers
        for tr in trackers if m is None else [trackers[i] for i in m]:
            if tr.healthy:
                break
        else:
            # nobody to route to: hold the request until a replica is back
            later = [e[0] for e in self._heap if e[3] == E_HEALTH and e[5]]
            if not later:
                raise RuntimeError(f"request {info.request_id} at {t:.3f}s: no healthy replica and none recovers")  # type: ignore[union-attr]
            self._decisions_queued += 1
            self._push(min(later), P_DECISION, E_RETRY, idx)
            return None
        self._pending = (idx, info, t)  # type: ignore[assignment]
        if self._fleet is not None:
            self._fleet.before_view(idx % len(self.routers), t)
        return self._filtered(idx, info, self._router_of(idx).view(t, info), t)  # type: ignore[arg-type]

    def _filtered(self, idx: int, info: RequestInfo, view: ClusterView, t: float) -> tuple[ClusterView, RequestInfo] | None:
        """The pipeline's filters on the pending request's view (the model's replicas; any added filter stage's
        rule); a filter that leaves no healthy replica sends it back as no healthy replica would (None)."""
        out = self.pipeline.filter(view, info, self._asks[info.model])
        if out is not view and not any(r.healthy for r in out.replicas):
            self._pending = None
            later = [e[0] for e in self._heap if e[3] == E_HEALTH and e[5]]
            if not later:
                raise RuntimeError(f"request {info.request_id} at {t:.3f}s: the filters "
                                   f"({', '.join(f.name for f in self.pipeline.filters)}) leave no healthy replica")
            self._decisions_queued += 1
            self._push(min(later), P_DECISION, E_RETRY, idx)
            return None
        return out, info

    # ---- scrapes -------------------------------------------------------------------------------

    def _schedule_sample(self, i: int, scrape_t: float) -> None:
        self._push(max(self.now_s, scrape_t - self.config.scrape.lag_s), P_SAMPLE, E_SAMPLE, i, scrape_t)

    def _on_sample(self, i: int, t: float, scrape_t: float) -> None:
        rep = self.replicas[i]
        self._samples[i].append(None if self._crashed[i] else (*rep.sample(t), rep.lora_sample()))
        self._push(scrape_t, P_SCRAPE, E_SCRAPE, i)
        sc = self.config.scrape
        nxt = scrape_t + max(1e-6, sc.interval_s + (float(self.rng.uniform(-sc.jitter_s, sc.jitter_s)) if sc.jitter_s else 0.0))
        if self.n_completed < len(self.requests):
            self._schedule_sample(i, nxt)

    def _on_scrape(self, i: int, t: float) -> None:
        values = self._samples[i].pop(0)
        fail = self.config.scrape.failure_prob > 0 and self.rng.random() < self.config.scrape.failure_prob
        if values is None or fail:
            return  # connection refused / timeout: the tracker keeps its old values, age grows
        waiting, running, usage, lora = values
        state = None if lora is None else LoraState(*lora)
        for router in self.routers:
            router.trackers[i].on_scrape(t, waiting, running, usage, self.replicas[i].kv_capacity_tokens, state)

    # ---- faults --------------------------------------------------------------------------------

    def _on_crash(self, i: int, duration: float | None, t: float) -> None:
        self._future_crashes -= 1
        if self._crashed[i]:
            return
        self._crashed[i] = True
        lost = self.replicas[i].crash()
        if self._kv is not None:
            self._kv.restart(i)
        self._rep_version[i] += 1  # drop its pending event
        self._lost[i].extend(st.idx for st in lost)
        delay = self.config.health_check_delay_s
        self._push(t + delay, P_HEALTH, E_HEALTH, i, False)
        self._detections_due += 1
        if duration is not None:
            self._push(t + duration, P_FAULT, E_RECOVER, i)
            self._push(max(t + duration, t + delay), P_HEALTH, E_HEALTH, i, True)

    def _on_health(self, i: int, healthy: bool, t: float) -> None:
        for router in self.routers:
            router.trackers[i].healthy = healthy
        if healthy:
            return
        self._detections_due -= 1
        for router in self.routers:
            router.prefix_index.forget(self.replica_ids[i])
        if self._kv is not None:
            self._kv.replica_failed(i, t)
        for idx in self._lost[i]:
            self._router_of(idx).trackers[i].on_complete(self._infos[idx].request_id, None)  # type: ignore[union-attr]
            self._decisions_queued += 1
            self._push(t, P_DECISION, E_RETRY, idx)
        self._lost[i] = []

    # ---- reward integrals ----------------------------------------------------------------------

    def _advance_integrals(self, t: float) -> None:
        if t > self._int_t:
            self._wait_integral += self._waiting_ft * (t - self._int_t)
            self._int_t = t


def sim_pipeline() -> Pipeline:
    """The simulator's pipeline: every filter stage; a lone candidate goes without the policy, and a scoring policy
    behind late binding always scores the whole fleet (router.policy.pipeline)."""
    return Pipeline(lone_goes=True, context_always=True)


def simulate(
    config: ClusterConfig,
    requests: Sequence[SimRequest],
    policy: Policy,
    seed: int | None = None,
    progress: bool = False,
) -> list[RequestRecord]:
    """Route every request with `policy` (reset with `seed`) and run to completion."""
    sim = ClusterSim(config, requests, seed=seed)
    policy.reset(seed)
    if type(policy).on_complete is not Policy.on_complete:  # skip the call for policies that ignore it
        sim.on_complete_hook = policy.on_complete
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sim.requests), desc="simulate", unit="req")
    pipeline = sim.pipeline
    while (d := sim.next_decision()) is not None:
        view, info = d
        sim.dispatch(pipeline.pick(make_choice(view), info, policy).index)
        if bar is not None:
            bar.update(1)
    records = sim.finish()
    if bar is not None:
        bar.close()
    return records
