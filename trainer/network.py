"""The routing network: per-replica encoder, cross-replica self-attention, one logit per replica.

Input is exactly `router.policy.build_features(...)` padded to any width R, plus a mask
(1 = a present, healthy replica). Observation normalisation lives inside the module as
buffers, so the exported ONNX graph takes raw features (normalisation folded in).
Permutation-equivariant over replicas: the replica order never matters.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from router.policy.baselines import EXPECTED_WAIT_DECODE_WEIGHT
from trainer.config import NetworkConfig

MASKED_LOGIT = -1e9  # what masked replicas get (the ONNX contract allows a large negative number)
_OBS_CLIP = 10.0


class ObsNormaliser(nn.Module):
    """Running mean/variance of per-replica feature rows (present rows only), as buffers."""

    def __init__(self, n_features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_features, dtype=torch.float64))
        self.register_buffer("var", torch.ones(n_features, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    @torch.no_grad()
    def update(self, features: np.ndarray, present: np.ndarray) -> None:
        """`features` [..., R, F], `present` [..., R] (bool/0-1): rows that are real replicas."""
        rows = np.asarray(features, dtype=np.float64).reshape(-1, features.shape[-1])[np.asarray(present).reshape(-1) > 0]
        if len(rows) == 0:
            return
        b_mean = torch.from_numpy(rows.mean(0))
        b_var = torch.from_numpy(rows.var(0))
        b_count = float(len(rows))
        delta = b_mean - self.mean
        tot = self.count + b_count
        new_mean = self.mean + delta * b_count / tot
        m2 = self.var * self.count + b_var * b_count + delta.pow(2) * self.count * b_count / tot
        self.mean.copy_(new_mean)
        self.var.copy_(m2 / tot)
        self.count.fill_(tot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = torch.sqrt(self.var + 1e-8).to(x.dtype)
        return torch.clamp((x - self.mean.to(x.dtype)) / std, -_OBS_CLIP, _OBS_CLIP)


class CrossReplicaInputs(nn.Module):
    """Derived per-replica inputs that make "the least loaded replica" easy to see.

    From the raw `build_features` rows (spec scales, log1p units) it adds, for every replica
    feature, its difference to the minimum, mean and maximum over valid replicas, plus the total
    token load (prompt + expected decode tokens, un-logged, summed, re-logged), the token load
    times the replica's TPOT EMA (a speed-aware load), and the expected wait for a first token
    (prompt tokens still awaiting their first token + this request's uncached prompt + a tenth of
    the decode tokens in flight, times the TPOT EMA relative to the fleet's mean; the
    `expected-wait` heuristic's score), each with its difference to the minimum.
    Permutation-equivariant; padded and masked replicas never enter the statistics.
    """

    def __init__(self) -> None:
        super().__init__()
        from router.policy.features import FEATURE_NAMES, REPLICA_FEATURES, REQUEST_FEATURES

        self.n_rep = len(REPLICA_FEATURES)
        self.i_match = FEATURE_NAMES.index("prefix_match_frac")
        raw = ("outstanding_prompt_tokens", "outstanding_decode_tokens", "tpot_ema_ms", "awaiting_prompt_tokens",
               "req_prompt_tokens_est")
        all_scales = {n: s for n, _, s in REPLICA_FEATURES + REQUEST_FEATURES}
        # not persistent: derived from the feature contract, never part of a checkpoint
        self.register_buffer("raw_cols", torch.tensor([FEATURE_NAMES.index(n) for n in raw]), persistent=False)
        self.register_buffer("raw_scales", torch.tensor([all_scales[n] for n in raw], dtype=torch.float32), persistent=False)

    n_derived = 3

    @property
    def n_extra(self) -> int:
        return 3 * self.n_rep + 2 * self.n_derived + 2 * (self.n_rep + self.n_derived) + 1

    @staticmethod
    def _stats(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Min, mean and max over valid replicas, per column (zeros when none is valid). Written for a small
        exported graph: scalar fills, one mask test, and the no-valid-replica case as a multiply by 0/1."""
        count = valid.sum(1, keepdim=True)
        any_valid = (count > 0.5).to(x.dtype)
        is_valid = valid > 0.5
        lo = torch.where(is_valid, x, 1e4).min(1, keepdim=True).values
        hi = torch.where(is_valid, x, -1e4).max(1, keepdim=True).values
        mean = (x * valid).sum(1, keepdim=True) / count.clamp(min=1.0)
        return lo * any_valid, mean, hi * any_valid

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(derived inputs [B, R, n_extra], the expected-wait score [B, R])."""
        valid = mask.unsqueeze(-1)
        rep = features[..., : self.n_rep]
        # the five un-logged columns at once: exp/log, not expm1/log1p: ONNX opset 17 has no expm1
        raw = torch.exp(features[..., self.raw_cols] * self.raw_scales) - 1.0
        prompt, decode, tpot_ms, awaiting, req_prompt = torch.split(raw, 1, -1)
        raw_load = prompt + decode
        load = torch.log(1.0 + raw_load) / 10.0
        speed_load = torch.log(1.0 + raw_load * tpot_ms / 10.0) / 10.0
        uncached = req_prompt * (1.0 - features[..., self.i_match : self.i_match + 1])
        measured = (tpot_ms > 0).to(tpot_ms.dtype) * valid
        mean_tpot = (tpot_ms * measured).sum(1, keepdim=True) / measured.sum(1, keepdim=True).clamp(min=1.0)
        rel_speed = torch.where(measured > 0.5, tpot_ms / mean_tpot.clamp(min=1e-6), torch.ones_like(tpot_ms))
        wait = torch.log(1.0 + (awaiting + uncached + EXPECTED_WAIT_DECODE_WEIGHT * decode) * rel_speed) / 10.0
        derived = torch.cat([load, speed_load, wait], -1)
        # one pass of statistics over [replica block | derived | token load]
        lo_all, mean_all, hi_all = self._stats(torch.cat([rep, derived, raw_load], -1), valid)
        n, d = self.n_rep, self.n_derived
        lo, mean, hi = lo_all[..., :n], mean_all[..., :n], hi_all[..., :n]
        d_lo = lo_all[..., n : n + d]
        raw_lo, raw_mean = lo_all[..., n + d :], mean_all[..., n + d :]
        both = torch.cat([rep, derived], -1)
        # exact "is the minimum / maximum" indicators: argmin-style heuristics become trivially representable
        is_min = (both <= lo_all[..., : n + d] + 1e-6).to(both.dtype)
        is_max = (both >= hi_all[..., : n + d] - 1e-6).to(both.dtype)
        rel_load = (raw_load - raw_lo) / (raw_mean + 256.0)  # load excess in units of the mean load
        out = torch.cat([rep - lo, rep - mean, hi - rep, derived, derived - d_lo, is_min, is_max, rel_load], -1)
        return out * valid, wait.squeeze(-1)


class _AttentionBlock(nn.Module):
    """Pre-norm multi-head self-attention across replicas + a feed-forward layer, with key masking."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, h: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        # h [B, R, H]; key_bias [B, 1, 1, R]: 0 for valid keys, a large negative number for masked ones
        b, r, hid = h.shape
        qkv = self.qkv(self.norm1(h)).reshape(b, r, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [B, heads, R, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + key_bias
        att = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(att, v).permute(0, 2, 1, 3).reshape(b, r, hid)
        h = h + self.out(ctx)
        return h + self.ff(self.norm2(h))


class RoutingNet(nn.Module):
    """features [B, R, F] float32, mask [B, R] float32 -> (logits [B, R], value [B])."""

    def __init__(self, n_features: int, cfg: NetworkConfig) -> None:
        super().__init__()
        self.n_features = n_features
        self.normaliser = ObsNormaliser(n_features)
        h = cfg.hidden
        self.cross_inputs = CrossReplicaInputs() if cfg.relative_inputs else None
        n_in = n_features + (self.cross_inputs.n_extra if self.cross_inputs is not None else 0)
        self.encoder = nn.Sequential(nn.Linear(n_in, h), nn.GELU(), nn.Linear(h, h))
        self.blocks = nn.ModuleList(_AttentionBlock(h, cfg.heads) for _ in range(cfg.layers))
        self.final_norm = nn.LayerNorm(h)
        self.policy_head = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, 1))
        self.register_parameter("wait_weight", None)
        if cfg.wait_prior:  # (the config checks relative_inputs is on)
            # logit = head - w x expected-wait score; w = 100 makes the untrained network rank replicas exactly like
            # the expected-wait heuristic (the score is log(1 + work ahead) / 10, the latency target's logit scale 10)
            self.wait_weight = nn.Parameter(torch.tensor(100.0))
        self.value_head = nn.Sequential(nn.Linear(2 * h, h), nn.GELU(), nn.Linear(h, 1))
        nn.init.zeros_(self.policy_head[-1].weight)  # start near uniform over valid replicas
        nn.init.zeros_(self.policy_head[-1].bias)

    def _embed(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(per-replica embedding [B, R, H], the logit prior [B, R] or None)."""
        x = self.normaliser(features)
        prior = None
        if self.cross_inputs is not None:
            extra, wait = self.cross_inputs(features, mask)
            x = torch.cat([x, extra], -1)
            if self.wait_weight is not None:
                prior = -self.wait_weight * wait
        h = self.encoder(x)
        key_bias = ((1.0 - mask) * MASKED_LOGIT)[:, None, None, :]
        for block in self.blocks:
            h = block(h, key_bias)
        return self.final_norm(h), prior

    def logits_from_embedding(self, h: torch.Tensor, mask: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.policy_head(h).squeeze(-1)
        if prior is not None:
            logits = logits + prior
        return torch.where(mask > 0.5, logits, torch.full_like(logits, MASKED_LOGIT))

    def value_from_embedding(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1)
        n = m.sum(1).clamp(min=1.0)
        mean_pool = (h * m).sum(1) / n
        max_pool = torch.where(m > 0.5, h, torch.full_like(h, -1e4)).max(1).values
        max_pool = torch.where(n > 0.5, max_pool, torch.zeros_like(max_pool))
        return self.value_head(torch.cat([mean_pool, max_pool], -1)).squeeze(-1)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, prior = self._embed(features, mask)
        return self.logits_from_embedding(h, mask, prior), self.value_from_embedding(h, mask)

    def logits(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h, prior = self._embed(features, mask)
        return self.logits_from_embedding(h, mask, prior)


class LogitsOnly(nn.Module):
    """The exported graph: (features, mask) -> logits."""

    def __init__(self, net: RoutingNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net.logits(features, mask)


def masked_categorical(logits: torch.Tensor, mask: torch.Tensor) -> torch.distributions.Categorical:
    return torch.distributions.Categorical(logits=torch.where(mask > 0.5, logits, torch.full_like(logits, MASKED_LOGIT)))


def parameter_count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())
