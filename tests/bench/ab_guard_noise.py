"""How often the A/B rollback guard trips on noise, and how fast it catches a real regression.

    .venv/bin/python tests/bench/ab_guard_noise.py [--runs 100] [--requests 3000] [--sigma 0.4]

Both arms get lognormal time-to-first-byte (median 100 ms, log-sigma `--sigma`); the treatment is
`ratio` times slower. Prints, per ratio, the share of runs in which the guard tripped and the median
number of requests per arm before it did, for the router's default GuardConfig.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.router.serving.arms import GuardConfig, RollbackGuard  # noqa: E402


def run(seed: int, ratio: float, n: int, sigma: float, cfg: GuardConfig) -> int | None:
    rng = np.random.default_rng(seed)
    guard = RollbackGuard(cfg)
    for i in range(n):
        for arm, median in (("control", 0.1), ("treatment", 0.1 * ratio)):
            if guard.record(arm, i * 0.01, float(rng.lognormal(np.log(median), sigma)), True):
                return i + 1
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--requests", type=int, default=3000, help="requests per arm per run")
    p.add_argument("--sigma", type=float, default=0.4)
    p.add_argument("--ratios", default="1.0,1.1,1.2,1.3,1.4,2.0")
    args = p.parse_args()
    cfg = GuardConfig()
    print(f"GuardConfig defaults: {cfg}")
    print(f"{args.runs} runs x {args.requests} requests per arm, lognormal sigma {args.sigma}")
    print(f"{'p99 ratio':>9} | {'runs tripped':>12} | requests per arm before the trip (median)")
    for ratio in (float(x) for x in args.ratios.split(",")):
        trips = [run(s, ratio, args.requests, args.sigma, cfg) for s in range(args.runs)]
        hit = [t for t in trips if t is not None]
        print(f"{ratio:>9.2f} | {len(hit) / len(trips):>12.0%} | {int(np.median(hit)) if hit else '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
