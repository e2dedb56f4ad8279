"""`trainer evaluate`: the learned policy and every baseline on the same seeds and scenarios.

The comparison itself is `simulator.experiments.compare` (same seeds => same arrivals for every policy);
this module adds the learned policy (a checkpoint is exported to ONNX first, so what is
evaluated is exactly what the router serves), a table with 95 % confidence intervals over seeds,
and PNG plots (TTFT CDFs per scenario on the first seed, p99 TTFT bars per policy).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from routewise_vllm.router.policy.registry import BASELINES
from routewise_vllm.simulator.metrics import render_table

LEARNED_LABEL = "learned"


def learned_onnx(policy: str, out_dir: Path) -> Path:
    """An ONNX file for `policy` (.onnx as is; a checkpoint is exported into out_dir)."""
    from routewise_vllm.trainer.checkpoint import load_network
    from routewise_vllm.trainer.export import check_onnx_file, export_onnx

    path = Path(policy)
    if path.suffix == ".onnx":
        check_onnx_file(path)
        return path
    net, cfg, doc = load_network(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / f"{path.stem}.onnx"
    export_onnx(net, onnx_path, f"checkpoint:{path.name}", cfg.model_dump(mode="json"))
    return onnx_path


def run_comparison(
    onnx_path: Path | None,
    scenarios: list[str],
    seeds: list[int],
    baselines: list[str],
    split: str,
    workers: int,
    progress: bool,
    ray: str | None = None,
    late_binding: bool = False,
) -> dict:
    """`simulator.experiments.compare` of the baselines and the learned ONNX (with `late_binding`, each also behind
    the router's late binding, as `NAME+late`); on the Ray cluster at `ray` when given (trainer/ray_backend.py: the
    ONNX file travels with each task)."""
    from routewise_vllm.simulator.experiments import compare

    policies = list(baselines) + ([str(onnx_path)] if onnx_path is not None else [])
    if ray is None:
        return compare(scenarios, policies, seeds, split=split, workers=workers, progress=progress, late_binding=late_binding)
    from routewise_vllm.trainer.ray_backend import RayExecutor, connect

    with connect(ray, num_cpus=max(1, workers)) as ray_module:
        executor = RayExecutor(ray_module, files=[onnx_path] if onnx_path is not None else [])
        return compare(scenarios, policies, seeds, split=split, progress=progress, executor=executor,
                       late_binding=late_binding)


def _fmt(v: float, ci: float, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if unit == "ms":
        return f"{v * 1000:.0f}±{(ci or 0) * 1000:.0f}ms"
    if unit == "s":
        return f"{v:.2f}±{(ci or 0):.2f}s"
    return f"{v:.3f}±{(ci or 0):.3f}"


def label(policy: str, onnx_path: Path | None) -> str:
    if onnx_path is not None and policy.startswith(str(onnx_path)):
        return LEARNED_LABEL + policy[len(str(onnx_path)):]  # "learned", "learned+late"
    return policy


def format_table(doc: dict, onnx_path: Path | None) -> str:
    head = ("scenario", "policy", "TTFT p50", "TTFT p99", "E2E p99", "goodput", "p99/best", "fallback")
    rows = [head]
    for r in doc["results"]:
        ratio = r["ttft_p99_vs_best_heuristic"]
        rows.append(
            (
                r["scenario"],
                label(r["policy"], onnx_path),
                _fmt(r["ttft_p50_s"], r["ttft_p50_s_ci95"], "ms"),
                _fmt(r["ttft_p99_s"], r["ttft_p99_s_ci95"], "ms"),
                _fmt(r["e2e_p99_s"], r["e2e_p99_s_ci95"], "s"),
                _fmt(r["goodput"], r["goodput_ci95"], ""),
                "nan" if ratio is None or math.isnan(ratio) else f"{ratio:.2f}",
                f"{r.get('fallback_share', 0.0):.1%}",
            )
        )
    return render_table(rows)


def learned_summary(doc: dict, onnx_path: Path) -> list[dict]:
    """Per scenario: the learned policy vs the best heuristic (p99 ratio, goodput difference). In a late-binding
    document (`NAME+late` rows) also the learned policy behind late binding vs the best heuristic behind it (like
    with like) and vs the best per-request heuristic, with goodput against the best heuristic row of either kind."""
    from routewise_vllm.simulator.late_binding import LATE_SUFFIX

    out = []
    by_sc: dict[str, dict[str, dict]] = {}
    for r in doc["results"]:
        by_sc.setdefault(r["scenario"], {})[r["policy"]] = r
    learned = str(onnx_path)

    def best_of(rows: dict[str, dict], suffix: str) -> dict | None:
        heur = [rows[b + suffix] for b in BASELINES if b + suffix in rows and not math.isnan(rows[b + suffix]["ttft_p99_s"])]
        return min(heur, key=lambda r: r["ttft_p99_s"]) if heur else None

    for sc, rows in by_sc.items():
        best, mine = best_of(rows, ""), rows.get(learned)
        if best is None or mine is None:
            continue
        heur_goodput = [r["goodput"] for p, r in rows.items() if p.removesuffix(LATE_SUFFIX) in BASELINES]
        best_goodput = max(r["goodput"] for p, r in rows.items() if p in BASELINES)
        entry = {
            "scenario": sc,
            "best_heuristic": best["policy"],
            "best_heuristic_ttft_p99_s": best["ttft_p99_s"],
            "learned_ttft_p99_s": mine["ttft_p99_s"],
            "ttft_p99_ratio": mine["ttft_p99_vs_best_heuristic"],
            "learned_goodput": mine["goodput"],
            "best_heuristic_goodput": best_goodput,
            "goodput_minus_best": mine["goodput"] - best_goodput,
        }
        best_late, mine_late = best_of(rows, LATE_SUFFIX), rows.get(learned + LATE_SUFFIX)
        if best_late is not None and mine_late is not None:
            entry |= {
                "best_late_heuristic": best_late["policy"],
                "best_late_heuristic_ttft_p99_s": best_late["ttft_p99_s"],
                "learned_late_ttft_p99_s": mine_late["ttft_p99_s"],
                "late_ttft_p99_ratio": mine_late["ttft_p99_s"] / best_late["ttft_p99_s"],
                "late_vs_best_per_request": mine_late["ttft_p99_s"] / best["ttft_p99_s"],
                "learned_late_goodput": mine_late["goodput"],
                "late_goodput_minus_best": mine_late["goodput"] - max(heur_goodput),
            }
        out.append(entry)
    return out


def summary_line(s: dict) -> str:
    """One scenario of learned_summary, for the terminal."""
    line = (f"  {s['scenario']:20s} p99 ratio {s['ttft_p99_ratio']:.3f} (best: {s['best_heuristic']}), "
            f"goodput {s['learned_goodput']:.3f} vs {s['best_heuristic_goodput']:.3f}")
    if "late_ttft_p99_ratio" in s:
        line += (f"; +late {s['late_ttft_p99_ratio']:.3f} of the best late heuristic ({s['best_late_heuristic']}), "
                 f"{s['late_vs_best_per_request']:.3f} of the best per request, goodput {s['learned_late_goodput']:.3f} "
                 f"({s['late_goodput_minus_best']:+.3f} vs the best heuristic row)")
    return line


def plot(doc: dict, onnx_path: Path | None, scenarios: list[str], seed: int, split: str, out_dir: Path, progress: bool) -> list[Path]:
    """TTFT CDF per scenario (seed `seed`) and a p99 TTFT bar chart per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tqdm import tqdm

    from routewise_vllm.router.policy.served import served_policy
    from routewise_vllm.simulator.cluster import simulate
    from routewise_vllm.simulator.late_binding import simulate_late, split_late
    from routewise_vllm.simulator.scenario import load_scenario

    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    policies = sorted({r["policy"] for r in doc["results"]}, key=lambda p: (p.startswith(str(onnx_path)), p))
    n = len(scenarios)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    bar = tqdm(total=n * len(policies), desc="CDF runs", unit="run", disable=not progress)
    for ax, sc_name in zip(axes.flat, scenarios):
        sc = load_scenario(sc_name, split=split)
        cluster, requests = sc.build(np.random.default_rng(seed))
        for p in policies:
            name, late = split_late(p)
            policy = served_policy(name, seed=seed)
            recs = simulate_late(cluster, requests, policy, seed=seed)[0] if late else simulate(cluster, requests, policy, seed=seed)
            ttft = np.sort([r.ttft_s for r in recs if r.tenant != "warmup" and math.isfinite(r.ttft_s)])
            y = np.arange(1, len(ttft) + 1) / max(1, len(ttft))
            lab = label(p, onnx_path)
            ax.plot(ttft, y, label=lab, lw=2.2 if lab.startswith(LEARNED_LABEL) else 1.0)
            bar.update(1)
        ax.set_xscale("log")
        ax.set_ylim(0.9, 1.0)
        ax.set_title(f"{sc_name} (seed {seed}, {split})")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("CDF (tail)")
        ax.grid(alpha=0.3)
    bar.close()
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "ttft_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)

    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, sc_name in zip(axes.flat, scenarios):
        rs = [r for r in doc["results"] if r["scenario"] == sc_name]
        names = [label(r["policy"], onnx_path) for r in rs]
        vals = [r["ttft_p99_s"] for r in rs]
        errs = [r["ttft_p99_s_ci95"] if r["ttft_p99_s_ci95"] is not None and not math.isnan(r["ttft_p99_s_ci95"]) else 0 for r in rs]
        colors = ["tab:red" if nm.startswith(LEARNED_LABEL) else "tab:blue" for nm in names]
        ax.bar(range(len(rs)), vals, yerr=errs, color=colors)
        ax.set_xticks(range(len(rs)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(sc_name)
        ax.set_ylabel("p99 TTFT (s)")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    path = out_dir / "ttft_p99_bars.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)
    return files
