"""The decision log: one JSON line per routing decision, written off the request path.

The request path only builds a `PendingRecord` (references to immutable objects it already
has) and `submit`s it to a bounded queue: when the queue is full the record is dropped and
counted, so the log can never slow down or fail a request. A background thread encodes
records (features as base64 float32), appends them to `decisions-NNNNNN.jsonl`, starts a new
file past `max_bytes` and deletes the oldest beyond `keep`. The format is documented in
router/serving/DECISION_LOG.md (the simulator's replay reads it without importing router code).

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
_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
REOPEN_RETRY_S = 1.0  # a file that could not be created is tried again after this long, not for every record


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
        self._retry_at = 0.0  # monotonic time before which a failed file creation is not retried
        self._failing: str | None = None  # the drop reason of the failure episode under way
        self._episode_dropped = 0
        self._lock = threading.Lock()  # `dropped` is counted from the request path and the writer thread
        self.written = 0
        self.dropped: dict[str, int] = {}
        self.last_error: str | None = None
        self.current_path: Path | None = None

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
        existing = log_files(self.directory, self.prefix)
        self._seq = int(FILE_RE.match(existing[-1].name)["seq"]) if existing else 0
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
        }

    # --- writer thread -------------------------------------------------------------------------

    def _open_next(self) -> None:
        """Open the next file; the number is taken only when the file could be created (OSError otherwise)."""
        seq = self._seq + 1
        path = self.directory / f"{self.prefix}-{seq:06d}.jsonl"
        fd = self._os_open(str(path), _OPEN_FLAGS, 0o644)
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._seq, self.current_path = fd, seq, path
        self._size = os.fstat(fd).st_size
        for old in log_files(self.directory, self.prefix)[: -self.keep]:
            try:
                old.unlink()
            except OSError as exc:
                self.last_error = f"cannot delete {old}: {exc}"

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
