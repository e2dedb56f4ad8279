"""Decision latency of FallbackPolicy.decide for every baseline (and `learned` when its model loads).

    .venv/bin/python tests/bench/decision_latency.py [--iters 2000] [--replicas 16 128] [--json]

Each decision gets a fresh ClusterView from a ClusterTracker with scraped stats, in-flight
requests and a prefix index, built the way the live router builds it; the timed part is
`view + decide`, as in `Router.route`, and `decide` alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.router.policy import (  # noqa: E402
    BASELINES, ClusterTracker, FallbackPolicy, LeastOutstanding, RequestInfo, make_policy, text_prefix_blocks,
)
from routewise_vllm.router.policy.onnx_policy import OnnxPolicy  # noqa: E402


def requests(rng: np.random.Generator, n: int = 64) -> list[RequestInfo]:
    """n requests with random short-alphabet prompts (shared prefixes, so the prefix index has work)."""
    prompts = ["".join(chr(97 + int(c)) for c in rng.integers(0, 4, size=int(rng.integers(100, 3000)))) for _ in range(n)]
    return [RequestInfo(f"q{i}", len(p) // 4, 128, text_prefix_blocks(p)) for i, p in enumerate(prompts)]


def cluster(n: int, rng: np.random.Generator) -> ClusterTracker:
    ct = ClusterTracker([f"10.0.{i // 250}.{i % 250}:8000" for i in range(n)])
    for i, t in enumerate(ct.trackers):
        t.on_scrape(0.0, int(rng.integers(0, 8)), int(rng.integers(0, 32)), float(rng.random()), 200_000)
        for k in range(int(rng.integers(0, 6))):
            ct.dispatch(i, RequestInfo(f"w{i}-{k}", int(rng.integers(50, 2000)), 256))
        t.on_first_token(f"w{i}-0", float(rng.uniform(0.02, 0.3)))
    return ct


def bench(name: str, n: int, iters: int) -> dict[str, float] | None:
    rng = np.random.default_rng(0)
    ct = cluster(n, rng)
    primary = make_policy(name, seed=0)
    if isinstance(primary, OnnxPolicy) and primary.load_error is not None:
        return None
    pol = FallbackPolicy(primary, LeastOutstanding(seed=1), budget_s=None, clock=time.perf_counter,
                         max_stats_age_s=10.0 if name == "learned" else None)
    reqs = requests(rng)
    total, decide_only = [], []
    for i in range(iters + 200):
        req = reqs[i % len(reqs)]
        t0 = time.perf_counter()
        view = ct.view(1.0, req)
        t1 = time.perf_counter()
        pol.decide(view, req)
        t2 = time.perf_counter()
        if i >= 200:  # warm-up
            total.append(t2 - t0)
            decide_only.append(t2 - t1)

    def p(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1] * 1e6

    return {"p50_us": p(total, 50), "p99_us": p(total, 99), "decide_p50_us": p(decide_only, 50),
            "decide_p99_us": p(decide_only, 99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--replicas", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for name in [*BASELINES, "learned"]:
        for n in args.replicas:
            r = bench(name, n, args.iters)
            if r is None:
                print(f"{name}: model not loadable, skipped", file=sys.stderr)
                break
            rows.append({"policy": name, "replicas": n, **r})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'policy':<18} {'replicas':>8} {'view+decide p50 us':>19} {'p99 us':>9} {'decide p50 us':>14} {'p99 us':>9}")
    for r in rows:
        print(f"{r['policy']:<18} {r['replicas']:>8} {r['p50_us']:>19.1f} {r['p99_us']:>9.1f} "
              f"{r['decide_p50_us']:>14.1f} {r['decide_p99_us']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
