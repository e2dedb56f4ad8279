"""The peers' routing algorithms, faithful to their sources, as baselines: each names its source and ships its
defaults (docs/peers.md)."""

from __future__ import annotations

from routewise_vllm.router.policy.base import Policy
from routewise_vllm.router.policy.peers.dynamo_kv import DynamoKv
from routewise_vllm.router.policy.peers.llmd import LlmD
from routewise_vllm.router.policy.peers.llmd_blend import LlmDBlend

PEER_CLASSES: tuple[type[Policy], ...] = (LlmD, LlmDBlend, DynamoKv)

__all__ = ["PEER_CLASSES", "DynamoKv", "LlmD", "LlmDBlend"]
