"""The proxy's per-request accounting: the metric children of each (replica, policy, arm), bound once, observed
in batches (router.observe.metric_batch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from routewise_vllm.router.telemetry import RouterMetrics

if TYPE_CHECKING:
    from routewise_vllm.router.routing import Route


def code_class(status: int) -> str:
    return "2xx" if status < 300 else "4xx" if status < 500 else "5xx"


class Children:
    """Pre-bound metric children of one (replica, policy, arm)."""

    __slots__ = ("ttft", "itl", "e2e", "codes")

    def __init__(self, m: RouterMetrics, rid: str, policy: str, arm: str) -> None:
        b = m.batch
        self.ttft = b.tally(m.ttft.labels(rid, policy, arm))
        self.itl = b.tally(m.itl.labels(rid, policy, arm))
        self.e2e = b.tally(m.e2e.labels(rid, policy, arm))
        self.codes = {c: b.count(m.requests.labels(rid, policy, arm, c)) for c in ("2xx", "4xx", "5xx", "error")}


class Accounts:
    """The Children of each (replica, policy, arm) a route went to, made on first use."""

    __slots__ = ("_metrics", "_children")

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self._children: dict[tuple[str, str, str], Children] = {}

    def of(self, route: Route) -> Children:
        key = (route.replica.id, route.runner.label, route.runner.arm)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = Children(self._metrics, *key)
        return c
