"""Soak: the live router (a real `router serve` process) in front of emulated vLLM replicas under a
steady mixed load for a long time, while one replica is killed and restarted, one is broken and one is slow.
A script that prints its figures (docs/soak.md); a 60 s run is a CI test (tests/router/test_soak.py).

    .venv/bin/python tests/bench/soak.py [--duration 1800] [--rate 8] [--json out.json]

Fleet (each replica its own process group on loopback):
  steady   `fleet emulate`, healthy
  killed   `fleet emulate`, SIGKILLed every --kill-every s and restarted on its port --down-for s later
  slow     `fleet emulate --slowdown 4` (a GPU four times slower)
  broken   a server in this process: /health and /v1/models fine, /metrics garbage, generations answered in
           turn with a 500, a 200 of garbage bytes, a stream cut after one malformed event, a 502 in plain text

Load: Poisson arrivals at --rate req/s, half streamed, half /v1/completions and half /v1/chat/completions,
max_tokens 8..96. The router runs with late binding and the decision log on.

Targets (exit status 1 if one is missed):
- no request hangs: every one ends (answer, error status, or cut stream) within --hang-s;
- the router's RSS grows less than 10 % from the end of warm-up (the first 10 %, at least 15 s) to the end;
- after the load stops, requests in flight (/admin/status inflight, llm_router_outstanding_requests) and held
  (llm_router_held_requests) return to 0;
- the decision log's count (llm_router_decision_log_records_total) equals the lines on disk, nothing dropped;
- the router drains and exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from routewise_vllm.fleet.demo import Processes, free_port  # noqa: E402

TOKEN = "soak-admin-token"
MODEL = "soak-model"
RSS_GROWTH_TARGET = 0.10


# --- the broken replica ---------------------------------------------------------------------------------------


class BrokenReplica:
    """Looks healthy to the prober, answers every generation wrongly (in turn: 500, garbage 200, cut stream, 502)."""

    def __init__(self) -> None:
        self.n = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> str:
        async def health(request: web.Request) -> web.Response:
            return web.Response(text="")

        async def models(request: web.Request) -> web.Response:
            return web.json_response(
                {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 4096}]})

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text="vllm:num_requests_running{{{ garbage\n\x00\x01")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.n += 1
        turn = self.n % 4
        if turn == 0:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        if turn == 1:
            return web.Response(body=b"\x00{not json at all" + os.urandom(64), content_type="application/json")
        if turn == 2:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"text": "half\n\n')
            request.transport.close()  # cut mid-stream
            return resp
        return web.Response(status=502, text="bad gateway (plain text)")


# --- load --------------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    done: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # ok, http_<status>, stream_error_event, cut, garbage, ...
    hung: int = 0
    slowest_s: float = 0.0

    def count(self, outcome: str, elapsed: float) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.done += 1
        self.slowest_s = max(self.slowest_s, elapsed)


def body(rng: random.Random, chat: bool, stream: bool) -> dict:
    words = " ".join(rng.choice(("route", "token", "cache", "batch", "soak", "replica")) for _ in range(rng.randint(8, 200)))
    b: dict = {"model": MODEL, "max_tokens": rng.randint(8, 96), "stream": stream}
    if chat:
        b["messages"] = [{"role": "user", "content": words}]
    else:
        b["prompt"] = words
    return b


async def one_request(session: aiohttp.ClientSession, base: str, rng: random.Random, tally: Tally, hang_s: float) -> None:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.monotonic()
    outcome = "ok"
    try:
        async with asyncio.timeout(hang_s):
            async with session.post(base + path, json=body(rng, chat, stream)) as resp:
                data = await resp.read()
                if resp.status != 200:
                    outcome = f"http_{resp.status}"
                elif stream:
                    text = data.decode(errors="replace")
                    if text.rstrip().endswith("data: [DONE]"):
                        outcome = "ok"
                    elif '"error"' in text:
                        outcome = "stream_error_event"
                    else:
                        outcome = "stream_cut"
                else:
                    try:
                        json.loads(data)["choices"]
                    except (ValueError, KeyError, TypeError):
                        outcome = "garbage_200"
    except TimeoutError:
        tally.hung += 1
        outcome = "hung"
    except aiohttp.ClientPayloadError:
        outcome = "stream_cut"
    except aiohttp.ClientError as exc:
        outcome = f"client_error_{type(exc).__name__}"
    tally.count(outcome, time.monotonic() - t0)


async def load(base: str, rate: float, until: float, tally: Tally, hang_s: float, seed: int) -> None:
    rng = random.Random(seed)
    tasks: set[asyncio.Task] = set()
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        next_t = time.monotonic()
        while time.monotonic() < until:
            next_t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            tally.sent += 1
            t = asyncio.create_task(one_request(session, base, random.Random(rng.random()), tally, hang_s))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)  # each is bounded by hang_s


# --- the router and the emulated replicas -----------------------------------------------------------------------


def emulate_argv(port: int, slowdown: float = 1.0) -> list[str]:
    return [sys.executable, "-m", "routewise_vllm.fleet", "emulate", "--port", str(port), "--profile", "llama3-8b-a100",
            "--model-name", MODEL, "--max-num-seqs", "8", "--slowdown", str(slowdown)]


def get(url: str, timeout: float = 5.0, admin: bool = False) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if admin:
        req.add_header("Authorization", f"Bearer {TOKEN}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def aget(url: str, admin: bool = False) -> tuple[int, bytes]:
    return await asyncio.to_thread(get, url, 5.0, admin)


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def metric_samples(text: str) -> dict[str, float]:
    """name -> the sum of its samples over every label set."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def by_replica(text: str, name: str) -> dict[str, float]:
    """replica label -> the sum of `name`'s samples with that label."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and "replica" in s.labels:
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def lines_on_disk(directory: Path) -> tuple[int, bool]:
    """(complete lines over every decision-log file, whether each file ends with a newline)."""
    n, whole = 0, True
    for p in sorted(directory.glob("decisions-*.jsonl")):
        data = p.read_bytes()
        n += data.count(b"\n")
        whole = whole and (not data or data.endswith(b"\n"))
    return n, whole


async def wait_until(cond, timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(interval_s)
    return await cond()


async def run(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir) if args.work_dir else Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    log_dir = work / "decisions"
    procs = Processes(work)
    broken = BrokenReplica()
    started = time.monotonic()
    result: dict = {"args": vars(args), "work_dir": str(work)}
    try:
        ports = {name: free_port() for name in ("steady", "killed", "slow")}
        emu = {
            "steady": procs.start("steady", emulate_argv(ports["steady"])),
            "killed": procs.start("killed", emulate_argv(ports["killed"])),
            "slow": procs.start("slow", emulate_argv(ports["slow"], slowdown=4.0)),
        }
        urls = [f"http://127.0.0.1:{ports[n]}" for n in ("steady", "killed", "slow")] + [await broken.start()]
        role = dict(zip(urls, ("steady", "killed", "slow", "broken")))
        rport = free_port()
        base = f"http://127.0.0.1:{rport}"
        argv = [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(rport),
                "--policy", args.policy, "--late-binding", "--admin-token", TOKEN, "--decision-log", str(log_dir),
                "--scrape-interval", "0.5", "--log-level", "warning"]
        for u in urls:
            argv += ["--replica", u]
        config = work / "router.json"  # no decision-log file is deleted: the count must match the lines
        config.write_text(json.dumps({"scrape_timeout_s": 0.5, "drain_timeout_s": 15, "decision_log_keep": 100000}))
        router = procs.start("router", argv + ["--config", str(config)])

        async def ready() -> bool:
            procs.check_alive()
            with contextlib.suppress(OSError, ValueError):
                status, b = await aget(base + "/ready")
                return status == 200 and json.loads(b)["healthy_replicas"] == len(urls)
            return False

        if not await wait_until(ready, 90):
            raise RuntimeError(f"router not ready with {len(urls)} replicas (logs in {work})")

        tally = Tally()
        t0 = time.monotonic()
        until = t0 + args.duration
        warmup = max(15.0, 0.1 * args.duration)
        rss: list[tuple[float, int]] = []
        kills: list[float] = []

        async def chaos() -> None:
            next_kill = t0 + args.kill_every
            while time.monotonic() + args.down_for < until:
                await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
                if time.monotonic() + args.down_for >= until:
                    break
                p = emu["killed"]
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                await asyncio.to_thread(p.wait)
                procs.procs = [(n, q) for n, q in procs.procs if q is not p]
                kills.append(round(time.monotonic() - t0, 1))
                await asyncio.sleep(args.down_for)
                emu["killed"] = procs.start("killed", emulate_argv(ports["killed"]))
                next_kill += args.kill_every

        async def sample_rss() -> None:
            while time.monotonic() < until:
                r = rss_bytes(router.pid)
                if r is not None:
                    rss.append((time.monotonic() - t0, r))
                await asyncio.sleep(5.0)

        load_task = asyncio.create_task(load(base, args.rate, until, tally, args.hang_s, args.seed))
        side = [asyncio.create_task(chaos()), asyncio.create_task(sample_rss())]
        await load_task
        for t in side:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        final_rss = rss_bytes(router.pid)
        load_s = time.monotonic() - t0

        # --- after the load: everything back to 0 ---------------------------------------------------------------
        end: dict = {}

        async def settled() -> bool:
            s1, st = await aget(base + "/admin/status", admin=True)
            s2, mt = await aget(base + "/metrics")
            s3, sv = await aget(base + "/admin/serving", admin=True)
            if (s1, s2, s3) != (200, 200, 200):
                return False
            status, m, dlog = json.loads(st), metric_samples(mt.decode()), json.loads(sv)["decision_log"]
            lines, whole = lines_on_disk(log_dir)
            end.update({
                "inflight": status["inflight"], "held": status["held"],
                "outstanding_requests_gauge": m.get("llm_router_outstanding_requests", 0.0),
                "held_requests_gauge": m.get("llm_router_held_requests", 0.0),
                "decision_log_records_total": m.get("llm_router_decision_log_records_total", 0.0),
                "decision_log_dropped_total": m.get("llm_router_decision_log_dropped_total", 0.0),
                "decision_log_written": dlog["written"], "decision_log_queued": dlog["queued"],
                "decision_log_lines": lines, "decision_log_whole_lines": whole,
            })
            return (end["inflight"] == 0 and not end["held"] and end["outstanding_requests_gauge"] == 0
                    and end["held_requests_gauge"] == 0 and end["decision_log_queued"] == 0
                    and end["decision_log_records_total"] == lines == end["decision_log_written"])

        end["settled"] = await wait_until(settled, 30.0)
        replicas = json.loads((await aget(base + "/admin/replicas", admin=True))[1])["replicas"]
        sent_to = by_replica((await aget(base + "/metrics"))[1].decode(), "llm_router_requests_total")
        procs.procs = [(n, q) for n, q in procs.procs if q is not router]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(router.pid, signal.SIGTERM)
        try:
            rc = await asyncio.to_thread(router.wait, 30)
        except subprocess.TimeoutExpired:
            os.killpg(router.pid, signal.SIGKILL)
            rc = None
        end["router_exit"] = rc
        end["decision_log_lines_after_exit"] = lines_on_disk(log_dir)[0]

        base_rss = next((r for t, r in rss if t >= warmup), rss[-1][1] if rss else None)
        result.update({
            "load_s": round(load_s, 1),
            "sent": tally.sent, "done": tally.done, "hung": tally.hung, "slowest_request_s": round(tally.slowest_s, 2),
            "outcomes": dict(sorted(tally.outcomes.items())),
            "kills_at_s": kills,
            "rss": {"after_warmup_mb": base_rss and round(base_rss / 2**20, 1),
                    "max_mb": rss and round(max(r for _, r in rss) / 2**20, 1),
                    "final_mb": final_rss and round(final_rss / 2**20, 1),
                    "growth": (round(final_rss / base_rss - 1, 4) if base_rss and final_rss else None),
                    "warmup_s": warmup,
                    # every tenth of the run: a growth that is still climbing at the end shows here
                    "trajectory_mb": [(round(t), round(r / 2**20, 1)) for t, r in rss[:: max(1, len(rss) // 10)]]},
            "end": end,
            "requests_by_replica": {role[f"http://{rid}"]: int(n) for rid, n in sent_to.items() if f"http://{rid}" in role},
            "ejections": {role[r["url"].rstrip("/")]: r["ejections"] for r in replicas},
            "breaker_trips": {role[r["url"].rstrip("/")]: r["breaker"]["trips"] for r in replicas},
        })
        return result
    finally:
        procs.stop()
        await broken.stop()
        result["wall_s"] = round(time.monotonic() - started, 1)


def outcome_failures(r: dict) -> list[str]:
    """The checks that do not depend on timing or the host (what CI asserts)."""
    out = []
    end = r["end"]
    if r["hung"] or r["done"] != r["sent"]:
        out.append(f"{r['hung']} hung, {r['sent'] - r['done']} never ended")
    if not end["settled"]:
        out.append(f"did not return to 0 after the load: {end}")
    if end["decision_log_records_total"] != end["decision_log_lines"] or not end["decision_log_whole_lines"]:
        out.append(f"decision log: {end['decision_log_records_total']} counted, {end['decision_log_lines']} lines")
    if end["decision_log_dropped_total"]:
        out.append(f"decision log dropped {end['decision_log_dropped_total']:.0f} records")
    if end["decision_log_lines_after_exit"] != end["decision_log_lines"]:
        out.append(f"decision log lines changed after exit: {end['decision_log_lines_after_exit']}")
    if end["router_exit"] != 0:
        out.append(f"router exit status {end['router_exit']}")
    return out


def verdict(r: dict) -> list[str]:
    out = outcome_failures(r)
    g = r["rss"]["growth"]
    if g is None or g >= RSS_GROWTH_TARGET:
        out.append(f"RSS grew {g} (target < {RSS_GROWTH_TARGET})")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second, Poisson (default 8)")
    p.add_argument("--kill-every", type=float, default=300.0, help="seconds between kills of the killed replica")
    p.add_argument("--down-for", type=float, default=10.0, help="seconds it stays down before its restart")
    p.add_argument("--hang-s", type=float, default=120.0, help="a request not ended after this long counts as hung")
    p.add_argument("--policy", default="learned", help="router policy (default learned)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="logs and the decision log (default $TMPDIR/soak-PID)")
    p.add_argument("--json", help="also write the figures to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    r = asyncio.run(run(args))
    r["date"] = datetime.date.today().isoformat()
    r["machine"] = f"{platform.node()} {os.cpu_count()} CPUs {platform.machine()}"
    failures = verdict(r)
    r["failures"] = failures
    print(json.dumps({k: v for k, v in r.items() if k != "args"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    print("soak: " + ("all targets met" if not failures else "MISSED: " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
