"""Heuristic routers. Each reads only what the live router can observe (a ReplicaSnapshot)."""

from __future__ import annotations

from routewise_vllm.router.policy.base import Policy, argmin_random_ties, healthy_or_raise
from routewise_vllm.router.policy.features import EXPECTED_WAIT_DECODE_WEIGHT
from routewise_vllm.router.policy.types import ClusterView, NoHealthyReplica, ReplicaSnapshot, RequestInfo


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._next = 0

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        n = len(view.replicas)
        for step in range(n):
            i = (self._next + step) % n
            if view.replicas[i].healthy:
                self._next = i + 1
                return i
        return healthy[0]

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self._next = 0


class RandomChoice(Policy):
    name = "random"

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        return healthy[int(self.rng.integers(len(healthy)))]


class LeastOutstanding(Policy):
    """LOR: fewest router-side in-flight requests. The fallback of every other policy."""

    name = "least-outstanding"

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        # argmin_random_ties over the healthy replicas' counts, in one pass (the simulator's hot path)
        best = -1
        tied: list[int] = []
        i = 0
        for r in view.replicas:
            if r.healthy:
                v = r.outstanding
                if not tied or v < best:
                    best = v
                    tied = [i]
                elif v == best:
                    tied.append(i)
            i += 1
        if not tied:
            raise NoHealthyReplica("no healthy replica in the view")
        return tied[0] if len(tied) == 1 else tied[int(self.rng.integers(len(tied)))]


class PowerOfTwo(Policy):
    name = "power-of-two"

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        if len(healthy) == 1:
            return healthy[0]
        a, b = self.rng.choice(len(healthy), size=2, replace=False)
        pair = [healthy[int(a)], healthy[int(b)]]
        return argmin_random_ties([view.replicas[i].outstanding for i in pair], pair, self.rng)


class LeastTokenLoad(Policy):
    """Fewest outstanding tokens: prompt tokens plus expected decode tokens in flight."""

    name = "least-token-load"

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        loads = [view.replicas[i].outstanding_prompt_tokens + view.replicas[i].outstanding_decode_tokens for i in healthy]
        return argmin_random_ties(loads, healthy, self.rng)


def _kv_or_none(r: ReplicaSnapshot) -> float | None:
    return r.kv_cache_usage if r.has_stats else None


class KvAware(Policy):
    """Lowest scraped KV-cache usage plus queue, corrected by what was sent since the scrape.

    Replicas never scraped get the mean usage of those that were (unknown is not zero).
    """

    name = "kv-aware"

    def __init__(self, seed: int | None = None, queue_weight: float = 0.05) -> None:
        super().__init__(seed)
        self.queue_weight = queue_weight

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        known = [k for i in healthy if (k := _kv_or_none(view.replicas[i])) is not None]
        default_kv = sum(known) / len(known) if known else 0.5
        scores = []
        for i in healthy:
            r = view.replicas[i]
            kv = _kv_or_none(r)
            queue = (r.waiting or 0) + r.dispatched_since_scrape
            scores.append((default_kv if kv is None else kv) + self.queue_weight * queue + 1e-4 * r.outstanding)
        return argmin_random_ties(scores, healthy, self.rng)


class PrefixAware(Policy):
    """SGLang-style cache-aware routing: prefix affinity while load is balanced, else shortest queue.

    Load is imbalanced when max - min outstanding exceeds `balance_abs` and max exceeds
    `balance_rel` x min. While balanced, the replica with the longest cached prefix wins if it
    covers at least `min_match_frac` of the request's blocks; otherwise the least loaded wins.

    Against sgl-router's cache_aware policy (launch_router defaults: cache_threshold 0.3, balance_abs_threshold 64,
    balance_rel_threshold 1.5): the same imbalance test and relative threshold, a far lower absolute one (4), and
    below the match threshold the least loaded replica rather than the one with the smallest cache tree. The
    shipped models were selected against these parameters, so they stay; docs/peers.md lists every difference.
    """

    name = "prefix-aware"

    def __init__(
        self, seed: int | None = None, balance_abs: int = 4, balance_rel: float = 1.5, min_match_frac: float = 0.3
    ) -> None:
        super().__init__(seed)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.min_match_frac = min_match_frac

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        loads = [view.replicas[i].outstanding for i in healthy]
        lo, hi = min(loads), max(loads)
        imbalanced = hi - lo > self.balance_abs and hi > self.balance_rel * lo
        n_blocks = len(request.prefix_blocks)
        if not imbalanced and n_blocks:
            matches = [view.replicas[i].prefix_match_blocks for i in healthy]
            best = max(matches)
            if best / n_blocks >= self.min_match_frac:
                # longest match; among equal matches the least loaded
                cands = [c for c, m in zip(healthy, matches) if m == best]
                return argmin_random_ties([view.replicas[i].outstanding for i in cands], cands, self.rng)
        return argmin_random_ties(loads, healthy, self.rng)


class WeightedScorer(Policy):
    """llm-d endpoint-picker style: a weighted sum of normalised queue, KV and prefix scores.

    Each scorer maps replicas to [0, 1] (1 = best); the highest weighted sum wins.
    """

    name = "weighted-scorer"

    def __init__(
        self, seed: int | None = None, queue_weight: float = 2.0, kv_weight: float = 1.0, prefix_weight: float = 3.0
    ) -> None:
        super().__init__(seed)
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.prefix_weight = prefix_weight

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        reps = [view.replicas[i] for i in healthy]
        queue = [float(r.outstanding) for r in reps]
        qmin, qmax = min(queue), max(queue)
        known = [k for r in reps if (k := _kv_or_none(r)) is not None]
        default_kv = sum(known) / len(known) if known else 0.5
        n_blocks = len(request.prefix_blocks)
        scores = []
        for r, q in zip(reps, queue):
            q_score = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            kv = _kv_or_none(r)
            kv_score = 1.0 - (default_kv if kv is None else kv)
            p_score = r.prefix_match_blocks / n_blocks if n_blocks else 0.0
            scores.append(-(self.queue_weight * q_score + self.kv_weight * kv_score + self.prefix_weight * p_score))
        return argmin_random_ties(scores, healthy, self.rng)


class SpeedAware(Policy):
    """Least expected delay: outstanding work divided by the replica's router-measured speed.

    Speed comes from the TPOT EMA the router keeps per replica; replicas not yet measured get
    the fleet's median TPOT.
    """

    name = "speed-aware"

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        known = sorted(t for i in healthy if (t := view.replicas[i].tpot_ema_s) is not None)
        median = known[len(known) // 2] if known else 1.0
        scores = []
        for i in healthy:
            r = view.replicas[i]
            tpot = median if r.tpot_ema_s is None else r.tpot_ema_s
            scores.append((r.outstanding + 1) * tpot)
        return argmin_random_ties(scores, healthy, self.rng)



class ExpectedWait(Policy):
    """Least expected wait for the first token: the prefill work queued ahead, scaled by speed.

    Work ahead = prompt tokens of requests on the replica that have no first token yet, plus
    this request's prompt minus its cached prefix, plus `decode_weight` x the expected decode
    tokens in flight (decodes share each step's token budget). It is scaled by the replica's
    TPOT EMA relative to the fleet's mean, so slow or slowed-down replicas look longer.
    """

    name = "expected-wait"

    def __init__(self, seed: int | None = None, decode_weight: float = EXPECTED_WAIT_DECODE_WEIGHT) -> None:
        super().__init__(seed)
        self.decode_weight = decode_weight

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        reps = view.replicas
        known = [t for i in healthy if (t := reps[i].tpot_ema_s) is not None and t > 0]
        mean = max(sum(known) / len(known), 1e-9) if known else 1.0
        n_blocks = len(request.prefix_blocks)
        prompt = request.prompt_tokens_est
        scores = []
        for i in healthy:
            r = reps[i]
            uncached = prompt * (1.0 - r.prefix_match_blocks / n_blocks) if n_blocks else prompt
            work = r.awaiting_prompt_tokens + uncached + self.decode_weight * r.outstanding_decode_tokens
            tpot = r.tpot_ema_s
            scores.append(work * (tpot / mean if tpot is not None and tpot > 0 else 1.0))
        return argmin_random_ties(scores, healthy, self.rng)


class LoraAffinity(Policy):
    """LoRA affinity in front of least-outstanding, as the Inference Extension's LoRA-affinity scorer: a request for
    an adapter goes to the least loaded replica whose running or waiting requests already use it (vLLM's
    vllm:lora_requests_info, in the snapshot's `lora`), else to the least loaded with a free adapter slot, else to the
    least loaded. The preferred replica is passed over for the least loaded when it has more than `balance_abs` and
    `balance_rel` x the least outstanding requests. A model no replica has reported as an adapter so far (a base
    model, or an adapter nobody has loaded yet) goes to the least loaded."""

    name = "lora-affinity"

    def __init__(self, seed: int | None = None, balance_abs: int = 8, balance_rel: float = 1.5) -> None:
        super().__init__(seed)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._adapters: set[str] = set()  # models some replica has reported running or waiting as an adapter

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self._adapters = set()

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = healthy_or_raise(view)
        reps = view.replicas
        loads = [reps[i].outstanding for i in healthy]
        model = request.model
        if model is not None and model not in self._adapters:
            if any((s := reps[i].lora) is not None and s.has(model) for i in healthy):
                self._adapters.add(model)
        if model in self._adapters:
            tier = [i for i in healthy if (s := reps[i].lora) is not None and s.has(model)]
            if not tier:
                tier = [i for i in healthy if (s := reps[i].lora) is not None and s.room]
            if tier:
                tier_loads = [reps[i].outstanding for i in tier]
                best, lo = min(tier_loads), min(loads)
                if not (best - lo > self.balance_abs and best > self.balance_rel * lo):
                    return argmin_random_ties(tier_loads, tier, self.rng)
        return argmin_random_ties(loads, healthy, self.rng)


BASELINE_CLASSES: tuple[type[Policy], ...] = (
    RoundRobin,
    RandomChoice,
    LeastOutstanding,
    PowerOfTwo,
    LeastTokenLoad,
    KvAware,
    PrefixAware,
    WeightedScorer,
    SpeedAware,
    ExpectedWait,
    LoraAffinity,
)
