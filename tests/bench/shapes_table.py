"""The model card's fleet-shape table from a `simulator compare --json` document (no simulation here).

    simulator compare --scenario shapes --seeds 3 --workers 2 --late-binding --json > shapes.json
    python tests/bench/shapes_table.py shapes.json
    python tests/bench/shapes_table.py suite.json --learned runs/fleets/candidate.onnx   # a candidate model's row
    python tests/bench/shapes_table.py suite.json shapes.json --models learned,runs/a.onnx,runs/b.onnx   # side by side
    # models behind late binding, each over the best heuristic behind it; the heuristics' rows may come from
    # another document of the same seeds and split (a model-only compare run beside an earlier full one)
    python tests/bench/shapes_table.py heuristics.json models.json --models runs/a.onnx,runs/b.onnx --late

Per scenario: the best per-request heuristic by mean p99 TTFT over seeds (and its ±95 % CI half-width), the
learned policy's p99 and their ratio; the best late-binding heuristic (`<name>+late` rows, when present) and
the learned p99 over it; with a `learned+late` row, the learned policy behind late binding against both; goodput of the learned policy, the best goodput of any per-request heuristic and (in
brackets) of any late-binding one; the learned policy's fallback share (decisions its guards or decision budget handed to the
fallback heuristic).
"""

from __future__ import annotations

import argparse
import json
import math

from routewise_vllm.router.policy.registry import BASELINES, LEARNED
from routewise_vllm.simulator.late_binding import LATE_SUFFIX

LATE_HEURISTICS = {name + LATE_SUFFIX for name in BASELINES}  # the `<heuristic>+late` rows


def _ms(row: dict) -> str:
    ci = row.get("ttft_p99_s_ci95")
    return f"{row['ttft_p99_s'] * 1000:.0f}" + ("" if ci is None or math.isnan(ci) else f"±{ci * 1000:.0f}") + " ms"


def rows(doc: dict, learned_name: str = LEARNED) -> list[dict]:
    by_sc: dict[str, dict[str, dict]] = {}
    for r in doc["results"]:
        by_sc.setdefault(r["scenario"], {})[r["policy"]] = r
    out = []
    for sc, pol in by_sc.items():
        learned = pol.get(learned_name)
        heur = [r for p, r in pol.items() if p in BASELINES and r["ttft_p99_s"] is not None]
        late = [r for p, r in pol.items() if p in LATE_HEURISTICS and r["ttft_p99_s"] is not None]
        if learned is None or not heur:
            continue
        best = min(heur, key=lambda r: r["ttft_p99_s"])
        best_late = min(late, key=lambda r: r["ttft_p99_s"]) if late else None
        out.append({
            "scenario": sc, "learned": learned, "best": best, "best_late": best_late, "learned_late": pol.get(learned_name + LATE_SUFFIX),
            "best_goodput": max(r["goodput"] for r in heur),
            "best_late_goodput": max(r["goodput"] for r in late) if late else None,
        })  # fmt: skip
    return out


def _late_cells(r: dict) -> str:
    ll, best, late = r["learned_late"], r["best"], r["best_late"]
    if ll is None:
        return " - | - | - | - |"
    ratio = ll["ttft_p99_s"] / best["ttft_p99_s"]
    vs_late = f"{ll['ttft_p99_s'] / late['ttft_p99_s']:.2f}" if late else "-"
    return f" {_ms(ll)} | {'**' if ratio <= 1.0 else ''}{ratio:.2f}{'**' if ratio <= 1.0 else ''} | {vs_late} | {ll['goodput']:.3f} |"


def markdown(doc: dict, learned_name: str = LEARNED) -> str:
    """The table; with `learned+late` rows (compare --late-binding) four more columns: the learned policy behind late
    binding, its p99 over the best per-request heuristic's and over the best late-binding heuristic's, its goodput."""
    with_late = any(r["learned_late"] for r in rows(doc, learned_name))
    lines = [
        "| scenario | best heuristic | its p99 | learned p99 | learned / best | best late-binding (p99) | "
        "learned / best late | goodput learned / best (best late) | learned fallback |"
        + (" learned+late p99 | / best | / best late | its goodput |" if with_late else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if with_late else ""),
    ]
    for r in rows(doc, learned_name):
        learned, best, late = r["learned"], r["best"], r["best_late"]
        ratio = learned["ttft_p99_s"] / best["ttft_p99_s"]
        late_goodput = f" ({r['best_late_goodput']:.3f})" if late else ""
        late_cells = (
            f"{late['policy']} ({_ms(late)})", f"{learned['ttft_p99_s'] / late['ttft_p99_s']:.2f}"
        ) if late else ("-", "-")
        lines.append(
            f"| {r['scenario']} | {best['policy']} | {_ms(best)} | {_ms(learned)} | "
            f"{'**' if ratio <= 1.0 else ''}{ratio:.2f}{'**' if ratio <= 1.0 else ''} | {late_cells[0]} | "
            f"{late_cells[1]} | {learned['goodput']:.3f} / {r['best_goodput']:.3f}{late_goodput} | {learned['fallback_share']:.1%} |"
            + (_late_cells(r) if with_late else "")
        )
    return "\n".join(lines)


def merged(docs: list[dict]) -> dict:
    """One document from several of the same seeds and split (rows of a later one replace an earlier one's)."""
    first = docs[0]
    for d in docs[1:]:
        if d["seeds"] != first["seeds"] or d["split"] != first["split"]:
            raise SystemExit(f"documents differ: seeds {first['seeds']} / {d['seeds']}, split {first['split']} / {d['split']}")
    by_key = {(r["scenario"], r["policy"]): r for d in docs for r in d["results"]}
    return {"seeds": first["seeds"], "split": first["split"], "results": list(by_key.values())}


def side_by_side(docs: list[dict], models: list[str], late: bool = False) -> str:
    """Per scenario, each model's p99 TTFT over the best per-request heuristic's (the same arrivals), then the
    geometric mean and the worst ratio over the scenarios every model ran, and each model's largest goodput deficit
    to the best goodput of any heuristic row, per request or behind late binding (and where). With `late`: each model behind late
    binding over the best heuristic behind it, and how many scenarios it has at or below 0.75x the best per-request
    heuristic."""
    doc = merged(docs)
    ratios: dict[str, dict[str, float]] = {}
    deficits: dict[str, dict[str, float]] = {}  # best goodput of any heuristic row minus the model's row's
    at_075: dict[str, int] = {m: 0 for m in models}
    for m in models:
        for r in rows(doc, m):
            best_goodput = max(r["best_goodput"], r["best_late_goodput"] or 0.0)
            if not late:
                ratios.setdefault(r["scenario"], {})[m] = r["learned"]["ttft_p99_s"] / r["best"]["ttft_p99_s"]
                deficits.setdefault(r["scenario"], {})[m] = best_goodput - r["learned"]["goodput"]
            elif r["learned_late"] is not None and r["best_late"] is not None:
                ratios.setdefault(r["scenario"], {})[m] = r["learned_late"]["ttft_p99_s"] / r["best_late"]["ttft_p99_s"]
                deficits.setdefault(r["scenario"], {})[m] = best_goodput - r["learned_late"]["goodput"]
                at_075[m] += r["learned_late"]["ttft_p99_s"] <= 0.75 * r["best"]["ttft_p99_s"]
    full = {sc: by for sc, by in ratios.items() if all(m in by for m in models)}
    if not full:
        raise SystemExit(f"no scenario has a row for every one of {', '.join(models)}" + (" behind late binding" if late else ""))
    lines = ["| scenario | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    lines += [f"| {sc} | " + " | ".join(f"{by[m]:.2f}" for m in models) + " |" for sc, by in full.items()]
    geo = [math.exp(sum(math.log(by[m]) for by in full.values()) / len(full)) for m in models]
    lines.append(f"| geometric mean ({len(full)}) | " + " | ".join(f"{g:.3f}" for g in geo) + " |")
    lines.append("| worst | " + " | ".join(f"{max(by[m] for by in full.values()):.2f}" for m in models) + " |")
    if late:
        lines.append("| at or below 0.75x the best per request | " + " | ".join(str(at_075[m]) for m in models) + " |")
    worst_gp = [max(full, key=lambda sc: deficits[sc][m]) for m in models]
    lines.append("| largest goodput deficit to the best heuristic row | "
                 + " | ".join(f"{deficits[sc][m]:.3f} ({sc})" for m, sc in zip(models, worst_gp)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("compare_json", nargs="+", help="output of `simulator compare --json` (several with --models)")
    ap.add_argument("--learned", default=LEARNED,
                    help="the policy whose row is the learned one, as compare names it (default: the shipped "
                         "`learned`; an .onnx path for a candidate)")
    ap.add_argument("--models", help="comma-separated learned policies as compare names them: instead of the table, "
                                      "each one's p99 over the best per-request heuristic side by side, with the "
                                      "geometric mean and the worst scenario")
    ap.add_argument("--late", action="store_true",
                    help="with --models: each model behind late binding (its `+late` row) over the best heuristic "
                         "behind it, and its count of scenarios at or below 0.75x the best per-request heuristic")
    args = ap.parse_args(argv)
    docs = []
    for path in args.compare_json:
        with open(path) as f:
            docs.append(json.load(f))
    if args.models:
        print(side_by_side(docs, args.models.split(","), late=args.late))
        return
    if len(docs) > 1:
        ap.error("several compare documents need --models")
    print(f"seeds {docs[0]['seeds']}, {docs[0]['split']} split")
    print(markdown(docs[0], args.learned))


if __name__ == "__main__":
    main()
