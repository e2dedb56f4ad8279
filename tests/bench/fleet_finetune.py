"""Learning from the fleet on real vLLM CPU servers: fine-tuned vs shipped learned vs heuristics.

    .venv/bin/python tests/bench/fleet_finetune.py [--fleet capacity|slow-roomy|deep-roomy] [--rate 8] [--train-s 240]
        [--segment-s 60] [--repeats 4] [--epochs 4] [--min-steps 0] [--also-quantile none] [--also-epochs 40]
        [--also-min-steps 0] [--also-model router/policy/models/any-fleet.onnx]
        [--keep DIR]

Two real vLLM servers (tiny model, one core each). `--fleet capacity` (default) is the e2e fleet (fleet/vllm.py
FLEET_ARGS): SMALL has 4 sequence slots and a 2 MB KV cache (it queues and preempts), ROOMY 16 slots and 16 MB.
`--fleet slow-roomy` (SLOW_ROOMY_FLEET_ARGS) gives ROOMY a model 6x as deep, so the roomier replica is the
slower one: a fleet the shipped policy's simulator prior gets wrong (its roomier GPUs were its faster ones).
`--fleet deep-roomy` (DEEP_ROOMY_FLEET_ARGS) makes it 24x as deep: about 8x slower decode, like an L4 beside an H100.
1. Segment A (earlier traffic) goes through the router with the shipped learned policy, the
   decision log on and a bounded exploration share (`ab_explore_share`, default 0.2: the router's
   answer to bandit feedback); `trainer finetune` fits on that log (its newest 20 % held out; the 0.9 quantile
   of log TTFT, its default); `--also-quantile Q|none`, `--also-epochs N` and/or `--also-min-steps S` fit a
   second model of the same log (`trainer finetune --quantile Q --epochs N --min-steps S`).
2. Segment B (later traffic: the same generator, another seed) is replayed, with the same arrivals,
   prompts and lengths, through a fresh router for each policy: least-outstanding, expected-wait,
   the shipped learned policy, and the fine-tuned one(s); `--repeats N` replays it N times, each policy
   first in turn, and pools the repeats. Printed: p50/p99 TTFT per policy (client side, streamed, first SSE
   event) with the p99's 95 % bootstrap interval and each repeat's p99, the share of requests sent to SMALL
   (from each router's decision log), and the prediction error on segment B's own decision log (unseen by
   the fit) before (shipped) and after (fine-tuned).
Requests: streamed completions with `ignore_eos`, Poisson arrivals, prompts of 10-150 words
(lognormal; the longest with 160 output tokens still fit the servers' 1024-token context), 16-160 output tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from routewise_vllm.fleet.fidelity_report import interval95, p99_bootstrap, rotated  # noqa: E402
from routewise_vllm.fleet.router_process import start_router  # noqa: E402
from routewise_vllm.fleet.vllm import (  # noqa: E402
    DEEP_ROOMY_FLEET_ARGS, FLEET_ARGS, SERVED_MODEL_NAME, SLOW_ROOMY_FLEET_ARGS, SMALL, ensure_tiny_model, start_servers, stop_servers, vllm_python,
)
from routewise_vllm.trainer.finetune import FinetuneConfig, finetune  # noqa: E402
from routewise_vllm.trainer.fleet_cli import parse_quantile  # noqa: E402

FLEETS = {"capacity": FLEET_ARGS, "slow-roomy": SLOW_ROOMY_FLEET_ARGS, "deep-roomy": DEEP_ROOMY_FLEET_ARGS}

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def segment(seed: int, duration_s: float, rate: float) -> list[dict]:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s:
            return out
        n_words = int(np.clip(rng.lognormal(np.log(60), 0.7), 10, 150))  # < max-model-len 1024 with the output
        prompt = " ".join(rng.choice(WORDS, n_words))
        out.append({"at_s": t, "prompt": prompt, "max_tokens": int(rng.integers(16, 161)), "key": f"u{len(out)}"})


async def replay(base_url: str, requests: list[dict]) -> list[float | None]:
    import aiohttp

    async def one(session, r) -> float | None:
        await asyncio.sleep(max(0.0, r["at_s"] - (time.monotonic() - t0)))
        start = time.monotonic()
        body = {"model": SERVED_MODEL_NAME, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "stream": True,
                "ignore_eos": True}
        try:
            async with session.post(f"{base_url}/v1/completions", json=body, headers={"x-routewise-key": r["key"]}) as resp:
                if resp.status != 200:
                    await resp.read()
                    return None
                ttft = None
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data:"):
                        ttft = time.monotonic() - start
                return ttft
        except aiohttp.ClientError:
            return None

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic()
        return await asyncio.gather(*(one(session, r) for r in requests))


def run_policy(urls: list[str], policy: str, requests: list[dict], work: Path, log_dir: Path | None,
               explore_share: float = 0.0) -> list[float | None]:
    env = {"ROUTEWISE_DECISION_LOG_DIR": str(log_dir)} if log_dir is not None else {}
    if explore_share > 0:  # every request in the treatment arm (the same model), a bounded share explored
        env |= {"ROUTEWISE_AB_TREATMENT": policy, "ROUTEWISE_AB_SHARE": "1.0", "ROUTEWISE_AB_AUTO_PROMOTE": "true",
                "ROUTEWISE_AB_EXPLORE_SHARE": str(explore_share)}
    router = start_router(urls, policy, work / "router-logs", scrape_interval_s=0.2, env=env)
    try:
        return asyncio.run(replay(router.base_url, requests))
    finally:
        router.stop()


def errors_on(log_dir: Path, models: dict[str, Path], pair_window_s: float = 0.5) -> dict[str, dict]:
    """Prediction error of each model on a decision log it was not fitted on (c from the first half)."""
    from routewise_vllm.trainer.finetune import all_logits, calibrate, load_init_model, prediction_errors, split
    from routewise_vllm.trainer.fleet_log import read_fleet_log

    data = read_fleet_log(log_dir)
    fit_c, held = split(data, 0.5)
    out = {}
    for name, path in models.items():
        net, _ = load_init_model(path)
        c = calibrate(all_logits(net, fit_c), fit_c)
        out[name] = prediction_errors(all_logits(net, held), c, held, pair_window_s)
    return out


def error_floor(log_dir: Path) -> dict[str, float]:
    """Yardsticks for the MAE of log TTFT on the second half of a log (trainer.finetune.baseline_errors fitted on
    its first half): a constant, and a ridge regression on the chosen replica's features fitted on the same
    traffic the errors are measured on. What the features cannot explain (scheduling jitter on a shared CPU)
    stays in both, so no fine-tune can be expected to go much below the ridge's figure on that traffic."""
    from routewise_vllm.trainer.finetune import baseline_errors, split
    from routewise_vllm.trainer.fleet_log import read_fleet_log

    b = baseline_errors(*split(read_fleet_log(log_dir), 0.5))
    return {"constant": b["constant"], "ridge_on_same_traffic": b["ridge_chosen_replica"]}


def share_on(log_dir: Path, replica: str) -> float:
    """The share of first attempts the router sent to `replica` (host:port), from its decision log."""
    picks = [rec["replica"] for path in sorted(log_dir.rglob("*.jsonl")) for line in path.read_text().splitlines()
             if (rec := json.loads(line)).get("attempt") == 0]
    return sum(p == replica for p in picks) / max(1, len(picks))


def pct(xs: list[float | None], q: float) -> float:
    ok = [x for x in xs if x is not None]
    return float(np.percentile(ok, q)) if ok else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segment-s", type=float, default=60.0, help="length of the replayed segment B (default 60 s)")
    ap.add_argument("--train-s", type=float, default=120.0, help="length of the earlier segment A (default 120 s)")
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s (default 4)")
    ap.add_argument("--explore", type=float, default=0.2, help="exploration share while segment A is logged (default 0.2)")
    ap.add_argument("--epochs", type=int, default=FinetuneConfig.epochs,
                    help=f"trainer finetune --epochs (default {FinetuneConfig.epochs}, as the command)")
    ap.add_argument("--min-steps", type=int, default=FinetuneConfig.min_steps,
                    help=f"trainer finetune --min-steps, both fits (default {FinetuneConfig.min_steps})")
    ap.add_argument("--repeats", type=int, default=1,
                    help="replay segment B this many times per policy, each policy first in turn; figures pool the "
                         "repeats (default 1)")
    ap.add_argument("--fleet", choices=sorted(FLEETS), default="capacity",
                    help="capacity: SMALL (4 slots, 2 MB KV) and ROOMY (16, 16 MB); slow-roomy: the same, ROOMY running "
                         "a 6x deeper model, so the roomier replica is the slower one; deep-roomy: 24x deeper, ~8x slower decode "
                         "(default capacity)")
    ap.add_argument("--also-quantile", default="off",
                    help="also fit a model with `trainer finetune --quantile` this value (a number, or none: the middle, "
                         "Huber) and replay it too (default off)")
    ap.add_argument("--also-epochs", type=int,
                    help="the second fit (--also-quantile's, or the default quantile's) with this many epochs instead "
                         "of --epochs")
    ap.add_argument("--also-min-steps", type=int, help="the second fit with this --min-steps instead of --min-steps")
    ap.add_argument("--also-model", type=Path, action="append", default=[],
                    help="also replay this .onnx model as it is on segment B, e.g. router/policy/models/any-fleet.onnx "
                         "(repeatable; its prediction error on segment B's log is printed too)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", type=Path, help="copy the decision logs and the fine-tuned model here (to refit offline)")
    args = ap.parse_args()
    for extra in args.also_model:
        if not extra.is_file():
            ap.error(f"--also-model: no such file {extra}")
    python = vllm_python()
    if python is None:
        print("no vLLM venv (.venv-vllm or ROUTEWISE_VLLM_PYTHON)", file=sys.stderr)
        return 2

    shipped = REPO / "router" / "policy" / "models" / "suite-fleet.onnx"
    work = Path(tempfile.mkdtemp(prefix="routewise-fleet-ft-"))
    seg_a = segment(1, args.train_s, args.rate)
    seg_b = segment(2, args.segment_s, args.rate)
    servers = start_servers(2, ensure_tiny_model(work / "model", python), python, work, extra_args=FLEETS[args.fleet])
    try:
        urls = [s.base_url for s in servers]
        t = time.perf_counter()
        ttft_a = run_policy(urls, str(shipped), seg_a, work, work / "log-a", args.explore)
        print(f"segment A: {len(seg_a)} requests through the shipped policy ({args.explore:.0%} explored) "
              f"in {time.perf_counter() - t:.0f}s "
              f"({sum(x is None for x in ttft_a)} failed)", flush=True)
        report = finetune(work / "log-a", shipped, work / "finetuned.onnx",
                          FinetuneConfig(epochs=args.epochs, min_steps=args.min_steps))
        print(report.summary(), flush=True)
        results = {}
        policies = {"least-outstanding": "least-outstanding", "expected-wait": "expected-wait",
                    "learned (shipped)": str(shipped), "learned (fine-tuned)": str(work / "finetuned.onnx")}
        models = {"shipped": shipped, "fine-tuned": work / "finetuned.onnx"}
        if args.also_quantile != "off" or args.also_epochs is not None or args.also_min_steps is not None:  # a 2nd fit
            q = FinetuneConfig.quantile if args.also_quantile == "off" else parse_quantile(args.also_quantile)
            epochs = args.epochs if args.also_epochs is None else args.also_epochs
            min_steps = args.min_steps if args.also_min_steps is None else args.also_min_steps
            name = ("fine-tuned middle" if q is None else f"fine-tuned q{q:g}") + f" e{epochs} s{min_steps}"
            models[name] = work / "finetuned-quantile.onnx"
            report_q = finetune(work / "log-a", shipped, models[name],
                                FinetuneConfig(epochs=epochs, min_steps=min_steps, quantile=q))
            print(f"{name}: {report_q.summary()}", flush=True)
            policies[f"learned ({name})"] = str(models[name])
        for extra in args.also_model:  # another prior, not fitted to this fleet
            models[extra.stem] = extra
            policies[f"learned ({extra.stem})"] = str(extra)
        small = urls[SMALL].split("//", 1)[1]
        log_dirs = {name: work / ("log-b-shipped" if name == "learned (shipped)" else f"log-b-{k}")
                    for k, name in enumerate(policies)}
        pooled: dict[str, list[float | None]] = {name: [] for name in policies}
        per_repeat: dict[str, list[float]] = {name: [] for name in policies}
        for repeat in range(args.repeats):  # the same segment again, each policy first in turn
            for name in rotated(list(policies), repeat):
                ttfts = run_policy(urls, policies[name], seg_b, work, log_dirs[name])
                pooled[name] += ttfts
                per_repeat[name].append(pct(ttfts, 99))
                print(f"  [{repeat + 1}/{args.repeats}] {name:26s} p50 {pct(ttfts, 50) * 1e3:7.1f} ms  "
                      f"p99 {pct(ttfts, 99) * 1e3:7.1f} ms  failed {sum(x is None for x in ttfts)}", flush=True)
        for name, ttfts in pooled.items():
            (boot,) = p99_bootstrap([[x for x in ttfts if x is not None]])
            results[name] = {"p50_s": pct(ttfts, 50), "p99_s": pct(ttfts, 99), "failed": sum(x is None for x in ttfts),
                             "p99_ci95_s": interval95(boot), "p99_per_repeat_s": per_repeat[name],
                             "share_small": share_on(log_dirs[name], small)}
        unseen = errors_on(work / "log-b-shipped", models)
        floor = error_floor(work / "log-b-shipped")
    finally:
        stop_servers(servers)
    best_h = min(results["least-outstanding"]["p99_s"], results["expected-wait"]["p99_s"])
    ft, sh = results["learned (fine-tuned)"]["p99_s"], results["learned (shipped)"]["p99_s"]
    print(f"\nsegment B ({len(seg_b)} requests, {args.rate}/s for {args.segment_s:.0f}s, x{args.repeats} pooled), "
          f"TTFT per policy (p99 95 % interval; p99 of each repeat):")
    for name, r in results.items():
        ci = r["p99_ci95_s"]  # None when no request of that policy succeeded
        print(f"  {name:26s} p50 {r['p50_s'] * 1e3:7.1f} ms   p99 {r['p99_s'] * 1e3:7.1f} ms "
              + ("[-]" if ci is None else f"[{ci[0] * 1e3:.0f}, {ci[1] * 1e3:.0f}]")
              + f"   failed {r['failed']}   to SMALL {r['share_small']:.0%}   "
              + " / ".join(f"{x * 1e3:.0f}" for x in r["p99_per_repeat_s"]))
    print(f"fine-tuned p99 < shipped p99: {ft < sh} ({ft * 1e3:.1f} vs {sh * 1e3:.1f} ms); "
          f"<= best heuristic p99: {ft <= best_h} ({best_h * 1e3:.1f} ms)")
    ft_ci, sh_ci = results["learned (fine-tuned)"]["p99_ci95_s"], results["learned (shipped)"]["p99_ci95_s"]
    apart = ft_ci is not None and sh_ci is not None and (ft_ci[1] < sh_ci[0] or sh_ci[1] < ft_ci[0])
    print("  [the p99s' 95 % bootstrap intervals, requests resampled; a lower bound on the noise: fine-tuned vs shipped "
          f"{'do not overlap' if apart else 'overlap (or one is undefined)'}]")
    print(f"prediction error, segment A held-out 20 %: MAE log TTFT {report.before['mae_log_ttft']:.4f} -> "
          f"{report.after['mae_log_ttft']:.4f}")
    for name, e in unseen.items():
        print(f"prediction error on segment B's log (unseen), {name}: MAE log TTFT {e['mae_log_ttft']:.4f}, "
              f"pair order accuracy {e['pair_order_accuracy']} ({e['pairs']} pairs)")
    ratio = unseen["fine-tuned"]["mae_log_ttft"] / unseen["shipped"]["mae_log_ttft"]
    print(f"error ratio fine-tuned / shipped on unseen traffic: {ratio:.2f} (target <= 0.5)")
    print(f"yardsticks on the same half of segment B's log: a constant predicts with MAE {floor['constant']:.4f}, a ridge "
          f"regression fitted on the other half of that very log {floor['ridge_on_same_traffic']:.4f} (about the floor "
          f"for any model of these features on this traffic: "
          f"{floor['ridge_on_same_traffic'] / unseen['shipped']['mae_log_ttft']:.2f} x shipped's error)")
    if args.json:
        print(json.dumps({"results": results, "finetune": {"before": report.before, "after": report.after},
                          "unseen": unseen, "unseen_yardsticks": floor}, indent=2))
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        for name in ("log-a", "log-b-shipped", "finetuned.onnx", "finetuned-quantile.onnx"):
            src, dst = work / name, args.keep / name
            if src.is_dir():
                shutil.copytree(src, dst, dirs_exist_ok=True)
            elif src.exists():
                shutil.copy2(src, dst)
        print(f"decision logs and fine-tuned model kept in {args.keep}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
