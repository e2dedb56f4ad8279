"""Checkpoints: network weights (normaliser statistics included, as buffers), optimiser state,
the full training config and the loop's progress, so `trainer train --resume` continues exactly.

A corrupt file, one written for another feature spec, or one whose tensors do not fit the
configured network raises CheckpointError naming the file and the mismatch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from routewise_vllm.router.policy.features import FEATURE_SPEC_HASH, N_FEATURES
from routewise_vllm.trainer.config import ConfigError, TrainConfig, config_from_dict
from routewise_vllm.trainer.network import RoutingNet

FORMAT = "routewise-trainer-checkpoint/1"


class CheckpointError(ValueError):
    pass


def save_checkpoint(path: str | Path, net: RoutingNet, cfg: TrainConfig, progress: dict[str, Any], optimizer=None, extra: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT,
        "feature_spec_hash": FEATURE_SPEC_HASH,
        "n_features": N_FEATURES,
        "config": cfg.model_dump(mode="json"),
        "model": net.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "progress": progress,
        "extra": extra or {},
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(doc, tmp)
    os.replace(tmp, path)  # never leave a half-written checkpoint behind
    return path


def read_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        doc = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - torch raises many types on a corrupt file
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(f"{path}: not a routewise trainer checkpoint (format {got!r}, expected {FORMAT!r})")
    if doc.get("feature_spec_hash") != FEATURE_SPEC_HASH:
        raise CheckpointError(
            f"{path}: feature_spec_hash {doc.get('feature_spec_hash')!r} does not match this code's {FEATURE_SPEC_HASH!r}"
        )
    if doc.get("n_features") != N_FEATURES:
        raise CheckpointError(f"{path}: n_features {doc.get('n_features')} does not match this code's {N_FEATURES}")
    return doc


def checkpoint_config(path: str | Path, doc: dict) -> TrainConfig:
    try:
        return config_from_dict(doc["config"], f"{path} (embedded config)")
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None


def load_network(path: str | Path, doc: dict | None = None) -> tuple[RoutingNet, TrainConfig, dict]:
    """The network described by a checkpoint, weights loaded; raises CheckpointError on any mismatch."""
    doc = read_checkpoint(path) if doc is None else doc
    cfg = checkpoint_config(path, doc)
    net = RoutingNet(N_FEATURES, cfg.network)
    try:
        net.load_state_dict(doc["model"])
    except (RuntimeError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()
        raise CheckpointError(f"{path}: weights do not fit the configured network: {' '.join(first[:3])}") from None
    net.eval()
    return net, cfg, doc
