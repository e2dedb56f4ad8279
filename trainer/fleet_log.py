"""Regression data from the router's decision log (format: router/serving/DECISION_LOG.md).

One sample per routing decision whose outcome the log can tell: the model input (`features`,
`mask`), the replica chosen (`index`) and the time to first token the router observed on it.
Kept out, and counted by reason (the model card reports the counts):

- `no_ttft`: non-streamed requests (the router sees no first token, only the whole response, whose
  length depends on the output, not on the replica's queue) and cancelled requests;
- `failed`: attempts that failed (no first token; the error rate is the A/B guard's business);
- `retry`: attempts after the first (a retry happens only when the first replica failed before its
  first byte, so its timing is dominated by that failure, not by the retried replica's state);
- `unhealthy_pick`: the chosen replica was masked (no healthy replica): the model scores it -1e9.

A final line without its newline (a writer that died mid-line) is skipped and counted; any other
bad line, a record of another feature contract, or a field of the wrong type or shape raises
FleetLogError naming file, line and field: a silently mis-read log would train a wrong model.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from routewise_vllm.router.policy.features import FEATURE_SPEC_HASH, N_FEATURES
from routewise_vllm.simulator.replay import DecisionLogError, log_paths
from routewise_vllm.simulator.replay import _field as _get  # the replay's field check: one wording for both readers

FORMAT_VERSION = 1


class FleetLogError(DecisionLogError):
    """A decision log that cannot be learned from; the message names file, line and field."""


@dataclass
class FleetData:
    """Samples in time order: features [N, R, F] (rows beyond a record's replicas are zero, mask 0),
    masks [N, R], actions [N], ttft_s [N], time_s [N]."""

    features: np.ndarray
    masks: np.ndarray
    actions: np.ndarray
    ttft_s: np.ndarray
    time_s: np.ndarray
    files: list[str]
    records: int  # every record read
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ttft_s)

    def subset(self, idx: np.ndarray) -> "FleetData":
        return FleetData(self.features[idx], self.masks[idx], self.actions[idx], self.ttft_s[idx], self.time_s[idx],
                         self.files, len(idx), {})

    def span(self) -> dict:
        if not len(self):
            return {"from_unix_s": None, "to_unix_s": None, "duration_s": 0.0}
        t0, t1 = float(self.time_s[0]), float(self.time_s[-1])
        return {"from_unix_s": round(t0, 3), "to_unix_s": round(t1, 3), "duration_s": round(t1 - t0, 3)}


def parse_sample(rec: object, where: str) -> tuple[str | None, tuple | None]:
    """(skip reason, None) or (None, (time, features [n, F], mask [n], action, ttft)) for one decoded line."""
    if not isinstance(rec, dict):
        raise FleetLogError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if rec.get("v") != FORMAT_VERSION:
        raise FleetLogError(f"{where}: field 'v' = {rec.get('v')!r}; this trainer reads version {FORMAT_VERSION}")
    got = _get(rec, "feature_hash", (str,), where)
    if got != FEATURE_SPEC_HASH:
        raise FleetLogError(
            f"{where}: field 'feature_hash' = {got!r}: written under another feature contract than this trainer's "
            f"{FEATURE_SPEC_HASH!r}; fine-tune with the routewise version that wrote the log, or start a new log"
        )
    t = float(_get(rec, "t", (int, float), where))
    if _get(rec, "attempt", (int,), where) != 0:
        return "retry", None
    ok = _get(rec, "ok", (bool,), where, optional=True)
    ttft = _get(rec, "ttft_s", (int, float), where, optional=True)
    if ok is False:
        return "failed", None
    if ttft is None or ok is None:
        return "no_ttft", None
    if not math.isfinite(ttft) or ttft < 0 or not math.isfinite(t):
        raise FleetLogError(f"{where}: field 'ttft_s' = {ttft!r} / 't' = {t!r} is not a finite non-negative time")
    n = _get(rec, "n_replicas", (int,), where)
    index = _get(rec, "index", (int,), where)
    mask = _get(rec, "mask", (list,), where)
    if n < 1 or not 0 <= index < n or len(mask) != n or not all(m in (0, 1) for m in mask):
        raise FleetLogError(f"{where}: fields 'n_replicas' = {n}, 'index' = {index}, 'mask' (length {len(mask)}) do not agree")
    if mask[index] != 1:
        return "unhealthy_pick", None
    try:
        raw = base64.b64decode(_get(rec, "features", (str,), where), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise FleetLogError(f"{where}: field 'features' is not base64 ({exc})") from None
    if len(raw) != n * N_FEATURES * 4:
        raise FleetLogError(f"{where}: field 'features' holds {len(raw)} bytes, expected {n} x {N_FEATURES} float32")
    feats = np.frombuffer(raw, dtype="<f4").reshape(n, N_FEATURES)
    if not np.all(np.isfinite(feats)):
        raise FleetLogError(f"{where}: field 'features' has non-finite values")
    return None, (t, feats, np.asarray(mask, dtype=np.float32), index, float(ttft))


def read_fleet_log(path: str | Path, max_records: int | None = None) -> FleetData:
    """Every usable sample of a log directory (or one file), oldest first; `max_records` keeps the newest."""
    try:
        files = log_paths(path)
    except DecisionLogError as exc:
        raise FleetLogError(str(exc)) from None
    skipped: dict[str, int] = {}
    samples = []
    records = 0
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FleetLogError(f"{file}: cannot read it ({exc})") from None
        lines = text.split("\n")
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{file}:{no}"
            if no == len(lines):  # no newline after it: a line the writer never finished
                skipped["truncated"] = skipped.get("truncated", 0) + 1
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FleetLogError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            records += 1
            try:
                reason, sample = parse_sample(rec, where)
            except DecisionLogError as exc:
                raise FleetLogError(str(exc)) from None
            if reason is not None:
                skipped[reason] = skipped.get(reason, 0) + 1
            else:
                samples.append(sample)
    if not samples:
        raise FleetLogError(
            f"decision log {path}: no usable records (read {records}; skipped {skipped or 'none'}): fine-tuning needs "
            "streamed, successful first attempts with a ttft_s"
        )
    samples.sort(key=lambda s: s[0])
    if max_records is not None and len(samples) > max_records:
        skipped["older_than_max_records"] = len(samples) - max_records
        samples = samples[-max_records:]
    width = max(len(s[2]) for s in samples)
    feats = np.zeros((len(samples), width, N_FEATURES), dtype=np.float32)
    masks = np.zeros((len(samples), width), dtype=np.float32)
    for k, (_, f, m, _, _) in enumerate(samples):
        feats[k, : len(m)] = f
        masks[k, : len(m)] = m
    return FleetData(
        features=feats, masks=masks,
        actions=np.array([s[3] for s in samples], dtype=np.int64),
        ttft_s=np.array([s[4] for s in samples], dtype=np.float64),
        time_s=np.array([s[0] for s in samples], dtype=np.float64),
        files=[str(f) for f in files], records=records, skipped=skipped,
    )
