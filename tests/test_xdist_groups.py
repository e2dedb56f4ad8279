"""The suite's xdist groups hold: under `--dist loadgroup` the tests of one `xdist_group` run on one worker, whether
the mark is declared (a module's `pytestmark`) or added by a conftest at collection, as tests/conftest.py adds it to
the modules that share a fixture and to the real-vLLM tests. On pytest 9.2 with pytest-xdist 3.8 the grouping stopped
without an error (pytest-dev/pytest-xdist#1386): each grouped test then went to any worker, and the wheel builds of
tests/deploy/test_wheel.py's fixture ran at once in one build/ folder and broke."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

CONFTEST = '''
import pytest

@pytest.hookimpl(tryfirst=True)  # as tests/conftest.py: before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name == "test_added.py":
            item.add_marker(pytest.mark.xdist_group("added"))
'''
DECLARED = '''
import pytest

pytestmark = pytest.mark.xdist_group("declared")

@pytest.mark.parametrize("i", range(6))
def test_declared(i):
    pass
'''
ADDED = '''
import pytest

@pytest.mark.parametrize("i", range(6))
def test_added(i):
    pass
'''


def test_each_group_runs_on_one_worker(tmp_path: Path):
    for name, text in (("conftest.py", CONFTEST), ("test_declared.py", DECLARED), ("test_added.py", ADDED)):
        (tmp_path / name).write_text(textwrap.dedent(text))
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "3", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
                          "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, test in re.findall(r"\[(gw\d+)\].*PASSED \S*(test_declared|test_added)", run.stdout):
        workers[test].add(worker)
    assert set(workers) == {"test_declared", "test_added"}, run.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)


ROOT_CONFTEST = '''
import pytest
from tests.conftest import _shared_fixture_group

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if group := _shared_fixture_group(item):
            item.add_marker(pytest.mark.xdist_group(group))
'''
RUN_CONFTEST = '''
import pytest

@pytest.fixture(scope="session")
def one_run():
    return object()
'''
USES_RUN = '''
import pytest

@pytest.mark.parametrize("i", range(6))
def test_uses(one_run, i):
    pass

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
'''


def test_modules_sharing_a_session_fixture_of_a_conftest_run_on_one_worker(tmp_path: Path):
    """tests/conftest.py's rule, applied to a folder whose conftest has a session fixture that two modules use: all
    their tests that use it on one worker (the fixture is set up once), their other tests in no group."""
    (tmp_path / "conftest.py").write_text(ROOT_CONFTEST)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "conftest.py").write_text(RUN_CONFTEST)
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / "runs" / name).write_text(USES_RUN)
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "3", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
                          str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, test in re.findall(r"\[(gw\d+)\].*PASSED \S*::(test_uses|test_free)", run.stdout):
        workers[test].add(worker)
    assert len(re.findall(r"PASSED \S*@runs::one_run", run.stdout)) == 12, run.stdout[-3000:]
    assert len(workers["test_uses"]) == 1, dict(workers)
    assert not re.findall(r"test_free\[\d+\]@", run.stdout)  # the tests that do not use it: in no group


def test_the_suites_own_groups_are_added_before_xdist_reads_them():
    from tests import conftest

    assert conftest.pytest_collection_modifyitems.pytest_impl.get("tryfirst") is True
