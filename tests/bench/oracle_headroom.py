"""How much p99 TTFT could any router win? A perfect-information greedy router as a yardstick.

The "oracle" reads the simulator's true replica state, which no real router has: the prompt tokens
still to prefill on every replica (queued and in progress, preempted requests included), this
request's true prefix-cache hit on each replica, the true remaining decode tokens, each replica's
true prefill speed including slow-down faults, and which replicas have crashed but are not yet
detected. It sends each request where that work, times that speed, is smallest (the
expected-wait rule on true values). It is greedy, so it is a yardstick, not a bound: a router
that plans ahead could do better still.

A second yardstick adds late binding: the same perfect information, but a request waits in a
router-side FIFO queue while no replica has room (its waiting queue empty, a free batch slot, and less
prefill work queued than one iteration's token budget) and the head of the queue goes to the replica that
frees first (the cheapest with room). That is one shared queue instead of one queue per replica.

    python tests/bench/oracle_headroom.py --scenarios prefix-heavy,kv-pressure --seeds 3 --workers 2

prints p99 TTFT per scenario for both oracles, the best heuristic and the shipped learned policy.
"""

from __future__ import annotations

import argparse
import math
import sys
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.router.policy.base import Policy  # noqa: E402
from routewise_vllm.router.policy.served import served_policy  # noqa: E402
from routewise_vllm.router.policy.types import ClusterView, RequestInfo  # noqa: E402
from routewise_vllm.simulator.cluster import ClusterSim  # noqa: E402
from routewise_vllm.simulator.metrics import summarize  # noqa: E402
from routewise_vllm.simulator.replica import ReqState  # noqa: E402
from routewise_vllm.simulator.scenario import load_scenario  # noqa: E402

HEURISTICS = ("least-outstanding", "least-token-load", "weighted-scorer", "prefix-aware", "expected-wait")
DECODE_WEIGHT = 0.1  # decode tokens share each step's token budget (as in the expected-wait heuristic)


class TrueStateGreedy(Policy):
    """Least (true prefill work ahead + true uncached prompt + 0.1 x true decode left) x true s/token."""

    name = "oracle"

    def __init__(self, sim: ClusterSim) -> None:
        super().__init__(0)
        self.sim = sim

    def _score(self, i: int, request: RequestInfo) -> float:
        sim = self.sim
        if sim._crashed[i]:
            return math.inf
        rep = sim.replicas[i]
        idx = sim._pending[0]
        work = sum(st.prompt - st.c for st in rep.waiting) + sum(st.prompt - st.c for st in rep.prefilling)
        decode_left = sum(st.output - st.g for st in rep.running)
        probe = ReqState(sim.requests[idx], idx, sim.now_s, request.prefix_blocks)
        hit = 0
        if probe.keys and rep.prefix_caching:
            rep._prepare_keys(probe)
            hit = rep._lookup(probe)[0]
        s_per_token = rep.co.s_per_flop * rep.co.flops_per_token * rep.factor
        return (work + probe.prompt - hit + DECODE_WEIGHT * decode_left) * s_per_token

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        healthy = [i for i, r in enumerate(view.replicas) if r.healthy]
        scores = [self._score(i, request) for i in healthy]
        return healthy[int(np.argmin(scores))]


class TrueStateLateBinding(TrueStateGreedy):
    """Holds while no replica has room; the head of the queue goes to the cheapest replica with room."""

    name = "oracle-late"

    def _has_room(self, i: int) -> bool:
        rep = self.sim.replicas[i]
        if self.sim._crashed[i] or rep.waiting or len(rep.running) >= rep.max_seqs:
            return False
        return sum(st.prompt - st.c for st in rep.prefilling) < rep.budget

    def choose_or_hold(self, view: ClusterView, request: RequestInfo) -> int | None:
        sim = self.sim
        idx = sim._pending[0]
        if sim.held_besides(idx) and not sim.is_offered(idx):
            return None  # first in, first out: a new arrival queues behind the held ones
        healthy = [i for i, r in enumerate(view.replicas) if r.healthy]
        room = [i for i in healthy if self._has_room(i)]
        if not room and any(tr.outstanding for tr in sim.tracker.trackers):
            return None
        candidates = room or healthy
        return candidates[int(np.argmin([self._score(i, request) for i in candidates]))]


def run(job: tuple[str, int, str]) -> tuple[str, int, str, float, float]:
    scenario, seed, name = job
    sc = load_scenario(scenario, split="eval")
    cluster, requests = sc.build(np.random.default_rng(seed))
    sim = ClusterSim(cluster, requests, seed=seed)
    if name == "oracle-late":
        late = TrueStateLateBinding(sim)
        while (d := sim.next_decision()) is not None:
            pick = late.choose_or_hold(*d)
            sim.hold() if pick is None else sim.dispatch(pick)
        s = summarize(sim.finish(), sc.slo)
        return scenario, seed, name, s["ttft_p99_s"], s["goodput"], sim.n_holds / len(sim.requests)
    policy = TrueStateGreedy(sim) if name == "oracle" else served_policy(name, seed=seed)
    policy.reset(seed)
    while (d := sim.next_decision()) is not None:
        sim.dispatch(policy.choose(*d))
    s = summarize(sim.finish(), sc.slo)
    return scenario, seed, name, s["ttft_p99_s"], s["goodput"], 0.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="heterogeneous,prefix-heavy,prefix-synthetic,kv-pressure,bursty-code,stale-metrics")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    scenarios = args.scenarios.split(",")
    names = ("oracle", "oracle-late", "learned", *HEURISTICS)
    jobs = [(sc, k, p) for sc in scenarios for k in range(args.seeds) for p in names]
    with get_context("spawn").Pool(args.workers) as pool:
        results = pool.map(run, jobs, chunksize=1)
    p99: dict[tuple[str, str], list[float]] = {}
    held: dict[str, list[float]] = {}
    for sc, _seed, name, v, _g, h in results:
        p99.setdefault((sc, name), []).append(v)
        if name == "oracle-late":
            held.setdefault(sc, []).append(h)
    print(f"p99 TTFT, mean over {args.seeds} seeds, EVAL windows; ratios to the best heuristic ({', '.join(HEURISTICS)})")
    print(f"{'scenario':17s} {'best heuristic':>24s} {'learned':>9s} {'oracle':>9s} {'late':>9s} "
          f"{'learned/best':>13s} {'oracle/best':>12s} {'late/best':>10s} {'held':>6s}")  # fmt: skip
    for sc in scenarios:
        mean = {name: float(np.mean(p99[(sc, name)])) for name in names}
        best = min(HEURISTICS, key=mean.get)
        print(f"{sc:17s} {best:>16s} {mean[best]:7.3f}s {mean['learned']:8.3f}s {mean['oracle']:8.3f}s "
              f"{mean['oracle-late']:8.3f}s {mean['learned'] / mean[best]:13.2f} {mean['oracle'] / mean[best]:12.2f} "
              f"{mean['oracle-late'] / mean[best]:10.2f} {np.mean(held[sc]):6.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
