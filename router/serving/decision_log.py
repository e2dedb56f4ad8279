"""The decision log: one JSON line per routing decision, written off the request path.

The request path only builds a `PendingRecord` (references to immutable objects it already
has) and `submit`s it to a bounded queue: when the queue is full the record is dropped and
counted, so the log can never slow down or fail a request. A background thread encodes
records (features as base64 float32), appends them to `decisions-NNNNNN.jsonl`, starts a new
file past `max_bytes` and deletes the oldest beyond `keep`. The format is documented in
router/serving/DECISION_LOG.md (the simulator's replay reads it without importing router code).

The writer owns its files and no others: `keep` counts the files it created (and, at start, the earlier runs'
regular files of the router's user), each remembered by its inode, so a file someone else puts in the
directory (a higher number, a symlink) is never counted, rotated or deleted, and a file that was replaced
since is left alone. Each file is created with O_CREAT | O_EXCL | O_NOFOLLOW: a name that exists (a planted
file or symlink) is refused, counted and logged once, and the next number is tried. A current file deleted
by someone else is noticed before the next write, counted and replaced by a new one.

Every record is either written or counted as dropped, by reason (`DROP_REASONS`): a record counts
as written once its whole line reached the file; a write that fails part-way (a full disk) is
truncated back to the last complete line, so no partial line stays behind. A failure episode is
logged once when it starts and once when writes succeed again, never per record. A file that
cannot be created (rotation into an unwritable directory) is retried at most once a second and
keeps its number for the next try.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from routewise_vllm.router.policy.decision_record import FORMAT_VERSION, PendingRecord, decision_record, decode_features

__all__ = ["DROP_REASONS", "FORMAT_VERSION", "DecisionLogError", "DecisionLogWriter", "PendingRecord", "check_directory",
           "decision_record", "decode_features", "log_files"]

log = logging.getLogger("router.decision_log")

FILE_RE = re.compile(r"^(?P<prefix>.+)-(?P<seq>\d{6,})\.jsonl$")

# llm_router_decision_log_dropped_total{reason}: the queue was full, the writer was not running, the record
# could not be encoded, the disk (or quota) is full, or another write / file-creation error
DROP_REASONS = ("queue_full", "not_running", "encode_error", "no_space", "write_error")
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# a new file only: never one that exists, never through a symlink
_OPEN_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))
REOPEN_RETRY_S = 1.0  # a file that could not be created is tried again after this long, not for every record
MAX_NAME_TRIES = 100  # names refused in a row (each one exists) before the rotation counts as failed
_MAX_SEQ = 10**12  # a number this long is no file of ours (a trillion rotations): it does not set the numbering


class DecisionLogError(ValueError):
    """The decision log cannot be written where the settings say (raised at start; `router serve` exits on it)."""


def log_files(directory: Path, prefix: str = "decisions") -> list[Path]:
    """The log's files, oldest first."""
    found = []
    for p in Path(directory).glob(f"{prefix}-*.jsonl"):
        m = FILE_RE.match(p.name)
        if m and m["prefix"] == prefix:
            found.append((int(m["seq"]), p))
    return [p for _, p in sorted(found)]


_STOP = object()


def check_directory(directory: str | Path) -> None:
    """Create `directory` and make sure a file can be created in it; DecisionLogError (one line) otherwise. `router
    serve` calls it before it starts any worker, so a bad directory is one line, not a worker restarted for ever."""
    where = f"decision_log_dir={str(directory)!r}"
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DecisionLogError(f"{where}: cannot create it ({exc.strerror or exc})") from exc
    try:
        tempfile.TemporaryFile(dir=directory).close()  # unnamed (or unlinked at once): nothing is left behind
    except OSError as exc:
        raise DecisionLogError(f"{where}: cannot write there ({exc.strerror or exc})") from exc


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """A file as the writer left it: a file deleted and replaced under its name may get the same inode number,
    not also the same size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class DecisionLogWriter:
    def __init__(
        self,
        directory: str | Path,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        keep: int = 10,
        queue_size: int = 10_000,
        metrics=None,  # router.serving.metrics.ServingMetrics or None
        prefix: str = "decisions",
        os_write: Callable[[int, memoryview], int] = os.write,  # tests inject a full disk
        os_open: Callable[[str, int, int], int] = os.open,  # tests inject an unwritable directory
    ) -> None:
        if max_bytes < 1024 or keep < 1 or queue_size < 1:
            raise ValueError(f"decision log: max_bytes={max_bytes} (>= 1024), keep={keep} (>= 1), queue_size={queue_size} (>= 1)")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.keep = keep
        self.prefix = prefix
        self.metrics = metrics
        self._os_write = os_write
        self._os_open = os_open
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._size = 0  # bytes of complete lines in the current file
        self._seq = 0
        self._owned: list[tuple[Path, tuple[int, ...]]] = []  # the files it rotates, oldest first, and `_identity`
        self._logged: set[str] = set()  # the kinds of file trouble already logged (once each)
        self._retry_at = 0.0  # monotonic time before which a failed file creation is not retried
        self._failing: str | None = None  # the drop reason of the failure episode under way
        self._episode_dropped = 0
        self._lock = threading.Lock()  # `dropped` is counted from the request path and the writer thread
        self.written = 0
        self.dropped: dict[str, int] = {}
        self.last_error: str | None = None
        self.current_path: Path | None = None
        self.files_refused = 0  # names that existed (someone else's file or symlink): skipped
        self.rotation_errors = 0  # old files that could not be deleted, or were replaced and so were not
        self.files_lost = 0  # current files deleted by someone else (the records in them are gone)

    # --- request path --------------------------------------------------------------------------

    def submit(self, record: PendingRecord) -> bool:
        """Queue a record; False (and counted) when the queue is full or the writer is not running."""
        if self._thread is None:
            self._drop("not_running")
            return False
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self._drop("queue_full")
            return False

    def _drop(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + n
        if self.metrics is not None:
            self.metrics.decision_log_dropped.labels(reason).inc(n)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Create the directory and the first file (a one-line DecisionLogError if either cannot be), then start
        the writer thread."""
        where = f"decision_log_dir={str(self.directory)!r}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DecisionLogError(f"{where}: cannot create it ({exc.strerror or exc})") from exc
        self._adopt()
        try:
            self._open_next()
        except OSError as exc:
            raise DecisionLogError(f"{where}: cannot write there ({exc.strerror or exc})") from exc
        self._thread = threading.Thread(target=self._run, name="decision-log-writer", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop."""
        t = self._thread
        if t is None:
            return
        self._queue.put(_STOP)  # blocks only at shutdown, when the queue is full
        t.join(timeout_s)
        self._thread = None
        if self._fd is not None and not t.is_alive():  # a writer still stuck in a write keeps its file (and fd number)
            os.close(self._fd)
            self._fd = None

    def describe(self) -> dict:
        return {
            "directory": str(self.directory),
            "current_file": None if self.current_path is None else str(self.current_path),
            "written": self.written,
            "dropped": dict(self.dropped),
            "queued": self._queue.qsize(),
            "failing": self._failing,
            "last_error": self.last_error,
            "files_refused": self.files_refused,
            "rotation_errors": self.rotation_errors,
            "files_lost": self.files_lost,
        }

    # --- writer thread -------------------------------------------------------------------------

    def _adopt(self) -> None:
        """At start: number after every log file there, and rotate the earlier runs' files (regular files of
        this user; a symlink or another user's file is not the log's) before this run's."""
        seq, uid = 0, os.geteuid()
        for path in log_files(self.directory, self.prefix):
            n = int(FILE_RE.match(path.name)["seq"])  # type: ignore[index]
            if n >= _MAX_SEQ:
                continue
            seq = max(seq, n)
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                self._owned.append((path, _identity(st)))
        self._seq = seq

    def _open_next(self) -> None:
        """Create the next file: O_EXCL | O_NOFOLLOW, so a name that exists is refused (counted, logged once)
        and the next number tried; a number is taken only when its file was created or its name was refused
        (OSError otherwise, and after MAX_NAME_TRIES refusals in a row)."""
        for _ in range(MAX_NAME_TRIES):
            seq = self._seq + 1
            path = self.directory / f"{self.prefix}-{seq:06d}.jsonl"
            try:
                fd = self._os_open(str(path), _OPEN_FLAGS, 0o644)
            except FileExistsError:
                self._seq = seq
                self.files_refused += 1
                self._trouble("refused", f"{path} exists and is not a file this router created: skipped its "
                              "number (counted in files_refused)")
                continue
            break
        else:
            raise OSError(errno.EEXIST, f"{MAX_NAME_TRIES} names in a row exist", str(path))
        if self._fd is not None:
            if self._owned and self._owned[-1][0] == self.current_path:  # as it is left: size and time included
                self._owned[-1] = (self.current_path, _identity(os.fstat(self._fd)))
            os.close(self._fd)
        self._fd, self._seq, self.current_path, self._size = fd, seq, path, 0
        self._owned.append((path, _identity(os.fstat(fd))))
        while len(self._owned) > self.keep:
            self._delete(*self._owned.pop(0))

    def _delete(self, path: Path, identity: tuple[int, ...]) -> None:
        """Delete an old file of this log's, if the name still holds the file it wrote."""
        try:
            st = path.lstat()
            if _identity(st) != identity:
                self.rotation_errors += 1
                self._trouble("replaced", f"{path} was replaced since it was written: left alone")
                return
            path.unlink()
        except FileNotFoundError:
            pass  # someone deleted it already
        except OSError as exc:
            self.rotation_errors += 1
            self._trouble("delete", f"cannot delete {path}: {exc.strerror or exc}")

    def _trouble(self, kind: str, error: str) -> None:
        """A file problem that loses no record: in last_error, its count in describe(), one log line per kind."""
        self.last_error = error
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("decision log: %s (logged once)", error)

    def _check_current(self) -> None:
        """The current file deleted by someone else (no name left): count it and write to a new one."""
        if self._fd is None:
            return
        try:
            gone = os.fstat(self._fd).st_nlink == 0
        except OSError:
            gone = False
        if gone:
            self.files_lost += 1
            self._trouble("lost", f"{self.current_path} was deleted while being written: its records are lost, "
                          "writing to a new file (counted in files_lost)")
            self._owned = [o for o in self._owned if o[0] != self.current_path]
            self._size = self.max_bytes  # rotate now

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < 512:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            lines = []
            for item in batch:
                if item is _STOP:
                    stop = True
                    continue
                try:
                    lines.append((json.dumps(decision_record(item), separators=(",", ":")) + "\n").encode())
                except Exception as exc:  # noqa: BLE001 - a bad record is dropped, never kills the writer
                    self.last_error = f"encode: {type(exc).__name__}: {exc}"
                    self._drop("encode_error")
                # Hand the GIL back after every record: otherwise the event loop waits up to the
                # interpreter's 5 ms switch interval whenever this thread works through a backlog.
                time.sleep(0)
            if lines:
                self._write(lines)

    def _write(self, lines: list[bytes]) -> None:
        """Append `lines`, starting a new file past max_bytes; whatever cannot be written is dropped and counted."""
        self._check_current()
        i = 0
        while i < len(lines):
            if self._fd is None or self._size >= self.max_bytes:
                if time.monotonic() < self._retry_at:
                    self._failed(self._failing or "write_error", len(lines) - i, None)
                    return
                try:
                    self._open_next()
                except OSError as exc:
                    self._retry_at = time.monotonic() + REOPEN_RETRY_S
                    self._failed(self._reason(exc), len(lines) - i, f"cannot create the next file: {exc}")
                    return
            j, size = i, self._size
            while j < len(lines) and size < self.max_bytes:
                size += len(lines[j])
                j += 1
            done, exc = self._append(lines[i:j])
            self._written(done)
            if exc is not None:
                self._failed(self._reason(exc), len(lines) - i - done, f"write {self.current_path}: {exc}")
                return
            i = j
        self._recovered()

    def _append(self, chunk: list[bytes]) -> tuple[int, OSError | None]:
        """Write `chunk` to the current file: (complete lines written, the error that stopped it). On an error the
        file is cut back to its last complete line."""
        buf = memoryview(b"".join(chunk))
        start, done = self._size, 0
        try:
            while done < len(buf):
                n = self._os_write(self._fd, buf[done:])  # type: ignore[arg-type]
                if n <= 0:
                    raise OSError(errno.ENOSPC, "write wrote nothing")
                done += n
        except OSError as exc:
            k = kept = 0
            for line in chunk:  # the complete lines among the `done` bytes that reached the file
                if kept + len(line) > done:
                    break
                kept += len(line)
                k += 1
            try:
                if done > kept:
                    os.ftruncate(self._fd, start + kept)  # type: ignore[arg-type]
            except OSError as texc:
                # the file may end mid-line: never write after it again (readers skip an unterminated last line)
                self.last_error = f"cannot cut {self.current_path} back to its last complete line: {texc}"
                log.warning("decision log: %s", self.last_error)
                os.close(self._fd)  # type: ignore[arg-type]
                self._fd = None
            self._size = start + kept
            return k, exc
        self._size += done
        return len(chunk), None

    def _written(self, n: int) -> None:
        if n:
            self.written += n
            if self.metrics is not None:
                self.metrics.decision_log_records.inc(n)

    @staticmethod
    def _reason(exc: OSError) -> str:
        return "no_space" if exc.errno in _NO_SPACE else "write_error"

    def _failed(self, reason: str, n: int, error: str | None) -> None:
        if n:
            self._drop(reason, n)
        self._episode_dropped += n
        if error is not None:
            self.last_error = error
        if self._failing is None:
            self._failing = reason
            log.warning("decision log: %s; records are dropped and counted in llm_router_decision_log_dropped_total"
                        "{reason=\"%s\"} until a write succeeds (logged once)", error or reason, reason)

    def _recovered(self) -> None:
        if self._failing is not None:
            log.warning("decision log: writing again to %s after dropping %d records (%s)", self.current_path,
                        self._episode_dropped, self._failing)
            self._failing = None
            self._episode_dropped = 0
