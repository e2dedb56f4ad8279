"""Suite-wide: the repository root on sys.path, so every test imports `tests.*` helpers (tests/ci.py,
tests/fakes/, tests/bench/) however pytest was started; the `vllm` and `slow` marks completed from the fixtures a
test uses, so `-m "not vllm and not slow"` is the fast local loop (tests/README.md); the groups pytest-xdist keeps
on one worker; and, under CI, a skip not listed in tests/README.md ("Skips allowed in CI") fails."""

from __future__ import annotations

import os
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.ci import in_ci  # noqa: E402

# One OpenMP/BLAS thread per pytest-xdist worker (and the processes its tests start), unless set: two workers of
# torch's default two threads each on 2 cores spin against each other (the fine-tuning tests took 78 s so, 18 s with
# one thread each). Set here, before any test module imports torch or numpy.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# Fixtures of tests/e2e/conftest.py that start real vLLM servers, or need the venv that runs them
VLLM_FIXTURES = frozenset({"vllm_python_path", "tiny_model_dir", "vllm_fleet", "vllm_servers"})
README = Path(__file__).with_name("README.md")
ALLOWED_SKIPS_HEADING = "## Skips allowed in CI"


#: The xdist group of every test that builds a wheel from this checkout (one at a time: they share build/)
WHEEL_BUILDS = "wheel-builds"

@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups (tests/test_xdist_groups.py)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts real vLLM (through these fixtures, however indirectly) is marked `vllm`, and `slow` too:
    the servers take 40-150 s to start on a 2-core machine. Under pytest-xdist (`--dist loadgroup`) the real-vLLM
    tests share one worker, in order (one pair of servers), and a module whose tests share a fixture wider than one
    test (a server, a stack) stays on one worker, as do the modules sharing a session fixture of a conftest (a
    training run), so that fixture starts once."""
    for item in items:
        if item.get_closest_marker("bench"):
            item.add_marker(pytest.mark.slow)  # a bench run is never part of the fast loop
        if VLLM_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif (group := _shared_fixture_group(item)) and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        items[:] = slow_units_first(items)


def slow_units_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The units xdist hands out (a group, or a test alone) reordered so that those holding a `slow` test go first,
    each unit's tests kept together and in order: the workers then end on short tests together, where a long test
    handed out last ran alone for minutes while the other worker idled."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = item.get_closest_marker("xdist_group")
        units.setdefault(group.args[0] if group else item.nodeid, []).append(item)
    ordered = sorted(units.values(), key=lambda unit: not any(i.get_closest_marker("slow") for i in unit))
    return [item for unit in ordered for item in unit]


def _shared_fixture_group(item: pytest.Item) -> str | None:
    """The xdist group of a test that uses a fixture of the suite's own (not a plugin's) living longer than one test:
    the fixture's own name for a session fixture of a conftest (the modules that use it then share one worker, so
    it is set up once), else the test's module."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    shared = [(name, d) for name, defs in info.name2fixturedefs.items() for d in defs if d.scope != "function" and d.baseid]
    for name, d in sorted(shared, key=lambda nd: nd[0]):
        if d.scope == "session" and not item.nodeid.startswith(f"{d.baseid}::"):
            return f"{d.baseid}::{name}"
    return item.nodeid.split("::")[0] if shared else None


@cache
def allowed_skips() -> tuple[str, ...]:
    """The node-id prefixes of tests/README.md's "Skips allowed in CI" table (its first column, in backticks)."""
    text = README.read_text()
    if ALLOWED_SKIPS_HEADING not in text:
        raise pytest.UsageError(f"{README}: no '{ALLOWED_SKIPS_HEADING}' section")
    section = text.split(ALLOWED_SKIPS_HEADING, 1)[1].split("\n## ", 1)[0]
    return tuple(m.group(1) for m in re.finditer(r"^\|\s*`([^`]+)`\s*\|", section, re.M))


def unlisted_skip(nodeid: str) -> bool:
    return in_ci() and not nodeid.startswith(allowed_skips())


def _fail_unlisted(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and unlisted_skip(report.nodeid):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"CI: skipped, and not listed in tests/README.md ('{ALLOWED_SKIPS_HEADING[3:]}'): "
                           f"{reason}. Fix what made it skip, or list it there with its reason.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _fail_unlisted(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail_unlisted(outcome.get_result())
