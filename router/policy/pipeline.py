"""The decision as declared stages: the one pipeline the live router, its hold queue, the simulator, late binding's
driver and the training environment run.

    view ──► filters ──► health ──► room ──────────► policy ──────────► pick
             by model     none?     late binding:     scores or         Routed(index, decision, view, late)
             retried      │         hold, or the      chooses; guards
             (stages/)    │         replicas with     (FallbackPolicy)
                          │         room              │
                          ▼         ▼                 ▼
                     NoneHealthy   Held     a guard tripped: the fallback picks

Learned from the Gateway API Inference Extension's endpoint picker, which composes filters, scorers and a picker,
small named plugins, in a scheduling profile. Here a filter is a named stage in router/policy/stages/ (one file
each, found there when a pipeline is built: adding a tenant rule or a new affinity is one file); a filter marks
the replicas it rules out unhealthy in the view (`late_binding.restrict`), so no later stage needs to know which
stage ruled a replica out, and a learned policy never counts a non-candidate in its fleet statistics. The room
stage is late binding's rule (router.policy.late_binding.decide); the policy stage is the served policy behind its
guards (router.policy.fallback: the primary scores or chooses, a guard that trips hands the pick to the fallback).

Each run returns a typed outcome: `Routed`, `Held` (late binding keeps it queued) or `NoneHealthy` (no candidate
is healthy). Two switches say where the worlds differ, both for the cost of a decision, never for its answer on a
live fleet: `lone_goes` (the simulator dispatches a lone candidate without asking the policy; the live router asks
it, for the decision log) and `context_always` (the simulator gives a scoring policy the whole fleet as context
whenever the room stage ran; the live router only when the room stage left a healthy replica out, so a learned
policy keeps its one-call fast path).

Pure (router.policy only): the callers build the view, keep the queue and dispatch the pick.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import ClassVar, Protocol

from routewise_vllm.router.policy import late_binding, stages
from routewise_vllm.router.policy.base import Decision
from routewise_vllm.router.policy.late_binding import LateBindingConfig, ReplicaLimit, restrict
from routewise_vllm.router.policy.types import ClusterView, RequestInfo, slot_builder


# ---- what a decision brings -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """What one decision brings to the filters besides the view and the request."""

    members: tuple[int, ...] | None = None  # the view indices serving the request's model (None: every replica)
    exclude: Set[str] = frozenset()  # replica ids this request was tried on already (retries)


#: Ask(members, exclude), built as plainly as the view (one per live decision).
make_ask = slot_builder(Ask)
NO_ASK = Ask()


@dataclass(frozen=True, slots=True)
class Room:
    """Late binding's question for one request: the queue around it (router.policy.late_binding.decide's inputs),
    or `force`: a reason it goes at once to the policy's pick over every candidate, the rule not asked (the live
    queue's "shutdown" and "error")."""

    limits: Sequence[ReplicaLimit]
    queued: int  # requests held for its model besides it
    is_head: bool  # it is the held head offered again
    waited_s: float  # since it arrived
    config: LateBindingConfig
    force: str | None = None


def forced(reason: str) -> Room:
    """A Room whose request goes at once, with `reason`, whatever the rule would say."""
    return Room((), 0, False, 0.0, _DEFAULT_LATE, reason)


_DEFAULT_LATE = LateBindingConfig()


# ---- outcomes ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Routed:
    """The request goes to `index` of `view` (the view the policy decided on)."""

    index: int
    decision: Decision | None  # the policy's decision; None: the lone candidate went unasked (`lone_goes`)
    view: ClusterView
    late: str | None = None  # late binding's reason it went (late_binding.DISPATCH_REASONS or a forced one)


@dataclass(frozen=True, slots=True)
class Held:
    """Late binding holds the request: no candidate has room."""


@dataclass(frozen=True, slots=True)
class NoneHealthy:
    """No candidate replica is healthy (after the filters): the request cannot be routed now."""

    model: str | None


@dataclass(frozen=True, slots=True)
class Choice:
    """What the policy picks among: `view` (its candidates healthy), `context` (the fleet the room stage restricted,
    for a scoring policy; None when it did not), the room stage's reason and candidates (None: not asked)."""

    view: ClusterView
    context: ClusterView | None = None
    late: str | None = None
    candidates: tuple[int, ...] | None = None


HELD = Held()
#: The reason a request skipped late binding's rule: the policy asked to pick over every candidate at once
POLICY_ROUTES = "policy"
make_routed = slot_builder(Routed)
make_choice = slot_builder(Choice)


class Decider(Protocol):
    """The policy stage: a policy behind its guards (FallbackPolicy), the live router's PolicyRunner, or any
    router.policy.base.Policy (its `decide` asks `choose`)."""

    def decide(self, view: ClusterView, request: RequestInfo, context: ClusterView | None = None) -> Decision: ...

    def binds_late(self, view: ClusterView, request: RequestInfo) -> bool: ...


# ---- filters --------------------------------------------------------------------------------------------------------


class Filter:
    """A filter stage: the view with the replicas it rules out for this request marked unhealthy (the same view
    object when it rules out none). Subclasses in router/policy/stages/ are found when a pipeline is built, in
    (`order`, `name`) order."""

    name: ClassVar[str]
    order: ClassVar[int] = 100

    def __call__(self, view: ClusterView, request: RequestInfo, ask: Ask) -> ClusterView:
        raise NotImplementedError


def default_filters() -> tuple[Filter, ...]:
    """One instance of every Filter subclass defined in a module of router/policy/stages/ (every folder on the
    package's `__path__`), in (`order`, `name`) order."""
    key = tuple(stages.__path__)
    cached = _FOUND.get(key)
    if cached is None:
        found: dict[str, type[Filter]] = {}
        for info in pkgutil.iter_modules(stages.__path__):
            module = importlib.import_module(f"{stages.__name__}.{info.name}")
            for cls in vars(module).values():
                if isinstance(cls, type) and issubclass(cls, Filter) and cls.__module__ == module.__name__:
                    if cls.name in found:
                        raise TypeError(f"two filter stages named {cls.name!r}: {found[cls.name]} and {cls}")
                    found[cls.name] = cls
        cached = _FOUND[key] = tuple(c() for c in sorted(found.values(), key=lambda c: (c.order, c.name)))
    return cached


_FOUND: dict[tuple[str, ...], tuple[Filter, ...]] = {}


# ---- the pipeline -------------------------------------------------------------------------------------------------


class Pipeline:
    """filters -> health -> room -> policy -> pick. `decide` runs them all; `filter`, `narrow` and `pick` run the
    parts, for a caller that builds the filtered view once (the simulator) or is the picker itself (training)."""

    __slots__ = ("filters", "lone_goes", "context_always")

    def __init__(self, filters: Sequence[Filter] | None = None, *, lone_goes: bool = False,
                 context_always: bool = False) -> None:
        self.filters = tuple(default_filters() if filters is None else filters)
        self.lone_goes = lone_goes
        self.context_always = context_always

    @property
    def names(self) -> tuple[str, ...]:
        """The stages, in order."""
        return (*(f.name for f in self.filters), "health", "room", "policy", "pick")

    def filter(self, view: ClusterView, request: RequestInfo, ask: Ask = NO_ASK) -> ClusterView:
        for f in self.filters:
            view = f(view, request, ask)
        return view

    def narrow(self, view: ClusterView, request: RequestInfo, room: Room | None = None,
               policy: Decider | None = None) -> Choice | Routed | Held | NoneHealthy:
        """Health and room on a filtered view: the policy's Choice, or Held / NoneHealthy, or (`lone_goes`) Routed.
        `policy`: asked whether late binding's rule applies to the request (`binds_late`); when it says no, the
        request goes at once with reason POLICY_ROUTES."""
        for r in view.replicas:
            if r.healthy:
                break
        else:
            return NoneHealthy(request.model)
        if room is None:
            return make_choice(view, None, None, None)
        if room.force is not None:
            return make_choice(view, None, room.force, None)
        if policy is not None and not policy.binds_late(view, request):
            return make_choice(view, None, POLICY_ROUTES, None)
        d = late_binding.decide(view, room.limits, room.queued, room.is_head, room.waited_s, room.config)
        if d.reason == "hold":
            return HELD
        candidates = d.candidates
        if self.lone_goes and len(candidates) == 1:
            return make_routed(candidates[0], None, view, d.reason)
        if not self.context_always and len(candidates) == sum(r.healthy for r in view.replicas):
            return make_choice(view, None, d.reason, None)  # every candidate has room: restricting changes nothing
        return make_choice(restrict(view, candidates), view, d.reason, candidates)

    @staticmethod
    def pick(choice: Choice, request: RequestInfo, policy: Decider) -> Routed:
        d = policy.decide(choice.view, request, choice.context)
        return make_routed(d.index, d, choice.view, choice.late)

    def decide(self, view: ClusterView, request: RequestInfo, policy: Decider, ask: Ask = NO_ASK,
               room: Room | None = None) -> Routed | Held | NoneHealthy:
        """Every stage, in order."""
        for f in self.filters:
            view = f(view, request, ask)
        if room is None:  # narrow + pick without late binding, inlined: the common live decision
            for r in view.replicas:
                if r.healthy:
                    d = policy.decide(view, request, None)
                    return make_routed(d.index, d, view, None)
            return NoneHealthy(request.model)
        out = self.narrow(view, request, room, policy)
        if type(out) is Choice:
            return self.pick(out, request, policy)
        return out  # type: ignore[return-value]
