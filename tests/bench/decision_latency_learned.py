"""Decision latency with the learned policy on: FallbackPolicy(OnnxPolicy) + build_features, as the live
router runs it (routing.PolicyRunner), at 16 and 128 replicas, with each executor side by side in one run:
`fastnet` (the compiled fast path, router/policy/fastnet.py, what the router uses when the model carries its
weights and the C extension is built) and `onnxruntime` (model_inputs in numpy + the ONNX graph). Prints
p50/p99 per replica count and a breakdown (view, build_features rows, the executor's part: cross-replica
inputs and network, and the rest of decide: mask, argmax and guards). Targets: p99 <= 100 us at 16
replicas, <= 300 us at 128 (view + decide).

    .venv/bin/python tests/bench/decision_latency_learned.py                    # shipped suite-fleet.onnx if present,
                                                                                # else a same-architecture model
    .venv/bin/python tests/bench/decision_latency_learned.py --model my.onnx
    .venv/bin/python tests/bench/decision_latency_learned.py --from-trainer     # trainer.network.RoutingNet (torch)
    .venv/bin/python tests/bench/decision_latency_learned.py --hidden 32 --layers 1
    .venv/bin/python tests/bench/decision_latency_learned.py --stand-in --arch pooled   # O(replicas) alternative

The stand-in model (tests/serving/onnx_models.attention_model) has the trainer's architecture: per-replica
MLP encoder, `layers` pre-norm cross-replica self-attention blocks, per-replica logit head; random weights.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from routewise_vllm.router.policy import FallbackPolicy, LeastOutstanding, build_features  # noqa: E402
from routewise_vllm.router.policy.features import model_inputs  # noqa: E402
from routewise_vllm.router.policy.onnx_policy import OnnxPolicy  # noqa: E402
from routewise_vllm.router.policy.registry import GATED, served_as  # noqa: E402
from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH  # noqa: E402
from routewise_vllm.router.policy.tracking import ClusterTracker  # noqa: E402
from routewise_vllm.router.policy.types import RequestInfo  # noqa: E402


def make_model(args, tmp: Path) -> tuple[Path, str]:
    if args.model:
        return Path(args.model), f"--model {args.model}"
    if args.from_trainer:
        import torch

        from routewise_vllm.router.policy.features import N_FEATURES
        from routewise_vllm.trainer.config import NetworkConfig
        from routewise_vllm.trainer.export import export_onnx
        from routewise_vllm.trainer.network import RoutingNet

        torch.manual_seed(0)
        cfg = NetworkConfig(hidden=args.hidden, heads=args.heads, layers=args.layers)
        path = export_onnx(RoutingNet(N_FEATURES, cfg), tmp / "trainer.onnx", "bench", {"network": cfg.model_dump()})
        return path, f"trainer.network.RoutingNet hidden={args.hidden} heads={args.heads} layers={args.layers} (random init)"
    if DEFAULT_MODEL_PATH.is_file() and not args.stand_in:
        return DEFAULT_MODEL_PATH, f"shipped {DEFAULT_MODEL_PATH.relative_to(ROOT)}"
    from tests.serving.onnx_models import attention_model, pooled_model

    if args.arch == "pooled":
        path = pooled_model(tmp / "stand_in.onnx", hidden=args.hidden, layers=args.layers)
        return path, f"stand-in pooled-context (DeepSets, O(replicas)) model hidden={args.hidden} layers={args.layers}"
    path = attention_model(tmp / "stand_in.onnx", hidden=args.hidden, heads=args.heads, layers=args.layers)
    return path, f"stand-in onnx.helper model hidden={args.hidden} heads={args.heads} layers={args.layers}"


def busy_cluster(n: int, rng: np.random.Generator) -> ClusterTracker:
    """n replicas in a plausible busy state: scraped stats, EMAs, in-flight requests, a warm prefix index."""
    cluster = ClusterTracker([f"10.0.{i // 250}.{i % 250}:8000" for i in range(n)])
    for i, t in enumerate(cluster.trackers):
        t.on_scrape(0.0, int(rng.integers(0, 8)), int(rng.integers(1, 32)), float(rng.uniform(0.1, 0.9)), 262_144)
        for k in range(int(rng.integers(0, 12))):
            cluster.dispatch(i, RequestInfo(f"warm-{i}-{k}", int(rng.integers(50, 3000)), 256,
                                            tuple(int(x) for x in rng.integers(0, 50, 4))))
        t.on_first_token(f"warm-{i}-0", float(rng.uniform(0.05, 0.5)))
        t.on_complete(f"warm-{i}-0", float(rng.uniform(0.01, 0.05)))
    return cluster


def percentiles(samples_ns: list[int]) -> tuple[float, float, float]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.mean())


def bench(model: Path, n: int, iters: int, budget_s: float, seed: int, fast: bool | None, idle_s: float = 0.0,
          gated: bool = False) -> dict:
    """fast: the learned policy on fastnet (True) or onnxruntime (False), or least-outstanding (None, no breakdown)."""
    rng = np.random.default_rng(seed)
    cluster = busy_cluster(n, rng)
    # no budget here, so every decision is the model's: the share over `budget_s` is counted instead
    # (the router stops asking a model whose rolling median is over budget: docs/decision-budget.md)
    primary = LeastOutstanding(seed=2) if fast is None else OnnxPolicy(model, fast=fast)
    model_policy = primary
    if gated and fast is not None:  # the default policy: the model behind its gate (router/policy/gated.py)
        primary = served_as(GATED, primary)
    policy = FallbackPolicy(primary, LeastOutstanding(seed=1), clock=time.perf_counter,
                            max_stats_age_s=10.0, overload_margin=32)
    if fast is None:
        executor = "least-outstanding"
    else:
        if model_policy.load_error is not None:
            raise SystemExit(f"model did not load: {model_policy.load_error}")
        executor = model_policy.describe()["executor"] + ("+gate" if gated else "")
        if fast and not executor.startswith("fastnet"):
            return {"skipped": model_policy.executor_note}
        session = model_policy._session
    requests = [RequestInfo(f"q{i}", int(rng.integers(50, 4000)), int(rng.integers(16, 512)),
                            tuple(int(x) for x in rng.integers(0, 50, int(rng.integers(0, 12))))) for i in range(256)]
    views = [cluster.view(1.0, r) for r in requests]
    decide, view_t, feat_t, cross_t, ort_t, total = [], [], [], [], [], []
    fallbacks: dict[str, int] = {}
    clock = time.perf_counter_ns
    for i in range(iters + 200):  # 200 warm-up decisions
        req = requests[i % 256]
        if idle_s:
            time.sleep(idle_s)
        t0 = clock()
        view = cluster.view(1.0, req)
        t1 = clock()
        d = policy.decide(view, req)
        t2 = clock()
        if fast is None:
            if i >= 200:
                view_t.append(t1 - t0)
                decide.append(t2 - t1)
                total.append(t2 - t0)
            continue
        feats = build_features(view, req)
        t3 = clock()
        if fast:  # the executor's whole part (cross-replica inputs + network) in one call
            t4 = t3
            model_policy._fast.logits(feats)
            t5 = clock()
        else:
            mask = np.ascontiguousarray(feats[None, :, 1])  # the `healthy` column, as OnnxPolicy takes it
            inputs = model_inputs(feats[None], mask)
            t4 = clock()
            session.run(["logits"], {"features": inputs, "mask": mask})
            t5 = clock()
        if i >= 200:
            view_t.append(t1 - t0)
            decide.append(t2 - t1)
            total.append(t2 - t0)
            feat_t.append(t3 - t2)
            cross_t.append(t4 - t3)
            ort_t.append(t5 - t4)
            if d.fallback_reason:
                fallbacks[d.fallback_reason] = fallbacks.get(d.fallback_reason, 0) + 1
            if d.elapsed_s is not None and d.elapsed_s > budget_s:
                fallbacks["over budget"] = fallbacks.get("over budget", 0) + 1
    del views
    if fast is None:
        return {"n": n, "executor": executor, "decide": percentiles(decide), "view": percentiles(view_t),
                "total": percentiles(total), "fallbacks": fallbacks, "iters": iters}
    rest = np.asarray(decide) - np.asarray(feat_t) - np.asarray(cross_t) - np.asarray(ort_t)
    return {"n": n, "executor": executor, "decide": percentiles(decide), "view": percentiles(view_t), "features": percentiles(feat_t),
            "cross": percentiles(cross_t), "onnxruntime": percentiles(ort_t), "total": percentiles(total),
            "rest_p50": float(np.percentile(rest, 50)) / 1e3, "fallbacks": fallbacks, "iters": iters}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an .onnx file in the router's contract")
    p.add_argument("--from-trainer", action="store_true", help="export trainer.network.RoutingNet (needs torch)")
    p.add_argument("--stand-in", action="store_true", help="use the onnx.helper stand-in even if suite-fleet.onnx exists")
    p.add_argument("--arch", choices=["attention", "pooled"], default="attention",
                   help="stand-in architecture: the trainer's self-attention, or an O(replicas) pooled-context block")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--replicas", default="16,128", help="comma-separated replica counts")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--budget-us", type=float, default=500.0, help="FallbackPolicy budget (router default 500 us)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--executor", choices=["both", "fastnet", "onnxruntime"], default="both",
                   help="which executor(s) to time (both: side by side, interleaved per replica count)")
    p.add_argument("--idle-ms", type=float, default=0.0,
                   help="sleep this long before each decision, untimed: a live router at 50 req/s idles ~20 ms "
                        "between requests, and on a shared host its caches go cold meanwhile (try --idle-ms 20 "
                        "--iters 500); adds a least-outstanding row, the same decision path without the model")
    p.add_argument("--gated", action="store_true",
                   help="also time each executor behind the gate (`gated`, the default policy), side by side")
    args = p.parse_args()
    executors: tuple[bool | None, ...] = {"both": (True, False), "fastnet": (True,), "onnxruntime": (False,)}[args.executor]
    if args.idle_ms:
        executors += (None,)
    with tempfile.TemporaryDirectory() as tmp:
        model, what = make_model(args, Path(tmp))
        print(f"model: {what}")
        print(f"{args.iters} decisions per replica count after 200 warm-up; times in microseconds; "
              f"budget {args.budget_us:.0f} us; 1 onnxruntime thread"
              + (f"; {args.idle_ms:g} ms idle before each decision" if args.idle_ms else ""))
        print(f"{'replicas':>8} {'executor':>11} | {'view+decide p50':>15} {'p99':>7} | {'decide p50':>10} {'p99':>7} | "
              f"{'view p50':>8} | {'rows p50':>8} | {'cross p50':>9} | {'net p50':>7} {'p99':>7} | {'rest p50':>8} | "
              "fallbacks / over budget")
        gc.collect()
        for n in (int(x) for x in args.replicas.split(",")):
            for fast, gated in [(f, g) for f in executors for g in ((False, True) if args.gated and f is not None else (False,))]:
                r = bench(model, n, args.iters, args.budget_us / 1e6, args.seed, fast, args.idle_ms / 1e3, gated)
                if "skipped" in r:
                    print(f"{n:>8} {'fastnet':>11} | not timed: {r['skipped']}")
                    continue
                t, d, v = r["total"], r["decide"], r["view"]
                if fast is None:
                    print(f"{n:>8} {'least-out':>11} | {t[0]:>15.1f} {t[1]:>7.1f} | {d[0]:>10.1f} {d[1]:>7.1f} | {v[0]:>8.1f} |")
                    continue
                f, c, o = r["features"], r["cross"], r["onnxruntime"]
                fb = ", ".join(f"{k} {c / r['iters']:.1%}" for k, c in r["fallbacks"].items()) or "none"
                cross = f"{c[0]:>9.1f}" if not fast else f"{'(in net)':>9}"
                print(f"{n:>8} {r['executor']:>11} | {t[0]:>15.1f} {t[1]:>7.1f} | {d[0]:>10.1f} {d[1]:>7.1f} | {v[0]:>8.1f} | "
                      f"{f[0]:>8.1f} | {cross} | {o[0]:>7.1f} {o[1]:>7.1f} | {r['rest_p50']:>8.1f} | {fb}")
    print("decide = FallbackPolicy.decide (rows + cross + net + rest), the router's decision latency minus the view; "
          "view = ClusterTracker.view (snapshots + prefix match), paid once per request; rows = build_features; "
          "cross = model_inputs (numpy; fastnet computes it inside its one call); net = onnxruntime's run, or "
          "fastnet's whole call; rest = decide - rows - cross - net (mask, argmax, guards); the breakdown columns "
          "are timed in separate calls after each decision"
          + (", warm: with --idle-ms, `rest` also carries the decision's cold-cache penalty." if args.idle_ms else "."))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
