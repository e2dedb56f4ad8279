"""`router serve --workers N`: the workers share one view of the host's in-flight load, aggregate their
metrics, apply admin drains everywhere and all drain on SIGTERM (loopback, fake replicas)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.router.policy.types import RequestInfo
from routewise_vllm.router.scale.shared import SharedClusterTracker, SharedLoad
from tests.ci import skip_or_fail
from tests.fakes.harness import wait_router_ready
from tests.router.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("compiled", [True, False], ids=["C", "numpy"])
def test_a_dispatch_by_one_worker_is_in_the_other_workers_view(compiled, monkeypatch):
    import routewise_vllm.router.scale.shared
    from routewise_vllm import router

    if compiled:  # the C extension beside router/scale/ (shared_c/), its own, not the learned policy's
        if router.scale.shared._compiled is None:
            skip_or_fail("the C extension router.scale._shared is not built (no C compiler at install)")
        assert router.scale.shared._compiled.__name__ == "routewise_vllm.router.scale._shared"
    else:
        monkeypatch.setattr(router.scale.shared, "_compiled", None)
    load = SharedLoad(2)
    try:
        a, b = SharedClusterTracker(load, 0), SharedClusterTracker(load, 1)
        for c in (a, b):
            c.add("r0:1")
            c.add("r1:1")
        req = RequestInfo("q1", prompt_tokens_est=100, max_tokens=50)
        a.dispatch(1, req)
        snap = b.view(0.0, RequestInfo("q2", 10)).replicas[1]
        assert (snap.outstanding, snap.outstanding_prompt_tokens, snap.outstanding_decode_tokens) == (1, 100, 50)
        assert (snap.awaiting_first_token, snap.awaiting_prompt_tokens) == (1, 100)
        b.dispatch(1, RequestInfo("q3", 10, max_tokens=5))
        assert a.view(0.0, req).replicas[1].outstanding == 2
        a.trackers[1].on_first_token("q1", 0.1)
        a.trackers[1].on_complete("q1")
        snap = b.view(0.0, req).replicas[1]
        assert (snap.outstanding, snap.outstanding_prompt_tokens, snap.awaiting_first_token) == (1, 10, 1)
        assert b.view(0.0, req).replicas[0].outstanding == 0
        b.trackers[1].on_complete("q3")
        assert load.counters[..., :5].sum() == 0  # all released (dispatched_since_scrape waits for a scrape)
    finally:
        load.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


async def _pid(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/admin/status", headers=AUTH) as resp:
        return (await resp.json())["pid"]


class Workers:
    """`router serve --workers 2` in a subprocess, with one one-connection session pinned to each worker."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc, self.url = proc, url
        self.sessions: list[aiohttp.ClientSession] = []
        self.by_pid: dict[int, aiohttp.ClientSession] = {}

    async def pinned(self, pid: int | None = None) -> aiohttp.ClientSession:
        """A new one-connection session on worker `pid` (any worker not yet pinned, if None)."""
        for _ in range(60):
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            self.sessions.append(s)
            got = await _pid(s, self.url)
            if got == pid or (pid is None and got not in self.by_pid):
                self.by_pid.setdefault(got, s)
                return s
            await asyncio.sleep(0.05)  # the other worker may still be starting
        raise AssertionError(f"no connection reached worker {pid} in 60 tries")


@asynccontextmanager
async def workers(reps, *args: str) -> AsyncIterator[Workers]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ROUTEWISE_ADMIN_TOKEN": TOKEN}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "routewise_vllm.router", "serve", "--workers", "2", "--host", "127.0.0.1", "--port", str(port),
        "--replica", reps[0].url, "--replica", reps[1].url, "--policy", "least-outstanding",
        "--log-level", "warning", *args, env=env, cwd=ROOT, start_new_session=True)
    w = Workers(proc, url)
    try:
        await wait_router_ready(url, proc)
        await w.pinned()
        await w.pinned()
        yield w
    finally:
        for s in w.sessions:
            await s.close()
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


@pytest.mark.timeout(90)
async def test_worker_b_sees_and_decides_on_worker_as_requests_then_sigterm_drains_all(fakes):
    reps = await fakes(2, token_delay_s=0.05)
    shm_before = set(os.listdir("/dev/shm"))
    async with workers(reps, "--scrape-interval", "0.2") as w:
        pid_a, pid_b = w.by_pid
        sb = w.by_pid[pid_b]
        a_slow = await w.pinned(pid_a)  # a second connection to worker A
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 40}  # 2 s at 50 ms a token
        first = asyncio.create_task(a_slow.post(w.url + "/v1/completions", json=body))
        await wait_for(lambda: reps[0].active + reps[1].active == 1)
        # worker B reports, and decides on, the request worker A has in flight
        assert await _metric(sb, w.url, "llm_router_outstanding_requests") == 1
        second = asyncio.create_task(sb.post(w.url + "/v1/completions", json=body))
        await wait_for(lambda: reps[0].active + reps[1].active == 2)
        assert (reps[0].active, reps[1].active) == (1, 1), "worker B sent its request to the busy replica"
        # SIGTERM while both are in flight: both finish, then everything stops
        w.proc.send_signal(signal.SIGTERM)
        for t in (first, second):
            resp = await asyncio.wait_for(t, 10)
            assert resp.status == 200
            await resp.read()
        assert await asyncio.wait_for(w.proc.wait(), 20) == 0
    assert {f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith("psm_")} == set()


async def _draining(s: aiohttp.ClientSession, url: str, rid: str) -> bool:
    async with s.get(url + "/admin/replicas", headers=AUTH) as resp:
        reps = (await resp.json())["replicas"]
    return next(r for r in reps if r["id"] == rid)["draining"]


@pytest.mark.timeout(90)
async def test_metrics_aggregate_and_drain_reaches_every_worker(fakes):
    reps = await fakes(2)
    async with workers(reps) as w:
        sa, sb = w.by_pid.values()
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        for s, n in ((sa, 3), (sb, 4)):
            for _ in range(n):
                async with s.post(w.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
        for s in (sa, sb):  # either worker's /metrics counts both workers' requests
            assert await _metric(s, w.url, "llm_router_requests_total") == 7
            assert await _metric(s, w.url, "llm_router_e2e_latency_seconds_count") == 7
        rid = reps[0].url.removeprefix("http://")
        async with sa.post(f"{w.url}/admin/replicas/{rid}/drain", headers=AUTH) as resp:
            assert resp.status == 200
        for _ in range(50):
            if await _draining(sb, w.url, rid):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("a drain through worker A did not reach worker B")
        before = reps[0].requests
        for _ in range(3):
            async with sb.post(w.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
        assert reps[0].requests == before
        w.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(w.proc.wait(), 20) == 0


@pytest.mark.timeout(90)
async def test_an_admin_reload_through_one_worker_reloads_every_worker(fakes, tmp_path):
    reps = await fakes(2)
    async with workers(reps, "--policy", "learned", "--decision-log", str(tmp_path)) as w:
        sa, sb = w.by_pid.values()

        async def reloads(s: aiohttp.ClientSession) -> int:
            async with s.get(w.url + "/admin/serving", headers=AUTH) as resp:
                return len((await resp.json())["reload"]["main"]["history"])

        before = await reloads(sb)
        async with sa.post(w.url + "/admin/policy/reload", headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
        for _ in range(100):
            if await reloads(sb) == before + 1:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("a reload through worker A did not reach worker B")
        # and one through worker B: once A has it, A has also handled everything its own reload broadcast
        async with sb.post(w.url + "/admin/policy/reload", headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
        for _ in range(100):
            if await reloads(sa) >= before + 2 and await reloads(sb) >= before + 2:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("a reload through worker B did not reach worker A")
        assert (await reloads(sa), await reloads(sb)) == (before + 2, before + 2)  # no worker repeats its own
        async with sb.post(w.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}) as resp:
            assert resp.status == 200
        w.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(w.proc.wait(), 20) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]  # one writer per log file


def test_a_replica_removed_and_added_again_keeps_its_requests_in_flight_counted_once():
    load = SharedLoad(1)
    try:
        c = SharedClusterTracker(load, 0)
        c.add("r0:1")
        old = c.dispatch(0, RequestInfo("q1", 10))
        c.remove("r0:1")
        assert c.add("r0:1") is old
        c.dispatch(0, RequestInfo("q2", 10))
        old.on_complete("q1")
        assert c.view(0.0, RequestInfo("q3", 1)).replicas[0].outstanding == 1
    finally:
        load.close()


@pytest.mark.timeout(90)
async def test_a_worker_that_dies_is_restarted_with_its_in_flight_counts_cleared(fakes):
    reps = await fakes(2, token_delay_s=0.05)
    async with workers(reps) as w:
        pid_a, pid_b = w.by_pid
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 200}  # 10 s: still in flight when A dies
        doomed = asyncio.create_task(w.by_pid[pid_a].post(w.url + "/v1/completions", json=body))
        await wait_for(lambda: reps[0].active + reps[1].active == 1)
        assert await _metric(w.by_pid[pid_b], w.url, "llm_router_outstanding_requests") == 1
        os.kill(pid_a, signal.SIGKILL)
        with pytest.raises(aiohttp.ClientError):
            await asyncio.wait_for(doomed, 10)
        w.by_pid.pop(pid_a)
        restarted = await w.pinned()  # a connection to a worker that is neither B nor the dead A
        assert await _pid(restarted, w.url) not in (pid_a, pid_b)
        assert await _metric(w.by_pid[pid_b], w.url, "llm_router_outstanding_requests") == 0
        w.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(w.proc.wait(), 20) == 0
