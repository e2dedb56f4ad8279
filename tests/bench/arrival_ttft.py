"""TTFT of one arriving request against the number of streams a real vLLM CPU server is already decoding.

Why: in `fleet fidelity` on the 2-core CPU fleet the real median TTFT grows by milliseconds per request in flight
on a server (the report's `ttft_vs_in_flight` lines) while the simulated one stays nearly flat. This bench asks
whether that growth belongs to the server (its scheduler or API process, something a profile should carry) or
to the fleet around it (two engines, their API servers, the router and the load generator sharing two cores):
it starts the fleet's servers (fleet/vllm.py FLEET_ARGS, one core each), and on each server alone, for each
stream count, runs that many background completions (`--stream-prompt` tokens, `--stream-out` tokens, ignore_eos),
waits until /metrics shows them running, sends one `--probe-prompt`-token request for one token and records its
client TTFT; `--repeats` times, median printed. Only counts below a server's max_num_seqs are run (at or above
it the probe would wait for a batch slot: queueing, which the simulator models).

Usage: ROUTEWISE_VLLM_PYTHON=.venv-vllm/bin/python python tests/bench/arrival_ttft.py [--streams 0,1,2,4,8,12]
Load: at most max(streams) + 1 requests at once on one server; about a minute per server.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path


async def measure(url: str, streams: list[int], args: argparse.Namespace) -> dict[int, list[float]]:
    """{stream count: the probe's client TTFTs} on the server at `url`, alone."""
    from routewise_vllm.fleet.calibrate import Client, _Text, _total, discover

    client = Client(url, 30.0)
    try:
        info = await discover(client, None)
        text = _Text()
        for _ in range(3):  # a fresh engine's first requests are slower
            await client.complete(info.model, text.prompt(args.probe_prompt), 8, "warm-up")
        out: dict[int, list[float]] = {}
        for c in streams:
            out[c] = []
            for _ in range(args.repeats):
                background = [asyncio.create_task(client.complete(info.model, text.prompt(args.stream_prompt),
                                                                  args.stream_out, "stream")) for _ in range(c)]
                t0 = time.monotonic()
                while c and time.monotonic() - t0 < 5.0:
                    page = await client.metrics("running")
                    if _total(page, "vllm:num_requests_running") >= c:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)  # the streams decode
                ttft, *_ = await client.complete(info.model, text.prompt(args.probe_prompt), 1, f"probe x{c}")
                out[c].append(ttft)
                await asyncio.gather(*background)
        return out
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="0,1,2,4,8,12", help="background stream counts (default 0,1,2,4,8,12)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--probe-prompt", type=int, default=128, help="the arriving request's prompt tokens")
    p.add_argument("--stream-prompt", type=int, default=32)
    p.add_argument("--stream-out", type=int, default=96)
    args = p.parse_args(argv)
    streams = [int(x) for x in args.streams.split(",") if x.strip()]

    from routewise_vllm.fleet import vllm

    python = vllm.vllm_python()
    if python is None:
        print(f"no vLLM interpreter: set {vllm.VLLM_PYTHON_ENV} or run scripts/install-vllm.sh", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="routewise-arrival-"))
    model = vllm.ensure_tiny_model(work / "model", python)
    servers = vllm.start_servers(len(vllm.FLEET_ARGS), model, python, work / "fleet", extra_args=vllm.FLEET_ARGS)
    try:
        for server, fleet_args in zip(servers, vllm.FLEET_ARGS):
            slots = int(fleet_args[fleet_args.index("--max-num-seqs") + 1])
            res = asyncio.run(measure(server.base_url, [c for c in streams if c < slots], args))
            print(f"{server.base_url} ({' '.join(fleet_args)}), alone: probe TTFT median (ms) by streams running")
            for c, values in res.items():
                print(f"  {c:3d} streams: {statistics.median(values) * 1e3:7.1f}   "
                      f"({', '.join(f'{v * 1e3:.1f}' for v in values)})")
    finally:
        vllm.stop_servers(servers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
