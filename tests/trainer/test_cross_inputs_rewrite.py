"""CrossReplicaInputs was rewritten for a smaller exported graph (issue 13: one statistics pass, scalar
fills, one gather of the un-logged columns). It must compute what the formulation the shipped model was
trained with computed; that formulation is kept here as the reference."""

from __future__ import annotations

import torch

from router.policy.features import FEATURE_NAMES, REPLICA_FEATURES, REQUEST_FEATURES, N_FEATURES
from trainer.network import CrossReplicaInputs


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


def test_rewritten_cross_inputs_match_the_trained_formulation():
    g = torch.Generator().manual_seed(0)
    features = torch.rand(64, 12, N_FEATURES, generator=g) * 1.2
    features[..., FEATURE_NAMES.index("prefix_match_frac")] = torch.rand(64, 12, generator=g)
    features[::3, :, FEATURE_NAMES.index("tpot_ema_ms")] = 0.0  # unmeasured replicas
    mask = (torch.rand(64, 12, generator=g) > 0.3).float()
    mask[0] = 0.0  # no valid replica at all
    mask[1] = 1.0
    got, got_wait = CrossReplicaInputs()(features, mask)
    want, want_wait = reference(features, mask)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), (got - want).abs().max()
    assert torch.allclose(got_wait, want_wait, atol=1e-7)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_cross_inputs_keep_no_checkpoint_state():
    assert CrossReplicaInputs().state_dict() == {}  # old checkpoints load unchanged
