"""How do policies degrade when N router pods share the traffic? (issue 17, item 3; a script, not a test)

Each router keeps its own router-side state (in-flight counts, requests awaiting a first token, prefix
index), so it sees only the share of in-flight load it routed itself; scraped vLLM stats (lagged by the
scrape interval) and health reach every router. Requests reach router `arrival index mod N`.

    python tests/bench/multi_router.py [--scenarios a,b] [--routers 1,2,4,8] [--seeds 3] [--workers 2]

prints p99 TTFT (EVAL windows, mean over seeds) per policy and router count, and its ratio to one router.
"""

from __future__ import annotations

import argparse
import sys
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from router.policy.served import served_policy  # noqa: E402
from simulator.cluster import simulate  # noqa: E402
from simulator.metrics import summarize  # noqa: E402
from simulator.scenario import load_scenario  # noqa: E402

POLICIES = ("least-outstanding", "prefix-aware", "expected-wait", "learned")


def run(job: tuple[str, int, str, int]) -> tuple[str, int, str, int, float]:
    scenario, seed, policy, routers = job
    sc = load_scenario(scenario, split="eval")
    cluster, requests = sc.build(np.random.default_rng(seed))
    cluster = cluster.model_copy(update={"routers": routers})
    records = simulate(cluster, requests, served_policy(policy, seed=seed), seed=seed)
    return scenario, seed, policy, routers, summarize(records, sc.slo)["ttft_p99_s"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="steady-chat,heterogeneous,prefix-heavy,bursty-code")
    ap.add_argument("--routers", default="1,2,4,8", help="router counts (comma-separated)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    scenarios, policies = args.scenarios.split(","), args.policies.split(",")
    counts = [int(n) for n in args.routers.split(",")]
    jobs = [(sc, k, p, n) for sc in scenarios for k in range(args.seeds) for p in policies for n in counts]
    with get_context("spawn").Pool(args.workers) as pool:
        results = pool.map(run, jobs, chunksize=1)
    p99: dict[tuple[str, str, int], list[float]] = {}
    for sc, _seed, p, n, v in results:
        p99.setdefault((sc, p, n), []).append(v)
    print(f"p99 TTFT (s), mean over {args.seeds} seeds, EVAL windows; in brackets: ratio to one router")
    print(f"{'scenario':15s} {'policy':18s} " + " ".join(f"{f'N={n}':>15s}" for n in counts))
    for sc in scenarios:
        for p in policies:
            base = float(np.mean(p99[(sc, p, counts[0])]))
            cells = []
            for n in counts:
                v = float(np.mean(p99[(sc, p, n)]))
                cells.append(f"{v:7.3f} ({v / base:4.2f}x)")
            print(f"{sc:15s} {p:18s} " + " ".join(f"{c:>15s}" for c in cells))


if __name__ == "__main__":
    main()
