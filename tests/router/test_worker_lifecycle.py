"""A worker lifecycle to trust (`router serve --workers N`, real subprocesses on loopback, fake replicas):
workers die with their parent, the parent ignores children that are not workers, a worker killed while it
reads the shared state leaves nothing locked, a second router on the port and a busy port are one line,
and metrics folders of dead routers are cleaned at start. Every wait is on an event, bounded by a generous
outer timeout; each test stops only the processes it started (their process group)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from routewise_vllm.router.scale.shared import SharedLoad
from routewise_vllm.router.scale.workers import ListenError, clean_stale_metrics_dirs, port_guard
from tests.fakes.harness import wait_router_ready
from tests.router.test_workers import AUTH, ROOT, TOKEN, Workers, _draining, _free_port

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


def _state(pid: int) -> str | None:
    """The process's state letter from /proc, None when it no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")  # a zombie has exited (an orphan's reaper may be slow or absent)


def _children(ppid: int) -> set[int]:
    kids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    kids.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


async def until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Polls `cond`; `timeout` is an outer bound for a busy host, never what a test measures."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.05)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "ROUTEWISE_ADMIN_TOKEN": TOKEN, **(extra or {})}


async def _spawn(args: list[str], stderr: Path, *, prelude: str = "", env: dict[str, str] | None = None):
    """`router serve ARGS` in a new process group; `prelude` runs first in the parent (a test's fault)."""
    code = f"{prelude}\nimport sys\nfrom router.cli import main\nsys.exit(main(sys.argv[1:]))"
    with stderr.open("ab") as err:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, "serve", *args, env=_env(env), cwd=ROOT, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=err)


def _stop_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives a killed parent: orphaned workers are in it
    except ProcessLookupError:
        pass


@asynccontextmanager
async def router(reps, tmp_path: Path, *args: str, port: int | None = None, workers: int = 2, prelude: str = "",
                 env: dict[str, str] | None = None) -> AsyncIterator[Workers]:
    """A ready `router serve --workers N` with one pinned session per worker."""
    port = port or _free_port()
    url = f"http://127.0.0.1:{port}"
    stderr = tmp_path / f"router-{port}.err"
    proc = await _spawn(["--workers", str(workers), "--host", "127.0.0.1", "--port", str(port), "--replica",
                         reps[0].url, "--replica", reps[1].url, "--log-level", "warning", *args],
                        stderr, prelude=prelude, env=env)
    w = Workers(proc, url)
    w.port = port  # type: ignore[attr-defined]
    try:
        await wait_router_ready(url, proc, stderr)
        for _ in range(workers):
            await w.pinned()
        yield w
    finally:
        for s in w.sessions:
            await s.close()
        if proc.returncode is None:
            _stop_group(proc)
            await proc.wait()
        else:
            _stop_group(proc)


async def _run_to_exit(args: list[str], tmp_path: Path, name: str) -> tuple[int, list[str]]:
    """Runs `router serve ARGS` expected to exit by itself: (exit status, non-empty stderr lines)."""
    stderr = tmp_path / f"{name}.err"
    proc = await _spawn(args, stderr)
    try:
        rc = await asyncio.wait_for(proc.wait(), 60)
    except asyncio.TimeoutError:
        _stop_group(proc)
        await proc.wait()
        pytest.fail(f"{name}: still running after 60 s; it should have refused to start")
    return rc, [line for line in stderr.read_text().splitlines() if line.strip()]


async def _complete(s: aiohttp.ClientSession, url: str) -> None:
    async def one() -> None:
        async with s.post(url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()

    try:
        await asyncio.wait_for(one(), 30)
    except asyncio.TimeoutError:
        pytest.fail("a worker did not answer a completion within 30 s (blocked?)")


# Workers learn of the parent's death twice: the parent-death signal (Linux) and the pipe (everywhere). This
# prelude leaves them the pipe only, by asking prctl for an option that does not exist.
PIPE_ONLY = """
import routewise_vllm.router.scale.workers
from routewise_vllm import router
router.scale.workers.PR_SET_PDEATHSIG = -1
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("prelude", ["", PIPE_ONLY], ids=["death-signal-and-pipe", "pipe-only"])
async def test_workers_exit_with_a_killed_parent_the_port_is_freed_and_the_next_router_cleans_up(
        prelude, fakes, tmp_path):
    reps = await fakes(2)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}  # the routers' metrics folders land here, not in the host's /tmp
    async with router(reps, tmp_path, "--policy", "least-outstanding", prelude=prelude, env=env) as w:
        pids, port = set(w.by_pid), w.port  # type: ignore[attr-defined]
        [left] = tmp.glob("routewise-metrics-*")
        await _complete(next(iter(w.by_pid.values())), w.url)
        w.proc.kill()
        await w.proc.wait()
        await until(lambda: all(_gone(p) for p in pids), "the workers exit after their parent was killed")
        socket.create_server(("127.0.0.1", port)).close()  # no SO_REUSEPORT: binds only if nothing listens
        assert left.is_dir()  # a killed parent cannot remove it
    async with router(reps, tmp_path, "--policy", "least-outstanding", port=port, env=env) as w:
        assert not left.exists(), "the next router left the dead router's metrics folder"
        assert len(list(tmp.glob("routewise-metrics-*"))) == 1  # its own
        await _complete(next(iter(w.by_pid.values())), w.url)
        w.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(w.proc.wait(), 60) == 0
    assert list(tmp.glob("routewise-metrics-*")) == []


# The fault: the first worker to parse the shared admin command naming "die-while-syncing" is SIGKILLed in
# the middle of reading it (inside router.scale.shared's read of the command, on its 0.1 s sync tick)
DIE_WHILE_SYNCING = """
import json, os, signal, types
import routewise_vllm.router.scale.shared
from routewise_vllm import router
def _loads(raw, _real=json.loads):
    if b"die-while-syncing" in (raw if isinstance(raw, bytes) else raw.encode()):
        try:
            fd = os.open(os.environ["RW_DIE_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
    return _real(raw)
router.scale.shared.json = types.SimpleNamespace(dumps=json.dumps, loads=_loads)
"""


@pytest.mark.timeout(240)
async def test_a_worker_killed_while_it_syncs_leaves_the_others_serving_and_following(fakes, tmp_path):
    reps = await fakes(2)
    mark = tmp_path / "died"
    async with router(reps, tmp_path, "--policy", "learned", prelude=DIE_WHILE_SYNCING,
                      env={"RW_DIE_MARK": str(mark)}) as w:
        sa = next(iter(w.by_pid.values()))
        async with sa.get(w.url + "/admin/serving", headers=AUTH) as resp:
            model = Path((await resp.json())["reload"]["main"]["path"])
        copy = tmp_path / "die-while-syncing.onnx"
        shutil.copy(model, copy)
        if model.with_suffix(".json").exists():
            shutil.copy(model.with_suffix(".json"), copy.with_suffix(".json"))
        async with sa.post(w.url + "/admin/policy/reload", json={"path": str(copy)}, headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
        await until(mark.exists, "a worker read the shared command")
        await until(lambda: mark.read_text() != "", "the dying worker wrote its pid")
        dead = int(mark.read_text())
        assert dead in w.by_pid
        await until(lambda: _gone(dead), "the worker was killed")
        [survivor] = [pid for pid in w.by_pid if pid != dead]
        for _ in range(3):  # the survivor's sync ticks go on: it is not stuck behind the dead worker
            await _complete(w.by_pid[survivor], w.url)
        w.by_pid.pop(dead)
        restarted = await w.pinned()  # the parent restarted the dead one: it starts past the shared state too
        await _complete(restarted, w.url)
        rid = reps[0].url.removeprefix("http://")
        async with restarted.post(f"{w.url}/admin/replicas/{rid}/drain", headers=AUTH) as resp:
            assert resp.status == 200
        sv = w.by_pid[survivor]
        deadline = asyncio.get_running_loop().time() + 60
        while not await asyncio.wait_for(_draining(sv, w.url, rid), 30):
            assert asyncio.get_running_loop().time() < deadline, "a drain did not reach the survivor"
            await asyncio.sleep(0.05)
        before = reps[0].requests
        for _ in range(3):
            await _complete(sv, w.url)
        assert reps[0].requests == before
        w.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(w.proc.wait(), 60) == 0


# A child of the router's parent that is not a worker, as multiprocessing's resource tracker is
OTHER_CHILD = """
import subprocess, sys
_other_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
"""


@pytest.mark.timeout(240)
async def test_a_child_that_is_not_a_worker_exiting_leaves_the_router_serving(fakes, tmp_path):
    reps = await fakes(2)
    async with router(reps, tmp_path, "--policy", "least-outstanding", prelude=OTHER_CHILD) as w:
        others = _children(w.proc.pid) - set(w.by_pid)
        assert others, "the parent has no child other than its workers"
        for pid in others:  # the test's child; a resource tracker too if the router has one
            os.kill(pid, signal.SIGKILL)
        # only the parent can reap its children: once gone from /proc, it has handled their exit
        await until(lambda: all(_state(p) is None for p in others), "the parent reaped its other children")
        for s in w.by_pid.values():
            await _complete(s, w.url)
        assert set(w.by_pid) <= _children(w.proc.pid), "the workers were replaced"
        w.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(w.proc.wait(), 60) == 0


@pytest.mark.timeout(240)
async def test_a_second_router_on_the_same_port_is_refused_in_one_line(fakes, tmp_path):
    reps = await fakes(2)
    async with router(reps, tmp_path, "--policy", "least-outstanding") as w:
        port = w.port  # type: ignore[attr-defined]
        rc, lines = await _run_to_exit(["--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--replica",
                                        reps[0].url, "--policy", "least-outstanding"], tmp_path, "second")
        assert rc != 0
        assert len(lines) == 1, lines
        assert f"127.0.0.1:{port}" in lines[0] and "another routewise router" in lines[0], lines
        for s in w.by_pid.values():  # the first one is untouched
            await _complete(s, w.url)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
async def test_a_busy_port_is_one_line_and_a_nonzero_exit(workers, tmp_path):
    # the occupant allows SO_REUSEPORT, as another process of this user serving on it may
    with socket.socket() as occupant:
        occupant.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        occupant.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        rc, lines = await _run_to_exit(["--workers", str(workers), "--host", "127.0.0.1", "--port", str(port),
                                        "--replica", "http://127.0.0.1:9", "--policy", "least-outstanding"],
                                       tmp_path, f"busy-{workers}")
    assert rc != 0
    assert len(lines) == 1, lines
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_metrics_folders_whose_processes_are_all_gone_are_cleaned(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    folders = {
        f"routewise-metrics-{dead}-a": [f"counter_{dead}.db"],  # parent and writers gone: removed
        f"routewise-metrics-{dead}-b": [f"counter_{alive}.db"],  # a writer still runs: kept
        f"routewise-metrics-{alive}-c": [],  # its parent runs: kept
        "routewise-metrics-old1": [f"gauge_livesum_{dead}.db", f"histogram_{dead}.db"],  # no pid in the name: files
        "routewise-metrics-old2": [],  # nothing to judge by: kept
        f"other-{dead}": [f"counter_{dead}.db"],  # not ours: kept
    }
    for name, files in folders.items():
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_bytes(b"")
    removed = clean_stale_metrics_dirs(str(tmp_path))
    assert sorted(p.name for p in removed) == sorted([f"routewise-metrics-{dead}-a", "routewise-metrics-old1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(folders) - {p.name for p in removed})


@pytest.mark.timeout(60)
def test_a_process_killed_while_writing_the_shared_state_blocks_no_one():
    load = SharedLoad(2)
    try:
        assert load.publish_command({"op": "reload", "arm": "main", "path": "a.onnx"}) == 1
        pid = os.fork()
        if pid == 0:  # a worker killed in the middle of publishing a command, holding the writers' lock
            with load._writing():
                load.command_head[0] += 1  # the sequence is odd while a writer writes
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        seq, cmd = load.last_command()  # no wait, no torn command
        assert (seq, cmd) == (1, None)
        assert load.column("r0:1") == 0  # the kernel released the dead writer's lock
        seq = load.publish_command({"op": "reload", "arm": "main", "path": "b.onnx"})
        assert load.last_command() == (seq, {"op": "reload", "arm": "main", "path": "b.onnx"}) and seq > 1
        assert load.column("r1:1") == 1 and load.column("r0:1") == 0
    finally:
        load.close()


@pytest.mark.timeout(60)
def test_the_port_guard_refuses_a_second_holder_and_dies_with_its_holder():
    """The guard closes the window in which two routers starting at once both pass the probe bind."""
    port = _free_port()
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a router process holding the guard of 127.0.0.1:port
        try:
            guard = port_guard("127.0.0.1", port)  # noqa: F841 - held until this process is killed
            os.write(ready_w, b"1")
            os.read(hold_r, 1)  # until killed
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        with pytest.raises(ListenError) as err:
            port_guard("127.0.0.1", port)
        assert f"cannot listen on 127.0.0.1:{port}: another routewise router" in err.value.strerror
        if sys.platform.startswith("linux"):
            assert f"(pid {pid})" in err.value.strerror
        port_guard("127.0.0.2", port).close()  # another address is another guard (the probe judges overlaps)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, hold_r, hold_w):
            os.close(fd)
    port_guard("127.0.0.1", port).close()  # released with its holder's death
