"""One smoke training (trainer/configs/smoke.yaml) for every module that reads a finished run: a session fixture of
this conftest, so tests/conftest.py keeps its users on one pytest-xdist worker and it trains once."""

from __future__ import annotations

from pathlib import Path

import pytest

from routewise_vllm.trainer.config import load_config
from routewise_vllm.trainer.ppo import train

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "trainer/configs/smoke.yaml"


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """The run folder of a smoke training with the config as shipped (no overrides but the folder)."""
    run_dir = tmp_path_factory.mktemp("smoke-run")
    cfg = load_config(SMOKE, [f"run.run_dir={run_dir}"])
    summary = train(cfg, progress=False)
    assert summary["updates"] == cfg.ppo.updates
    return run_dir
