"""Re-export a shipped ONNX policy through today's `export_onnx` without its checkpoint: the weights are
read back from the old graph into a RoutingNet (same config, from the model's metadata), exported anew,
and the two files must agree: identical argmax and logits within 1e-4 on simulator observations.

    python -m routewise_vllm.trainer.reexport OLD.onnx NEW.onnx [--observations 4096]

Used to move router/policy/models/suite-fleet.onnx to the smaller graphs without retraining (the
second time onto feature contract 3, whose graph takes `model_inputs`: an OLD file of the previous contract,
whose graph took the `build_features` rows, is fed those rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from routewise_vllm.router.policy.features import N_FEATURES, model_inputs
from routewise_vllm.trainer.config import NetworkConfig, TrainConfig
from routewise_vllm.trainer.export import export_onnx
from routewise_vllm.trainer.network import RoutingNet


def _module_key(node_name: str) -> str:
    """'/blocks.0/ff/ff.0/MatMul' -> 'blocks.0.ff.0' (the TorchScript exporter's scope names)."""
    parts: list[str] = []
    for comp in node_name.strip("/").split("/")[:-1]:
        if parts and comp.startswith(parts[-1] + "."):
            parts[-1] = comp
        else:
            parts.append(comp)
    return ".".join(parts)


def net_from_onnx(model: onnx.ModelProto, cfg: NetworkConfig) -> RoutingNet:
    """The RoutingNet whose export `model` is (policy path only; the value head is not in the graph)."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    net = RoutingNet(N_FEATURES, cfg).eval()
    state = net.state_dict()
    found = {k.removeprefix("net."): torch.from_numpy(v.copy()) for k, v in inits.items() if k.startswith("net.")}
    for node in model.graph.node:
        w = inits.get(node.input[1]) if len(node.input) > 1 else None
        if node.op_type == "MatMul" and w is not None:
            found[_module_key(node.name) + ".weight"] = torch.tensor(np.ascontiguousarray(w.T))
        elif node.name == "/normaliser/Sub" and w is not None:
            found["normaliser.mean"] = torch.from_numpy(w.astype(np.float64))
        elif node.name == "/normaliser/Div" and w is not None:
            found["normaliser.var"] = torch.from_numpy(w.astype(np.float64) ** 2 - 1e-8)
    if cfg.wait_prior:
        raise ValueError("models with the wait prior are not supported (its weight is folded into a constant)")
    policy_keys = {k for k in state if not k.startswith(("value_head.", "normaliser.count"))}
    missing = sorted(policy_keys - set(found))
    if missing:
        raise ValueError(f"weights not found in the graph: {missing}")
    for k in policy_keys:
        if tuple(found[k].shape) != tuple(state[k].shape):
            raise ValueError(f"{k}: shape {tuple(found[k].shape)} in the graph, {tuple(state[k].shape)} in the network")
        state[k] = found[k].to(state[k].dtype)
    net.load_state_dict(state)
    return net


def compare_files(old: Path, new: Path, feats: np.ndarray, masks: np.ndarray) -> tuple[float, float]:
    """(max |logit diff| over valid replicas, identical-argmax share) of two ONNX files, per observation
    at its true replica count."""
    import onnxruntime as ort

    a = ort.InferenceSession(str(old), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(new), providers=["CPUExecutionProvider"])

    def run(sess, x: np.ndarray, mk: np.ndarray) -> np.ndarray:
        rows = sess.get_inputs()[0].shape[-1] == N_FEATURES  # a graph of the previous contract takes the rows
        return sess.run(["logits"], {"features": x if rows else model_inputs(x, mk), "mask": mk})[0][0]

    worst, agree = 0.0, 0
    for f, m in zip(feats, masks):
        w = max(int((f[:, 0] > 0.5).sum()), 1)
        x, mk = f[None, :w].astype(np.float32), m[None, :w].astype(np.float32)
        la, lb = run(a, x, mk), run(b, x, mk)
        valid = mk[0] > 0.5
        if valid.any():
            worst = max(worst, float(np.abs(la - lb)[valid].max()))
        agree += int(np.argmax(la) == np.argmax(lb))
    return worst, agree / len(feats)


def compare_fast_path(path: Path, feats: np.ndarray, masks: np.ndarray) -> tuple[float, float] | None:
    """(max |logit diff|, identical-argmax share) of the router's fast path against onnxruntime on the same
    observations, or None when the file has no fast path here (router/policy/fastnet.py)."""
    from routewise_vllm.router.policy.onnx_policy import OnnxPolicy

    policy = OnnxPolicy(path)
    fast = policy._fast
    if fast is None:
        return None
    worst, agree = 0.0, 0
    for f, m in zip(feats, masks):
        w = max(int((f[:, 0] > 0.5).sum()), 1)
        rows = np.array(f[:w], dtype=np.float32)  # a copy: the healthy column is set below
        rows[:, 1] = m[:w]  # the mask is the healthy column
        ref, got = policy.onnxruntime_logits(rows), fast.logits(rows)
        valid = m[:w] > 0.5
        if valid.any():
            worst = max(worst, float(np.abs(ref - got)[valid].max()))
        agree += int(np.argmax(ref) == np.argmax(got))
    return worst, agree / len(feats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--observations", type=int, default=4096)
    args = p.parse_args(argv)
    model = onnx.load(args.old)
    meta = {e.key: e.value for e in model.metadata_props}
    train_cfg = TrainConfig.model_validate(json.loads(meta["training_config"]))
    net = net_from_onnx(model, train_cfg.network)
    export_onnx(net, args.new, meta["policy_version"], json.loads(meta["training_config"]))
    from routewise_vllm.trainer.observations import simulator_observations

    feats, masks = simulator_observations(net, train_cfg, args.observations)
    worst, agree = compare_files(Path(args.old), Path(args.new), feats, masks)
    print(f"{args.old} -> {args.new}: {len(feats)} simulator observations, max |logit diff| {worst:.3g}, "
          f"identical argmax {agree:.2%}; nodes {len(model.graph.node)} -> {len(onnx.load(args.new).graph.node)}")
    fast = compare_fast_path(Path(args.new), feats, masks)
    if fast is not None:
        print(f"fast path vs onnxruntime on the same observations: max |logit diff| {fast[0]:.3g}, identical argmax {fast[1]:.2%}")
    return 0 if agree == 1.0 and worst < 1e-4 and (fast is None or fast[1] == 1.0) else 1


if __name__ == "__main__":
    sys.exit(main())
