"""A retry goes to a replica the request was not tried on yet."""

from __future__ import annotations

from routewise_vllm.router.policy.pipeline import Ask, Filter
from routewise_vllm.router.policy.types import ClusterView, RequestInfo, make_view, unhealthy


class NotRetried(Filter):
    name = "retried"
    order = 20

    def __call__(self, view: ClusterView, request: RequestInfo, ask: Ask) -> ClusterView:
        exclude = ask.exclude
        if not exclude:
            return view
        return make_view(tuple(unhealthy(r) if r.replica_id in exclude else r for r in view.replicas))
