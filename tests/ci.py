"""Whether the suite runs in CI: the one reading of the `CI` environment variable every test uses.

CI installs everything the suite needs (the [test] extra, the C extension, Debian's prometheus, real vLLM), so
there a missing piece is a failure; on a developer's machine it is a skip naming what to install.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

TRUTHY = frozenset({"1", "true", "yes"})


def in_ci() -> bool:
    """`CI` set to 1, true or yes (any case, surrounding blanks ignored), as CI services set it."""
    return os.environ.get("CI", "").strip().lower() in TRUTHY


def skip_or_fail(reason: str) -> NoReturn:
    """Skip locally; fail under CI, where `reason` means the CI setup is broken."""
    if in_ci():
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason)


def require_compiled_views():
    """The C view builder (router.policy.tracking._compiled). Without the C extension: a skip locally, a failure
    under CI, which builds it. An extension built that cannot bind the view and row tables fails the import of
    router.policy itself, everywhere."""
    from routewise_vllm.router.policy import fastnet, tracking

    if not fastnet.available():
        skip_or_fail("the C extension router.policy._fastnet is not built (no C compiler at install)")
    assert tracking._compiled is not None, "C extension built but not used by the views"
    return tracking._compiled
