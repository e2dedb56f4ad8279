"""Per-request latency targets: `x-slo-ttft-ms` and `x-slo-tpot-ms` (the headers of llm-d's predicted-latency
scheduler), else the model's default (settings slo_default_ttft_s / slo_default_tpot_s, '*' for every model).

A target travels in RequestInfo (ttft_target_s, tpot_target_s). Behind late binding the hold queue lets the held
request with the earliest TTFT deadline (arrival + target) go first (router.hold_queue). A header that is not a
positive finite number is ignored, counted (llm_router_slo_header_errors_total) and logged at debug: never an error.

Attainment, once per request (not per attempt), in llm_router_slo_attainment_total{model, target, result}: `met`,
`missed` (over the target, or failed), `no_target`, or `unmeasured` where the router cannot see the figure: the
TTFT of a streamed answer whose events are not tokens (a response's lifecycle, a transcription), the TPOT of an
answer that is not a token stream. The TTFT of a non-streamed answer is its whole time: the client's first token
arrives with it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from routewise_vllm.router.policy.model_routing import ModelLabels
from routewise_vllm.router.policy.types import Outcome, RequestInfo

if TYPE_CHECKING:
    from routewise_vllm.router.settings import RouterSettings
    from routewise_vllm.router.telemetry import RouterMetrics

log = logging.getLogger("router.slo")

HEADERS = {"ttft": "x-slo-ttft-ms", "tpot": "x-slo-tpot-ms"}
RESULTS = ("met", "missed", "no_target", "unmeasured")


def header_ms(value: str | None) -> float | None:
    """A header's target in seconds; None when absent. ValueError when it is not a positive finite number of ms."""
    if value is None:
        return None
    ms = float(value.strip())  # ValueError for anything float() does not read
    if not math.isfinite(ms) or ms <= 0:
        raise ValueError(f"{value!r} is not a positive number of milliseconds")
    return ms / 1000.0


def judge(target_s: float | None, seen_s: float | None, ok: bool) -> str:
    if target_s is None:
        return "no_target"
    if not ok:
        return "missed"
    if seen_s is None:
        return "unmeasured"
    return "met" if seen_s <= target_s else "missed"


class Targets:
    """Reads a request's targets and counts their attainment."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics,
                 model_label: Callable[[str | None, frozenset[str]], str] | None = None) -> None:
        self.defaults = {"ttft": settings.slo_default_ttft_s, "tpot": settings.slo_default_tpot_s}
        self.metrics = metrics
        # the router's labeller (router.routing), so that one bound holds for every model-labelled metric
        self.model_label = model_label or ModelLabels(settings.metrics_max_models)
        self._counts: dict[tuple[str, str, str], Any] = {}  # attainment children by labels, counted in batches
        for h in HEADERS.values():
            metrics.slo_header_errors.labels(h)

    def of(self, headers: Mapping[str, str] | None, model: str | None) -> tuple[float | None, float | None]:
        """(TTFT target, TPOT target) in seconds: the header's, else the model's default, else None."""
        out = []
        for kind, name in HEADERS.items():
            target = None
            raw = headers.get(name) if headers else None
            if raw is not None:
                try:
                    target = header_ms(raw)
                except ValueError as exc:
                    self.metrics.slo_header_errors.labels(name).inc()
                    log.debug("%s ignored: %s", name, exc)
            if target is None:
                d = self.defaults[kind]
                target = d.get(model, d.get("*")) if model is not None else d.get("*")
            out.append(target)
        return out[0], out[1]

    def done(self, info: RequestInfo, outcome: Outcome | None, stream: bool, tpot_s: float | None,
             known_models: frozenset[str]) -> None:
        """A request's end: its attainment of each target. `outcome` None: it failed before any answer."""
        ok = outcome is not None and outcome.ok
        ttft = None
        if outcome is not None:
            ttft = outcome.ttft_s if outcome.ttft_s is not None else None if stream else outcome.e2e_s
        label = self.model_label(info.model, known_models)
        self._count(label, "ttft", judge(info.ttft_target_s, ttft, ok))
        self._count(label, "tpot", judge(info.tpot_target_s, tpot_s, ok))

    def _count(self, *labels: str) -> None:
        c = self._counts.get(labels)
        if c is None:
            c = self._counts[labels] = self.metrics.batch.count(self.metrics.slo_attainment.labels(*labels))
        c.inc()
