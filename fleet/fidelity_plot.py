"""One picture of a fidelity run (`fleet fidelity --plot FILE.png`): per policy, the real and the simulated TTFT
distribution's tail (CDF from the median up, log time axis), and the p99 TTFTs side by side with their 95 %
bootstrap intervals, so a ranking inside the noise looks like one. Needs matplotlib (the [sim] extra)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np


class Served(Protocol):  # fleet.fidelity.Served; not imported, so that fidelity can import this module
    ttft_s: float


def _sorted_ttft(rows: Sequence[Served]) -> np.ndarray:
    return np.sort([r.ttft_s for r in rows if r.ttft_s is not None and math.isfinite(r.ttft_s)])


def plot_fidelity(real: dict[str, Sequence[Served]], sim: dict[str, Sequence[Served]], report: dict,
                  path: str | Path) -> Path:
    """Write the figure to `path` (PNG, or any format matplotlib infers from the suffix); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    policies = list(real)
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    medians, tops = [], []
    for i, p in enumerate(policies):
        for src, rows, style in (("real", real[p], "-"), ("sim", sim[p], "--")):
            t = _sorted_ttft(rows)
            if len(t):
                y = np.arange(1, len(t) + 1) / len(t)
                cdf.plot(t * 1e3, y, style, color=colours[i % len(colours)], lw=1.6, label=f"{p} ({src})")
                medians.append(float(np.median(t)) * 1e3)
                tops.append(float(t[-1]) * 1e3)
    cdf.set_xscale("log")
    # plain milliseconds at 1, 2 and 5 of each decade; minor ticks unlabelled (labelled minors overlap)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    cdf.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    cdf.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    cdf.xaxis.set_minor_formatter(NullFormatter())
    if medians and min(medians) > 0:
        cdf.set_xlim(min(medians) * 0.8, max(tops) * 1.1)
    cdf.set_ylim(0.5, 1.0)
    cdf.set_xlabel("TTFT (ms, log)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT tail: real (solid) vs simulated (dashed)")
    cdf.grid(alpha=0.3, which="both")
    cdf.legend(fontsize=7, loc="lower right")

    x = np.arange(len(policies))
    for k, (src, hatch) in enumerate((("real", None), ("sim", "//"))):
        cells = [report["policies"][p]["ttft_s"]["p99"] for p in policies]
        vals = np.array([np.nan if c[src] is None else c[src] * 1e3 for c in cells])
        lo = np.array([np.nan if c["ci95"][src] is None else c["ci95"][src][0] * 1e3 for c in cells])
        hi = np.array([np.nan if c["ci95"][src] is None else c["ci95"][src][1] * 1e3 for c in cells])
        err = np.vstack([np.clip(vals - lo, 0, None), np.clip(hi - vals, 0, None)])
        bars.bar(x + (k - 0.5) * 0.38, vals, 0.38, yerr=err, capsize=3, hatch=hatch, label=src,
                 color=[colours[i % len(colours)] for i in range(len(policies))], alpha=1.0 if src == "real" else 0.55,
                 edgecolor="black", linewidth=0.5)
    bars.set_xticks(x, policies, rotation=15, fontsize=8)
    bars.set_ylabel("p99 TTFT (ms)")
    rk = report["ranking_by_ttft_p99"]
    sep = rk.get("separated", {})
    bars.set_title(f"p99 TTFT, 95 % bootstrap intervals\nranking {'same' if rk['same'] else 'DIFFERENT'}; "
                   f"real {'outside' if sep.get('real') else 'inside'} the noise", fontsize=9)
    bars.legend(fontsize=8)
    g = report.get("learned_gain_ttft_p99")
    if g and g.get("real") is not None and g.get("predicted") is not None:
        bars.annotate(f"learned gain over least-outstanding: real {g['real'] * 100:+.0f} %, "
                      f"predicted {g['predicted'] * 100:+.0f} %", (0.5, -0.28), xycoords="axes fraction",
                      ha="center", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
