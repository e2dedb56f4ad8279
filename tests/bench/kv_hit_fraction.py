r"""vLLM's own prefix-cache hit fraction and the client's TTFT behind the router, per arm (a policy and its flags):
the product's default, least-outstanding, prefix-aware (on the router's guess or on the replicas' KV events), gated,
and the peers' algorithms (llm-d, llm-d-blend, dynamo-kv).

Two real vLLM CPU servers (the tiny model, 16 MiB of KV each, block size 32, one core each), KV events on
(`--kv-events-config`, a wildcard endpoint each), `--requests` completions of `system prompt + a short question`
(12 system prompts of ~400 words, ~950 tokens a request, 8 tokens out), 4 at a time. The hit fraction is vLLM's
(`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, both servers, over the arm). Every arm starts from
the same cache state: a fresh router and system prompts of its own (seed `--seed` + the arm's position), so no arm
finds its prompts cached, and the earlier arms' blocks are the oldest in the servers' caches, evicted first, as free
blocks would be; a short warm-up (unrelated prompts, straight to each server) runs before the first arm so that it
does not pay the servers' first requests. The TTFT is the client's (requests streamed: time to the first chunk
with text); p50, p90 and p99 (nearest rank) are printed per arm, with the requests, the failures and the wall time.

Arms (every one on KV events, the default, unless it says `--kv-events off`):
    default        `router serve` with no --policy: exactly what an operator gets (`gated` behind late binding)
    default-events-only   the default with --kv-events-inflight-s 0 (blocks just sent not counted as cached)
    gated-cache    --policy gated:cache-fleet (the gate around cache-fleet, behind late binding)
    learned        `--policy learned`: the model alone, behind late binding (the default before the gate)
    gated          --policy gated --no-late-binding (the gate, routing every request at once)
    lo             --policy least-outstanding --kv-events off
    prefix-aware   --policy prefix-aware (after SGLang's cache-aware router); `events` is the same arm
    guess          --policy prefix-aware --kv-events off
    llm-d, llm-d-blend, dynamo-kv   --policy NAME (the peers' algorithms, docs/peers.md)
    guess-two-routers, events-two-routers   two routers of that arm (no Redis, no shared state: each subscribes to
                   both replicas' events on its own), the requests sent to them in turn, so each router's guess sees
                   half the traffic while the events show both halves

    flock /tmp/vllm.lock .venv/bin/python tests/bench/kv_hit_fraction.py [--requests 96] [--seed 0] \
        [--arms lo,prefix-aware,llm-d,llm-d-blend,dynamo-kv,gated,default] [--tokenizer] [--json FILE]
    # where the cache decides: ~1,900-token prompts, which no longer all fit one server's cache (docs/fidelity.md)
    flock /tmp/vllm.lock .venv/bin/python tests/bench/kv_hit_fraction.py --words 800 --requests 1000 \
        --arms default,lo,prefix-aware,lo,prefix-aware,default,prefix-aware,default,lo

Needs the vLLM venv (scripts/install-vllm.sh or ROUTEWISE_VLLM_PYTHON). Run time on 2 cores shared with other
jobs (load average 2-8): the servers' start (about 60 s) plus, per arm, 2-3 s of router start and 25-50 ms a
request (200 requests: 4-9 s); seven arms of 200 requests 130 s in all, of 1,000 requests 340 s. `--tokenizer`:
every router tokenizes with the model's own tokenizer, as several routers need (docs/multi-router.md). `--json FILE`:
every arm's figures, its `router serve` flags, its sorted TTFTs and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from routewise_vllm.router.policy.registry import DEFAULT_POLICY  # noqa: E402
from routewise_vllm.fleet.vllm import ensure_tiny_model, free_ports, start_servers, stop_servers, vllm_python  # noqa: E402

# arm -> (the policy the router runs, `router serve` flags); NO_POLICY_FLAG arms pass no --policy at all
ARMS = {
    "default": (DEFAULT_POLICY, []),  # no --policy: what an operator gets
    "default-events-only": (DEFAULT_POLICY, ["--kv-events-inflight-s", "0"]),  # lately sent blocks not counted
    "learned": ("learned", []),
    "gated-cache": ("gated:cache-fleet", []),  # the gate around the model trained for the cache
    "gated": ("gated", ["--no-late-binding"]),
    "lo": ("least-outstanding", ["--kv-events", "off"]),
    "prefix-aware": ("prefix-aware", []),
    "llm-d": ("llm-d", []),
    "llm-d-blend": ("llm-d-blend", []),
    "dynamo-kv": ("dynamo-kv", []),
    "guess": ("prefix-aware", ["--kv-events", "off"]),
    "events": ("prefix-aware", []),
    "guess-two-routers": ("prefix-aware", ["--kv-events", "off"]),
    "events-two-routers": ("prefix-aware", []),
}
NO_POLICY_FLAG = {"default", "default-events-only"}
TWO_ROUTERS = "-two-routers"
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "qu", "ex", "th", "sh", "ing", "ed", "er"]


def system_prompts(seed: int, n: int = 12, words: int = 400) -> list[str]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))) for _ in range(300)]
    return [f"System {seed}-{i}: " + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(n)]


def vllm_counters(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def router_metric(port: int, prefix: str) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [line for line in text.splitlines() if line.startswith(prefix)]


async def drive(ports: list[int], prompts: list[str], n: int, concurrency: int, seed: int,
                errors: list[str] | None = None) -> list[float]:
    """Send the arm's requests (request k to router k mod len(ports)); returns each answered request's TTFT
    (seconds). A failed request is appended to `errors` when given (raised otherwise) and has no TTFT."""
    rng = random.Random(seed)
    order = [i % len(prompts) for i in range(n)]
    rng.shuffle(order)
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    async with aiohttp.ClientSession() as s:
        async def one(k: int, p: int) -> None:
            body = {"model": "tiny", "prompt": prompts[p] + f"\nQuestion {k}: which replica?", "max_tokens": 8,
                    "ignore_eos": True, "stream": True}
            port = ports[k % len(ports)]
            async with sem:
                t0 = time.perf_counter()
                try:
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                        if r.status != 200:
                            raise RuntimeError(f"request {k}: {r.status}: {(await r.text())[:200]}")
                        first = None
                        async for line in r.content:
                            if (first is None and line.startswith(b"data: {")
                                    and b'"text":""' not in line.replace(b" ", b"")):
                                first = time.perf_counter() - t0
                        ttfts.append(first if first is not None else time.perf_counter() - t0)
                except (RuntimeError, aiohttp.ClientError) as e:
                    if errors is None:
                        raise
                    errors.append(str(e) or type(e).__name__)

        await asyncio.gather(*(one(k, p) for k, p in enumerate(order)))
    return ttfts


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it (p99 of 200: the 198th)."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q * len(ranked)) - 1)] if ranked else float("nan")


def router_flags(arm: str) -> list[str]:
    """The arm's `router serve` flags past the replicas (the default arm: none)."""
    policy, flags = ARMS[arm]
    return ([] if arm in NO_POLICY_FLAG else ["--policy", policy]) + flags


def start_router(urls: list[str], flags: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_ports(1)[0]
    args = [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(port),
            *(a for u in urls for a in ("--replica", u)), *flags]
    proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"router did not get ready: {log.read_text()[-2000:]}")


def warm_up(urls: list[str], n: int, words: int) -> None:
    """A few requests straight to each server, on prompts no arm uses, so the first arm does not pay the servers'
    first requests (their blocks are then the oldest in the caches, evicted first)."""
    if n <= 0:
        return
    prompts = system_prompts(-1, n=2, words=words)
    for url in urls:
        port = int(url.rsplit(":", 1)[1])
        asyncio.run(drive([port], prompts, n, 2, -1))


def print_router_kv(ports: list[int]) -> None:
    for i, port in enumerate(ports):
        lines = [line for line in router_metric(port, "llm_router_kv_")
                 if "BlockStored" in line or "view_blocks" in line or "fresh" in line
                 or ("ignored" in line and not line.endswith(" 0.0"))]
        lines += router_metric(port, "llm_router_prefix_match_source_total")
        lines += router_metric(port, "llm_router_tokenize_seconds_count")
        lines += router_metric(port, "llm_router_prompt_blocks_total")
        for line in lines:
            print(f"   router {i}:", line)


def run_arm(arm: str, seed: int, urls: list[str], model: Path, work: Path, args: argparse.Namespace) -> dict:
    """One arm on its own router(s) and prompts; its figures."""
    flags = router_flags(arm) + args.router_args.split() + (["--tokenizer", str(model)] if args.tokenizer else [])
    routers = [start_router(urls, flags, work / f"router-{seed}-{arm}-{i}.log")
               for i in range(2 if arm.endswith(TWO_ROUTERS) else 1)]
    ports = [port for _, port in routers]
    try:
        time.sleep(1.0)  # the subscriptions connect
        before = [vllm_counters(u) for u in urls]
        errors: list[str] = []
        t = time.monotonic()
        ttfts = asyncio.run(drive(ports, system_prompts(seed, words=args.words), args.requests, args.concurrency,
                                  seed, errors))
        wall = time.monotonic() - t
        after = [vllm_counters(u) for u in urls]
        if arm.startswith("events") or (args.router_metrics and "--kv-events" not in flags):
            print_router_kv(ports)
    finally:
        for i, (router, _) in enumerate(routers):
            router.terminate()
            router.wait(10)
            if os.environ.get("KV_BENCH_SHOW_LOG"):
                print((work / f"router-{seed}-{arm}-{i}.log").read_text()[-3000:])
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return {
        "arm": arm, "policy": ARMS[arm][0], "router_flags": flags, "routers": len(ports), "seed": seed,
        "hit_fraction": round(hits / queries, 4) if queries else None, "hit_tokens": hits, "query_tokens": queries,
        "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1) if ttfts else None,
        "ttft_p90_ms": round(percentile(ttfts, 0.90) * 1e3, 1) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 0.99) * 1e3, 1) if ttfts else None,
        "requests": args.requests, "answered": len(ttfts), "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 1), "ttfts_ms": [round(x * 1e3, 1) for x in sorted(ttfts)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--arms", default="lo,guess,events", help="comma-separated, run in this order; an arm named "
                    "twice runs twice, each time on prompts of its own")
    ap.add_argument("--seed", type=int, default=0, help="the arm at position i (from 1) has prompts and request order "
                    "of seed + i")
    ap.add_argument("--words", type=int, default=400, help="words per system prompt (~2.4 tokens each); 800 makes the "
                    "twelve prompts outgrow one server's 16 MiB cache, so routing decides the hit fraction")
    ap.add_argument("--kv-bytes", default="16M")
    ap.add_argument("--warmup", type=int, default=8, help="requests straight to each server before the first arm")
    ap.add_argument("--router-args", default="", help="more `router serve` flags for every arm")
    ap.add_argument("--router-metrics", action="store_true", help="print the router KV metrics of every arm on KV "
                    "events (the events arms always print them)")
    ap.add_argument("--tokenizer", action="store_true", help="every router tokenizes with the tiny model's own "
                    "tokenizer (`--tokenizer DIR`) instead of asking a replica's /tokenize")
    ap.add_argument("--json", type=Path, help="write every arm's figures here")
    args = ap.parse_args()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if args.requests < 1:
        print(f"--requests {args.requests}: must be at least 1", file=sys.stderr)
        return 2
    python = vllm_python()
    if python is None:
        print("no vLLM venv (scripts/install-vllm.sh, or ROUTEWISE_VLLM_PYTHON)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kv-hit-"))
    model = ensure_tiny_model(work / "model", python)
    zports = free_ports(2)
    extra = [["--max-model-len", "2048", "--kv-cache-memory-bytes", args.kv_bytes, "--max-num-seqs", "16",
              "--enable-prefix-caching", "--kv-events-config",
              json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{z}", "topic": "kv"})]
             for z in zports]
    t0 = time.monotonic()
    servers = start_servers(2, model, python, work / "fleet", extra_args=extra)
    urls = [s.base_url for s in servers]
    print(f"2 vLLM servers in {time.monotonic() - t0:.0f} s: {', '.join(urls)}; load average before "
          f"{' '.join(f'{x:.2f}' for x in load_before)}", flush=True)
    results: list[dict] = []
    try:
        warm_up(urls, args.warmup, args.words)
        for position, arm in enumerate(arms, start=1):
            r = run_arm(arm, args.seed + position, urls, model, work, args)
            results.append(r)
            hit = "n/a" if r["hit_fraction"] is None else f"{r['hit_fraction']:.3f}"
            print(f"{arm:18s} {' '.join(r['router_flags']) or '(no flags)':40s} hit fraction {hit} "
                  f"({r['hit_tokens']:.0f}/{r['query_tokens']:.0f} tokens), TTFT p50 {r['ttft_p50_ms']} ms "
                  f"p90 {r['ttft_p90_ms']} ms p99 {r['ttft_p99_ms']} ms, {r['answered']}/{r['requests']} answered"
                  f"{' (first failure: ' + str(r['first_error']) + ')' if r['failed'] else ''}, {r['wall_s']:.0f} s",
                  flush=True)
    finally:
        stop_servers(servers)
    load_after = os.getloadavg()
    print(f"load average after {' '.join(f'{x:.2f}' for x in load_after)}; {time.monotonic() - started:.0f} s in all")
    for label, key in (("hit fraction", "hit_fraction"), ("TTFT p50 (ms)", "ttft_p50_ms"),
                       ("TTFT p99 (ms)", "ttft_p99_ms")):  # ARM=VALUE,... as kv_hit_fraction_sim.py's --live takes
        print(f"{label}: " + ",".join(f"{r['arm']}={r[key]}" for r in results))
    if args.json:
        args.json.write_text(json.dumps({
            "arms": results, "seed": args.seed, "requests": args.requests, "concurrency": args.concurrency,
            "load_average_before": load_before, "load_average_after": load_after,
            "wall_s": round(time.monotonic() - started, 1), "cpus": os.cpu_count(),
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
