"""Candidate promotion: a new model enters as the A/B treatment, becomes the primary (control) only
when the rollback guard's window finds it no worse than the current primary, and is rolled back
(all traffic to control, the existing guard latch) otherwise.

Life of a candidate (`trainer follow` hands one over with `POST /admin/policy/reload {"arm": "treatment"}`):
- `on_candidate`: the treatment arm now serves it; the guard's windows are emptied (the old
  treatment's outcomes say nothing about the new one) and a rollback latch is lifted.
- every `check_every` outcomes, with at least `min_samples` latency samples per arm in the window:
  treatment p99 <= control p99 x `max_p99_ratio` (default 1.0: no worse) and treatment error rate <=
  control's, in `confirm_checks` consecutive checks -> **promoted**: the control arm's policy is
  swapped for the candidate (and its reloader now points at the candidate's file).
- the guard trips first (treatment significantly worse) -> **rolled_back**: control keeps serving
  everything until the next candidate.
Each verdict is counted in `llm_router_policy_promotions_total{result}` and logged with its reason.
Nothing here blocks: it runs on the event loop inside `on_release`, a few comparisons per outcome.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from routewise_vllm.router.policy.base import best_of
from routewise_vllm.router.serving.arms import RollbackGuard

log = logging.getLogger("router.promotion")

RESULTS = ("promoted", "rolled_back")
MAX_EXPLORE_SHARE = 0.2  # of the treatment arm's decisions: exploration costs latency, so it stays bounded
STATES = ("idle", "evaluating", "promoted", "rolled_back")


@dataclass(frozen=True, slots=True)
class PromotionConfig:
    min_samples: int = 500  # latency samples per arm in the window before a promotion verdict
    max_p99_ratio: float = 1.0  # treatment p99 / control p99 at most this to count as "no worse"
    confirm_checks: int = 3
    check_every: int = 20

    def __post_init__(self) -> None:
        if self.min_samples < 1 or self.confirm_checks < 1 or self.check_every < 1 or not self.max_p99_ratio > 0:
            raise ValueError(f"promotion: min_samples, confirm_checks, check_every >= 1 and max_p99_ratio > 0, got {self}")


def read_card(model_path: str | None) -> dict:
    """The `finetune` section of a model's card, or {} (no card, unreadable: the candidate still runs)."""
    if model_path is None:
        return {}
    try:
        doc = json.loads(Path(model_path).with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
    ft = doc.get("finetune") if isinstance(doc, dict) else None
    return ft if isinstance(ft, dict) else {}


class PromotionController:
    def __init__(
        self,
        guard: RollbackGuard,
        promote: Callable[[], str | None],  # swap control's policy for the treatment's; returns the candidate's path
        candidate_path: Callable[[], str | None],
        metrics,  # router.serving.metrics.ServingMetrics
        config: PromotionConfig = PromotionConfig(),
    ) -> None:
        self.guard = guard
        self.promote = promote
        self.candidate_path = candidate_path
        self.config = config
        self.state = "idle"
        self.candidate: str | None = None
        self.history: deque[dict] = deque(maxlen=20)
        self._since_check = 0
        self._good_checks = 0
        self.verdicts = metrics.promotions
        self.state_gauge = metrics.candidate_state
        self.candidate_error = metrics.candidate_error
        self._export()

    def _export(self) -> None:
        for s in STATES:
            self.state_gauge.labels(s).set(1 if s == self.state else 0)

    def on_candidate(self, now_s: float) -> None:
        """A new treatment model is serving: judge it from scratch."""
        self.candidate = self.candidate_path()
        self._export_card()
        self.guard.reset()
        self.state = "evaluating"
        self._since_check = self._good_checks = 0
        self._export()
        log.info("candidate %s: now the A/B treatment, evaluating against the primary", self.candidate)

    def _export_card(self) -> None:
        """Prediction errors from the candidate's model card (`trainer finetune` writes NAME.json beside NAME.onnx)."""
        card = read_card(self.candidate)
        for stage in ("before", "after"):
            value = card.get(f"validation_{stage}", {}).get("mae_log_ttft")
            if isinstance(value, (int, float)):
                self.candidate_error.labels(stage).set(value)
            else:
                with contextlib.suppress(KeyError):  # a candidate without a card: no stale figure
                    self.candidate_error.remove(stage)

    def on_outcome(self, now_s: float, tripped: bool) -> str | None:
        """After each guard record; returns a verdict when one was reached now."""
        if self.state != "evaluating":
            return None
        if self.guard.active:  # the guard tripped (now or already): the candidate lost its window
            return self._verdict("rolled_back", now_s, f"rollback guard tripped ({self.guard.cause}): {self.guard.reason}")
        self._since_check += 1
        if self._since_check < self.config.check_every:
            return None
        self._since_check = 0
        c, t = self.guard.last_stats["control"], self.guard.last_stats["treatment"]
        cfg = self.config
        if min(c["latency_samples"], t["latency_samples"]) < cfg.min_samples:
            return None
        ratio = t["ttfb_p99_s"] / max(c["ttfb_p99_s"], 1e-9)
        if ratio <= cfg.max_p99_ratio and t["error_rate"] <= c["error_rate"]:
            self._good_checks += 1
        else:
            self._good_checks = 0
        if self._good_checks < cfg.confirm_checks:
            return None
        reason = (f"treatment p99 {t['ttfb_p99_s'] * 1e3:.1f} ms <= {cfg.max_p99_ratio:.2f} x control's "
                  f"{c['ttfb_p99_s'] * 1e3:.1f} ms and error rate {t['error_rate']:.2%} <= {c['error_rate']:.2%} "
                  f"over {t['latency_samples']}/{c['latency_samples']} samples, {cfg.confirm_checks} checks in a row")
        self.promote()
        self.guard.reset()
        return self._verdict("promoted", now_s, reason)

    def _verdict(self, result: str, now_s: float, reason: str) -> str:
        self.state = result
        self.verdicts.labels(result).inc()
        self.history.append({"candidate": self.candidate, "result": result, "reason": reason, "at_s": now_s})
        self._export()
        (log.info if result == "promoted" else log.warning)("candidate %s %s: %s", self.candidate, result.replace("_", " "), reason)
        return result

    def describe(self) -> dict:
        cfg = self.config
        return {
            "state": self.state,
            "candidate": self.candidate,
            "config": {"min_samples": cfg.min_samples, "max_p99_ratio": cfg.max_p99_ratio,
                       "confirm_checks": cfg.confirm_checks, "check_every": cfg.check_every},
            "history": list(self.history),
        }


class ExploringPolicy:
    """The treatment arm's bounded exploration (bandit feedback): with probability `share`, the policy's
    scores are changed so a uniformly random healthy replica ranks first. The decision still passes
    the FallbackPolicy's guards (an overloaded pick still falls back). The decision log then holds
    outcomes of replicas the policy would not have picked, which `trainer finetune` needs to correct
    the prior where it is wrong. Counted in `llm_router_exploration_decisions_total`.
    Explored outcomes are kept out of the A/B guard's windows (the candidate is judged on its own picks).
    Everything else (describe, last_input, on_complete, ...) is the wrapped policy's."""

    def __init__(self, inner, share: float, counter, seed: int | None = None) -> None:
        if not 0.0 <= share <= MAX_EXPLORE_SHARE:
            raise ValueError(f"ab_explore_share={share}: must be within [0, {MAX_EXPLORE_SHARE}]")
        self.inner = inner
        self.share = share
        self.counter = counter
        self.explored = 0
        self.pending: set[str] = set()  # request ids explored and not yet released (kept out of the A/B guard)
        self._rng = np.random.default_rng(seed)

    def scores(self, view, request):
        s = np.array(self.inner.scores(view, request), dtype=np.float64)
        if self.share > 0 and self._rng.random() < self.share:
            healthy = np.flatnonzero([r.healthy for r in view.replicas])
            if len(healthy) > 1 and np.isfinite(s[healthy]).all():
                s[int(self._rng.choice(healthy))] = s[healthy].max() + 1.0
                self.explored += 1
                self.pending.add(request.request_id)
                self.counter.inc()
        return s

    def release(self, request_id: str) -> bool:
        """True (once) if this request was an exploration: its outcome is not the policy's, so the A/B guard skips it."""
        if request_id in self.pending:
            self.pending.discard(request_id)
            return True
        return False

    def best(self, view, request) -> tuple[int, bool]:
        # defined here, not taken from the inner policy by __getattr__: its best() would skip the exploration
        return best_of(self.scores(view, request), [r.healthy for r in view.replicas])

    def choose(self, view, request) -> int:
        s = self.scores(view, request)
        healthy = np.array([r.healthy for r in view.replicas])
        return int(np.where(healthy, s, -np.inf).argmax())

    def describe(self) -> dict:
        return {**self.inner.describe(), "explore_share": self.share, "explored": self.explored}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
