"""The second and third shipped models: each card names the configuration that trained it, and that file
still says so."""

from __future__ import annotations

import json
from pathlib import Path

from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH
from routewise_vllm.router.policy.onnx_policy import OnnxPolicy
from routewise_vllm.trainer.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
ANY_FLEET = DEFAULT_MODEL_PATH.parent / "any-fleet.onnx"
LATE_FLEET = DEFAULT_MODEL_PATH.parent / "late-fleet.onnx"


def test_any_fleet_card_was_trained_by_its_config_file():
    card = json.loads(ANY_FLEET.with_suffix(".json").read_text())
    config = load_config(ROOT / "trainer/configs/any-fleet.yaml").model_dump(mode="json")
    # the card's config with today's defaults filled in (fields added since it was trained keep their defaults)
    assert TrainConfig.model_validate(card["training"]["config"]).model_dump(mode="json") == config
    assert config["warm_start"]["quantile"] == 0.9 and config["env"]["randomisation"]["fleet_prob"] == 0.25
    selected = card["training"]["selected_checkpoint"]
    assert card["policy_version"] == f"any-fleet-{selected}"
    assert OnnxPolicy(ANY_FLEET).describe()["version"] == card["policy_version"]


def test_late_fleet_card_was_trained_behind_late_binding_by_its_config_file():
    card = json.loads(LATE_FLEET.with_suffix(".json").read_text())
    config = load_config(ROOT / "trainer/configs/late-fleet.yaml").model_dump(mode="json")
    assert TrainConfig.model_validate(card["training"]["config"]).model_dump(mode="json") == config
    assert config["env"]["late_binding"] is True
    assert card["policy_version"] == f"late-fleet-{card['training']['selected_checkpoint']}"
    assert OnnxPolicy(LATE_FLEET).describe()["version"] == card["policy_version"]
    evaluation = card["evaluation"]  # evaluated as it is meant to run: behind late binding, like with like
    assert evaluation["late_binding"] is not None
    assert all("late_ttft_p99_ratio" in s for s in evaluation["vs_best_heuristic"])


def test_cache_fleet_card_was_trained_on_the_uniform_pools_with_kv_event_views_by_its_config_file():
    cache = DEFAULT_MODEL_PATH.parent / "cache-fleet.onnx"
    card = json.loads(cache.with_suffix(".json").read_text())
    config = load_config(ROOT / "trainer/configs/cache-fleet.yaml").model_dump(mode="json")
    assert TrainConfig.model_validate(card["training"]["config"]).model_dump(mode="json") == config
    env = config["env"]
    assert env["late_binding"] is True and env["randomisation"]["kv_events_prob"] == 0.5
    assert {s for s in env["scenarios"] if s.startswith("uniform-")} == {
        "uniform-tenants-8", "uniform-tenants-2", "uniform-chat-4", "uniform-chat-32", "uniform-rag-16", "uniform-rag-4-l4"}
    assert card["policy_version"] == f"cache-fleet-{card['training']['selected_checkpoint']}"
    assert OnnxPolicy(cache).describe()["version"] == card["policy_version"]
