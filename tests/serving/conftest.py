"""Shared helpers for the serving tests: views and ONNX model files built per test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for tests.* imports
