r"""Late binding's room in time on real vLLM: the same trace segment through the live router with the awaiting-prefill
limit in tokens (late_binding_room_in_time off) and in time (on), alternating, on a fleet of two CPU vLLM servers of
very different speeds (fleet/vllm.py DEEP_ROOMY_FLEET_ARGS: SMALL, 4 slots, the 2-layer tiny model; ROOMY, 16 slots,
the same model 48 layers deep, ~8x slower decode).

    ROUTEWISE_VLLM_PYTHON=$PWD/.venv-vllm/bin/python .venv/bin/python tests/bench/room_in_time_live.py \
        [--policy least-outstanding] [--rate 8] [--duration 40] [--repeats 2] [--max-batched-tokens 256]

Prints, per run: TTFT p50 / p99 (client side), the share of requests sent to SMALL, requests held and by what the
router let them go, and the TPOT floor the router measured on each server with the speed scale it gives SMALL
(`/admin/replicas`). `--max-batched-tokens` is the router's late_binding_max_batched_tokens: set below the servers'
own 2,048 so that the awaiting-prefill limit binds at this rig's load. Needs .venv-vllm (scripts/install-vllm.sh)
and three or more cores: each server's engine busy-waits on its core, and a router or client sharing those cores
reads each stream in bursts, so the TPOTs it measures (and the floors) are near zero and say nothing of speed.
On the 2-core development machine (2026-11-28) client-side TPOT p50 was 0.0 ms on both servers in this bench; one
server on core 1 with the client on core 0 streamed its 32 tokens at a 1.9-2.1 ms median gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.fleet.loadgen import ClientSpec, run_load  # noqa: E402
from routewise_vllm.fleet.loadplan import PlanSpec, build_plan  # noqa: E402
from routewise_vllm.fleet.router_process import ADMIN_TOKEN, start_router  # noqa: E402
from routewise_vllm.fleet.vllm import (  # noqa: E402
    DEEP_ROOMY_FLEET_ARGS, ROOMY, SERVED_MODEL_NAME, SMALL, ensure_tiny_model, start_servers, stop_servers, vllm_python,
)
from routewise_vllm.router.policy.late_binding import LateBindingConfig, speed_scales  # noqa: E402
from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot  # noqa: E402

SLOTS = {SMALL: 4, ROOMY: 16}  # the servers' --max-num-seqs (fleet/vllm.py FLEET_ARGS)


def _get(url: str) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def _late_dispatches(metrics_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("llm_router_late_dispatches_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def one_run(urls: list[str], policy: str, room_in_time: bool, plan, args, log_dir: Path) -> dict:
    ids = [u.removeprefix("http://") for u in urls]
    env = {
        "ROUTEWISE_LATE_BINDING": "1",
        "ROUTEWISE_LATE_BINDING_REPLICA_MAX_NUM_SEQS": ",".join(f"{ids[i]}={SLOTS[i]}" for i in (SMALL, ROOMY)),
        "ROUTEWISE_LATE_BINDING_MAX_BATCHED_TOKENS": str(args.max_batched_tokens),
        "ROUTEWISE_LATE_BINDING_ROOM_IN_TIME": "true" if room_in_time else "false",
        "ROUTEWISE_REPLICA_HEADER": "true",
    }
    router = start_router(urls, policy, log_dir, env=env)
    try:
        results, _ = asyncio.run(run_load(plan, ClientSpec(url=router.base_url, model=SERVED_MODEL_NAME), progress=False,
                                       drain_timeout_s=60.0))
        status = json.loads(_get(f"{router.base_url}/admin/replicas"))
        late = _late_dispatches(_get(f"{router.base_url}/metrics"))
    finally:
        router.stop()
    floors = {r["id"]: r.get("tpot_floor_s") for r in status["replicas"]}
    snaps = tuple(ReplicaSnapshot(i, True, 0, 0, tpot_floor_s=floors.get(i)) for i in ids)
    scales = speed_scales(ClusterView(snaps), LateBindingConfig().max_speed_scale)
    ok = [r for r in results if r.ok and math.isfinite(r.ttft_s)]
    ttft = [r.ttft_s for r in ok]
    tpot = {i: sorted(r.tpot_s for r in ok if r.replica == i and math.isfinite(r.tpot_s)) for i in ids}
    return {
        "room_in_time": room_in_time, "requests": len(results),
        "errors": dict(Counter(r.error or "no first token" for r in results if id(r) not in {id(o) for o in ok})),
        "ttft_p50_s": statistics.median(ttft) if ttft else float("nan"), "ttft_p99_s": _pct(ttft, 0.99),
        "to_small": sum(r.replica == ids[SMALL] for r in ok) / max(1, len(ok)),
        "late_dispatches": late, "tpot_floor_s": [floors.get(i) for i in ids], "small_scale": scales[SMALL],
        "client_tpot_p10_p50_s": [[_pct(tpot[i], 0.1), _pct(tpot[i], 0.5)] for i in ids],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="least-outstanding", help="the policy behind late binding (default least-outstanding)")
    ap.add_argument("--rate", type=float, default=8.0, help="offered requests/s (default 8)")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of replay per run (default 40)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating tokens / time (default 2)")
    ap.add_argument("--max-batched-tokens", type=int, default=256, help="the router's late_binding_max_batched_tokens (default 256)")
    ap.add_argument("--trace", default="azure-code", help="trace (default azure-code: long prompts)")
    ap.add_argument("--token-scale", type=float, default=0.1, help="shrink trace lengths for CPU servers (default 0.1)")
    ap.add_argument("--json", action="store_true", help="print the runs as JSON")
    args = ap.parse_args()
    python = vllm_python()
    if python is None:
        print("no vLLM interpreter: set ROUTEWISE_VLLM_PYTHON or run scripts/install-vllm.sh", file=sys.stderr)
        return 2
    plan, _ = build_plan(PlanSpec(trace=args.trace, window="eval", rate=args.rate, duration_s=args.duration,
                                  token_scale=args.token_scale, max_tokens_cap=32, max_prompt_tokens=400))
    if len(os.sched_getaffinity(0)) < 3:
        print(f"warning: {len(os.sched_getaffinity(0))} CPUs: the router and client share the servers' cores, so "
              "streams arrive in bursts and the TPOT floors are not speeds (see --help)", file=sys.stderr)
    runs = []
    with tempfile.TemporaryDirectory(prefix="room-in-time-") as tmp:
        work = Path(tmp)
        model = ensure_tiny_model(work / "model", python)
        t0 = time.monotonic()
        servers = start_servers(2, model, python, work, extra_args=DEEP_ROOMY_FLEET_ARGS)
        print(f"2 servers healthy in {time.monotonic() - t0:.0f} s; {len(plan)} requests per run", file=sys.stderr)
        try:
            urls = [s.base_url for s in servers]
            for rep in range(args.repeats):
                for room_in_time in (False, True):
                    run = one_run(urls, args.policy, room_in_time, plan, args, work / "routers")
                    run["repeat"] = rep
                    runs.append(run)
                    print(f"repeat {rep} room in {'time  ' if room_in_time else 'tokens'}: TTFT p50 "
                          f"{run['ttft_p50_s'] * 1e3:.0f} ms p99 {run['ttft_p99_s'] * 1e3:.0f} ms, to SMALL "
                          f"{run['to_small']:.0%}, late dispatches {run['late_dispatches']}, errors {run['errors']}, "
                          f"TPOT floors SMALL / ROOMY {run['tpot_floor_s']} (client-side TPOT p10 / p50 "
                          f"{run['client_tpot_p10_p50_s']}), SMALL's speed scale {run['small_scale']}",
                          file=sys.stderr, flush=True)
        finally:
            stop_servers(servers)
    if args.json:
        print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
