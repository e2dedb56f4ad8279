"""A learned policy served by onnxruntime (one thread, sequential, no spinning).

Model contract (written by `trainer export`):
  inputs  features float32 [batch, replicas, N_MODEL_INPUTS] (`model_inputs`), mask float32 [batch, replicas]
  output  logits   float32 [batch, replicas]
  metadata feature_spec_hash, feature_version, policy_version, training_config (JSON)
The input is `model_inputs(build_features(...), mask)`: the cross-replica inputs are computed in numpy,
once, so the graph is a small network; normalisation is folded into it.

Decisions run on the compiled fast path (router/policy/fastnet.py) when the model carries its weights
and the fast path agrees with this file's onnxruntime session at load; otherwise onnxruntime decides.
`describe()["executor"]` says which, and why.

A file that is missing, corrupt, of another feature spec or another shape does not raise at
construction: the policy records `load_error` and every decision raises PolicyUnavailable,
so a FallbackPolicy keeps serving with LOR and says why.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from routewise_vllm.router.policy import fastnet
from routewise_vllm.router.policy.base import Policy, PolicyUnavailable, best_of
from routewise_vllm.router.policy.features import (
    FEATURE_NAMES,
    FEATURE_SPEC_HASH,
    N_MODEL_INPUTS,
    action_mask,
    build_features,
    compiled_row_args,
    model_inputs,
)
from routewise_vllm.router.policy.types import ClusterView, RequestInfo


_HEALTHY_COL = FEATURE_NAMES.index("healthy")


class ModelLoadError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def load_session(path: Path):
    """An onnxruntime session for `path`, checked against the feature contract.

    Raises ModelLoadError naming the file and the mismatch.
    """
    import onnxruntime as ort

    if not path.is_file():
        raise ModelLoadError("unavailable", f"{path}: model file not found")
    opts = ort.SessionOptions()
    # one tiny call per request: one thread, run in order, and no thread spinning after a call (a spinning
    # pool burns the core the event loop needs). IO binding was measured slower (its Python binding calls
    # cost more than the copies they save), so inputs go in plainly (tests/bench/decision_latency_learned.py).
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    opts.log_severity_level = 4  # a failing run is counted and described by FallbackPolicy, not logged per request
    try:
        session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types for bad files
        raise ModelLoadError("unavailable", f"{path}: not a loadable ONNX model ({type(exc).__name__}: {exc})") from exc
    meta = session.get_modelmeta().custom_metadata_map
    got = meta.get("feature_spec_hash")
    if got != FEATURE_SPEC_HASH:
        raise ModelLoadError(
            "spec_mismatch", f"{path}: feature_spec_hash {got!r} does not match this router's {FEATURE_SPEC_HASH!r}"
        )
    inputs = {i.name: i.shape for i in session.get_inputs()}
    if set(inputs) != {"features", "mask"} or inputs["features"][-1] != N_MODEL_INPUTS:
        raise ModelLoadError(
            "spec_mismatch", f"{path}: inputs {inputs} do not match features[batch, replicas, {N_MODEL_INPUTS}] + mask"
        )
    return session


class OnnxPolicy(Policy):
    name = "learned"

    def __init__(self, path: str | Path, seed: int | None = None, greedy: bool = True, fast: bool = True) -> None:
        super().__init__(seed)
        self.path = Path(path)
        self.greedy = greedy
        self.load_error: ModelLoadError | None = None
        self.metadata: dict[str, str] = {}
        self._session = None
        self._run_options = None
        self._fast: fastnet.FastNet | None = None
        self.executor_note = "no model loaded"
        # (view, features) of the last scores() call, so a decision log can reuse the input it built.
        # The features array is a fresh one per call (another thread may still be encoding an older one).
        self.last_input: tuple[ClusterView, np.ndarray] | None = None
        try:
            self._session = load_session(self.path)
            self.metadata = dict(self._session.get_modelmeta().custom_metadata_map)
            import onnxruntime as ort

            self._run_options = ort.RunOptions()
            self._run_options.log_severity_level = 4
        except ModelLoadError as exc:
            self.load_error = exc
            return
        self._warm_up()
        if fast:
            self._fast, self.executor_note = fastnet.load(self.metadata, self.onnxruntime_logits)
        else:
            self.executor_note = "the fast path is turned off"

    def _warm_up(self) -> None:
        """onnxruntime's first runs at a width allocate and plan; do them at load, not on a request's time."""
        for width in (1, 4, 16):
            try:
                self._session.run(["logits"], {"features": np.zeros((1, width, N_MODEL_INPUTS), np.float32),
                                               "mask": np.ones((1, width), np.float32)}, self._run_options)
            except Exception:  # noqa: BLE001 - a model that fails here fails per decision, counted there
                return

    def describe(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "version": self.metadata.get("policy_version", "unknown"),
            "feature_spec_hash": self.metadata.get("feature_spec_hash", ""),
            "load_error": None if self.load_error is None else str(self.load_error),
            "executor": "fastnet" if self._fast is not None else "onnxruntime",
            "executor_note": self.executor_note,
        }

    def onnxruntime_logits(self, rows: np.ndarray) -> np.ndarray:
        """The reference: this file's onnxruntime session on build_features rows float32 [R, N_FEATURES]."""
        mask = np.ascontiguousarray(rows[None, :, _HEALTHY_COL])
        (logits,) = self._session.run(["logits"], {"features": model_inputs(rows[None], mask), "mask": mask}, self._run_options)
        return logits[0]

    def _input(self, view: ClusterView, request: RequestInfo) -> np.ndarray:
        if self._session is None:
            err = self.load_error or ModelLoadError("unavailable", f"{self.path}: no model loaded")
            raise PolicyUnavailable(err.reason, str(err))
        feats = build_features(view, request)
        self.last_input = (view, feats)
        return feats

    def scores(self, view: ClusterView, request: RequestInfo) -> np.ndarray:
        feats = self._input(view, request)
        if self._fast is not None:
            return self._fast.logits(feats)
        # the `healthy` feature is exactly action_mask(view) as float32 (1.0 / 0.0): no second pass over the view
        return self.onnxruntime_logits(feats)

    def best(self, view: ClusterView, request: RequestInfo) -> tuple[int, bool]:
        """base.best_of(scores(view, request), healthy), in one compiled call on the fast path."""
        if self._fast is not None:
            row_args = compiled_row_args(view, request)
            if row_args is not None:  # rows and network in one C call (the decision log builds the same rows itself)
                return self._fast.best_view(row_args)
            return self._fast.best(self._input(view, request))
        return best_of(np.asarray(self.scores(view, request), dtype=np.float64), [r.healthy for r in view.replicas])

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        logits = self.scores(view, request).astype(np.float64)
        mask = action_mask(view).astype(bool)
        logits = np.where(mask, logits, -np.inf)
        if self.greedy:
            return int(np.argmax(logits))
        p = np.exp(logits - logits.max())
        return int(self.rng.choice(len(p), p=p / p.sum()))
