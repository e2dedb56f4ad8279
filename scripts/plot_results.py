#!/usr/bin/env python3
"""The README's picture: p99 TTFT of the recommended configuration against the heuristics, per scenario.

    .venv/bin/python scripts/plot_results.py                  # docs/data/any-fleet-20-seeds.csv -> docs/img/results.svg
    # the table afresh from `simulator compare --json` documents (heuristics and the model may be in separate ones):
    .venv/bin/python scripts/plot_results.py --compare h.json m.json --model router/policy/models/any-fleet.onnx+late

Each bar is a p99 over the best heuristic *per request* on that scenario (1.0, chosen with hindsight): the best
heuristic behind the router's late binding, and the recommended model behind it. Needs matplotlib (the [sim] extra).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CSV = ROOT / "docs" / "data" / "any-fleet-20-seeds.csv"
SVG = ROOT / "docs" / "img" / "results.svg"
FIELDS = ["scenario", "group", "best_per_request_heuristic", "best_per_request_p99_ms", "best_late_heuristic",
          "best_late_p99_ms", "model_late_p99_ratio"]


def rows_from_compare(paths: list[Path], model: str) -> list[dict]:
    """One row per scenario of the compare documents that has the model's row and some heuristic rows."""
    from routewise_vllm.router.policy.registry import BASELINES

    by_scenario: dict[str, dict[str, float]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["results"]:
            if r.get("ttft_p99_s") is not None:
                by_scenario.setdefault(r["scenario"], {})[r["policy"]] = r["ttft_p99_s"]
    out = []
    for scenario, p99 in sorted(by_scenario.items()):
        per_request = {p: v for p, v in p99.items() if p in BASELINES}
        late = {p.removesuffix("+late"): v for p, v in p99.items() if p.endswith("+late") and p.removesuffix("+late") in BASELINES}
        if model not in p99 or not per_request or not late:
            continue
        best, best_late = min(per_request, key=per_request.get), min(late, key=late.get)
        out.append({
            "scenario": scenario, "group": "shapes" if scenario.startswith("shape-") else "suite",
            "best_per_request_heuristic": best, "best_per_request_p99_ms": round(per_request[best] * 1000),
            "best_late_heuristic": best_late, "best_late_p99_ms": round(late[best_late] * 1000),
            "model_late_p99_ratio": round(p99[model] / per_request[best], 2),
        })
    if not out:
        raise SystemExit(f"no scenario has a {model!r} row beside heuristic rows with and without +late")
    return out


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "routewise"  # stable element ids: the file changes only with the data
    import matplotlib.pyplot as plt

    groups = [("suite", "The scenario suite"), ("shapes", "Fleet shapes outside the suite")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2), sharex=True)
    for ax, (group, title) in zip(axes, groups):
        part = [r for r in rows if r["group"] == group]
        y = range(len(part))
        late = [float(r["best_late_p99_ms"]) / float(r["best_per_request_p99_ms"]) for r in part]
        model = [float(r["model_late_p99_ratio"]) for r in part]
        ax.barh([i + 0.2 for i in y], late, height=0.4, color="#9aa5b1", label="best heuristic, late binding")
        ax.barh([i - 0.2 for i in y], model, height=0.4, color="#1f77b4", label="routewise default (any-fleet, late binding)")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(list(y), [r["scenario"].removeprefix("shape-") for r in part])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=11)
        ax.set_xlim(0, 1.25)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_xlabel("p99 TTFT / best heuristic per request (lower is better)")
    axes[1].set_xlabel("p99 TTFT / best heuristic per request (lower is better)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.suptitle("Simulated p99 time to first token, EVAL windows, 20 seeds", fontsize=12)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lstrip(".") or "svg", metadata={"Date": None} if out.suffix == ".svg" else None)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", nargs="+", type=Path, metavar="JSON", help="simulator compare --json documents")
    p.add_argument("--model", default="router/policy/models/any-fleet.onnx+late",
                   help="the compare row of the configuration to draw (default: %(default)s)")
    p.add_argument("--csv", type=Path, default=CSV, help="the table read, or written with --compare (default: %(default)s)")
    p.add_argument("--out", type=Path, default=SVG, help="the picture (default: %(default)s)")
    args = p.parse_args(argv)
    if args.compare:
        rows = rows_from_compare(args.compare, args.model)
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, FIELDS, lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
    with args.csv.open() as f:
        rows = list(csv.DictReader(f))
    plot(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
