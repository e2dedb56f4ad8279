"""Only the replicas that serve the request's model are candidates (router.policy.model_routing)."""

from __future__ import annotations

from routewise_vllm.router.policy.late_binding import restrict
from routewise_vllm.router.policy.pipeline import Ask, Filter
from routewise_vllm.router.policy.types import ClusterView, RequestInfo


class ByModel(Filter):
    name = "model"
    order = 10

    def __call__(self, view: ClusterView, request: RequestInfo, ask: Ask) -> ClusterView:
        return view if ask.members is None else restrict(view, ask.members)
