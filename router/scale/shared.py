"""One host's in-flight load shared by the router's worker processes (`router serve --workers N`).

A shared anonymous mapping (inherited by the forked workers: it has no name, so nothing is left behind
even when every process is SIGKILLed, and no resource-tracker process is needed) holds, per worker slot
and per replica column, the counters decisions read (outstanding requests, outstanding prompt/decode
tokens, requests awaiting a first token and their prompt tokens, dispatches since the last scrape). Each
worker writes only its own slot row; readers sum the rows, so a worker's view counts every request the
host has in flight, not its own slice. Replica ids map to columns through a name table so every worker
agrees, and a per-column draining flag carries admin drain/restore to all workers.

No lock a dead process can hold: every read (the 0.1 s sync tick, every decision) is lock-free. Counters
are single-writer rows and draining flags single words; the admin command is a seqlock (odd sequence while written,
a CRC over the body) that readers retry and never wait on. The two rare writes that several workers make
(claiming a column, publishing a command) take a POSIX record lock (fcntl), which the kernel releases
when its holder dies, and wait for it a bounded time.

`SharedClusterTracker` is a `ClusterTracker` whose trackers keep this sharing out of router/policy:
the policy hooks run unchanged on the worker's own counters and publish them; views read the sums.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from routewise_vllm.router.policy.tracking import ClusterTracker, ReplicaTracker
from routewise_vllm.router.policy.types import ClusterView, RequestInfo

try:  # numpy's sum and slice assignment cost tens of microseconds on the cold caches of a live decision
    from routewise_vllm.router.scale import _shared as _compiled  # shared_c/shared.c
except ImportError:  # built without a C compiler: numpy does it (the reference)
    _compiled = None

log = logging.getLogger("router.shared")

FIELDS = ("outstanding", "outstanding_prompt_tokens", "outstanding_decode_tokens", "awaiting_first_token",
          "awaiting_prompt_tokens", "dispatched_since_scrape")
_NAME_BYTES = 128  # byte 0: the name's length, written last (a row is claimed once it is set); then the name
_COMMAND_BYTES = 4096
WRITE_LOCK_WAIT_S = 2.0  # a writer holds the lock for microseconds; only a stopped (SIGSTOP) holder can exceed this


class SharedLoad:
    """The segment: counters int64[workers, max_replicas, len(FIELDS)], draining flags int64[max_replicas],
    replica names bytes[max_replicas, 128], the last admin command (sequence, length, CRC32, JSON bytes) for
    the other workers to repeat. The parent creates it before forking the workers, which inherit it."""

    def __init__(self, workers: int, max_replicas: int = 256) -> None:
        self.workers, self.max_replicas = workers, max_replicas
        n_counters = workers * max_replicas * len(FIELDS)
        names_at = 8 * (n_counters + max_replicas)
        command_at = names_at + _NAME_BYTES * max_replicas
        size = command_at + 24 + _COMMAND_BYTES
        self.mem = mmap.mmap(-1, size)  # anonymous, MAP_SHARED: zeroed, shared with every process forked later
        self.counters = np.ndarray((workers, max_replicas, len(FIELDS)), np.int64, self.mem)
        self.draining = np.ndarray((max_replicas,), np.int64, self.mem, offset=8 * n_counters)
        self.names = np.ndarray((max_replicas, _NAME_BYTES), np.uint8, self.mem, offset=names_at)
        self.command_head = np.ndarray((3,), np.int64, self.mem, offset=command_at)  # seqlock sequence, length, crc32
        self.command_body = np.ndarray((_COMMAND_BYTES,), np.uint8, self.mem, offset=command_at + 24)
        # POSIX record locks belong to a process (not to the file descriptor the workers inherit), so the
        # workers exclude each other on this one unlinked file, and the kernel drops a dead holder's lock
        self._lock_file = tempfile.TemporaryFile(prefix="routewise-shared-")

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """The writers' lock: bounded wait (TimeoutError), released by the kernel if its holder dies."""
        fd = self._lock_file.fileno()
        deadline = time.monotonic() + WRITE_LOCK_WAIT_S
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router.shared: another worker held the write lock over "
                                       f"{WRITE_LOCK_WAIT_S:.0f} s") from None
                time.sleep(0.001)
        try:
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)

    def _find(self, raw: bytes) -> int | None:
        n = len(raw)
        for col in range(self.max_replicas):
            row = self.names[col]
            if row[0] == n and row[1 : 1 + n].tobytes() == raw:
                return col
        return None

    def column(self, replica_id: str) -> int | None:
        """The column of `replica_id` (claimed if new); None when the table is full, the id too long, or the
        write lock not had in WRITE_LOCK_WAIT_S."""
        raw = replica_id.encode()
        if not raw or len(raw) >= _NAME_BYTES:
            return None
        col = self._find(raw)  # claimed rows never change: found without the lock
        if col is not None:
            return col
        try:
            with self._writing():
                col = self._find(raw)
                if col is not None:
                    return col
                for col in range(self.max_replicas):
                    row = self.names[col]
                    if not row[0]:  # free, or a claim whose writer died before setting the length
                        row[1:] = 0
                        row[1 : 1 + len(raw)] = np.frombuffer(raw, np.uint8)
                        row[0] = len(raw)
                        return col
        except TimeoutError as exc:
            log.warning("%s: replica %s gets no shared column", exc, replica_id)
        return None

    def publish_command(self, command: dict) -> int:
        """Stores `command` (JSON) for the other workers; returns its sequence number."""
        raw = json.dumps(command).encode()
        if len(raw) > _COMMAND_BYTES:
            raise ValueError(f"admin command too long to share ({len(raw)} bytes > {_COMMAND_BYTES})")
        head = self.command_head
        with self._writing():
            seq = int(head[0])
            seq += seq & 1  # odd: a writer died mid-write; its command is abandoned
            head[0] = seq + 1  # odd while the body changes
            self.command_body[: len(raw)] = np.frombuffer(raw, np.uint8)
            head[1], head[2] = len(raw), zlib.crc32(raw)
            head[0] = seq + 2
            return (seq + 2) // 2

    def last_command(self) -> tuple[int, dict | None]:
        """(sequence, command): sequence 0 when none was published; command None while one is being written
        (or its writer died writing it: the next command replaces it). Never waits."""
        head = self.command_head
        seq = 0
        for _ in range(3):
            seq = int(head[0])
            if seq == 0:
                return 0, None
            if seq & 1:
                continue
            n, crc = int(head[1]), int(head[2])
            raw = self.command_body[:n].tobytes()
            if int(head[0]) == seq and zlib.crc32(raw) == crc:
                return seq // 2, json.loads(raw)
        return seq // 2, None

    def clear_slot(self, slot: int) -> None:
        """A worker that died left its in-flight requests counted: the parent zeroes its row before a restart."""
        self.counters[slot] = 0

    def close(self) -> None:
        # release the buffer exports before closing
        del self.counters, self.draining, self.names, self.command_head, self.command_body
        try:
            self.mem.close()
        except BufferError:  # trackers still hold views of it: the mapping goes with them
            pass
        self._lock_file.close()


class SharedReplicaTracker(ReplicaTracker):
    """A ReplicaTracker whose FIELDS are this worker's own counts inside its hooks (which the policy code
    runs unchanged, then published to the worker's slot) and the host's sums everywhere else (views,
    metrics, admin), as of the cluster's last `refresh()`."""

    def __init__(self, replica_id: str, counters: np.ndarray, slot: int, col: int) -> None:
        self._counters = counters
        self._row = counters[slot, col]  # this worker's slot, this replica's column: written by this process only
        self._offset = (slot * counters.shape[1] + col) * counters.shape[2]
        self._own = [0] * len(FIELDS)
        self._total = [0] * len(FIELDS)
        self._hook = True
        super().__init__(replica_id)
        self._hook = False

    def on_dispatch(self, request: RequestInfo) -> None:
        self._hook = True
        try:
            super().on_dispatch(request)
        finally:
            self._publish()

    def on_first_token(self, request_id: str, ttft_s: float) -> None:
        self._hook = True
        try:
            super().on_first_token(request_id, ttft_s)
        finally:
            self._publish()

    def on_complete(self, request_id: str, tpot_s: float | None = None) -> None:
        self._hook = True
        try:
            super().on_complete(request_id, tpot_s)
        finally:
            self._publish()

    def on_scrape(self, *args, **kwargs) -> None:
        self._hook = True
        try:
            super().on_scrape(*args, **kwargs)
        finally:
            self._publish()

    def _publish(self) -> None:
        if _compiled is not None:
            _compiled.put_row(self._counters, self._offset, self._own)
        else:
            self._row[:] = self._own
        self._hook = False


def _field(i: int) -> property:
    def get(self: SharedReplicaTracker) -> int:
        return self._own[i] if self._hook else self._total[i]

    def set_(self: SharedReplicaTracker, value: int) -> None:
        self._own[i] = value

    return property(get, set_)


for _i, _name in enumerate(FIELDS):
    setattr(SharedReplicaTracker, _name, _field(_i))


class SharedClusterTracker(ClusterTracker):
    """A ClusterTracker over SharedReplicaTrackers of worker `slot`: every view sums all workers' rows."""

    def __init__(self, load: SharedLoad, slot: int, **kwargs) -> None:
        self.load, self.slot = load, slot
        self._cols: dict[str, int] = {}
        self._ncols = 0
        self._removed: dict[str, ReplicaTracker] = {}  # a removed replica's tracker still owns its column's row
        self._pairs: list[tuple[ReplicaTracker, int]] | None = None  # (tracker in the view, its column), cached
        super().__init__([], **kwargs)

    def add(self, replica_id: str) -> ReplicaTracker:
        if replica_id in self.by_id:
            return self.by_id[replica_id]
        self._pairs = None
        t = self._removed.pop(replica_id, None)
        if t is not None:  # back (DNS flap): the same tracker, so its requests in flight stay counted once
            self.trackers.append(t)
            self.by_id[replica_id] = t
            return t
        col = self.load.column(replica_id)
        if col is None:
            log.warning("replica %s: no shared column left, its load is this worker's only", replica_id)
            t = ReplicaTracker(replica_id)
        else:
            t = SharedReplicaTracker(replica_id, self.load.counters, self.slot, col)
            self._cols[replica_id] = col
            self._ncols = max(self._ncols, col + 1)
        self.trackers.append(t)
        self.by_id[replica_id] = t
        return t

    def remove(self, replica_id: str) -> None:
        t = self.by_id.get(replica_id)
        super().remove(replica_id)
        self._pairs = None
        if isinstance(t, SharedReplicaTracker):
            self._removed[replica_id] = t

    def refresh(self) -> None:
        """Reads every worker's counters into the trackers' host-wide sums (one call)."""
        if not self._cols:
            return
        if self._pairs is None:
            self._pairs = [(self.by_id[rid], col) for rid, col in self._cols.items() if rid in self.by_id]
        c = self.load.counters
        if _compiled is not None:
            totals = _compiled.sum_rows(c, c.shape[0], c.shape[1], c.shape[2], self._ncols)
        else:
            totals = c[:, : self._ncols].sum(axis=0).tolist()  # one conversion, not one per replica
        for t, col in self._pairs:
            t._total = totals[col]  # type: ignore[attr-defined]

    def view(self, now_s: float, request: RequestInfo) -> ClusterView:
        self.refresh()
        return super().view(now_s, request)

    # admin: draining is host-wide
    def publish_draining(self, replica_id: str, draining: bool) -> None:
        col = self._cols.get(replica_id)
        if col is not None:
            self.load.draining[col] = int(draining)

    def draining_of(self, replica_id: str) -> bool | None:
        col = self._cols.get(replica_id)
        return None if col is None else bool(self.load.draining[col])
