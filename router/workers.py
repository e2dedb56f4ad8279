"""`router serve --workers N`: N worker processes acting as one router on one host.

The parent binds one SO_REUSEPORT listening socket per worker (so a port in use fails once, in the
parent, and the kernel spreads new connections evenly over the workers by hash; one shared socket lets
the busiest-awake worker accept nearly all of them), creates the shared in-flight load (router.shared)
and the prometheus_client multiprocess directory, then forks the workers, each running the ordinary app
on its own sockets. A restarted worker's socket stays open in the parent, so its backlog waits for it. Every worker probes and
scrapes the replicas itself: that keeps each worker's health, breaker and scrape state exactly as one
router's (no staleness across processes) for N small scrapes per interval per replica, which at
N = cores is negligible next to vLLM's own /metrics cost.

SIGTERM/SIGINT to the parent is passed to every worker, which drains as a single router does; the
parent then removes the metrics directory (the shared memory has no name once the workers are forked). A worker that dies is restarted with
its slot of in-flight counts zeroed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable

from router.settings import RouterSettings

log = logging.getLogger("router.workers")


def bind(host: str, port: int, backlog: int = 1024) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=backlog, reuse_port=True)
    sock.setblocking(False)
    return sock


def listeners(settings: RouterSettings) -> list[list[socket.socket]]:
    """[worker][public, ops?] sockets; OSError names the address that could not be bound."""
    socks: list[list[socket.socket]] = []
    addrs = [(settings.host, settings.port)]
    if settings.ops_port is not None:
        addrs.append((settings.ops_host or settings.host, settings.ops_port))
    try:
        for _ in range(settings.workers):
            socks.append([])
            for host, port in addrs:
                socks[-1].append(bind(host, port))
    except OSError as exc:
        for s in (s for ws in socks for s in ws):
            s.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return socks


def worker_settings(settings: RouterSettings, slot: int) -> RouterSettings:
    """Worker `slot`'s settings: its own decision log directory, DIR/worker-<slot> (files of one writer each,
    so rotation and `keep` stay per file set; read each worker's directory)."""
    if settings.decision_log_dir is None:
        return settings
    return settings.model_copy(update={"decision_log_dir": settings.decision_log_dir / f"worker-{slot}"})


def run_workers(settings: RouterSettings, worker_main: Callable[..., int]) -> int:
    """Runs settings.workers workers until SIGTERM/SIGINT; `worker_main(settings, socks, shared)` is one
    worker's life (router.cli.serve_worker). Returns the exit status."""
    socks = listeners(settings)
    if "prometheus_client" in __import__("sys").modules:
        raise RuntimeError("prometheus_client was imported before the workers' metrics directory was set")
    metrics_dir = tempfile.mkdtemp(prefix="routewise-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from router.shared import SharedLoad

    load = SharedLoad(settings.workers, multiprocessing.get_context("fork").Lock())
    load.unlink()  # forked workers inherit the mapping: no name is needed, and none is left behind even on SIGKILL
    children: dict[int, int] = {}  # pid -> slot
    stopping = False

    def spawn(slot: int) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                for other in socks:
                    if other is not socks[slot]:
                        for s in other:
                            s.close()
                code = worker_main(worker_settings(settings, slot), socks[slot], (load, slot))
            except BaseException:  # noqa: BLE001 - a worker's crash is logged, the parent restarts it
                log.exception("worker %d failed", slot)
            finally:
                logging.shutdown()
                os._exit(code)
        children[pid] = slot

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            _kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for slot in range(settings.workers):
            spawn(slot)
        log.info("%d workers on http://%s:%d", settings.workers, settings.host, settings.port)
        deadline: float | None = None
        while children:
            if stopping and deadline is None:
                deadline = time.monotonic() + settings.drain_timeout_s + 5.0
            pid, status = _reap()
            if pid == 0:
                if deadline is not None and time.monotonic() > deadline:
                    log.warning("workers still running %.0f s after SIGTERM: killing them", settings.drain_timeout_s + 5)
                    for p in children:
                        _kill(p, signal.SIGKILL)
                time.sleep(0.05)
                continue
            slot = children.pop(pid)
            _mark_dead(pid)
            if not stopping:
                log.error("worker %d (pid %d) exited with status %d: restarting it", slot, pid, status)
                load.clear_slot(slot)
                time.sleep(0.5)
                spawn(slot)
        return 0
    finally:
        for pid in children:  # only on an error in the parent itself
            _kill(pid, signal.SIGKILL)
        for ws in socks:
            for s in ws:
                s.close()
        load.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        log.info("stopped")


def _reap() -> tuple[int, int]:
    try:
        pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return 0, 0
    return pid, (os.waitstatus_to_exitcode(status) if pid else 0)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _mark_dead(pid: int) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)
