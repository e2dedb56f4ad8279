"""The demo's result as a picture: each arm's TTFT tail (the share of requests served within t) and its p99 with
the 95 % bootstrap interval, so an overlap that does not rank the arms is seen as one. Needs matplotlib (the
[sim] extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def plot_demo(ttfts: Mapping[str, Sequence[float]], intervals: Mapping[str, Sequence[float] | None], title: str,
              path: str | Path) -> Path:
    """`ttfts`: each arm's TTFTs in seconds (served requests); `intervals`: its p99 interval (seconds) or None."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    arms = [a for a in ttfts if len(ttfts[a])]
    fig, (tail, p99) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(arms):
        t = np.sort(np.asarray(ttfts[arm], dtype=float)) * 1e3
        tail.plot(t, np.arange(1, len(t) + 1) / len(t), color=colours[i % len(colours)], lw=1.6,
                  label=f"{arm} ({len(t)} requests)")
    tail.set_xscale("log")
    tail.set_ylim(0.5, 1.0)
    tail.set_xlabel("TTFT (ms, log)")
    tail.set_ylabel("share of requests served within")
    tail.set_title("TTFT tail per arm")
    tail.grid(alpha=0.3, which="both")
    tail.legend(fontsize=8, loc="lower right")
    for i, arm in enumerate(arms):
        p = float(np.percentile(np.asarray(ttfts[arm], dtype=float), 99)) * 1e3
        ci = intervals.get(arm)
        err = None if ci is None else [[p - ci[0] * 1e3], [ci[1] * 1e3 - p]]
        p99.bar(i, p, color=colours[i % len(colours)], yerr=err, capsize=6)
    p99.set_xticks(range(len(arms)), arms)
    p99.set_ylabel("TTFT p99 (ms)")
    p99.set_title("p99 with its 95 % interval")
    p99.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
