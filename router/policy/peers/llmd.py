"""llm-d's default scheduler, "sticky until saturated": prefix-cache affinity filter, token-load scorer, max-score picker.

Source: the llm-d router (github.com/llm-d/llm-d-router, pkg/epp/framework/plugins): scheduling/filter
`prefix-cache-affinity-filter`, scheduling/scorer `token-load-scorer`, requestcontrol/dataproducer
`inflight-load-producer`, scheduling/picker `max-score-picker`; described with its parameters in
llm-d/llm-d.github.io, blog/2026-08-17_bottleneck-aware-scheduling-for-llm-inference.mdx ("Sticky Until Saturated").
"""

from __future__ import annotations

from routewise_vllm.router.policy.base import Policy, argmin_random_ties, healthy_or_raise
from routewise_vllm.router.policy.peers.ledger import InflightLedger, uncached_tokens
from routewise_vllm.router.policy.types import ClusterView, Outcome, RequestInfo

# The filter's shipped defaults (DefaultConfig): calibrated for Qwen3-32B on 2x H100 (TP=2), vLLM, 8192-token chunks.
AFFINITY_THRESHOLD = 0.80
PEAK_PREFILL_THROUGHPUT = 15928.0  # tokens/s: one endpoint's measured peak prefill rate
MAX_TTFT_PENALTY_MS = 18000.0  # 15928 tok/s x 18 s = a 286,704-token lead in in-flight prefill work
EXPLORATION_PROBABILITY = 0.0
QUEUE_THRESHOLD_TOKENS = 4_194_304  # token-load-scorer's normalisation (128 requests of 32K)


class LlmD(Policy):
    """llm-d's default: keep a request on the replicas that hold its prefix until they are saturated, then balance
    uncached prefill tokens.

    1. Affinity filter: a replica is sticky when its cached fraction of the request's prefix blocks is at least
       `affinity_threshold` (0.8). No sticky replica: every candidate passes. Otherwise only the sticky ones pass,
       unless the saturation release fires: the best sticky replica's estimated TTFT (uncached prefill tokens in
       flight / `peak_prefill_throughput`) exceeds the best non-sticky one's by more than `max_ttft_penalty_ms`
       (18 s at 15,928 tok/s, the shipped defaults), and then every candidate passes.
    2. Token-load scorer: load = uncached prefill tokens in flight + this request's uncached tokens there;
       score = 1 - min(load, 4,194,304) / 4,194,304 (1 when the load is zero).
    3. Max-score picker: the highest score, ties at random.

    Inputs mapped onto the view: the affinity is `prefix_match_blocks / len(prefix_blocks)` from the router's
    approximate prefix index, as llm-d's approx-prefix-cache-producer (blocks inserted at dispatch). The in-flight
    load is, as llm-d's in-flight-load-producer with its default `addEstimatedOutputTokens=false`, the uncached prompt
    tokens of requests without a first token: the snapshot's exact `awaiting_prompt_tokens` scaled by the uncached
    fraction this policy recorded for them (approximated: see peers/ledger.py). A request's uncached tokens are
    `prompt x (1 - matched / total blocks)` (llm-d: unmatched blocks x block size + the unindexed tail).
    `peak_prefill_throughput` is llm-d's shipped calibration, not the simulated GPU's: like an operator who keeps the
    default, the gate fires at the same token lead on every fleet.
    """

    name = "llm-d"

    def __init__(
        self,
        seed: int | None = None,
        affinity_threshold: float = AFFINITY_THRESHOLD,
        peak_prefill_throughput: float = PEAK_PREFILL_THROUGHPUT,
        max_ttft_penalty_ms: float = MAX_TTFT_PENALTY_MS,
        queue_threshold_tokens: int = QUEUE_THRESHOLD_TOKENS,
        exploration_probability: float = EXPLORATION_PROBABILITY,
    ) -> None:
        super().__init__(seed)
        if not 0.0 <= affinity_threshold <= 1.0:
            raise ValueError(f"affinity_threshold must be in [0, 1], got {affinity_threshold}")
        if not 0.0 <= exploration_probability <= 1.0:
            raise ValueError(f"exploration_probability must be in [0, 1], got {exploration_probability}")
        if max_ttft_penalty_ms < 0:
            raise ValueError(f"max_ttft_penalty_ms must be >= 0, got {max_ttft_penalty_ms}")
        if max_ttft_penalty_ms > 0 and peak_prefill_throughput <= 0:
            raise ValueError("peak_prefill_throughput must be > 0 when max_ttft_penalty_ms is set")
        if queue_threshold_tokens <= 0:
            raise ValueError(f"queue_threshold_tokens must be > 0, got {queue_threshold_tokens}")
        self.affinity_threshold = affinity_threshold
        self.peak_prefill_throughput = peak_prefill_throughput
        self.max_ttft_penalty_ms = max_ttft_penalty_ms
        self.queue_threshold_tokens = float(queue_threshold_tokens)
        self.exploration_probability = exploration_probability
        self.ledger = InflightLedger()

    def candidates(self, view: ClusterView, request: RequestInfo, inflight: dict[int, float]) -> list[int]:
        """The affinity filter: the sticky replicas, or every healthy one (none sticky, or the release fired)."""
        healthy = list(inflight)
        n = len(request.prefix_blocks)
        if len(healthy) <= 1 or self.affinity_threshold <= 0 or not n:
            return healthy
        if self.exploration_probability > 0 and self.rng.random() < self.exploration_probability:
            return healthy
        reps = view.replicas
        sticky = [i for i in healthy if reps[i].prefix_match_blocks / n >= self.affinity_threshold]
        if not sticky:
            return healthy
        stuck = set(sticky)
        others = [i for i in healthy if i not in stuck]
        if self.max_ttft_penalty_ms > 0 and others:
            ms_per_token = 1000.0 / self.peak_prefill_throughput
            penalty = (min(inflight[i] for i in sticky) - min(inflight[i] for i in others)) * ms_per_token
            if penalty > self.max_ttft_penalty_ms:
                return healthy
        return sticky

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        reps = view.replicas
        for r in reps:
            self.ledger.sync(r)
        inflight = {i: self.ledger.uncached_in_prefill(reps[i]) for i in healthy}
        cands = self.candidates(view, request, inflight)
        q = self.queue_threshold_tokens
        neg_scores = []
        for i in cands:
            load = inflight[i] + uncached_tokens(request, reps[i].prefix_match_blocks)
            neg_scores.append(-(1.0 if load <= 0 else 1.0 - min(load, q) / q))
        pick = argmin_random_ties(neg_scores, cands, self.rng)
        self.ledger.record(reps[pick].replica_id, request, uncached_tokens(request, reps[pick].prefix_match_blocks))
        return pick

    def on_complete(self, replica_id: str, request: RequestInfo, outcome: Outcome) -> None:
        self.ledger.forget(replica_id, request.request_id)

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self.ledger.clear()

    def describe(self) -> dict:
        return {"name": self.name, "affinity_threshold": self.affinity_threshold,
                "peak_prefill_throughput": self.peak_prefill_throughput, "max_ttft_penalty_ms": self.max_ttft_penalty_ms,
                "queue_threshold_tokens": int(self.queue_threshold_tokens)}
