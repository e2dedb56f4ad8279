"""Finding external tools: skip when absent on a developer machine, fail when absent in CI."""

from __future__ import annotations

import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require_tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path:
        return path
    if IN_CI:
        pytest.fail(f"{name} not found; CI installs Debian's prometheus package (.ci/run -> scripts/test.sh)")
    pytest.skip(f"{name} not installed (apt-get install prometheus); required in CI")
