"""The cross-replica inputs moved out of the network into router.policy.features.model_inputs (numpy; issue
13: the served graph is a plain small network). They must compute what the torch formulation the shipped
model was trained with computed; that formulation is kept here as the reference."""

from __future__ import annotations

import torch

import numpy as np
import pytest

from routewise_vllm.router.policy.features import (
    CROSS_NAMES,
    FEATURE_NAMES,
    MODEL_INPUT_NAMES,
    N_FEATURES,
    REPLICA_FEATURES,
    REQUEST_FEATURES,
    model_inputs,
)
from routewise_vllm.trainer.config import NetworkConfig
from routewise_vllm.trainer.network import RoutingNet


def reference(features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n_rep = len(REPLICA_FEATURES)
    scales = {n: s for n, _, s in REPLICA_FEATURES + REQUEST_FEATURES}

    def col(name):
        i = FEATURE_NAMES.index(name)
        return features[..., i : i + 1]

    def unlog(name):
        return torch.exp(col(name) * scales[name]) - 1.0

    def stats(x, valid):
        n = valid.sum(1, keepdim=True).clamp(min=1.0)
        any_valid = valid.sum(1, keepdim=True) > 0.5
        lo = torch.where(valid > 0.5, x, torch.full_like(x, 1e4)).min(1, keepdim=True).values
        hi = torch.where(valid > 0.5, x, torch.full_like(x, -1e4)).max(1, keepdim=True).values
        mean = (x * valid).sum(1, keepdim=True) / n
        zero = torch.zeros_like(lo)
        return torch.where(any_valid, lo, zero), torch.where(any_valid, mean, zero), torch.where(any_valid, hi, zero)

    valid = mask.unsqueeze(-1)
    rep = features[..., :n_rep]
    lo, mean, hi = stats(rep, valid)
    prompt, decode = unlog("outstanding_prompt_tokens"), unlog("outstanding_decode_tokens")
    load = torch.log(1.0 + prompt + decode) / 10.0
    tpot_ms = unlog("tpot_ema_ms")
    speed_load = torch.log(1.0 + (prompt + decode) * tpot_ms / 10.0) / 10.0
    awaiting, req_prompt = unlog("awaiting_prompt_tokens"), unlog("req_prompt_tokens_est")
    uncached = req_prompt * (1.0 - col("prefix_match_frac"))
    measured = (tpot_ms > 0).to(tpot_ms.dtype) * valid
    mean_tpot = (tpot_ms * measured).sum(1, keepdim=True) / measured.sum(1, keepdim=True).clamp(min=1.0)
    rel_speed = torch.where(measured > 0.5, tpot_ms / mean_tpot.clamp(min=1e-6), torch.ones_like(tpot_ms))
    wait = torch.log(1.0 + (awaiting + uncached + 0.1 * decode) * rel_speed) / 10.0
    derived = torch.cat([load, speed_load, wait], -1)
    d_lo, _, d_hi = stats(derived, valid)
    raw_load = prompt + decode
    raw_lo, raw_mean, _ = stats(raw_load, valid)
    both = torch.cat([rep, derived], -1)
    is_min = (both <= torch.cat([lo, d_lo], -1) + 1e-6).to(both.dtype)
    is_max = (both >= torch.cat([hi, d_hi], -1) - 1e-6).to(both.dtype)
    rel_load = (raw_load - raw_lo) / (raw_mean + 256.0)
    out = torch.cat([rep - lo, rep - mean, hi - rep, derived, derived - d_lo, is_min, is_max, rel_load], -1)
    return out * valid, wait.squeeze(-1)


def _batch(seed: int, r: int = 12):
    g = torch.Generator().manual_seed(seed)
    features = torch.rand(64, r, N_FEATURES, generator=g) * 1.2
    features[..., FEATURE_NAMES.index("prefix_match_frac")] = torch.rand(64, r, generator=g)
    features[::3, :, FEATURE_NAMES.index("tpot_ema_ms")] = 0.0  # unmeasured replicas
    mask = (torch.rand(64, r, generator=g) > 0.3).float()
    mask[0] = 0.0  # no valid replica at all
    mask[1] = 1.0
    return features, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_model_inputs_match_the_trained_formulation(seed):
    features, mask = _batch(seed)
    got = model_inputs(features.numpy(), mask.numpy())
    want, _ = reference(features, mask)
    assert got.dtype == np.float32 and got.shape == (64, 12, len(MODEL_INPUT_NAMES))
    assert np.array_equal(got[..., :N_FEATURES], features.numpy())  # the rows come first, unchanged
    # numpy and torch differ in exp/log by an ulp or so; an indicator that flipped would differ by 1
    assert np.allclose(got[..., N_FEATURES:], want.numpy(), atol=1e-5, rtol=1e-5), np.abs(got[..., N_FEATURES:] - want.numpy()).max()
    assert not got[0, :, N_FEATURES:].any()  # no valid replica: no cross inputs


def test_all_valid_fast_path_gives_the_masked_path_bits():
    """Every replica valid takes plain statistics; they must equal the masked ones bit for bit."""
    features, _ = _batch(6, r=9)
    ones = np.ones((64, 9), np.float32)
    fast = model_inputs(features.numpy(), ones)
    half = ones.copy()
    half[0, 0] = 0.0  # one invalid replica anywhere sends the whole batch down the masked path
    masked = model_inputs(features.numpy(), half)
    assert np.array_equal(fast[1:], masked[1:])
    want, _ = reference(features, torch.from_numpy(ones))
    assert np.allclose(fast[..., N_FEATURES:], want.numpy(), atol=1e-5, rtol=1e-5)


def test_model_inputs_of_one_decision_equal_its_row_in_a_batch():
    """The router calls model_inputs on one observation [1, R, F], the trainer on batches [N, R, F]."""
    features, mask = _batch(3, r=7)
    batch = model_inputs(features.numpy(), mask.numpy())
    for i in (1, 5, 9):
        one = model_inputs(features.numpy()[i : i + 1], mask.numpy()[i : i + 1])
        assert np.array_equal(one[0], batch[i])
        assert np.array_equal(model_inputs(features.numpy()[i], mask.numpy()[i]), batch[i])  # no batch axis


def test_cross_inputs_are_named_and_the_wait_prior_reads_its_column():
    assert MODEL_INPUT_NAMES == FEATURE_NAMES + CROSS_NAMES and len(set(MODEL_INPUT_NAMES)) == len(MODEL_INPUT_NAMES)
    features, mask = _batch(4)
    _, want_wait = reference(features, mask)
    got = model_inputs(features.numpy(), mask.numpy())[..., MODEL_INPUT_NAMES.index("expected_wait")]
    assert np.allclose(got, (want_wait * mask).numpy(), atol=1e-6)


def test_network_inputs_are_model_inputs():
    net = RoutingNet(N_FEATURES, NetworkConfig(hidden=16, heads=2, layers=1)).eval()
    features, mask = _batch(5)
    with torch.no_grad():
        assert torch.equal(net.logits(features, mask), net.logits_from_inputs(torch.from_numpy(model_inputs(features.numpy(), mask.numpy())), mask))
