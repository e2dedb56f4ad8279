"""Live: one router against two router processes sharing the fleet's load through a real Redis, same fleet, same
arrivals.

The demo's emulated fleet (four replicas of mixed speed, 8 batch slots, half-speed GPUs) and a real trace
segment (azure-conv TRAIN window, as the demo replays it). Each round replays the same plan twice, in turn:
1. one `router serve` (the default configuration) takes every request;
2. two `router serve` processes with `--shared-state redis://...` (no shared memory between them) take the
   requests in turn (`fleet loadgen`'s round-robin over several URLs, as pods behind a Service);
and, with `--no-sharing`, 3. the same two routers without Redis (each sees only its own in-flight requests).
Prints TTFT and E2E percentiles per configuration and the p99 ratios to one router. Needs redis-server.

    .venv/bin/python tests/bench/multi_router_live.py --duration 60 --rounds 2 --no-sharing
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.fleet.demo import DEFAULT_FLEET, Processes, free_port, wait_ready  # noqa: E402
from routewise_vllm.fleet.loadgen import ClientSpec, run_load, summarize  # noqa: E402
from routewise_vllm.fleet.loadplan import PlanSpec, build_plan  # noqa: E402
from routewise_vllm.fleet.router_process import start_router  # noqa: E402
from tests.fakes.redis_server import RedisServer, require_redis  # noqa: E402


def replay(plan, urls: list[str]) -> dict:
    import asyncio

    results, _ = asyncio.run(run_load(plan, ClientSpec(url=urls[0], also=tuple(urls[1:]), timeout_s=120.0),
                                      progress=False))
    for r in results:  # every router is one arm here, whatever its arm header says
        r.group = "all"
    s = summarize(results)["all"]
    return {"requests": len(results), "ok": s["ok"], "errors": s["errors"],
            **{f"{k}_{p}": s[k][p] for k in ("ttft_s", "e2e_s") for p in ("p50", "p99")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of trace per replay (default 60)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each replaying every configuration once (default 2)")
    p.add_argument("--time-scale", type=float, default=3.0, help="trace speed-up (default 3, the demo's)")
    p.add_argument("--no-sharing", action="store_true", help="also two routers without Redis")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    binary = require_redis()
    plan, _ = build_plan(PlanSpec(trace="azure-conv", window="train", start_s=600.0, time_scale=args.time_scale,
                                  duration_s=args.duration, token_scale=0.5, max_tokens_cap=48, seed=0))
    configs = ["one router", "two routers + Redis"] + (["two routers, no sharing"] if args.no_sharing else [])
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        procs = Processes(Path(tmp))
        redis = RedisServer(binary)
        routers = []
        try:
            redis.start()
            urls = []
            for i, rep in enumerate(DEFAULT_FLEET):
                port = free_port()
                procs.start(f"replica-{i}", [sys.executable, "-m", "routewise_vllm.fleet", "emulate", "--port", str(port), "--profile",
                                             rep.profile, "--slowdown", str(rep.slowdown), "--max-num-seqs", "8",
                                             "--speed", "0.5"])
                urls.append(f"http://127.0.0.1:{port}")
            late = {"ROUTEWISE_LATE_BINDING": "1"}  # the default configuration (start_router turns it off otherwise)
            one = start_router(urls, "learned", Path(tmp), env=late)
            shared = [start_router(urls, "learned", Path(tmp), env={**late, "ROUTEWISE_SHARED_STATE": redis.url})
                      for _ in range(2)]
            alone = [start_router(urls, "learned", Path(tmp), env=late) for _ in range(2)] if args.no_sharing else []
            routers = [one, *shared, *alone]
            wait_ready(procs, urls, one.base_url, 60)
            targets = {"one router": [one.base_url], "two routers + Redis": [r.base_url for r in shared],
                       "two routers, no sharing": [r.base_url for r in alone]}
            for k in range(args.rounds):
                for c in configs:
                    runs[c].append(replay(plan, targets[c]))
                    r = runs[c][-1]
                    print(f"round {k + 1} {c:24}: {r['ok']}/{r['requests']} ok, TTFT p50 {r['ttft_s_p50'] * 1e3:7.1f} "
                          f"p99 {r['ttft_s_p99'] * 1e3:7.1f} ms, E2E p99 {r['e2e_s_p99']:6.2f} s", flush=True)
        finally:
            for r in routers:
                r.stop()
            procs.stop()
            redis.stop()
    base = runs["one router"]
    print()
    for c in configs[1:]:
        ratios = [r["ttft_s_p99"] / b["ttft_s_p99"] for r, b in zip(runs[c], base)]
        print(f"{c}: TTFT p99 over one router's, per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
