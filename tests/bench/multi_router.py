"""How do policies degrade when N router pods share the traffic, and how much does a shared fleet view win back?
(a script, not a test)

Each router keeps its own router-side state (in-flight counts, requests awaiting a first token, prefix
index), so it sees only the share of in-flight load it routed itself; scraped vLLM stats (lagged by the
scrape interval) and health reach every router. Requests reach router `arrival index mod N`.

    python tests/bench/multi_router.py [--scenarios a,b] [--routers 1,2,4,8] [--lags none,0,5,20,100]
                                       [--seeds 3] [--workers 2]

prints p99 TTFT (EVAL windows, mean over seeds) per policy and router count, and its ratio to one router; with
--lags, one column per router count and lag: `none` = each router its own counts (no shared state), a number =
milliseconds of `shared_state_lag_s` (the routers share their in-flight counts through --shared-state, each seeing
the others' as of that lag; docs/multi-router.md).
"""

from __future__ import annotations

import argparse
import sys
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.router.policy.served import served_policy  # noqa: E402
from routewise_vllm.simulator.cluster import simulate  # noqa: E402
from routewise_vllm.simulator.metrics import summarize  # noqa: E402
from routewise_vllm.simulator.scenario import load_scenario  # noqa: E402

POLICIES = ("least-outstanding", "prefix-aware", "expected-wait", "learned")


def run(job: tuple[str, int, str, int, float | None]) -> tuple[str, int, str, int, float | None, float]:
    scenario, seed, policy, routers, lag_s = job
    sc = load_scenario(scenario, split="eval")
    cluster, requests = sc.build(np.random.default_rng(seed))
    cluster = cluster.model_copy(update={"routers": routers, "shared_state_lag_s": lag_s})
    records = simulate(cluster, requests, served_policy(policy, seed=seed), seed=seed)
    return scenario, seed, policy, routers, lag_s, summarize(records, sc.slo)["ttft_p99_s"]


def _lag(text: str) -> float | None:
    return None if text == "none" else float(text) / 1000.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="steady-chat,heterogeneous,prefix-heavy,bursty-code")
    ap.add_argument("--routers", default="1,2,4,8", help="router counts (comma-separated)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--lags", default="none", help="none and/or shared-state lags in ms (comma-separated)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    scenarios, policies = args.scenarios.split(","), args.policies.split(",")
    counts = [int(n) for n in args.routers.split(",")]
    lags = [_lag(x) for x in args.lags.split(",")]
    # one router has nothing to share: its column is run once, without shared state
    columns = [(n, lag) for n in counts for lag in (lags if n > 1 else [None])]
    jobs = [(sc, k, p, n, lag) for sc in scenarios for k in range(args.seeds) for p in policies for n, lag in columns]
    with get_context("spawn").Pool(args.workers) as pool:
        results = pool.map(run, jobs, chunksize=1)
    p99: dict[tuple[str, str, int, float | None], list[float]] = {}
    for sc, _seed, p, n, lag, v in results:
        p99.setdefault((sc, p, n, lag), []).append(v)
    print(f"p99 TTFT (s), mean over {args.seeds} seeds, EVAL windows; in brackets: ratio to the first column")
    heads = [f"N={n}" + ("" if n == 1 and lag is None else f" {'own' if lag is None else f'{lag * 1000:g}ms'}")
             for n, lag in columns]
    print(f"{'scenario':15s} {'policy':18s} " + " ".join(f"{h:>15s}" for h in heads))
    for sc in scenarios:
        for p in policies:
            base = float(np.mean(p99[(sc, p, *columns[0])]))
            cells = []
            for n, lag in columns:
                v = float(np.mean(p99[(sc, p, n, lag)]))
                cells.append(f"{v:7.3f} ({v / base:4.2f}x)")
            print(f"{sc:15s} {p:18s} " + " ".join(f"{c:>15s}" for c in cells))


if __name__ == "__main__":
    main()
