"""Suite-wide: the repository root on sys.path, so every test imports `tests.*` helpers (tests/ci.py,
tests/fakes/, tests/bench/) however pytest was started."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
