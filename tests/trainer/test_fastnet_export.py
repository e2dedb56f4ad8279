"""Every export carries the fast path's weights, checked against onnxruntime, for every network shape the
config allows (router/policy/fastnet.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routewise_vllm.router.policy import fastnet
from routewise_vllm.router.policy.features import FEATURE_NAMES, N_FEATURES
from routewise_vllm.router.policy.onnx_policy import OnnxPolicy
from routewise_vllm.trainer.config import NetworkConfig
from routewise_vllm.trainer.export import ExportError, export_onnx
from tests.ci import in_ci
from routewise_vllm.trainer.network import RoutingNet

# CI builds the extension: there these fail without it
pytestmark = pytest.mark.skipif(not fastnet.available() and not in_ci(), reason="C extension not built")
HEALTHY = FEATURE_NAMES.index("healthy")


@pytest.mark.parametrize(
    "cfg",
    [
        dict(hidden=32, heads=2, layers=1),  # the shipped shape
        dict(hidden=16, heads=4, layers=0),
        dict(hidden=24, heads=3, layers=1),  # widths that are not a multiple of the C tile
        dict(hidden=64, heads=4, layers=2, wait_prior=True),
        dict(hidden=40, heads=5, layers=1),  # head width 8
    ],
)
def test_export_serves_on_the_fast_path_like_onnxruntime(tmp_path, cfg) -> None:
    torch.manual_seed(0)
    net = RoutingNet(N_FEATURES, NetworkConfig(**cfg))
    with torch.no_grad():
        for p in net.parameters():  # trained-looking weights, not the zero-initialised head
            p.normal_(0.0, 0.3)
    policy = OnnxPolicy(export_onnx(net, tmp_path / "m.onnx", "test", {"network": cfg}))
    assert policy.describe()["executor"] == "fastnet", policy.executor_note
    rng = np.random.default_rng(1)
    for width in (1, 2, 9, 31, 70):
        rows = rng.uniform(0, 1.2, (width, N_FEATURES)).astype(np.float32)
        rows[:, HEALTHY] = rng.random(width) < 0.8
        rows[:, FEATURE_NAMES.index("prefix_match_frac")] = rng.uniform(0, 1, width)
        valid = rows[:, HEALTHY] > 0.5
        if not valid.any():
            continue
        want, got = policy.onnxruntime_logits(rows), policy._fast.logits(rows)
        assert np.abs(want - got)[valid].max() < 1e-4
        assert np.argmax(want) == np.argmax(got)


def test_export_refuses_weights_that_disagree(tmp_path, monkeypatch) -> None:
    """The exporter checks the fast path on every export: a packing bug fails the export, naming the file."""
    net = RoutingNet(N_FEATURES, NetworkConfig(hidden=16, heads=2, layers=1))
    real_pack = fastnet.pack

    def bad_pack(state, hidden, heads, layers):
        state = dict(state)
        state["policy_head.2.bias"] = state["policy_head.2.bias"] + 1.0
        return real_pack(state, hidden, heads, layers)

    monkeypatch.setattr(fastnet, "pack", bad_pack)
    with pytest.raises(ExportError, match="m.onnx: fast path disagrees with onnxruntime"):
        export_onnx(net, tmp_path / "m.onnx", "test", {})
