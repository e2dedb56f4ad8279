"""A flood of cheap requests against a fleet listing 100,000 LoRA adapters, beside a legitimate client (a script,
not a test).

    .venv/bin/python tests/bench/model_flood.py [--adapters 100000] [--clients 20] [--phase-s 20] [--rate 5]
        [--models-encoding identity|gzip] [--json]

Two fake vLLM replicas (tests/fakes/fake_vllm.py, in one child process) each list `--adapters` adapters of one
base model in /v1/models; a router runs as `router serve` (its defaults: health probe every 2 s, 1 s timeout, 3
failures in a row take a replica out; /metrics scraped every second) in its own process group. While a legitimate
client sends `--rate` completions a second for the base model (open loop, each request on time whatever the
previous one's fate), a flood child process runs `--clients` closed-loop clients, for `--phase-s` seconds each:
1. unknown-model completions (each a 404 from the router);
2. `GET /v1/models` (the union of both lists, 100,000 entries; read and thrown away; `--models-encoding gzip`
   takes the gzipped body the router offers, identity, the default, the attacker's worst case, the whole JSON).
Meanwhile the router's /admin/replicas is read every 0.5 s. Printed, per phase: the flood's rate and statuses, the
legitimate requests' count, non-200s, p50, p99 and max; then whether both replicas stayed healthy in every
reading, the longest gap between health probes a replica saw, the router's scrape errors and ejections over the
run. Done when every legitimate request is a 200, p50 <= 0.5 s, and both replicas stay healthy throughout.
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
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fakes.fake_vllm import FakeVllm  # noqa: E402

TOKEN = "bench"
BASE = "base"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# --- the replicas (child process) -----------------------------------------------------------------------------

class ListingReplica(FakeVllm):
    """A fake vLLM replica listing many adapters: its /v1/models body built once (a real vLLM answers it in a few
    ms), and the arrival time of each health probe kept for GET /bench/probes."""

    def __init__(self, adapters: int) -> None:
        super().__init__(model=BASE, adapters={f"sql-lora-{i:06d}": BASE for i in range(adapters)})
        self.probes: list[float] = []
        self._listing: bytes | None = None

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/bench/probes", self._bench_probes)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        self.probes.append(time.monotonic())
        return await super()._health(request)

    async def _models(self, request: web.Request) -> web.Response:
        if self._listing is None:
            self._listing = (await super()._models(request)).body  # type: ignore[assignment]
        else:
            self.model_requests += 1
        return web.Response(body=self._listing, content_type="application/json")

    async def _bench_probes(self, request: web.Request) -> web.Response:
        since = float(request.query.get("since", "0"))
        times = [t for t in self.probes if t >= since]
        gaps = [b - a for a, b in zip(times, times[1:])]
        return web.json_response({"probes": len(times), "max_gap_s": max(gaps, default=None),
                                  "model_requests": self.model_requests, "now": time.monotonic()})


async def serve_replicas(ports: list[int], adapters: int) -> None:
    reps = [ListingReplica(adapters) for _ in ports]
    for rep, port in zip(reps, ports):
        await rep.start(port)
    print("ready", flush=True)
    await asyncio.Event().wait()


# --- the flood (child process) ---------------------------------------------------------------------------------

async def flood(url: str, kind: str, clients: int, duration_s: float, encoding: str) -> dict:
    statuses: dict[str, int] = {}
    bytes_read = 0
    deadline = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:

        async def one_client(c: int) -> None:
            nonlocal bytes_read
            i = 0
            while time.monotonic() < deadline:
                i += 1
                try:
                    if kind == "unknown":
                        ctx = session.post(url + "/v1/completions", json={"model": f"no-such-lora-{c}-{i}",
                                                                         "prompt": "x", "max_tokens": 1})
                    else:
                        ctx = session.get(url + "/v1/models", headers={"Accept-Encoding": encoding})
                    async with ctx as resp:
                        async for chunk in resp.content.iter_chunked(1 << 20):
                            bytes_read += len(chunk)
                        key = str(resp.status)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    key = type(exc).__name__
                statuses[key] = statuses.get(key, 0) + 1

        t0 = time.monotonic()
        await asyncio.gather(*(one_client(c) for c in range(clients)))
        took = time.monotonic() - t0
    n = sum(statuses.values())
    return {"kind": kind, "requests": n, "per_s": round(n / took, 1), "statuses": statuses,
            "mb_read": round(bytes_read / 1e6, 1)}


# --- the run (main process) ------------------------------------------------------------------------------------

async def wait_until(check, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await check():
                return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{what}: not within {timeout_s} s")


async def legit_client(session: aiohttp.ClientSession, url: str, rate: float, stop: asyncio.Event, t0: float,
                       out: list[tuple[float, int | str, float]]) -> None:
    async def one(sent: float) -> None:
        start = time.monotonic()
        try:
            async with session.post(url + "/v1/completions",
                                    json={"model": BASE, "prompt": "hello there", "max_tokens": 4}) as resp:
                await resp.read()
                status: int | str = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            status = type(exc).__name__
        out.append((sent - t0, status, time.monotonic() - start))

    tasks = []
    k = 0
    while not stop.is_set():
        tasks.append(asyncio.create_task(one(time.monotonic())))
        k += 1
        await asyncio.sleep(max(0.0, t0 + k / rate - time.monotonic()))
    await asyncio.gather(*tasks)


async def monitor(session: aiohttp.ClientSession, url: str, stop: asyncio.Event,
                  out: list[tuple[float, list[str], float]]) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    while not stop.is_set():
        start = time.monotonic()
        try:
            async with session.get(url + "/admin/replicas", headers=headers) as resp:
                states = [r["state"] for r in (await resp.json())["replicas"]]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            states = [type(exc).__name__]
        out.append((start, states, time.monotonic() - start))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sched_s(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main thread, its event loop."""
    on, waiting, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(on) / 1e9, int(waiting) / 1e9


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def run_flood_child(url: str, kind: str, args: argparse.Namespace) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--flood", url, "--kind", kind, "--clients", str(args.clients),
        "--phase-s", str(args.phase_s), "--models-encoding", args.models_encoding, stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    return json.loads(out)


async def run(args: argparse.Namespace) -> dict:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    procs: list[subprocess.Popen] = []
    try:
        reps = subprocess.Popen([sys.executable, __file__, "--serve-replicas", ",".join(map(str, ports)),
                                 "--adapters", str(args.adapters)], cwd=REPO, start_new_session=True,
                                stdout=subprocess.PIPE, text=True)
        procs.append(reps)
        if reps.stdout is None or reps.stdout.readline().strip() != "ready":
            raise RuntimeError("the replicas did not start")
        env = {**os.environ, "ROUTEWISE_ADMIN_TOKEN": TOKEN}
        cmd = [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port",
               str(router_port), "--log-level", "warning", *(a for u in urls for a in ("--replica", u))]
        if args.policy:
            cmd += ["--policy", args.policy]
        procs.append(router_proc := subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def lists_known() -> bool:  # a 404 for an unknown model: the router has read the lists
                async with session.post(router + "/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
                    return r.status == 404 and "more" in (await r.json())["error"]["message"]

            await wait_until(lists_known, "the router reading the replicas' lists")
            async with session.get(router + "/metrics") as r:
                before = await r.text()
            probe_since = []
            for u in urls:
                async with session.get(u + "/bench/probes") as r:
                    probe_since.append((await r.json())["now"])
            legit: list[tuple[float, int | str, float]] = []
            readings: list[tuple[float, list[str], float]] = []
            stop = asyncio.Event()
            t0 = time.monotonic()
            watch = asyncio.create_task(monitor(session, router, stop, readings))
            load = asyncio.create_task(legit_client(session, router, args.rate, stop, t0, legit))
            floods = []
            for kind in ("quiet", "unknown", "models"):
                used, sched, started = cpu_s(router_proc.pid), sched_s(router_proc.pid), time.monotonic()
                if kind == "quiet":
                    await asyncio.sleep(args.quiet_s)
                    floods.append({"kind": kind, "requests": 0, "per_s": 0, "statuses": {}, "mb_read": 0})
                else:
                    floods.append(await run_flood_child(router, kind, args))
                took = time.monotonic() - started
                on, waiting = (b - a for a, b in zip(sched, sched_s(router_proc.pid)))
                floods[-1].update(start=started - t0, end=started - t0 + took, router_cpu=round((cpu_s(router_proc.pid) - used) / took, 2),
                                  loop_on_cpu=round(on / took, 2), loop_waiting_for_cpu=round(waiting / took, 2))
            stop.set()
            await load
            await watch
            async with session.get(router + "/metrics") as r:
                after = await r.text()
            async with session.get(router + "/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                ejections = sum(sum(rep["ejections"].values()) for rep in (await r.json())["replicas"])
            probes = []
            for u, since in zip(urls, probe_since):
                async with session.get(u + "/bench/probes", params={"since": str(since)}) as r:
                    probes.append(await r.json())
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
    phases = {}
    for flood_out in floods:
        mine = [(t, s, d) for t, s, d in legit if flood_out["start"] <= t < flood_out["end"]]
        took = [d for _, _, d in mine]
        phases[flood_out["kind"]] = {
            "flood": flood_out, "legit": len(mine), "legit_not_200": sum(1 for _, s, _ in mine if s != 200),
            "p50_ms": round(1000 * statistics.median(took), 1) if took else None,
            "p99_ms": round(1000 * percentile(took, 0.99), 1), "max_ms": round(1000 * max(took, default=0), 1),
            "slowest": [(round(t - flood_out["start"], 1), round(1000 * d)) for t, _, d in sorted(mine, key=lambda x: -x[2])[:3]]}
    under_flood = [x for x in legit if x[0] >= floods[0]["end"]]
    all_took = [d for _, _, d in under_flood]
    unhealthy = [s for _, s, _ in readings if s != ["healthy", "healthy"]]
    return {
        "adapters": args.adapters, "clients": args.clients, "phase_s": args.phase_s, "rate": args.rate,
        "models_encoding": args.models_encoding, "phases": phases,
        "legit": len(under_flood), "legit_not_200": sum(1 for _, s, _ in legit if s != 200),
        "legit_p50_ms": round(1000 * statistics.median(all_took), 1) if all_took else None,
        "readings": len(readings), "readings_not_both_healthy": len(unhealthy),
        "admin_read_max_ms": round(1000 * max((d for _, _, d in readings), default=0), 1),
        "probe_max_gap_s": [None if p["max_gap_s"] is None else round(p["max_gap_s"], 2) for p in probes],
        "scrape_errors": metric_sum(after, "llm_router_scrape_errors_total") - metric_sum(before, "llm_router_scrape_errors_total"),
        "ejections": ejections,
    }


def verdict(out: dict) -> bool:
    return (out["legit"] > 0 and out["legit_not_200"] == 0 and out["legit_p50_ms"] <= 500
            and out["readings_not_both_healthy"] == 0 and out["ejections"] == 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=100_000, help="adapters each replica lists (default 100,000)")
    ap.add_argument("--clients", type=int, default=20, help="flooding clients (default 20)")
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds of each flood (default 20)")
    ap.add_argument("--quiet-s", type=float, default=5.0, help="seconds of the legitimate client alone first, for "
                    "comparison (default 5)")
    ap.add_argument("--rate", type=float, default=5.0, help="the legitimate client's requests a second (default 5)")
    ap.add_argument("--models-encoding", choices=("identity", "gzip"), default="identity",
                    help="what the /v1/models flood accepts (default identity: the whole JSON each time)")
    ap.add_argument("--policy", help="the router's --policy (default: the router's default)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve-replicas", help=argparse.SUPPRESS)  # child: the replicas on these ports
    ap.add_argument("--flood", help=argparse.SUPPRESS)  # child: flood this router
    ap.add_argument("--kind", choices=("unknown", "models"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_replicas:
        asyncio.run(serve_replicas([int(p) for p in args.serve_replicas.split(",")], args.adapters))
        return 0
    if args.flood:
        print(json.dumps(asyncio.run(flood(args.flood, args.kind, args.clients, args.phase_s, args.models_encoding))))
        return 0
    out = asyncio.run(run(args))
    ok = verdict(out)
    if args.json:
        print(json.dumps({**out, "ok": ok}, indent=1))
        return 0 if ok else 1
    print(f"2 replicas x {out['adapters']:,} adapters; {out['clients']} flooding clients, {out['phase_s']:g} s a phase; "
          f"legitimate {out['rate']:g} req/s; /v1/models flood accepts {out['models_encoding']}")
    print(f"{'phase':8} {'flood req/s':>11} {'flood MB':>9}  {'flood statuses':16} {'router CPUs':>11} "
          f"{'loop waits':>10} {'legit':>5} {'not 200':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}")
    for kind, p in out["phases"].items():
        f = p["flood"]
        print(f"{kind:8} {f['per_s']:>11} {f['mb_read']:>9}  {json.dumps(f['statuses']):16} {f['router_cpu']:>11} "
              f"{f['loop_waiting_for_cpu']:>10} {p['legit']:>5} {p['legit_not_200']:>7} {p['p50_ms']:>7} "
              f"{p['p99_ms']:>7} {p['max_ms']:>7}")
    for kind, p in out["phases"].items():
        print(f"{kind}: slowest legitimate requests (s into the phase, ms): {p['slowest']}")
    print(f"legitimate under the floods: {out['legit']} requests, {out['legit_not_200']} not 200 (of all, quiet "
          f"phase included), p50 {out['legit_p50_ms']} ms")
    print(f"replicas both healthy in {out['readings'] - out['readings_not_both_healthy']} of {out['readings']} "
          f"readings of /admin/replicas (slowest read {out['admin_read_max_ms']} ms); longest gap between health "
          f"probes at each replica {out['probe_max_gap_s']} s; scrape errors {out['scrape_errors']:g}; "
          f"ejections {out['ejections']}")
    print("PASS" if ok else "FAIL", "(every legitimate request 200, p50 <= 500 ms, both replicas healthy throughout)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
