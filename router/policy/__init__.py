"""Shared routing core: view types, feature contract, policies. Pure Python + numpy."""

from routewise_vllm.router.policy.base import Policy, PolicyUnavailable
from routewise_vllm.router.policy.baselines import LeastOutstanding
from routewise_vllm.router.policy.estimate import PrefixIndex, TokenEstimator, id_prefix_blocks, text_prefix_blocks
from routewise_vllm.router.policy.fallback import FALLBACK_REASONS, Decision, FallbackPolicy
from routewise_vllm.router.policy.features import FEATURE_NAMES, FEATURE_SPEC_HASH, N_FEATURES, action_mask, build_features
from routewise_vllm.router.policy.registry import BASELINES, make_policy, policy_names
from routewise_vllm.router.policy.tracking import ClusterTracker, ReplicaTracker
from routewise_vllm.router.policy.types import ClusterView, NoHealthyReplica, Outcome, ReplicaSnapshot, RequestInfo

__all__ = [
    "BASELINES", "FALLBACK_REASONS", "FEATURE_NAMES", "FEATURE_SPEC_HASH", "N_FEATURES",
    "ClusterTracker", "ClusterView", "Decision", "FallbackPolicy", "LeastOutstanding", "NoHealthyReplica",
    "Outcome", "Policy", "PolicyUnavailable", "PrefixIndex", "ReplicaSnapshot", "ReplicaTracker", "RequestInfo",
    "TokenEstimator", "action_mask", "build_features", "id_prefix_blocks", "make_policy", "policy_names",
    "text_prefix_blocks",
]
