"""vLLM's own prefix-cache hit fraction behind the router: least-outstanding, prefix-aware on the router's guess,
prefix-aware on the replicas' KV events.

Two real vLLM CPU servers (the tiny model, 16 MiB of KV each: too little for the 12 system prompts on one server,
enough for half of them on each), KV events on (`--kv-events-config`, a wildcard endpoint each), 96 completions of
`system prompt + a short question`, 4 at a time. The hit fraction is vLLM's (`vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total`, both servers, over the run). Each arm has a fresh router and system prompts of its
own (the earlier arms' blocks are the oldest in the servers' caches, evicted first). The events arm is
`router serve --policy prefix-aware` with nothing else about events. The `-two-routers` arms run two routers of
that arm (no Redis, no shared state: each subscribes to both replicas' events on its own) and send the requests to
them in turn, so each router's guess sees half the traffic while the events show both halves. The TTFT is the
client's (requests streamed: time to the first chunk with text); its p50 is printed per arm.

    flock /tmp/vllm.lock .venv/bin/python tests/bench/kv_hit_fraction.py [--requests 96] \
        [--arms lo,guess,events,guess-two-routers,events-two-routers] [--tokenizer]

Needs the vLLM venv (scripts/install-vllm.sh or ROUTEWISE_VLLM_PYTHON). About 5 minutes on 2 cores for the five arms
(1 to 3 of them the servers' start). `--tokenizer`: every router tokenizes with the model's own tokenizer, as several
routers need (docs/multi-router.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from routewise_vllm.fleet.vllm import ensure_tiny_model, free_ports, start_servers, stop_servers, vllm_python  # noqa: E402

ARMS = {
    "lo": ("least-outstanding", ["--kv-events", "off"]),
    "guess": ("prefix-aware", ["--kv-events", "off"]),
    "events": ("prefix-aware", []),
    "guess-two-routers": ("prefix-aware", ["--kv-events", "off"]),
    "events-two-routers": ("prefix-aware", []),
}
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


async def drive(ports: list[int], prompts: list[str], n: int, concurrency: int, seed: int) -> list[float]:
    """Send the arm's requests (request k to router k mod len(ports)); returns each request's TTFT (seconds)."""
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
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}: {(await r.text())[:200]}")
                    first = None
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {") and b'"text":""' not in line.replace(b" ", b""):
                            first = time.perf_counter() - t0
                    ttfts.append(first if first is not None else time.perf_counter() - t0)

        await asyncio.gather(*(one(k, p) for k, p in enumerate(order)))
    return ttfts


def start_router(urls: list[str], policy: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_ports(1)[0]
    args = [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, *(a for u in urls for a in ("--replica", u)), *extra]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--arms", default="lo,guess,events")
    ap.add_argument("--words", type=int, default=400)
    ap.add_argument("--kv-bytes", default="16M")
    ap.add_argument("--router-args", default="", help="more `router serve` flags for every arm")
    ap.add_argument("--tokenizer", action="store_true", help="every router tokenizes with the tiny model's own "
                    "tokenizer (`--tokenizer DIR`) instead of asking a replica's /tokenize")
    args = ap.parse_args()
    python = vllm_python()
    if python is None:
        print("no vLLM venv (scripts/install-vllm.sh, or ROUTEWISE_VLLM_PYTHON)", file=sys.stderr)
        return 2
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
    print(f"2 vLLM servers in {time.monotonic() - t0:.0f} s: {', '.join(urls)}", flush=True)
    results: dict[str, float] = {}
    ttft_p50: dict[str, float] = {}
    try:
        for seed, arm in enumerate(args.arms.split(","), start=1):
            policy, flags = ARMS[arm]
            more = args.router_args.split() + (["--tokenizer", str(model)] if args.tokenizer else [])
            routers = [start_router(urls, policy, flags + more, work / f"router-{arm}-{i}.log")
                       for i in range(2 if arm.endswith(TWO_ROUTERS) else 1)]
            ports = [port for _, port in routers]
            try:
                time.sleep(1.0)  # the subscriptions connect
                before = [vllm_counters(u) for u in urls]
                t = time.monotonic()
                ttfts = asyncio.run(drive(ports, system_prompts(seed, words=args.words), args.requests,
                                          args.concurrency, seed))
                wall = time.monotonic() - t
                after = [vllm_counters(u) for u in urls]
                hits = sum(a[0] - b[0] for a, b in zip(after, before))
                queries = sum(a[1] - b[1] for a, b in zip(after, before))
                results[arm] = hits / queries if queries else float("nan")
                ttft_p50[arm] = statistics.median(ttfts)
                print(f"{arm:18s} {policy:18s} {' '.join(flags) or '(events on by default)':24s} hit fraction "
                      f"{results[arm]:.3f} ({hits:.0f}/{queries:.0f} tokens, {wall:.0f} s), TTFT p50 "
                      f"{ttft_p50[arm] * 1e3:.0f} ms p90 {sorted(ttfts)[int(0.9 * len(ttfts))] * 1e3:.0f} ms",
                      flush=True)
                if "events" in arm:
                    for i, port in enumerate(ports):
                        lines = [line for line in router_metric(port, "llm_router_kv_")
                                 if "BlockStored" in line or "view_blocks" in line or "fresh" in line
                                 or ("ignored" in line and not line.endswith(" 0.0"))]
                        lines += router_metric(port, "llm_router_prefix_match_source_total")
                        lines += router_metric(port, "llm_router_tokenize_seconds_count")
                        lines += router_metric(port, "llm_router_prompt_blocks_total")
                        for line in lines:
                            print(f"   router {i}:", line)
            finally:
                for i, (router, _) in enumerate(routers):
                    router.terminate()
                    router.wait(10)
                    if os.environ.get("KV_BENCH_SHOW_LOG"):
                        print((work / f"router-{arm}-{i}.log").read_text()[-3000:])
    finally:
        stop_servers(servers)
    print(json.dumps({k: round(v, 3) for k, v in results.items()}))
    print("TTFT p50 (ms): " + json.dumps({k: round(v * 1e3, 1) for k, v in ttft_p50.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
