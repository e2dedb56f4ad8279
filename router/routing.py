"""Turn a parsed OpenAI request into a routing decision.

`PolicyRunner` owns one policy (wrapped in FallbackPolicy with LOR) and its telemetry for one
arm. `Router` owns the runners, builds the RequestInfo and the ClusterView, runs the decision pipeline
(router.policy.pipeline: filters, health, late binding's room, the policy and its guards) and dispatches its pick
into the tracker, and feeds outcomes back. Every decision returns a typed outcome: a `Route`, `Held` (late binding
queues it: `when_room` waits) or `NoneHealthy`. Shadow evaluation and A/B splits extend `Router.select_runner` and
`Router.arms`; everything else stays as is.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routewise_vllm.router.endpoints import Parsed
from routewise_vllm.router.hold_queue import HoldQueue, late_binding_config
from routewise_vllm.router.models import no_replica_message
from routewise_vllm.router.openai import decode_budget, prompt_text, user_of
from routewise_vllm.router.policy import FEATURE_SPEC_HASH, FallbackPolicy, TokenEstimator, text_prefix_blocks
from routewise_vllm.router.policy.fallback import BUDGET_COOLDOWN, FALLBACK_REASONS, Decision
from routewise_vllm.router.policy.model_routing import ModelLabels
from routewise_vllm.router.policy.pipeline import Held, NoneHealthy, Pipeline, Room, Routed, make_ask
from routewise_vllm.router.policy.served import GUARD_FIELDS, served_policy
from routewise_vllm.router.policy.types import ClusterView, NoHealthyReplica, Outcome, RequestInfo, make_request_info
from routewise_vllm.router.kv.prompt_tokens import PromptBlocks
from routewise_vllm.router.replicas import Replica, ReplicaSet
from routewise_vllm.router.serving.arms import routing_key
from routewise_vllm.router.serving.layer import ServingLayer
from routewise_vllm.router.serving.shadow import ShadowResult
from routewise_vllm.router.settings import RouterSettings, is_learned
from routewise_vllm.router.slo import Targets
from routewise_vllm.router.telemetry import RouterMetrics

log = logging.getLogger("router.routing")


def policy_label(name: str) -> str:
    """A bounded metric label for a policy setting: the name, or an .onnx file's stem."""
    return Path(name).stem if name.endswith(".onnx") else name


def guarded_policy(policy_name: str, settings: RouterSettings) -> FallbackPolicy:
    """`policy_name` as served (router.policy.served): its kind's default guards, the settings'
    explicit guards over them, the settings' budget judged on the deciding thread's CPU time (what the
    policy costs; time the OS spent running other processes would delay least-outstanding just as
    much). llm_router_decision_latency_seconds reports wall time."""
    explicit = {f: getattr(settings, f) for f in GUARD_FIELDS if f in settings.model_fields_set}
    return served_policy(policy_name, seed=settings.seed, guards=explicit, budget_s=settings.decision_budget_s,
                         clock=time.thread_time)


class PolicyRunner:
    """One policy for one arm: decisions, fallback accounting, decision latency, policy info."""

    def __init__(self, arm: str, policy_name: str, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.arm = arm
        self.name = policy_name
        self.label = policy_label(policy_name)
        learned = is_learned(policy_name)
        self.policy = guarded_policy(policy_name, settings)
        primary = self.policy.primary
        self.fallback_counts: Counter[str] = Counter()
        self.decisions = 0
        self.last_error: str | None = None
        self._metrics = metrics
        self._latency = metrics.batch.tally(metrics.decision_latency.labels(self.label, arm))
        for reason in FALLBACK_REASONS:  # exported at 0 from the start, so rates and alerts work
            metrics.fallbacks.labels(self.label, arm, reason)
        info = primary.describe()
        self.version = str(info.get("version", "builtin"))
        self.feature_hash = str(info.get("feature_spec_hash") or (FEATURE_SPEC_HASH if learned else ""))
        self.load_error: str | None = None
        self._set_info(info)

    def _info_labels(self) -> tuple[str, str, str, str]:
        """What really serves: the fallback (version "fallback", no feature hash) while the primary is unloaded."""
        if self.load_error:
            return self.arm, policy_label(self.policy.fallback.name), "fallback", ""
        return self.arm, self.label, self.version, self.feature_hash

    def _set_info(self, info: dict[str, Any]) -> None:
        self.load_error = str(info["load_error"]) if info.get("load_error") else None
        if self.load_error:
            log.warning("policy %s unavailable, every decision falls back to %s: %s", self.name,
                        self.policy.fallback.name, self.load_error)
        elif info.get("executor"):
            log.info("policy %s (%s arm) decides with %s: %s", self.name, self.arm, info["executor"], info["executor_note"])
        self._metrics.policy_info.labels(*self._info_labels()).set(1)

    @property
    def serving(self) -> str:
        """The policy that makes this arm's decisions now."""
        return f"{self.policy.fallback.name} (fallback)" if self.load_error else self.name

    def swap_primary(self, primary) -> None:
        """Hot reload: later decisions use `primary`; decisions already made are untouched."""
        self.policy.primary = primary
        info = primary.describe()
        self._metrics.policy_info.remove(*self._info_labels())
        self.version = str(info.get("version", "builtin"))
        self.feature_hash = str(info.get("feature_spec_hash") or self.feature_hash)
        self._set_info(info)
        self.last_error = None

    def binds_late(self, view: ClusterView, request: RequestInfo) -> bool:
        return self.policy.binds_late(view, request)

    def decide(self, view: ClusterView, request: RequestInfo, context: ClusterView | None = None) -> Decision:
        policy = self.policy
        trips = policy.trips
        d = policy.decide(view, request, context)
        if policy.trips != trips and (trip := policy.last_trip) is not None:
            log.warning(
                "policy %s (%s arm): %d of its last %d decisions overran the %.2f ms decision budget (slowest %.2f ms); "
                "least-outstanding decides the next %d (llm_router_fallbacks_total{reason=\"over_budget\"})",
                self.label, self.arm, trip.slow, trip.window, (policy.budget_s or 0.0) * 1e3, trip.slowest_s * 1e3,
                BUDGET_COOLDOWN,
            )
        self.decisions += 1
        if d.fallback_reason is not None:
            self.fallback_counts[d.fallback_reason] += 1
            self._metrics.fallbacks.labels(self.label, self.arm, d.fallback_reason).inc()
            if d.error:
                self.last_error = d.error
        return d

    def describe(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "policy": self.name,
            "version": self.version,
            "feature_hash": self.feature_hash,
            "serving": self.serving,
            "load_error": self.load_error,
            "describe": self.policy.describe(),
            "decisions": self.decisions,
            "fallbacks": dict(self.fallback_counts),
            "last_error": self.last_error,
        }


@dataclass(slots=True)
class Route:
    """One attempt of a request. What the decision made is set once, where it was made (`Router.decide`, late binding's
    reason and hold time included; the shadow's pick by the serving layer within that call); what the attempt
    measured (status, stream, outcome, tpot_s) the proxy writes as it measures it, and the decision log reads it all
    at release. Mutable for those results only: they are measured across awaits of one attempt, and a record passed
    along each would cost an allocation per attempt on the hot path for nothing the log needs earlier."""

    replica: Replica
    decision: Decision
    runner: PolicyRunner
    request: RequestInfo
    outcome: Outcome | None = None  # set by the proxy, passed to the policy at release
    tpot_s: float | None = None
    view: ClusterView | None = None  # what the policy saw (shadow evaluation, decision log)
    wall_s: float = 0.0  # unix time of the decision (decision log)
    attempt: int = 0  # 0 for the first try, 1.. for retries on another replica
    status: int | None = None  # upstream HTTP status, set by the proxy
    stream: bool | None = None
    shadow: ShadowResult | None = None
    prefix_block_tokens: int | None = None
    late: str | None = None  # late binding on: why the hold queue let it go (hold_queue.LATE_REASONS)
    model: str | None = None  # the request's model as a bounded label (model_routing.model_label)
    held_s: float | None = None  # late binding on: time held in the queue (0 when it went at once)

    @property
    def found_idle(self) -> bool:
        """First try, sent to a replica with nothing outstanding: its time to first byte is the replica's own
        speed, not a queue (outlier detection judges only these)."""
        return self.attempt == 0 and self.view is not None and self.view.replicas[self.decision.index].outstanding == 0


class Router:
    def __init__(
        self, settings: RouterSettings, replicas: ReplicaSet, metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.replicas = replicas
        self.metrics = metrics
        self.clock = clock
        self.estimator = TokenEstimator(chars_per_token=settings.chars_per_token)
        self.prompt_blocks: PromptBlocks | None = None  # set when KV events are on (router.kv.events)
        if settings.ab_treatment is not None:  # A/B: arms control (= policy) and treatment
            self.main = PolicyRunner("control", settings.policy, settings, metrics)
            self.arms: dict[str, PolicyRunner] = {
                "control": self.main, "treatment": PolicyRunner("treatment", settings.ab_treatment, settings, metrics),
            }
        else:
            self.main = PolicyRunner("main", settings.policy, settings, metrics)
            self.arms = {"main": self.main}
        self.serving = ServingLayer(
            settings, metrics.registry, self.arms, lambda name: guarded_policy(name, settings), policy_label, clock,
        )
        self._ids = itertools.count(1)
        # the `model` label of every model-labelled metric and of the decision log, bounded by metrics_max_models
        self.model_label = ModelLabels(settings.metrics_max_models)
        self.targets = Targets(settings, metrics, self.model_label)  # latency targets: headers, defaults, attainment
        self._model_decisions: dict[str, Any] = {}  # metric children by model label
        self._model_ttft: dict[str | None, Any] = {}
        # the decision's stages; live, the policy is asked even for a lone candidate (its decision is logged)
        self.pipeline = Pipeline()
        self.holds: HoldQueue[Route] | None = None  # late binding: the first attempt of a request goes through it
        if settings.late_binding:
            self.holds = HoldQueue(late_binding_config(settings), replicas, metrics, clock, self)
            replicas.listeners.append(self.holds.wake)

    def request_info(self, body: dict[str, Any], chat: bool, headers: Any = None) -> RequestInfo:
        text, exact = prompt_text(body, chat)
        request_id = f"r{next(self._ids)}"
        model = body.get("model")
        # the prompt's token blocks when the replicas' KV views can match them (router.kv.prompt_tokens), else the estimate
        blocks = None if self.prompt_blocks is None else self.prompt_blocks.of(body, chat)
        return make_request_info(
            request_id,
            exact if exact is not None else self.estimator.from_text(text),
            decode_budget(body, chat),
            blocks or (text_prefix_blocks(text, self.estimator.chars_per_token) if text else ()),
            routing_key(headers or {}, user_of(body), request_id),
            model, *self.targets.of(headers, model),
        )

    def endpoint_info(self, parsed: Parsed, headers: Any = None) -> RequestInfo:
        """RequestInfo of a request to one of vLLM's other endpoints (router.endpoints), as `request_info`'s."""
        request_id = f"r{next(self._ids)}"
        text = parsed.text
        tokens = parsed.token_ids + (self.estimator.from_text(text) if text else 0)
        return make_request_info(
            request_id, max(1, tokens), parsed.max_tokens,
            text_prefix_blocks(text, self.estimator.chars_per_token) if text else (),
            routing_key(headers or {}, parsed.user, request_id), parsed.model, *self.targets.of(headers, parsed.model),
        )

    def select_runner(self, request: RequestInfo) -> PolicyRunner:
        """The arm that routes this request: by the stable hash of its key under A/B."""
        arm = self.serving.arm_for(request.key or request.request_id)
        return self.main if arm is None else self.arms[arm]

    def first(self, request: RequestInfo) -> Route | Held | NoneHealthy:
        """A request's first attempt: routed now, or behind late binding the hold queue's answer (Held: `when_room`
        waits for a replica with room)."""
        return self.decide(request) if self.holds is None else self.holds.route_now(request)

    async def when_room(self, request: RequestInfo) -> Route | NoneHealthy:
        """Late binding: the request's route once a replica of its model has room (asked again first)."""
        assert self.holds is not None, "a request is held only behind late binding"
        return await self.holds.route(request)

    def route(self, request: RequestInfo, exclude: Set[str] | None = None) -> Route:
        """`decide` without late binding's queue; raises NoHealthyReplica."""
        out = self.decide(request, exclude or frozenset())
        if type(out) is NoneHealthy:
            raise NoHealthyReplica(no_replica_message(request.model))
        return out  # type: ignore[return-value]

    def decide(self, request: RequestInfo, exclude: Set[str] = frozenset(), *, view: ClusterView | None = None,
               room: Room | None = None, started: float | None = None, held_s: float | None = None,
               ) -> Route | Held | NoneHealthy:
        """Runs the pipeline on the request (`exclude`: replica ids tried already) and dispatches its pick in the
        tracker. The hold queue passes `view`, the one it built in the same instant (None = build it), `room`, its
        question to late binding's stage, `started`, the perf_counter reading before it built that view (the
        decision latency metric counts view + rule + policy), and `held_s`, the time held."""
        t0 = time.perf_counter() if started is None else started
        runner = self.select_runner(request)
        if view is None:
            view = self.replicas.cluster.view(self.clock(), request)
        out = self.pipeline.decide(view, request, runner, make_ask(self.replicas.members(request.model), exclude), room)
        if type(out) is not Routed:
            return out  # type: ignore[return-value]
        decision = out.decision
        replica = self.replicas.ordered[out.index]
        self.replicas.cluster.dispatch(out.index, request, self.clock())
        runner._latency.observe(time.perf_counter() - t0)  # applied in a batch, off the request's path
        label = self.model_label(request.model, self.replicas.known_models)
        held = 0.0 if held_s is None else held_s  # the decision log's `t` stays the arrival (replays read it as such)
        route = Route(replica, decision, runner, request, view=out.view, wall_s=time.time() - held,  # type: ignore[arg-type]
                      attempt=len(exclude), late=out.late, held_s=None if out.late is None else held,
                      prefix_block_tokens=getattr(request.prefix_blocks, "block_tokens",
                                                  self.replicas.cluster.prefix_block_tokens), model=label)
        counter = self._model_decisions.get(label)
        if counter is None:
            counter = self._model_decisions[label] = self.metrics.batch.count(
                self.metrics.model_decisions.labels(label))
        counter.inc()
        self.serving.after_decision(route, out.view)
        return route

    def can_retry(self, rep: Replica, tried: Set[str], model: str | None) -> bool:
        """Another routable replica of the request's model, not tried yet: asked only when an attempt failed."""
        members = self.replicas.members(model)
        return any(r.routable and r is not rep and r.id not in tried and (members is None or i in members)
                   for i, r in enumerate(self.replicas.ordered))

    def on_first_token(self, route: Route, ttft_s: float) -> None:
        route.replica.tracker.on_first_token(route.request.request_id, ttft_s)
        tally = self._model_ttft.get(route.model)
        if tally is None:
            tally = self._model_ttft[route.model] = self.metrics.batch.tally(
                self.metrics.model_ttft.labels(route.model))
        tally.observe(ttft_s)
        if self.holds is not None:
            self.holds.wake()

    def release(self, route: Route, outcome: Outcome | None = None, tpot_s: float | None = None) -> None:
        """The request left this replica (completed, failed or cancelled). Idempotent per request."""
        route.replica.tracker.on_complete(route.request.request_id, tpot_s)
        if outcome is not None:
            route.runner.policy.on_complete(route.replica.id, route.request, outcome)
        self.serving.on_release(route, outcome)
        if self.holds is not None:
            self.holds.wake()

    def describe(self) -> dict[str, Any]:
        return {name: runner.describe() for name, runner in self.arms.items()}
