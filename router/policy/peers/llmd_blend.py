"""llm-d's previous default scheduler: a weighted blend of four scorers and a max-score picker.

Source: the llm-d router (github.com/llm-d/llm-d-router, pkg/epp/framework/plugins/scheduling): scorers
`prefix-cache-scorer` (weight 3), `queue-scorer` (2), `kv-cache-utilization-scorer` (2), `no-hit-lru-scorer` (2) and
`max-score-picker`, the optimized-baseline guide's configuration until "sticky until saturated" replaced it
(llm-d/llm-d.github.io, blog/2026-08-17_bottleneck-aware-scheduling-for-llm-inference.mdx, "legacy blend").
"""

from __future__ import annotations

from collections import OrderedDict

from routewise_vllm.router.policy.base import Policy, argmin_random_ties, healthy_or_raise
from routewise_vllm.router.policy.types import ClusterView, RequestInfo

PREFIX_WEIGHT = 3.0
QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0
LRU_WEIGHT = 2.0
LRU_SIZE = 1024  # no-hit-lru-scorer's default lruSize


class LlmDBlend(Policy):
    """llm-d's legacy blend: the highest `3 x prefix + 2 x queue + 2 x KV + 2 x no-hit-LRU` wins, ties at random.

    Each scorer maps the candidates to [0, 1], 1 = best:
    - prefix: matched / total prefix blocks of the request (`prefix_match_blocks / len(prefix_blocks)`, from the
      router's approximate index, as llm-d's approx-prefix-cache-producer);
    - queue: `(max - waiting) / (max - min)` over the candidates' scraped `vllm:num_requests_waiting`, 1 for all when
      they are equal;
    - KV: `1 - vllm:kv_cache_usage_perc`, scraped;
    - no-hit LRU: for a request no candidate has any prefix of (cold), replicas never given a cold request score
      `1 - k / (n - 1)` in candidate order k, then the others by how long ago they last got one (least recent highest),
      `1 - (never-used count + LRU position) / (n - 1)`, floored at 0; the pick of a cold request becomes the most
      recent. A warm request scores 0.5 everywhere.

    Approximated: the queue and KV scorers read the router's last scrape, which is as old as its scrape interval
    (llm-d refreshes these metrics every 50 ms); a replica never scraped reads as 0 waiting and 0 % KV, as llm-d's
    zero-valued metrics before the first refresh.
    """

    name = "llm-d-blend"

    def __init__(
        self,
        seed: int | None = None,
        prefix_weight: float = PREFIX_WEIGHT,
        queue_weight: float = QUEUE_WEIGHT,
        kv_weight: float = KV_WEIGHT,
        lru_weight: float = LRU_WEIGHT,
        lru_size: int = LRU_SIZE,
    ) -> None:
        super().__init__(seed)
        if lru_size <= 0:
            raise ValueError(f"lru_size must be > 0, got {lru_size}")
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.lru_weight = lru_weight
        self.lru_size = lru_size
        self._lru: OrderedDict[str, None] = OrderedDict()  # replica ids given a cold request, least recent first

    def lru_scores(self, view: ClusterView, cands: list[int]) -> list[float]:
        """no-hit-lru-scorer's scores of a cold request's candidates."""
        n = len(cands)
        if n == 1:
            return [1.0]
        position = {rid: k for k, rid in enumerate(self._lru)}
        never = [i for i in cands if view.replicas[i].replica_id not in position]
        rank = {i: k for k, i in enumerate(never)}
        out = []
        for i in cands:
            pos = position.get(view.replicas[i].replica_id)
            r = rank[i] if pos is None else len(never) + pos
            out.append(max(0.0, 1.0 - r / (n - 1)))
        return out

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        cands = healthy_or_raise(view)
        reps = [view.replicas[i] for i in cands]
        n_blocks = len(request.prefix_blocks)
        waiting = [r.waiting or 0 for r in reps]
        qmin, qmax = min(waiting), max(waiting)
        cold = not any(r.prefix_match_blocks > 0 for r in reps)
        lru = self.lru_scores(view, cands) if cold else [0.5] * len(cands)
        neg_scores = []
        for r, q, lru_score in zip(reps, waiting, lru):
            prefix = r.prefix_match_blocks / n_blocks if n_blocks else 0.0
            queue = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            kv = 1.0 - (r.kv_cache_usage or 0.0)
            neg_scores.append(-(self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * kv
                                + self.lru_weight * lru_score))
        pick = argmin_random_ties(neg_scores, cands, self.rng)
        if cold:
            rid = view.replicas[pick].replica_id
            self._lru.pop(rid, None)
            self._lru[rid] = None
            while len(self._lru) > self.lru_size:
                self._lru.popitem(last=False)
        return pick

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self._lru.clear()

    def describe(self) -> dict:
        return {"name": self.name, "prefix_weight": self.prefix_weight, "queue_weight": self.queue_weight,
                "kv_weight": self.kv_weight, "lru_weight": self.lru_weight}
