"""`router serve --workers N`: N worker processes acting as one router on one host.

The parent binds one SO_REUSEPORT listening socket per worker (so a port in use fails once, in the
parent, and the kernel spreads new connections evenly over the workers by hash; one shared socket lets
the busiest-awake worker accept nearly all of them), creates the shared in-flight load (router.scale.shared)
and the prometheus_client multiprocess directory, then forks the workers, each running the ordinary app
on its own sockets. A restarted worker's socket stays open in the parent, so its backlog waits for it.
Every worker probes and scrapes the replicas itself: that keeps each worker's health, breaker and scrape
state exactly as one router's (no staleness across processes) for N small scrapes per interval per
replica, which at N = cores is negligible next to vLLM's own /metrics cost.

SIGTERM/SIGINT to the parent is passed to every worker, which drains as a single router does; the
parent then removes the metrics directory. A worker that dies is restarted with its slot of in-flight
counts zeroed; other children of the parent (none of ours, but a library may start one) are reaped and
ignored. Workers die with the parent: a parent-death signal (Linux) and, everywhere, a pipe whose only
writer is the parent, so a worker sees end-of-file when the parent is gone however it ended; either one
makes the worker drain and exit. Metrics directories a killed parent left behind are removed at start.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("router.workers")

METRICS_PREFIX = "routewise-metrics-"
# A process that started this long after a metrics folder last changed cannot have made it or written in it:
# its pid was reused (a container's router restarted gets the same small pid). The margin covers the clock's
# granularity and small steps of the wall clock; a crash and restart within it leaves the folder for a later start.
PID_REUSE_MARGIN_S = 60.0


@dataclass(frozen=True, slots=True)
class WorkersConfig:
    """The settings of the same names (RouterSettings.workers_config builds it)."""

    host: str
    port: int
    ops_host: str | None  # None: host
    ops_port: int | None  # None: no ops listener
    workers: int
    drain_timeout_s: float


def bind(host: str, port: int, backlog: int = 1024, reuse_port: bool = True) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=backlog, reuse_port=reuse_port)
    sock.setblocking(False)
    return sock


class ListenError(OSError):
    """An address the router cannot listen on; strerror is the one line to show."""

    def __init__(self, err: int | None, host: str, port: int, why: str) -> None:
        super().__init__(err, f"cannot listen on {host}:{port}: {why}")


class _FdHolder:
    """A lock file's descriptor with a socket's close()."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def port_guard(host: str, port: int) -> socket.socket | _FdHolder:
    """Held for the router's life (the workers inherit it): a second router for host:port is refused.

    SO_REUSEPORT lets any process of the same user bind beside our listeners, so the kernel alone does
    not refuse a second router. Two checks do: this guard, and a probe bind without SO_REUSEPORT
    (listeners) that fails on any listener of an overlapping address, router or not. The probe alone
    leaves a window between it and the SO_REUSEPORT binds in which a second router starting at the same
    moment passes too; the guard closes it. It is a Linux abstract-namespace Unix socket: scoped to the
    network namespace as the port is, bound atomically, and released by the kernel when the last process
    holding it dies (kill -9 included), so it is never stale, unlike a lock file or a PID file. Elsewhere,
    an flock on a file in the temporary directory (also released on death, but scoped to that directory)."""
    key = f"routewise-port-{host}:{port}"
    if sys.platform.startswith("linux"):
        guard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            guard.bind("\0" + key)
            guard.listen(8)
        except OSError as exc:
            guard.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            why = f"another routewise router{_guard_holder(key)} is serving it"
            raise ListenError(errno.EADDRINUSE, host, port, why) from None
        return guard  # forked workers keep it open (not across exec: Python's descriptors are not inheritable)
    import fcntl

    path = Path(tempfile.gettempdir()) / (key.replace(":", "-").replace("/", "_") + ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ListenError(errno.EADDRINUSE, host, port, "another routewise router is serving it") from None
    return _FdHolder(fd)


def _guard_holder(key: str) -> str:
    """' (pid N)' of the router holding the guard, from the kernel's peer credentials; '' if unknown."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect("\0" + key)
            pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return f" (pid {pid})"
    except (OSError, AttributeError):
        return ""


def listeners(config: WorkersConfig) -> tuple[list[list[socket.socket]], list]:
    """([worker][public, ops?] sockets, guards to close last). One worker binds without SO_REUSEPORT, so the
    kernel refuses any other listener on its addresses. OSError names the address that could not be bound."""
    socks: list[list[socket.socket]] = []
    guards: list = []
    addrs = [(config.host, config.port)]
    if config.ops_port is not None:
        addrs.append((config.ops_host or config.host, config.ops_port))
    many = config.workers > 1
    host, port = addrs[0]
    try:
        if many:
            for host, port in addrs:
                guards.append(port_guard(host, port))
                bind(host, port, backlog=1, reuse_port=False).close()  # the probe (port_guard's docstring)
        for _ in range(config.workers):
            socks.append([])
            for host, port in addrs:
                socks[-1].append(bind(host, port, reuse_port=many))
    except OSError as exc:
        for s in (*(s for ws in socks for s in ws), *guards):
            s.close()
        if isinstance(exc, ListenError):
            raise
        why = (exc.strerror or str(exc)).split(" (while attempting to bind")[0]  # socket.create_server's suffix
        raise ListenError(exc.errno, host, port, why.lower()) from None
    return socks, guards


def clean_stale_metrics_dirs(tmpdir: str | None = None) -> list[Path]:
    """Removes the metrics directories (METRICS_PREFIX<parent pid>-*) whose processes are all gone: the
    parent named in the directory and every process that wrote a file in it (prometheus_client names them
    <kind>_<pid>.db). A pid whose process started after the directory last changed (PID_REUSE_MARGIN_S) is
    another process's, this one's included. A directory with no process to judge by, or another user's, is
    left alone."""
    removed = []
    for path in Path(tmpdir or tempfile.gettempdir()).glob(METRICS_PREFIX + "*"):
        try:
            st = path.lstat()
            if path.is_symlink() or not path.is_dir() or st.st_uid != os.getuid():
                continue
            m = re.match(re.escape(METRICS_PREFIX) + r"(\d+)-", path.name)
            pids = {int(m.group(1))} if m else set()
            pids |= {int(f.stem.rsplit("_", 1)[1]) for f in path.glob("*_*.db") if f.stem.rsplit("_", 1)[1].isdigit()}
        except OSError:
            continue
        if pids and not any(_alive(p) and not _started_after(p, st.st_mtime + PID_REUSE_MARGIN_S) for p in pids):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("removed %s: left by router processes that are gone (%s)", path, ", ".join(map(str, sorted(pids))))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # a zombie has exited: an orphaned worker waits as one where nothing reaps orphans (some containers' init)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _started_after(pid: int, when: float) -> bool:
    """Whether process `pid` started after `when` (unix time); False when that cannot be read (not Linux)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK") > when
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def run_workers(config: WorkersConfig, worker_main: Callable[[list[socket.socket], tuple], int]) -> int:
    """Runs config.workers workers until SIGTERM/SIGINT; `worker_main(socks, (shared load, slot))` is one
    worker's life (router.cli.serve_worker with that slot's settings). Returns the exit status. OSError
    (ListenError) when an address cannot be listened on."""
    socks, guards = listeners(config)
    clean_stale_metrics_dirs()
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")  # the pid: clean_stale_metrics_dirs
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    if "prometheus_client" in sys.modules:
        # prometheus_client picks its value class at import; the workers build every metric after the fork,
        # so choosing it again here makes theirs multiprocess even if the parent imported it (policy checks)
        from prometheus_client import values

        values.ValueClass = values.get_value_class()
    from routewise_vllm.router.scale.shared import SharedLoad

    load = SharedLoad(config.workers)
    parent = os.getpid()
    watch_r, watch_w = os.pipe()  # the parent holds the only write end: end-of-file for the workers when it is gone
    children: dict[int, int] = {}  # worker pid -> slot
    stopping = False
    grace_s = config.drain_timeout_s + 5.0

    def spawn(slot: int) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.close(watch_w)
                _die_with_parent(parent, watch_r, grace_s)
                for other in socks:
                    if other is not socks[slot]:
                        for s in other:
                            s.close()
                code = worker_main(socks[slot], (load, slot))
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
        for slot in range(config.workers):
            spawn(slot)
        log.info("%d workers on http://%s:%d", config.workers, config.host, config.port)
        deadline: float | None = None
        while children:
            if stopping and deadline is None:
                deadline = time.monotonic() + grace_s
            pid, status = _reap()
            if pid == 0:
                if deadline is not None and time.monotonic() > deadline:
                    log.warning("workers still running %.0f s after SIGTERM: killing them", grace_s)
                    for p in children:
                        _kill(p, signal.SIGKILL)
                time.sleep(0.05)
                continue
            slot = children.pop(pid, None)
            if slot is None:  # not a worker (a library's helper process, e.g. multiprocessing's resource tracker)
                log.info("child process %d (not a worker) exited with status %d", pid, status)
                continue
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
        for s in (*(s for ws in socks for s in ws), *guards):
            s.close()
        os.close(watch_w)
        os.close(watch_r)
        load.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        log.info("stopped")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int, watch_fd: int, grace_s: float) -> None:
    """In a worker: SIGTERM (drain, as on the parent's own SIGTERM) once the parent is gone, and exit
    `grace_s` later if draining has not ended. The parent-death signal is immediate on Linux; the pipe is the
    backstop everywhere (end-of-file once the parent's write end closes, by exit or kill -9)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        try:
            while os.read(watch_fd, 1):
                pass
        except OSError:
            pass
        log.error("the router's parent process is gone: worker draining and exiting")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


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
