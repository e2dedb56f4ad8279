"""FallbackPolicy: a primary policy guarded by a fallback (LOR), recording why it fell back."""

from __future__ import annotations

import math

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from routewise_vllm.router.policy.base import Decision, Policy, PolicyUnavailable, best_of
from routewise_vllm.router.policy.types import ClusterView, Outcome, ReplicaSnapshot, RequestInfo

# The bounded set of labels `Decision.fallback_reason` can take (used as a metric label).
FALLBACK_REASONS = (
    "exception",
    "nan",
    "masked_pick",
    "over_budget",
    "stale_stats",
    "unavailable",
    "spec_mismatch",
    "low_confidence",
    "overload_guard",
)


@dataclass(frozen=True, slots=True)
class BudgetTrip:
    """Why a cool-down started: `slow` of the last `window` decisions overran the budget."""

    slow: int
    window: int
    slowest_s: float


# The guards a learned policy runs with unless configured otherwise (router/settings.py). Training
# sees scrape ages up to ~20 s (the stale-metrics scenario: 5 +- 2 s interval, 3 s lag, 20 % failed
# scrapes), so only older stats mean the scraper is broken rather than slow. The overload guard is
# relative: a good policy keeps a fast replica 2-3x as busy as slow ones (heterogeneous GPUs,
# slow-downs); an absolute margin of 32 over the least-loaded replica handed 22 % of the learned
# policy's heterogeneous decisions to the fallback and doubled its p99 TTFT. On a fleet of 2 H100s and
# 6 L4s (~8x apart, the `shapes` group) a good policy keeps the fast pair far busier than the mean:
# margin + 3x the others' mean fired on 6.2 % of decisions there and made the p99 TTFT 0.87 s instead
# of 0.35 s; 8x never fires on the suite or the shapes (identical p99s where 3x never fired either,
# tests/bench/guard_fallbacks.py) and still stops a policy stuck on one replica after 33 requests.
LEARNED_GUARDS: dict[str, float | int] = {"max_stats_age_s": 30.0, "overload_margin": 32, "overload_ratio": 8.0}


# Budget (docs/decision-budget.md): the last BUDGET_WINDOW measured decisions are kept as over / within the budget;
# once BUDGET_TRIP of them overran it (more than half: the rolling median is over budget), the primary is not called
# for the next BUDGET_COOLDOWN decisions (least-outstanding decides, reason "over_budget"), then it is measured
# afresh. Stalls on a busy host come in ones and short bursts: up to 50 in any 100 decisions, in a row or not, never
# trip it (two once did, under a "more than 1 % of 200" rule, and turned a good model off for 1,000 decisions). A
# model over budget on every decision trips on its BUDGET_TRIP-th, one over on a share p > 0.51 of them within about
# BUDGET_TRIP / p. O(1) per decision: a ring of bools and a count.
BUDGET_WINDOW = 100
BUDGET_TRIP = BUDGET_WINDOW // 2 + 1
BUDGET_MIN_SAMPLES = BUDGET_TRIP  # the fewest measured decisions the rule can trip on
BUDGET_COOLDOWN = 1000


class FallbackPolicy(Policy):
    """Returns the primary's choice unless it raises, returns NaN scores, picks a masked
    replica, is persistently slow (see BUDGET_WINDOW: more than half of its last 100 decision times,
    measured with the injected `clock` or given by the deterministic `cost(view)`, over
    `budget_s`; a computed answer is never discarded for being slow), runs on stats older
    than `max_stats_age_s` (replicas never scraped yet do not count), is less sure than
    `min_confidence`, or picks an overloaded replica: more than `overload_margin` requests above
    max(the least-loaded other healthy replica, `overload_ratio` x the other healthy replicas'
    mean). Then the fallback decides.

    Primaries whose `scores(view, request)` gives one logit per replica (router.policy.base.Policy declares it,
    and `best`) get the NaN and confidence checks; others are asked `choose`.
    """

    name = "fallback"

    def __init__(
        self,
        primary: Policy,
        fallback: Policy,
        *,
        budget_s: float | None = None,
        clock: Callable[[], float] | None = None,
        cost: Callable[[ClusterView], float] | None = None,
        max_stats_age_s: float | None = None,
        min_confidence: float | None = None,
        overload_margin: int | None = None,
        overload_ratio: float = 0.0,
    ) -> None:
        super().__init__()
        self.primary = primary
        self.fallback = fallback
        self.budget_s = budget_s
        self.clock = clock
        self.cost = cost
        self.max_stats_age_s = max_stats_age_s
        self.min_confidence = min_confidence
        self.overload_margin = overload_margin
        self.overload_ratio = overload_ratio
        self.last_decision: Decision | None = None
        self.decisions = 0
        self.fallback_counts: dict[str, int] = {}  # reason -> decisions, since the last reset
        self._slow: deque[bool] = deque(maxlen=BUDGET_WINDOW)
        self._n_slow = 0
        self._slowest = 0.0  # the slowest over-budget decision in the window, seconds
        self.trips = 0  # cool-downs started (the router logs each one)
        self.last_trip: BudgetTrip | None = None
        self._cooldown = 0  # decisions left in which the primary is not called

    def describe(self) -> dict:
        return {"name": self.primary.name, "fallback": self.fallback.name, "primary": self.primary.describe()}

    def _primary_pick(self, view: ClusterView, request: RequestInfo,
                      context: ClusterView | None = None) -> tuple[int | None, str | None, str | None]:
        """(pick, fallback_reason, error). With `context` a scoring primary scores it and picks among `view`'s
        healthy replicas."""
        primary = self.primary
        try:
            # a primary's own best() is best_of(scores) in fewer steps; the confidence guard needs the scores
            if self.min_confidence is None and context is None and (best := primary.best(view, request)) is not None:
                pick, finite = best
                return (pick, None, None) if finite else (None, "nan", "scores not finite")
            raw = primary.scores(view if context is None else context, request)
            if raw is None:  # not a scoring policy: it chooses
                return int(primary.choose(view, request)), None, None
            scores = np.asarray(raw, dtype=np.float64)
        except PolicyUnavailable as exc:
            return None, exc.reason, str(exc)
        except Exception as exc:  # noqa: BLE001 - any primary failure must fall back, never fail a request
            return None, "exception", f"{type(exc).__name__}: {exc}"
        if scores.shape != (len(view.replicas),):
            return None, "nan", f"scores not finite or of shape {scores.shape}"
        healthy = [r.healthy for r in view.replicas]
        pick, finite = best_of(scores, healthy)
        if not finite:
            return None, "nan", f"scores not finite or of shape {scores.shape}"
        if self.min_confidence is not None and pick >= 0:
            masked = np.where(healthy, scores, -np.inf)
            z = masked - masked[pick]
            probs = np.exp(z) / np.exp(z).sum()
            if probs[pick] < self.min_confidence:
                return pick, "low_confidence", None
        return pick, None, None

    def decide(self, view: ClusterView, request: RequestInfo, context: ClusterView | None = None) -> Decision:
        """`context`: the whole fleet when `view` restricts it (late binding marks the replicas without room
        unhealthy, router.policy.late_binding.restrict): a scoring primary (the learned one) scores the fleet it
        was trained on and picks among `view`'s healthy replicas; heuristics and the fallback decide on `view`."""
        reps = view.replicas
        reason: str | None = None
        if self.max_stats_age_s is not None:
            # a replica never scraped yet (age inf, e.g. just after start) has no stats to go stale; its
            # features say so (stats_missing) and training starts every episode in that state
            limit = self.max_stats_age_s
            for r in reps:  # a plain loop, age first: this runs over every replica at every decision
                if limit < r.stats_age_s < math.inf and r.healthy:
                    reason = "stale_stats"
                    break
        pick: int | None = None
        error: str | None = None
        elapsed: float | None = None
        if reason is None and self._cooldown > 0:
            self._cooldown -= 1
            reason = "over_budget"
        elif reason is None:
            t0 = self.clock() if self.clock is not None else None
            pick, reason, error = self._primary_pick(view, request, context)
            if t0 is not None:
                elapsed = self.clock() - t0  # type: ignore[misc]
            elif self.cost is not None:
                elapsed = self.cost(view)
            if elapsed is not None and self.budget_s is not None:
                self._judge(elapsed)
        if reason is None and pick is not None:
            if not (0 <= pick < len(reps)) or not reps[pick].healthy:
                reason = "masked_pick"
            elif self.overload_margin is not None and self._overloaded(reps, pick):
                reason = "overload_guard"
        if reason is None and pick is not None:
            decision = Decision(pick, pick, None, elapsed)
        else:
            decision = Decision(self.fallback.choose(view, request), pick, reason, elapsed, error)
            self.fallback_counts[reason or "none"] = self.fallback_counts.get(reason or "none", 0) + 1
        self.decisions += 1
        self.last_decision = decision
        return decision

    def _judge(self, elapsed: float) -> None:
        """Track the slow decisions among the last BUDGET_WINDOW; BUDGET_TRIP of them start a cool-down."""
        slow = elapsed > self.budget_s  # type: ignore[operator]
        if len(self._slow) == BUDGET_WINDOW:
            self._n_slow -= self._slow[0]
        self._slow.append(slow)
        self._n_slow += slow
        if slow:
            self._slowest = max(self._slowest, elapsed)
            if self._n_slow >= BUDGET_TRIP:
                self._cooldown = BUDGET_COOLDOWN
                self.last_trip = BudgetTrip(self._n_slow, len(self._slow), self._slowest)
                self.trips += 1
                self._slow.clear()
                self._n_slow = 0
                self._slowest = 0.0

    def _overloaded(self, reps: tuple[ReplicaSnapshot, ...], pick: int) -> bool:
        if reps[pick].outstanding <= self.overload_margin:  # type: ignore[operator]
            return False  # the reference below is never negative: no need to look at the others
        others = [r.outstanding for i, r in enumerate(reps) if r.healthy and i != pick]
        if not others:
            return False
        ref = min(others)
        if self.overload_ratio > 0:
            ref = max(ref, self.overload_ratio * sum(others) / len(others))
        return reps[pick].outstanding - ref > self.overload_margin  # type: ignore[operator]

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        return self.decide(view, request).index

    def binds_late(self, view: ClusterView, request: RequestInfo) -> bool:
        """The primary's answer; late binding's rule (True) when the primary cannot answer."""
        try:
            return self.primary.binds_late(view, request) is not False
        except Exception:  # noqa: BLE001 - a broken primary must not stop the room stage; its pick falls back anyway
            return True

    @property
    def fallback_share(self) -> float:
        """Share of decisions since the last reset that the fallback made."""
        return sum(self.fallback_counts.values()) / self.decisions if self.decisions else 0.0

    def on_complete(self, replica_id: str, request: RequestInfo, outcome: Outcome) -> None:
        self.primary.on_complete(replica_id, request, outcome)
        self.fallback.on_complete(replica_id, request, outcome)

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self.primary.reset(seed)
        self.fallback.reset(None if seed is None else seed + 1)
        self.last_decision = None
        self.decisions = 0
        self.fallback_counts = {}
        self._slow.clear()
        self._n_slow = 0
        self._slowest = 0.0
        self._cooldown = 0


