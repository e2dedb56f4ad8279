"""The serving layer of the live router: A/B split and rollback guard, shadow evaluation,
decision log and hot reload, wired around the router's policy runners.

`router.routing.Router` owns one ServingLayer and calls it at three points of a request:
`arm_for` (which runner decides), `after_decision` (schedule the shadow, off the response's
critical path) and `on_release` (guard window, shadow feedback, decision log). The app's
cleanup context starts and stops the log writer and the policy file watchers.
Runners are duck-typed (`arm`, `name`, `label`, `policy`: a FallbackPolicy, `swap_primary`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from routewise_vllm.router.policy.fallback import FallbackPolicy
from routewise_vllm.router.policy.registry import served_as
from routewise_vllm.router.policy.types import ClusterView, Outcome
from routewise_vllm.router.serving.arms import ABSplit, GuardConfig, RollbackGuard
from routewise_vllm.router.serving.decision_log import DecisionLogWriter, PendingRecord
from routewise_vllm.router.serving.metrics import ServingMetrics
from routewise_vllm.router.serving.promotion import ExploringPolicy, PromotionConfig, PromotionController
from routewise_vllm.router.serving.reload import PolicyFileWatcher, PolicyReloader, is_reloadable
from routewise_vllm.router.serving.shadow import ShadowEvaluator

log = logging.getLogger("router.serving")


class ServingLayer:
    def __init__(
        self,
        settings,  # router.settings.RouterSettings
        registry: CollectorRegistry,
        runners: dict[str, Any],
        make_guarded: Callable[[str], FallbackPolicy],
        label_of: Callable[[str], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = ServingMetrics(registry)
        self.runners = runners
        self.clock = clock
        m = self.metrics
        self.ab: ABSplit | None = None
        if "treatment" in runners:
            guard = RollbackGuard(GuardConfig(
                window_requests=settings.ab_window_requests, window_s=settings.ab_window_s,
                min_samples=settings.ab_min_samples, max_p99_ratio=settings.ab_max_p99_ratio,
                max_error_rate_delta=settings.ab_max_error_rate_delta,
            ))
            self.ab = ABSplit(settings.ab_share, guard)
            m.ab_configured_share.set(settings.ab_share)
        self._export_ab_state()
        self.shadow: ShadowEvaluator | None = None
        if settings.shadow_policy is not None:
            self.shadow = ShadowEvaluator(make_guarded(settings.shadow_policy), label_of(settings.shadow_policy), m)
        self.decision_log: DecisionLogWriter | None = None
        if settings.decision_log_dir is not None:
            self.decision_log = DecisionLogWriter(
                settings.decision_log_dir, max_bytes=settings.decision_log_max_bytes, keep=settings.decision_log_keep,
                queue_size=settings.decision_log_queue, metrics=m,
            )
        self.reloaders: dict[str, PolicyReloader] = {}
        for arm, runner in runners.items():
            if is_reloadable(runner.name):
                self.reloaders[arm] = PolicyReloader(
                    runner.name, runner.swap_primary, seed=settings.seed, metrics=m, label=arm,
                    current=lambda r=runner: r.policy.primary.describe(),
                )
        if self.shadow is not None and is_reloadable(settings.shadow_policy):
            shadow = self.shadow
            self.reloaders["shadow"] = PolicyReloader(
                settings.shadow_policy, lambda p: setattr(shadow.policy, "primary", p), seed=settings.seed, metrics=m,
                label="shadow", current=lambda: shadow.policy.primary.describe(),
            )
        self.promotion = self._promotion(settings)
        self.watchers = [PolicyFileWatcher(r, settings.policy_watch_interval_s) for r in self.reloaders.values()] \
            if settings.policy_watch_interval_s else []

    def _promotion(self, settings) -> PromotionController | None:
        """With ab_auto_promote, a model reloaded into the treatment arm is a candidate (promotion.py)."""
        if self.ab is None or not getattr(settings, "ab_auto_promote", False):
            return None
        if "treatment" not in self.reloaders or "control" not in self.reloaders:
            raise ValueError("ab_auto_promote needs learned policies (.onnx or `learned`) in both --policy and --ab-treatment")
        treat, ctrl = self.reloaders["treatment"], self.reloaders["control"]

        def promote() -> str | None:
            primary = self.runners["treatment"].policy.primary
            model = primary.inner if isinstance(primary, ExploringPolicy) else primary
            self.runners["control"].swap_primary(served_as(ctrl.spec, model, seed=settings.seed))
            ctrl.path = treat.path  # later reloads/watching of control follow the promoted file
            return None if treat.path is None else str(treat.path)

        controller = PromotionController(self.ab.guard, promote, lambda: None if treat.path is None else str(treat.path),
                                         self.metrics, PromotionConfig(min_samples=settings.ab_min_samples))
        install = treat.install
        share = getattr(settings, "ab_explore_share", 0.0)

        def explore(policy):
            return ExploringPolicy(policy, share, self.metrics.explorations, settings.seed) if share > 0 else policy

        runner = self.runners["treatment"]
        runner.policy.primary = explore(runner.policy.primary)

        def install_candidate(policy) -> None:
            install(explore(policy))
            # after the reloader has recorded the new path (same task, before it yields)
            asyncio.get_running_loop().call_soon(self._new_candidate)

        treat.install = install_candidate
        return controller

    def _new_candidate(self) -> None:
        self.promotion.on_candidate(self.clock())
        self._export_ab_state()

    # --- request path --------------------------------------------------------------------------

    def arm_for(self, key: str) -> str | None:
        """The A/B arm of a request key (None without A/B: the single runner decides)."""
        return None if self.ab is None else self.ab.assign(key)

    def after_decision(self, route, view: ClusterView) -> None:
        """Schedule the shadow's decision on the same view to run once the request is on its way."""
        if self.shadow is None:
            return
        try:
            asyncio.get_running_loop().call_soon(self._run_shadow, route, view)
        except RuntimeError:  # no running loop (a synchronous caller): decide inline
            self._run_shadow(route, view)

    def _run_shadow(self, route, view: ClusterView) -> None:
        route.shadow = self.shadow.observe(view, route.request, route.decision.index, route.runner.label)

    def on_release(self, route, outcome: Outcome | None) -> None:
        """The attempt ended (completed, failed or cancelled); called once per attempt."""
        explorer = route.runner.policy.primary
        explored = isinstance(explorer, ExploringPolicy) and explorer.release(route.request.request_id)
        if outcome is not None:
            if self.shadow is not None:
                self.shadow.on_complete(route.replica.id, route.request, outcome)
            if self.ab is not None and not explored:
                ttfb = outcome.ttft_s if outcome.ttft_s is not None else outcome.e2e_s
                was_active = self.ab.guard.active
                tripped = self.ab.guard.record(route.runner.arm, self.clock(), ttfb, outcome.ok)
                if tripped and not was_active:
                    g = self.ab.guard
                    self.metrics.ab_rollbacks.labels(g.cause).inc()
                    log.warning("A/B rollback: all traffic to control: %s", g.reason)
                if self.promotion is not None:
                    self.promotion.on_outcome(self.clock(), tripped)
                self._export_ab_state()
        if self.decision_log is not None:
            self.decision_log.submit(self._record(route, outcome))

    def _record(self, route, outcome: Outcome | None) -> PendingRecord:
        d = route.decision
        feats = None  # reuse the model input a learned policy already built for this very view
        for policy in (route.runner.policy.primary, None if self.shadow is None else self.shadow.policy.primary):
            last = getattr(policy, "last_input", None)
            if last is not None and last[0] is route.view:
                feats = last[1]
                break
        sh = route.shadow
        return PendingRecord(
            time_s=route.wall_s, request=route.request, view=route.view, arm=route.runner.arm, policy=route.runner.label,
            index=d.index, primary_index=d.primary_index, fallback_reason=d.fallback_reason, decision_s=d.elapsed_s,
            attempt=route.attempt, stream=route.stream,
            shadow=None if sh is None else {"policy": self.shadow.label, **sh.as_log()},
            features=feats, status=route.status, ok=None if outcome is None else outcome.ok,
            ttft_s=None if outcome is None else outcome.ttft_s, e2e_s=None if outcome is None else outcome.e2e_s,
            output_tokens=None if outcome is None or not outcome.output_tokens else outcome.output_tokens,
            prefix_block_tokens=route.prefix_block_tokens, late=route.late, held_s=route.held_s, model=route.model,
        )

    # --- A/B state -----------------------------------------------------------------------------

    def _export_ab_state(self) -> None:
        m = self.metrics
        if self.ab is None:
            m.ab_rollback_active.set(0)
            m.ab_treatment_share.set(0)
            return
        m.ab_rollback_active.set(1 if self.ab.guard.active else 0)
        m.ab_treatment_share.set(self.ab.effective_share)
        for arm, stats in self.ab.guard.last_stats.items():
            if stats.get("ttfb_p99_s") is not None:
                m.ab_window_ttft_p99.labels(arm).set(stats["ttfb_p99_s"])
            if stats.get("error_rate") is not None:
                m.ab_window_error_ratio.labels(arm).set(stats["error_rate"])

    def describe_ab(self) -> dict:
        if self.ab is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "control": self.runners["control"].name,
            "treatment": self.runners["treatment"].name,
            "configured_share": self.ab.share,
            "effective_share": self.ab.effective_share,
            **self.ab.guard.describe(),
            "promotion": None if self.promotion is None else self.promotion.describe(),
        }

    def reset_ab(self) -> dict:
        if self.ab is not None:
            self.ab.guard.reset()
            self._export_ab_state()
            log.info("A/B guard reset: treatment share back to %.3f", self.ab.share)
        return self.describe_ab()

    def describe(self) -> dict:
        return {
            "ab": self.describe_ab(),
            "shadow": None if self.shadow is None else self.shadow.describe(),
            "decision_log": None if self.decision_log is None else self.decision_log.describe(),
            "reload": {name: r.describe() for name, r in self.reloaders.items()},
        }

    # --- lifecycle -----------------------------------------------------------------------------

    async def cleanup_ctx(self, app) -> AsyncIterator[None]:
        if self.decision_log is not None:
            self.decision_log.start()
        tasks = [asyncio.create_task(w.run(), name=f"policy-watch-{i}") for i, w in enumerate(self.watchers)]
        yield
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.decision_log is not None:
            await asyncio.to_thread(self.decision_log.close)
