"""ONNX export in router/policy/onnx_policy.py's contract, plus the torch-vs-onnxruntime parity check.

Contract: inputs `features` float32 [batch, replicas, N_MODEL_INPUTS] (`model_inputs(build_features rows,
mask)`: the cross-replica inputs are computed outside the graph) and `mask` float32 [batch, replicas];
output `logits` float32 [batch, replicas] (masked entries = -1e9); metadata `feature_spec_hash`,
`feature_version`, `policy_version`, `training_config` (JSON), and `fastnet`: the same weights for the
router's compiled fast path (router/policy/fastnet.py), checked against onnxruntime on every export. Observation normalisation is folded into
the graph, which the exporter constant-folds: a plain small network (MatMul/Add/LayerNorm/Softmax...).
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from routewise_vllm.router.policy import fastnet
from routewise_vllm.router.policy.fastnet import PARITY_TIE
from routewise_vllm.router.policy.features import FEATURE_SPEC_HASH, FEATURE_VERSION, N_MODEL_INPUTS, model_inputs
from routewise_vllm.trainer.network import LogitsOnly, RoutingNet

OPSET = 17


class ExportError(RuntimeError):
    pass


@dataclass
class ParityReport:
    n_observations: int
    max_abs_diff: float
    argmax_agreement: float  # the same pick, or a tie (see `ties`)
    replica_counts: tuple[int, ...]
    ties: int = 0  # observations where the picks differ but torch scores them within PARITY_TIE (float rounding)

    @property
    def ok(self) -> bool:
        return self.argmax_agreement == 1.0 and self.max_abs_diff < 1e-3

    def __str__(self) -> str:
        return (
            f"parity over {self.n_observations} observations (replica widths {list(self.replica_counts)}): "
            f"max |logit diff| over valid replicas = {self.max_abs_diff:.3g}, "
            f"identical argmax = {self.argmax_agreement * 100:.2f}%"
            + (f" ({self.ties} of them ties within {PARITY_TIE:g}: the same replica score, another pick)" if self.ties else "")
        )


def export_onnx(net: RoutingNet, path: str | Path, policy_version: str, training_config: dict) -> Path:
    """Write the ONNX model (dynamic batch and replica axes) with the contract's metadata."""
    path = Path(path)
    net = net.eval()
    wrapper = LogitsOnly(net).eval()
    feats = torch.zeros(2, 5, N_MODEL_INPUTS)
    mask = torch.ones(2, 5)
    buf = io.BytesIO()
    # The TorchScript exporter (dynamo=False) gives a plain, small opset-17 graph with symbolic
    # batch/replica axes; it warns that it is deprecated, which is noise here.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(
            wrapper,
            (feats, mask),
            buf,
            input_names=["features", "mask"],
            output_names=["logits"],
            dynamic_axes={"features": {0: "batch", 1: "replicas"}, "mask": {0: "batch", 1: "replicas"}, "logits": {0: "batch", 1: "replicas"}},
            opset_version=OPSET,
            dynamo=False,
        )
    model = onnx.load_from_string(buf.getvalue())
    meta = {
        "feature_spec_hash": FEATURE_SPEC_HASH,
        "feature_version": str(FEATURE_VERSION),
        "policy_version": policy_version,
        "training_config": json.dumps(training_config, sort_keys=True),
    }
    if net.relative_inputs:  # the only input layout the fast path reads
        meta[fastnet.METADATA_KEY] = fastnet_weights(net)
    del model.metadata_props[:]
    for k, v in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    if fastnet.METADATA_KEY in meta and fastnet.available():
        from routewise_vllm.router.policy.onnx_policy import OnnxPolicy

        served = OnnxPolicy(path)
        if served.describe()["executor"] != "fastnet":
            raise ExportError(f"{path}: {served.executor_note}")
    return path


def fastnet_weights(net: RoutingNet) -> str:
    """The `fastnet` metadata value: the policy path's weights in router.policy.fastnet's layout."""
    state = {k: v.detach().cpu().numpy() for k, v in net.state_dict().items()}
    if net.wait_weight is not None:
        state["wait_weight"] = net.wait_weight.detach().cpu().numpy().reshape(1)
    heads = net.blocks[0].heads if len(net.blocks) else 1
    return fastnet.pack(state, net.encoder[0].out_features, heads, len(net.blocks))


def pick_agreement(got: np.ndarray, want: np.ndarray, valid: np.ndarray) -> tuple[int, int]:
    """(observations whose picks agree, how many of those are ties) for logits [N, R] of the exported model (`got`)
    and the reference (`want`) over `valid` replicas. A different pick among replicas the reference scores within
    PARITY_TIE (identical replicas, where float rounding decides) is a tie and agrees, as the router's own
    fast-path check counts it (router/policy/fastnet.py); an observation with no valid replica agrees."""
    got = np.where(valid, got, -np.inf)
    want = np.where(valid, want, -np.inf)
    picks, best = got.argmax(1), want.argmax(1)
    rows = np.arange(len(got))
    has_valid = valid.any(1)
    same = picks == best
    with np.errstate(invalid="ignore"):  # -inf - -inf where no replica is valid: NaN, masked by has_valid
        tie = ~same & (want[rows, best] - want[rows, picks] <= PARITY_TIE) & has_valid
    return int((same | tie | ~has_valid).sum()), int(tie.sum())


def parity_check(net: RoutingNet, onnx_path: str | Path, features: np.ndarray, masks: np.ndarray, batch: int = 256) -> ParityReport:
    """Compare torch and onnxruntime logits on observations `features` [N, R, N_FEATURES] (build_features rows,
    fed to onnxruntime through `model_inputs` as the router does), `masks` [N, R].

    Observations are also re-cut to their true replica count (trailing padding removed) in
    groups, so the dynamic replica axis is exercised at several widths.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    net = net.eval()
    max_diff = 0.0
    agree = 0
    ties = 0
    total = 0
    widths = set()
    present = features[..., 0] > 0.5  # feature 0 is `present`
    counts = present.sum(1)
    for width in np.unique(counts):
        idx = np.nonzero(counts == width)[0]
        for start in range(0, len(idx), batch):
            sel = idx[start : start + batch]
            w = int(max(width, 1))
            f = np.ascontiguousarray(features[sel, :w], dtype=np.float32)
            m = np.ascontiguousarray(masks[sel, :w], dtype=np.float32)
            (onnx_logits,) = sess.run(["logits"], {"features": model_inputs(f, m), "mask": m})
            with torch.no_grad():
                torch_logits = net.logits(torch.from_numpy(f), torch.from_numpy(m)).numpy()
            valid = m > 0.5
            if valid.any():
                max_diff = max(max_diff, float(np.abs(onnx_logits - torch_logits)[valid].max()))
            a, t = pick_agreement(onnx_logits, torch_logits, valid)
            agree += a
            ties += t
            total += len(sel)
            widths.add(w)
    return ParityReport(total, max_diff, agree / max(total, 1), tuple(sorted(widths)), ties)


def model_size_bytes(path: str | Path) -> int:
    return Path(path).stat().st_size


def check_onnx_file(path: str | Path) -> dict[str, str]:
    """Load an ONNX file and check it against the contract; raise ExportError naming file and mismatch."""
    from routewise_vllm.router.policy.onnx_policy import ModelLoadError, load_session

    try:
        sess = load_session(Path(path))
    except ModelLoadError as exc:
        raise ExportError(str(exc)) from None
    outs = [o.name for o in sess.get_outputs()]
    if outs != ["logits"]:
        raise ExportError(f"{path}: outputs {outs} do not match the contract's ['logits']")
    return dict(sess.get_modelmeta().custom_metadata_map)
