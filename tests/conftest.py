"""Suite-wide: the repository root on sys.path, so every test imports `tests.*` helpers (tests/ci.py,
tests/fakes/, tests/bench/) however pytest was started; the `vllm` and `slow` marks completed from the fixtures a
test uses, so `-m "not vllm and not slow"` is the fast local loop (tests/README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Fixtures of tests/e2e/conftest.py that start real vLLM servers, or need the venv that runs them
VLLM_FIXTURES = frozenset({"vllm_python_path", "tiny_model_dir", "vllm_fleet", "vllm_servers"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts real vLLM (through these fixtures, however indirectly) is marked `vllm`, and `slow` too:
    the servers take 40-150 s to start on a 2-core machine."""
    for item in items:
        if VLLM_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)
