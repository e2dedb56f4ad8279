"""The decision pipeline (router.policy.pipeline): its typed outcomes, and a filter stage added as one new file in
router/policy/stages/ changing routing live (the router app on fake replicas) and simulated."""

from __future__ import annotations

import sys
import textwrap

import pytest

from routewise_vllm.router.policy import LeastOutstanding, stages
from routewise_vllm.router.policy.base import Decision, Policy
from routewise_vllm.router.policy.fallback import FallbackPolicy
from routewise_vllm.router.policy.late_binding import LateBindingConfig, ReplicaLimit
from routewise_vllm.router.policy.pipeline import (
    HELD, POLICY_ROUTES, Ask, Choice, Held, NoneHealthy, Pipeline, Room, Routed, default_filters, forced,
)
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo
from routewise_vllm.simulator.cluster import simulate
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.late_binding import simulate_late
from routewise_vllm.simulator.types import SimRequest
from tests.router.conftest import fakes, router_client  # noqa: F401 - fixtures

REQ = RequestInfo("q", 100, model="m")
ONE = ReplicaLimit(max_outstanding=1, max_prefill_tokens=10_000)
LATE = LateBindingConfig(timeout_s=5.0)


def view(*outstanding: int, healthy: tuple[bool, ...] | None = None) -> ClusterView:
    healthy = healthy or (True,) * len(outstanding)
    return ClusterView(tuple(ReplicaSnapshot(f"r{i}", h, o, 0) for i, (o, h) in enumerate(zip(outstanding, healthy))))


def room(queued: int = 0, is_head: bool = False, waited_s: float = 0.0, n: int = 3) -> Room:
    return Room([ONE] * n, queued, is_head, waited_s, LATE)


class Spy(Policy):
    """Picks the first healthy replica of the view it is given, and remembers what it was given."""

    name = "spy"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[ClusterView, ClusterView | None]] = []

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        return view.healthy_indices()[0]

    def decide(self, view: ClusterView, request: RequestInfo, context: ClusterView | None = None) -> Decision:
        self.seen.append((view, context))
        return super().decide(view, request, context)


# ---- typed outcomes ---------------------------------------------------------------------------------------------


def test_the_default_stages_are_found_in_the_stages_package_in_order():
    assert Pipeline().names == ("model", "retried", "health", "room", "policy", "pick")


def test_routed_carries_the_index_the_decision_and_the_view_the_policy_saw():
    out = Pipeline().decide(view(2, 0, 1), REQ, LeastOutstanding(seed=0))
    assert type(out) is Routed and out.index == 1 and out.late is None
    assert out.decision == Decision(1, 1, None) and [r.outstanding for r in out.view.replicas] == [2, 0, 1]


def test_none_healthy_when_no_candidate_is_left_after_the_filters():
    assert Pipeline().decide(view(0, 0, healthy=(False, False)), REQ, Spy()) == NoneHealthy("m")
    # the model's replicas (0) and the retried one (r1): none left
    out = Pipeline().decide(view(0, 0, 0), REQ, Spy(), Ask(members=(0, 1), exclude=frozenset({"r0", "r1"})))
    assert out == NoneHealthy("m")


def test_the_model_and_retried_filters_leave_only_candidates_healthy():
    spy = Spy()
    out = Pipeline().decide(view(0, 0, 0, 0), REQ, spy, Ask(members=(1, 2, 3), exclude=frozenset({"r1"})))
    assert type(out) is Routed and out.index == 2
    assert [r.healthy for r in spy.seen[0][0].replicas] == [False, False, True, True]


def test_held_when_no_candidate_has_room():
    assert Pipeline().decide(view(1, 1, 1), REQ, Spy(), room=room()) is HELD
    assert type(HELD) is Held


def test_room_restricts_the_policy_to_the_replicas_with_room_and_gives_the_fleet_as_context():
    spy = Spy()
    out = Pipeline().decide(view(1, 0, 0), REQ, spy, room=room())
    assert type(out) is Routed and out.index == 1 and out.late == "room"
    seen, context = spy.seen[0]
    assert [r.healthy for r in seen.replicas] == [False, True, True] and context is not None
    assert [r.healthy for r in context.replicas] == [True, True, True]


def test_live_every_candidate_with_room_is_no_restriction_simulated_it_is():
    live, sim = Spy(), Spy()
    timeout = room(is_head=True, waited_s=LATE.timeout_s)  # a timeout: every healthy replica is a candidate
    Pipeline().decide(view(1, 1, 1), REQ, live, room=timeout)
    Pipeline(context_always=True).decide(view(1, 1, 1), REQ, sim, room=timeout)
    assert live.seen[0][1] is None and sim.seen[0][1] is not None


def test_a_lone_candidate_goes_unasked_only_where_the_pipeline_says():
    spy = Spy()
    out = Pipeline(lone_goes=True).decide(view(1, 0, 1), REQ, spy, room=room())
    assert out == Routed(1, None, view(1, 0, 1), "room") and spy.seen == []
    out = Pipeline().decide(view(1, 0, 1), REQ, spy, room=room())
    assert type(out) is Routed and out.index == 1 and out.decision is not None and len(spy.seen) == 1


def test_a_forced_room_goes_at_once_with_its_reason():
    out = Pipeline().decide(view(1, 1, 1), REQ, Spy(), room=forced("shutdown"))
    assert type(out) is Routed and out.late == "shutdown"


class PerRequest(Spy):
    """A policy that asks to pick every request over every candidate at once (late binding's rule not asked)."""

    def binds_late(self, view: ClusterView, request: RequestInfo) -> bool:
        return False


def test_a_policy_that_does_not_bind_late_picks_at_once_over_every_candidate():
    # no replica has room: the rule would hold it; the policy asked not to be held, so it picks over all three
    spy = PerRequest()
    out = Pipeline().decide(view(1, 1, 1), REQ, spy, room=room())
    assert type(out) is Routed and out.index == 0 and out.late == POLICY_ROUTES
    assert spy.seen[0][1] is None and all(r.healthy for r in spy.seen[0][0].replicas)
    # a forced room keeps its reason; no room stage at all (late binding off) never asks
    assert Pipeline().decide(view(1, 1, 1), REQ, PerRequest(), room=forced("shutdown")).late == "shutdown"
    assert Pipeline().decide(view(1, 1, 1), REQ, PerRequest()).late is None
    # behind its guards the primary's answer is the served policy's
    assert FallbackPolicy(PerRequest(), LeastOutstanding()).binds_late(view(1), REQ) is False
    assert FallbackPolicy(Spy(), LeastOutstanding()).binds_late(view(1), REQ) is True


def test_narrow_and_pick_are_decide_in_two_steps():
    p = Pipeline()
    choice = p.narrow(p.filter(view(1, 0, 0), REQ), REQ, room())
    assert type(choice) is Choice and choice.candidates == (1, 2) and choice.late == "room"
    assert p.pick(choice, REQ, Spy()).index == 1


def test_a_policy_declares_the_scoring_interface_the_fallback_reads():
    heuristic = LeastOutstanding(seed=0)
    assert heuristic.scores(view(0), REQ) is None and heuristic.best(view(0), REQ) is None


# ---- a filter stage added in one file ------------------------------------------------------------------------

NEVER_FIRST = '''
"""A dummy stage: the first replica of the view is never a candidate."""

from routewise_vllm.router.policy.late_binding import restrict
from routewise_vllm.router.policy.pipeline import Filter


class NeverFirst(Filter):
    name = "never-first"

    def __call__(self, view, request, ask):
        return restrict(view, range(1, len(view.replicas)))
'''


@pytest.fixture
def never_first(tmp_path):
    """router/policy/stages/ with one more file, `never_first.py` (the package's path extended to a temporary
    folder: nothing else is touched)."""
    folder = tmp_path / "stages"
    folder.mkdir()
    (folder / "never_first.py").write_text(textwrap.dedent(NEVER_FIRST))
    stages.__path__.append(str(folder))
    try:
        yield
    finally:
        stages.__path__.remove(str(folder))
        sys.modules.pop(f"{stages.__name__}.never_first", None)


def sim_replicas(late: bool) -> set[str]:
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=3)])
    requests = [SimRequest(i, 0.05 * i, 300, 20) for i in range(30)]
    policy = make_policy("round-robin")
    records = (simulate_late(cluster, requests, policy, seed=0)[0] if late
               else simulate(cluster, requests, policy, seed=0))
    return {r.replica_id.split("-")[0] for r in records}


@pytest.mark.parametrize("late", [False, True])
def test_a_new_stage_file_changes_simulated_routing(late):
    assert sim_replicas(late) == {"r0", "r1", "r2"}


@pytest.mark.parametrize("late", [False, True])
def test_a_new_stage_file_changes_simulated_routing_with_it(never_first, late):
    assert "never-first" in Pipeline().names
    assert sim_replicas(late) == {"r1", "r2"}


async def live_served(fakes, router_client, **settings) -> list[int]:  # noqa: F811
    a, b = await fakes(2)
    client = await router_client([a.url, b.url], policy="round-robin", **settings)
    for i in range(6):
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": f"p{i}", "max_tokens": 1})
        assert resp.status == 200, await resp.text()
    return [a.requests, b.requests]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [False, True])
async def test_live_routing_without_the_stage_uses_both(fakes, router_client, late):  # noqa: F811
    assert await live_served(fakes, router_client, late_binding=late) == [3, 3]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [False, True])
async def test_a_new_stage_file_changes_live_routing(never_first, fakes, router_client, late):  # noqa: F811
    assert await live_served(fakes, router_client, late_binding=late) == [0, 6]


def test_two_stages_of_one_name_are_refused(never_first, tmp_path):
    (tmp_path / "stages" / "never_first_again.py").write_text(textwrap.dedent(NEVER_FIRST))
    try:
        with pytest.raises(TypeError, match="two filter stages named 'never-first'"):
            default_filters()
    finally:
        sys.modules.pop(f"{stages.__name__}.never_first_again", None)
