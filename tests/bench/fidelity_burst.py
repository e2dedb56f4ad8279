"""Where the simulator misses a real fleet's bursts: real minus simulated TTFT per request, by how many requests
had reached the same server in the previous `--window` seconds (no simulation here; reads `fleet fidelity --out
DIR`'s raw.json, every policy pooled).

    python tests/bench/fidelity_burst.py DIR/raw.json [--window 0.1]

A median excess that grows with recent arrivals looks like a serial per-request cost at the server (HTTP,
tokenisation on the engine's core) that the simulator's constant `request_overhead_s` does not queue; modelled as
such a queue it did not close the gap (README, "How far the simulator is from real vLLM").
"""

from __future__ import annotations

import argparse
import json

import numpy as np

MIN_REQUESTS = 20  # rows with fewer requests are left out


def excess_by_recent_arrivals(raw: dict, window_s: float) -> dict[int, tuple[int, float, float]]:
    """{recent arrivals: (requests, median excess s, p90 excess s)} over every policy of a raw.json."""
    recent_all, excess_all = [], []
    for runs in raw.values():
        real, sim = runs["real"], runs["sim"]
        arrival = np.array([r["arrival_s"] for r in real])  # repeats are offset far apart: no window spans two
        replica = np.array([r["replica"] for r in real])
        excess = np.array([r["ttft_s"] - s["ttft_s"] for r, s in zip(real, sim)])
        for i in range(len(arrival)):
            same = (arrival > arrival[i] - window_s) & (arrival <= arrival[i]) & (replica == replica[i])
            recent_all.append(int(same.sum()) - 1)
            excess_all.append(excess[i])
    recent, excess = np.array(recent_all), np.array(excess_all)
    return {int(k): (int((recent == k).sum()), float(np.median(excess[recent == k])), float(np.percentile(excess[recent == k], 90)))
            for k in np.unique(recent) if (recent == k).sum() >= MIN_REQUESTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw_json", help="raw.json of `fleet fidelity --out DIR`")
    ap.add_argument("--window", type=float, default=0.1, help="seconds counted back from each arrival (default 0.1)")
    args = ap.parse_args()
    with open(args.raw_json) as f:
        rows = excess_by_recent_arrivals(json.load(f), args.window)
    print(f"arrivals at the same server in the previous {args.window:g} s | requests | real - simulated TTFT: median, p90 (ms)")
    for k, (n, med, p90) in rows.items():
        print(f"{k:>5} {n:>8} {med * 1e3:>9.1f} {p90 * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
