"""What a large non-streamed answer costs through the router, on each transport path (a script, not a test).

    .venv/bin/python tests/bench/large_answer.py [--size-mb 1] [--delay 0.5] [--requests 10] [--json]

A replica on loopback (tests/fakes/scripted_replica.py, in this process) answers every completion with one JSON
body of --size-mb MB (Content-Length) after --delay seconds, as a replica generating for that long would. For
each path (lean listener or aiohttp's server side, times h1client or aiohttp's client) a router runs as
`router serve` in its own process group; the requests alternate, direct to the replica then through
the router, one at a time, and the added time is each pair's difference. Printed: p50 and max added ms, and
the replica's ejections after the run (the router's /admin/replicas), which must be none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fakes.scripted_replica import Pause, ScriptedReplica, sized  # noqa: E402

PATHS = {"lean-h1": (True, True), "lean-aiohttp": (True, False), "aiohttp-h1": (False, True),
         "aiohttp-aiohttp": (False, False)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/ready") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}/ready did not answer 200 within {timeout} s")


async def timed(session: aiohttp.ClientSession, url: str, size: int) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json={"model": "tiny", "prompt": "big", "max_tokens": 1}) as r:
        body = await r.read()
    took = time.perf_counter() - t0
    if r.status != 200 or len(body) != size:
        raise RuntimeError(f"{url}: {r.status}, {len(body)} bytes: {body[:200]!r}")
    return took


async def run(args: argparse.Namespace) -> dict:
    body = json.dumps({"choices": [{"index": 0, "text": "y" * (int(args.size_mb * (1 << 20)) - 40)}]}).encode()
    replica = ScriptedReplica({"big": [Pause(args.delay), *sized(200, body, [("Content-Type", "application/json")])]})
    direct = await replica.start()
    out: dict = {"size_bytes": len(body), "delay_s": args.delay, "requests": args.requests, "paths": {}}
    try:
        async with aiohttp.ClientSession() as session:
            for name, (lean_listener, lean_client) in PATHS.items():
                port = free_port()
                env = {**os.environ, "ROUTEWISE_ADMIN_TOKEN": "bench", "ROUTEWISE_LEAN_LISTENER": str(int(lean_listener)),
                       "ROUTEWISE_LEAN_CLIENT": str(int(lean_client))}
                proc = subprocess.Popen([sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port",
                                         str(port), "--replica", direct, "--policy", "least-outstanding",
                                         "--log-level", "warning"], cwd=REPO, env=env, start_new_session=True)
                try:
                    url = f"http://127.0.0.1:{port}"
                    await wait_ready(session, url)
                    await timed(session, url, len(body))  # warm: connections open
                    added = []
                    for _ in range(args.requests):
                        d = await timed(session, direct, len(body))
                        added.append(await timed(session, url, len(body)) - d)
                    async with session.get(url + "/admin/replicas", headers={"Authorization": "Bearer bench"}) as r:
                        ejections = [rep["ejections"] for rep in (await r.json())["replicas"]]
                finally:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=30)
                out["paths"][name] = {"added_ms_p50": round(1000 * statistics.median(added), 1),
                                      "added_ms_max": round(1000 * max(added), 1), "ejections": ejections}
    finally:
        await replica.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1.0, help="the answer's size")
    ap.add_argument("--delay", type=float, default=0.5, help="the replica's time before it answers (s)")
    ap.add_argument("--requests", type=int, default=10, help="measured requests per path")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['size_bytes']:,} B answer after {args.delay:g} s, {args.requests} requests per path")
    print(f"{'path':18} {'added p50 ms':>13} {'added max ms':>13}  ejections")
    for name, r in out["paths"].items():
        print(f"{name:18} {r['added_ms_p50']:>13} {r['added_ms_max']:>13}  {r['ejections']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
