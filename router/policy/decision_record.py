"""One decision-log record: what the request path keeps (`PendingRecord`) and its JSON form.

Pure (no I/O): the live router's log writer (router/serving/decision_log.py) and the trainer's simulated
fleet logs encode records with this one function, so both write the format DECISION_LOG.md documents.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from routewise_vllm.router.policy.features import FEATURE_SPEC_HASH, N_FEATURES, action_mask, build_features
from routewise_vllm.router.policy.types import ClusterView, RequestInfo

FORMAT_VERSION = 1


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
    late: str | None = None  # late binding on: why the hold queue let the request go
    held_s: float | None = None  # late binding on: seconds it was held (0 when it went at once)
    model: str | None = None  # the request's model as a bounded label (router.policy.model_routing.model_label)


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
    record = {
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
    if p.model is not None:  # absent where no model was known (the simulator's fleets without model lists)
        record["model"] = p.model
    if p.late is not None:  # only with late binding on: records without it stay as they were
        record["late"] = p.late
        record["held_s"] = _round(p.held_s)
    return record


def decode_features(record: dict) -> np.ndarray:
    """float32 (n_replicas, N_FEATURES) from a record's `features` field."""
    raw = base64.b64decode(record["features"])
    return np.frombuffer(raw, dtype="<f4").reshape(record["n_replicas"], -1)
