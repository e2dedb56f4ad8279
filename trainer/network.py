"""The routing network: per-replica encoder, cross-replica self-attention, one logit per replica.

Input is `router.policy.build_features(...)` padded to any width R, plus a mask (1 = a present,
healthy replica). The cross-replica inputs are `router.policy.features.model_inputs` (numpy, no
parameters): `logits`/`forward` compute them from the features, `logits_from_inputs` takes them
ready-made and is what the ONNX graph exports, so the served graph is a plain small network.
Observation normalisation lives inside the module as buffers (folded into the graph).
Permutation-equivariant over replicas: the replica order never matters.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from routewise_vllm.router.policy.features import MODEL_INPUT_NAMES, N_MODEL_INPUTS, model_inputs
from routewise_vllm.trainer.config import NetworkConfig

MASKED_LOGIT = -1e9  # what masked replicas get (the ONNX contract allows a large negative number)
_OBS_CLIP = 10.0
_WAIT_COL = MODEL_INPUT_NAMES.index("expected_wait")


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
        self.relative_inputs = cfg.relative_inputs
        n_in = N_MODEL_INPUTS if cfg.relative_inputs else n_features
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

    def inputs(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The exported graph's input [B, R, N_MODEL_INPUTS] for `features` [B, R, n_features] (no gradient flows
        into the inputs, so numpy computes them: the router's code, not a torch copy of it)."""
        inp = model_inputs(features.detach().cpu().numpy(), mask.detach().cpu().numpy())
        return torch.from_numpy(inp).to(features.device)

    def _embed(self, inputs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(per-replica embedding [B, R, H], the logit prior [B, R] or None) from model inputs."""
        nf = self.n_features
        x = self.normaliser(inputs[..., :nf])
        prior = None
        if self.relative_inputs:
            x = torch.cat([x, inputs[..., nf:]], -1)
            if self.wait_weight is not None:
                prior = -self.wait_weight * inputs[..., _WAIT_COL]
        h = self.encoder(x)
        key_bias = ((1.0 - mask) * MASKED_LOGIT)[:, None, None, :]
        for block in self.blocks:
            h = block(h, key_bias)
        return self.final_norm(h), prior

    def logits_from_embedding(self, h: torch.Tensor, mask: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.policy_head(h).squeeze(-1)
        if prior is not None:
            logits = logits + prior
        # a scalar fill, not full_like: the same values, and two graph nodes (Shape, ConstantOfShape) fewer
        return torch.where(mask > 0.5, logits, MASKED_LOGIT)

    def value_from_embedding(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1)
        n = m.sum(1).clamp(min=1.0)
        mean_pool = (h * m).sum(1) / n
        max_pool = torch.where(m > 0.5, h, torch.full_like(h, -1e4)).max(1).values
        max_pool = torch.where(n > 0.5, max_pool, torch.zeros_like(max_pool))
        return self.value_head(torch.cat([mean_pool, max_pool], -1)).squeeze(-1)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, prior = self._embed(self.inputs(features, mask), mask)
        return self.logits_from_embedding(h, mask, prior), self.value_from_embedding(h, mask)

    def logits(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.logits_from_inputs(self.inputs(features, mask), mask)

    def logits_from_inputs(self, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits from model inputs (`model_inputs(features, mask)`): the exported computation."""
        h, prior = self._embed(inputs, mask)
        return self.logits_from_embedding(h, mask, prior)


class LogitsOnly(nn.Module):
    """The exported graph: (model inputs, mask) -> logits."""

    def __init__(self, net: RoutingNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net.logits_from_inputs(inputs, mask)


def masked_categorical(logits: torch.Tensor, mask: torch.Tensor) -> torch.distributions.Categorical:
    return torch.distributions.Categorical(logits=torch.where(mask > 0.5, logits, torch.full_like(logits, MASKED_LOGIT)))


def parameter_count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())
