"""Finding external tools: skip when absent on a developer machine, fail when absent in CI."""

from __future__ import annotations

import os
import shutil

from tests.ci import skip_or_fail


def require_tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path:
        return path
    skip_or_fail(f"{name} not installed (apt-get install prometheus; .ci/run -> scripts/test.sh installs it)")
