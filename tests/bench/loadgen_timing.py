"""Load generator timing against the emulator (the targets tests/fleet/test_loadgen.py used to assert, moved here
because a busy host breaks them, not the code): TPOT of an emulated H100 near its decode step, and a 1 s client
timeout cutting a 14 s answer short. Prints the figures; exit status 1 if a target is missed.

    .venv/bin/python tests/bench/loadgen_timing.py          # ~10 s on an idle 2-core machine
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp.test_utils import TestServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.fleet.emulator import EmulatorSettings, make_app  # noqa: E402
from routewise_vllm.fleet.loadgen import ClientSpec, run_load, summarize  # noqa: E402
from routewise_vllm.fleet.loadplan import PlannedRequest, PlanSpec, build_plan  # noqa: E402

TPOT_P50_S = (0.004, 0.05)  # H100 decode steps are ~6-9 ms: near that, not near zero or near the E2E
TIMEOUT_WALL_S = 3.0  # a 1 s client timeout ends the run long before the 14 s answer would


async def _run(profile: str, plan: list[PlannedRequest], **client) -> tuple[list, float]:
    server = TestServer(make_app(EmulatorSettings(profile=profile, max_num_seqs=4)), host="127.0.0.1")
    await server.start_server()
    try:
        return await run_load(plan, ClientSpec(url=str(server.make_url("")), **client), progress=False)
    finally:
        await server.close()


async def main() -> int:
    plan, _ = build_plan(PlanSpec(trace="poisson", rate=20.0, duration_s=1.5, prompt_tokens=120, output_tokens=12, seed=2))
    results, _ = await _run("llama3-8b-h100", plan)
    tpot = summarize(results)["all"]["tpot_s"]["p50"]
    long_and_short = [PlannedRequest(0.0, "x" * 40, 10, 200), PlannedRequest(0.05, "y" * 40, 10, 2)]
    _, wall = await _run("llama3-8b-l4", long_and_short, timeout_s=1.0)
    checks = [(f"TPOT p50 {tpot * 1e3:.1f} ms within {TPOT_P50_S[0] * 1e3:.0f}-{TPOT_P50_S[1] * 1e3:.0f} ms",
               TPOT_P50_S[0] < tpot < TPOT_P50_S[1]),
              (f"1 s timeout: run over in {wall:.2f} s (target < {TIMEOUT_WALL_S} s)", wall < TIMEOUT_WALL_S)]
    for text, ok in checks:
        print(("ok   " if ok else "MISS ") + text)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
