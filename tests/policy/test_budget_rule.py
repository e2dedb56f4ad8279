"""The decision-budget rule (docs/decision-budget.md): stalls on a busy host never turn the primary off, a model
that is over budget does, within a bounded number of decisions. Decision times come from an injected cost or
clock: no real sleeps."""

from __future__ import annotations

import random

from routewise_vllm.router.policy import ClusterView, FallbackPolicy, LeastOutstanding, Policy, ReplicaSnapshot, RequestInfo
from routewise_vllm.router.policy.fallback import BUDGET_COOLDOWN, BUDGET_TRIP, BUDGET_WINDOW

BUDGET = 0.0005
VIEW = ClusterView(tuple(ReplicaSnapshot(f"r{i}", True, n, 100 * n) for i, n in enumerate((3, 0, 5))))
REQ = RequestInfo("req", 120, 64)


class Pick0(Policy):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def choose(self, view, request):
        self.calls += 1
        return 0


def guarded(times) -> tuple[FallbackPolicy, Pick0]:
    """A primary whose i-th measured decision takes times[i] seconds (a deterministic cost, read per call)."""
    it = iter(times)
    primary = Pick0()
    return FallbackPolicy(primary, LeastOutstanding(), budget_s=BUDGET, cost=lambda view: next(it)), primary


def run(times) -> list[str | None]:
    fb, _ = guarded(times)
    return [fb.decide(VIEW, REQ).fallback_reason for _ in range(len(times))]


def test_the_rule_as_documented():
    assert (BUDGET_WINDOW, BUDGET_TRIP, BUDGET_COOLDOWN) == (100, 51, 1000)  # docs/decision-budget.md states them


def test_one_slow_decision_in_100_never_trips_it():
    rng = random.Random(7)
    times = []
    for _ in range(200):  # 20,000 decisions, one 20x-over-budget stall at a random place in every 100
        block = [BUDGET / 5] * 100
        block[rng.randrange(100)] = 20 * BUDGET
        times += block
    assert set(run(times)) == {None}


def test_bursts_of_five_never_trip_it():
    # a burst of 5 stalls (a GC pause, a preempted core) every 20 decisions: 25 % of all decisions slow
    times = [10 * BUDGET if i % 20 < 5 else BUDGET / 5 for i in range(20_000)]
    assert set(run(times)) == {None}


def test_a_stall_of_50_decisions_in_a_row_does_not_trip_it_51_does():
    fast = [BUDGET / 5] * 200
    assert set(run(fast + [3 * BUDGET] * 50 + fast)) == {None}
    reasons = run(fast + [3 * BUDGET] * 51 + fast)
    assert reasons.index("over_budget") == 200 + 51  # the 51st slow answer is still used; the next decision is not


def test_a_model_3x_over_budget_trips_on_its_51st_decision_and_again_after_each_cooldown():
    n = 3 * (BUDGET_TRIP + BUDGET_COOLDOWN)
    fb, primary = guarded([3 * BUDGET] * n)
    decisions = [fb.decide(VIEW, REQ) for _ in range(n)]
    reasons = [d.fallback_reason for d in decisions]
    cycle = [None] * BUDGET_TRIP + ["over_budget"] * BUDGET_COOLDOWN
    assert reasons == cycle * 3
    assert all(d.index == 1 for d in decisions if d.fallback_reason)  # least-outstanding decided those
    assert primary.calls == 3 * BUDGET_TRIP  # no request paid for an answer that was thrown away
    assert fb.trips == 3 and fb.last_trip.slow == BUDGET_TRIP and fb.last_trip.slowest_s == 3 * BUDGET


def test_a_noisy_slow_model_trips_within_a_bound():
    # 3x over budget but fast on a random 1 in 5 decisions: trips within 51 / 0.8 ~ 64 measured decisions
    rng = random.Random(3)
    times = [BUDGET / 2 if rng.random() < 0.2 else 3 * BUDGET for _ in range(2000)]
    reasons = run(times)
    first = reasons.index("over_budget")
    assert BUDGET_TRIP < first <= 80, first


def test_it_judges_the_injected_clock_too():
    ticks = []
    for _ in range(BUDGET_TRIP):
        ticks += [0.0, 3 * BUDGET]  # start, end of each measured decision
    it = iter(ticks)
    fb = FallbackPolicy(Pick0(), LeastOutstanding(), budget_s=BUDGET, clock=lambda: next(it))
    reasons = [fb.decide(VIEW, REQ).fallback_reason for _ in range(BUDGET_TRIP + 1)]
    assert reasons == [None] * BUDGET_TRIP + ["over_budget"]


def test_a_reset_forgets_the_slow_decisions():
    fb, _ = guarded([3 * BUDGET] * (BUDGET_TRIP - 1) + [BUDGET / 5] * 10 + [3 * BUDGET] * BUDGET_TRIP)
    for _ in range(BUDGET_TRIP - 1):
        fb.decide(VIEW, REQ)
    fb.reset(0)
    assert [fb.decide(VIEW, REQ).fallback_reason for _ in range(10 + BUDGET_TRIP)] == [None] * (10 + BUDGET_TRIP)
