"""The decision log: one JSON line per routing decision, written off the request path.

The request path only builds a `PendingRecord` (references to immutable objects it already
has) and `submit`s it to a bounded queue: when the queue is full the record is dropped and
counted, so the log can never slow down or fail a request. A background thread encodes
records (features as base64 float32), appends them to `decisions-NNNNNN.jsonl`, starts a new
file past `max_bytes` and deletes the oldest beyond `keep`. The format is documented in
router/serving/DECISION_LOG.md (the simulator's replay reads it without importing router code).
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from router.policy.features import FEATURE_SPEC_HASH, N_FEATURES, action_mask, build_features
from router.policy.types import ClusterView, RequestInfo

log = logging.getLogger("router.decision_log")

FORMAT_VERSION = 1
FILE_RE = re.compile(r"^(?P<prefix>.+)-(?P<seq>\d{6,})\.jsonl$")


@dataclass(slots=True)
class PendingRecord:
    """Everything one record needs, as the request path has it (encoding happens in the writer)."""

    time_s: float  # wall-clock arrival time (unix seconds)
    request: RequestInfo
    view: ClusterView
    arm: str
    policy: str
    index: int
    primary_index: int | None
    fallback_reason: str | None
    decision_s: float | None
    attempt: int = 0
    stream: bool | None = None
    shadow: dict | None = None
    features: np.ndarray | None = None  # the model input if the policy already built it for this view
    status: int | None = None
    ok: bool | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int | None = None
    prefix_block_tokens: int | None = None


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(float(x), digits)


def decision_record(p: PendingRecord) -> dict:
    """The JSON object of one record (see DECISION_LOG.md)."""
    reps = p.view.replicas
    feats = p.features if p.features is not None else build_features(p.view, p.request)
    feats = np.ascontiguousarray(feats, dtype="<f4")
    if feats.shape != (len(reps), N_FEATURES):
        raise ValueError(f"features of shape {feats.shape}, expected {(len(reps), N_FEATURES)}")
    r = p.request
    return {
        "v": FORMAT_VERSION,
        "t": round(p.time_s, 6),
        "id": r.request_id,
        "attempt": p.attempt,
        "arm": p.arm,
        "policy": p.policy,
        "replica": reps[p.index].replica_id,
        "index": p.index,
        "primary_index": p.primary_index,
        "fallback": p.fallback_reason,
        "decision_s": _round(p.decision_s, 9),
        "shadow": p.shadow,
        "n_replicas": len(reps),
        "feature_hash": FEATURE_SPEC_HASH,
        "features": base64.b64encode(feats.tobytes()).decode("ascii"),
        "mask": action_mask(p.view).tolist(),
        "prompt_tokens_est": r.prompt_tokens_est,
        "max_tokens": r.max_tokens,
        "prefix_blocks": list(r.prefix_blocks),
        "prefix_block_tokens": p.prefix_block_tokens,
        "stream": p.stream,
        "status": p.status,
        "ok": p.ok,
        "ttft_s": _round(p.ttft_s),
        "e2e_s": _round(p.e2e_s),
        "output_tokens": p.output_tokens,
    }


def decode_features(record: dict) -> np.ndarray:
    """float32 (n_replicas, N_FEATURES) from a record's `features` field."""
    raw = base64.b64decode(record["features"])
    return np.frombuffer(raw, dtype="<f4").reshape(record["n_replicas"], -1)


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
