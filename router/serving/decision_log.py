"""The decision log: one JSON line per routing decision, written off the request path.

The request path only builds a `PendingRecord` (references to immutable objects it already
has) and `submit`s it to a bounded queue: when the queue is full the record is dropped and
counted, so the log can never slow down or fail a request. A background thread encodes
records (features as base64 float32), appends them to `decisions-NNNNNN.jsonl`, starts a new
file past `max_bytes` and deletes the oldest beyond `keep`. The format is documented in
router/serving/DECISION_LOG.md (the simulator's replay reads it without importing router code).
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from pathlib import Path

from router.policy.decision_record import FORMAT_VERSION, PendingRecord, decision_record, decode_features

__all__ = ["FORMAT_VERSION", "PendingRecord", "decision_record", "decode_features", "log_files", "DecisionLogWriter"]

log = logging.getLogger("router.decision_log")

FILE_RE = re.compile(r"^(?P<prefix>.+)-(?P<seq>\d{6,})\.jsonl$")


def log_files(directory: Path, prefix: str = "decisions") -> list[Path]:
    """The log's files, oldest first."""
    found = []
    for p in Path(directory).glob(f"{prefix}-*.jsonl"):
        m = FILE_RE.match(p.name)
        if m and m["prefix"] == prefix:
            found.append((int(m["seq"]), p))
    return [p for _, p in sorted(found)]


_STOP = object()


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
    ) -> None:
        if max_bytes < 1024 or keep < 1 or queue_size < 1:
            raise ValueError(f"decision log: max_bytes={max_bytes} (>= 1024), keep={keep} (>= 1), queue_size={queue_size} (>= 1)")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.keep = keep
        self.prefix = prefix
        self.metrics = metrics
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._file = None
        self._size = 0
        self._seq = 0
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
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        if self.metrics is not None:
            self.metrics.decision_log_dropped.labels(reason).inc(n)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Create the directory (a clear error if it cannot be) and start the writer thread."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"decision_log_dir={str(self.directory)!r}: cannot create it ({exc})") from exc
        existing = log_files(self.directory, self.prefix)
        self._seq = int(FILE_RE.match(existing[-1].name)["seq"]) if existing else 0
        self._open_next()
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
        if self._file is not None:
            self._file.close()
            self._file = None

    def describe(self) -> dict:
        return {
            "directory": str(self.directory),
            "current_file": None if self.current_path is None else str(self.current_path),
            "written": self.written,
            "dropped": dict(self.dropped),
            "queued": self._queue.qsize(),
            "last_error": self.last_error,
        }

    # --- writer thread -------------------------------------------------------------------------

    def _open_next(self) -> None:
        if self._file is not None:
            self._file.close()
        self._seq += 1
        self.current_path = self.directory / f"{self.prefix}-{self._seq:06d}.jsonl"
        self._file = open(self.current_path, "a", encoding="utf-8")  # noqa: SIM115 - long-lived, closed in close()
        self._size = self._file.tell()
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
                    lines.append(json.dumps(decision_record(item), separators=(",", ":")) + "\n")
                except Exception as exc:  # noqa: BLE001 - a bad record is dropped, never kills the writer
                    self.last_error = f"encode: {type(exc).__name__}: {exc}"
                    self._drop("encode_error")
                # Hand the GIL back after every record: otherwise the event loop waits up to the
                # interpreter's 5 ms switch interval whenever this thread works through a backlog.
                time.sleep(0)
            self._write(lines)

    def _write(self, lines: list[str]) -> None:
        for line in lines:
            try:
                if self._size >= self.max_bytes:
                    self._open_next()
                self._file.write(line)
                self._size += len(line)
                self.written += 1
                if self.metrics is not None:
                    self.metrics.decision_log_records.inc()
            except (OSError, ValueError) as exc:
                self.last_error = f"write: {exc}"
                self._drop("write_error")
                log.warning("decision log: %s", exc)
        try:
            self._file.flush()
        except (OSError, ValueError) as exc:
            self.last_error = f"flush: {exc}"
