"""NVIDIA Dynamo's KV router: the lowest cost of prefill blocks still to compute plus active decode blocks.

Source: ai-dynamo/dynamo, lib/kv-router/src/scheduling/selector/default.rs (DefaultWorkerSelector: the cost and the
softmax sampling) and scheduling/config.rs (KvRouterConfig's defaults); docs/router (the KV router guide).
"""

from __future__ import annotations

import math

from routewise_vllm.router.policy.base import Policy, argmin_random_ties, healthy_or_raise
from routewise_vllm.router.policy.peers.ledger import InflightLedger, uncached_tokens
from routewise_vllm.router.policy.types import ClusterView, Outcome, RequestInfo

# KvRouterConfig::default()
OVERLAP_SCORE_CREDIT = 1.0  # the overlap weight (`--kv-overlap-score-weight`, 1 by default)
OVERLAP_SCORE_CREDIT_DECAY = 0.0
PREFILL_LOAD_SCALE = 1.0
DECODE_ACTIVE_REQUEST_WEIGHT = 0.0
ROUTER_TEMPERATURE = 0.0  # 0: the lowest cost; > 0: softmax sampling of the costs
BLOCK_TOKENS = 16  # vLLM's default KV block size: only converts the active-request term (0 by default) to tokens


class DynamoKv(Policy):
    """Dynamo's KV router: per replica, in KV blocks,

        cost = prefill_load_scale x max(0, active prefill + prompt - overlap_credit x cached) + active + new decode

    with the shipped defaults (credit 1, scale 1, temperature 0) the uncached prefill work queued there including this
    request, plus the KV blocks its in-flight requests hold and this request would add. Temperature 0 takes the
    lowest cost (ties at random); above 0 it samples `exp(-(c - min) / ((max - min) x T))`, as Dynamo's
    softmax_sample.

    Inputs mapped onto the view (costs in tokens, Dynamo's in blocks: the same ranking and softmax, which is
    scale-free; Dynamo's blocks round up): cached = `prompt x prefix_match_blocks / len(prefix_blocks)` from the
    router's approximate prefix index (Dynamo's default reads workers' KV events: an exact index); active prefill =
    uncached prompt tokens of requests without a first token (Dynamo: until prefill completes), and active decode =
    distinct prompt tokens of in-flight requests (Dynamo tracks their prompt blocks by hash, output blocks off by
    default), both from the snapshot's exact totals scaled by this policy's ledger (peers/ledger.py); new decode =
    the request's blocks the in-flight requests do not already hold. Not modelled: Dynamo's router-side queue (it holds
    requests while every worker has over `router_queue_threshold` x max-num-batched-tokens of prefill in flight;
    routewise's late binding is the counterpart) and host/disk cache tiers.
    """

    name = "dynamo-kv"

    def __init__(
        self,
        seed: int | None = None,
        overlap_score_credit: float = OVERLAP_SCORE_CREDIT,
        overlap_score_credit_decay: float = OVERLAP_SCORE_CREDIT_DECAY,
        prefill_load_scale: float = PREFILL_LOAD_SCALE,
        decode_active_request_weight: float = DECODE_ACTIVE_REQUEST_WEIGHT,
        router_temperature: float = ROUTER_TEMPERATURE,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        super().__init__(seed)
        for field, value in (("overlap_score_credit", overlap_score_credit), ("prefill_load_scale", prefill_load_scale),
                             ("overlap_score_credit_decay", overlap_score_credit_decay),
                             ("decode_active_request_weight", decode_active_request_weight),
                             ("router_temperature", router_temperature)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{field} must be a finite number >= 0, got {value}")
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.overlap_score_credit = overlap_score_credit
        self.overlap_score_credit_decay = overlap_score_credit_decay
        self.prefill_load_scale = prefill_load_scale
        self.decode_active_request_weight = decode_active_request_weight
        self.router_temperature = router_temperature
        self.block_tokens = block_tokens
        self.ledger = InflightLedger(track_blocks=True)

    def costs(self, view: ClusterView, request: RequestInfo, cands: list[int]) -> list[float]:
        reps = view.replicas
        isl = float(request.prompt_tokens_est)
        blocks = request.prefix_blocks
        n = len(blocks)
        prefill = [self.ledger.uncached_in_prefill(reps[i]) for i in cands]
        floor = min(prefill)
        out = []
        for i, active_prefill in zip(cands, prefill):
            r = reps[i]
            cached = isl - uncached_tokens(request, r.prefix_match_blocks)
            credit = self.overlap_score_credit
            if self.overlap_score_credit_decay > 0 and isl > 0:  # softly trades locality for prefill balance
                credit /= 1.0 + self.overlap_score_credit_decay * (active_prefill - floor) / isl
            prefill_cost = self.prefill_load_scale * max(0.0, active_prefill + isl - credit * cached)
            shared = self.ledger.active_shared_blocks(r.replica_id, blocks) if n else 0
            new_decode = isl * (1.0 - shared / n) if n else isl
            decode_cost = self.ledger.distinct_active_tokens(r) + new_decode
            requests_cost = self.decode_active_request_weight * r.outstanding * self.block_tokens
            out.append(prefill_cost + decode_cost + requests_cost)
        return out

    def sample(self, costs: list[float], cands: list[int]) -> int:
        lo, hi = min(costs), max(costs)
        if lo == hi:
            return cands[int(self.rng.integers(len(cands)))]
        scale = (hi - lo) * self.router_temperature
        weights = [math.exp(-(c - lo) / scale) for c in costs]
        u = self.rng.random() * sum(weights)
        acc = 0.0
        for i, w in zip(cands, weights):
            acc += w
            if u <= acc:
                return i
        return cands[-1]

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        cands = healthy_or_raise(view)
        reps = view.replicas
        for r in reps:
            self.ledger.sync(r)
        costs = self.costs(view, request, cands)
        pick = self.sample(costs, cands) if self.router_temperature > 0 else argmin_random_ties(costs, cands, self.rng)
        self.ledger.record(reps[pick].replica_id, request, uncached_tokens(request, reps[pick].prefix_match_blocks))
        return pick

    def on_complete(self, replica_id: str, request: RequestInfo, outcome: Outcome) -> None:
        self.ledger.forget(replica_id, request.request_id)

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self.ledger.clear()

    def describe(self) -> dict:
        return {"name": self.name, "overlap_score_credit": self.overlap_score_credit,
                "prefill_load_scale": self.prefill_load_scale, "router_temperature": self.router_temperature}
