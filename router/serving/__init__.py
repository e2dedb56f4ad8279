"""Safe serving of learned policies: A/B arms with a rollback guard, shadow evaluation,
the decision log and hot reload. Plain Python + numpy + prometheus_client; no aiohttp here
except the admin routes (router/serving/admin_api.py), so each part is testable alone."""

from routewise_vllm.router.serving.arms import ARMS, ABSplit, GuardConfig, RollbackGuard, routing_key, stable_fraction
from routewise_vllm.router.serving.decision_log import DecisionLogWriter, decision_record
from routewise_vllm.router.serving.metrics import ServingMetrics
from routewise_vllm.router.serving.reload import PolicyFileWatcher, PolicyReloader, ReloadResult
from routewise_vllm.router.serving.shadow import ShadowEvaluator, ShadowResult

__all__ = [
    "ARMS", "ABSplit", "DecisionLogWriter", "GuardConfig", "PolicyFileWatcher", "PolicyReloader", "ReloadResult",
    "RollbackGuard", "ServingMetrics", "ShadowEvaluator", "ShadowResult", "decision_record", "routing_key",
    "stable_fraction",
]
