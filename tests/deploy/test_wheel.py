"""The wheel as a user installs it: built from the checkout, installed (not editable) into a fresh virtual
environment, and run from a folder outside the checkout, so that a file left out of the package data, a module
named outside the namespace or a console script pointing nowhere fails here rather than on a user's machine.

The fresh environment takes its third-party dependencies from the test's own environment through a path file
(the wheel is installed with --no-deps): the packages are the same, and routewise_vllm can only come from the wheel.
"""

from __future__ import annotations

import email
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.ci import skip_or_fail
from tests.conftest import WHEEL_BUILDS

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("router", "simulator", "trainer", "fleet")
# every test that builds a wheel from this checkout on one xdist worker: setuptools builds in the tree's build/
# folder, which two builds at once corrupt
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(WHEEL_BUILDS)]


def _run(args: list, cwd: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{args}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, ROOT], cwd=out,
         timeout=600)
    (path,) = out.glob("routewise_vllm-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """bin/ of a fresh venv holding the wheel; its cwd for commands is a folder outside the checkout."""
    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", venv], cwd=venv)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # a plain path: its .pth files don't run
    _run([venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], cwd=venv)
    return venv / "bin"


def _names_in_wheel(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_carries_every_data_file_of_the_tree(wheel):
    names = set(_names_in_wheel(wheel))
    tracked = subprocess.run(["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True, text=True, check=True)
    data = [p for p in tracked.stdout.split() if not p.endswith((".py", ".c", ".h"))]
    assert len(data) > 40  # models, scenarios of every folder, profiles, traces, configs, READMEs
    missing = [p for p in data if f"routewise_vllm/{p}" not in names]
    assert missing == []
    assert not [n for n in names if n.endswith((".c", ".h", ".pyc"))]


def test_the_wheel_carries_each_c_extension_beside_the_python_it_serves(wheel):
    """One extension per owner: the learned policy's, the HTTP stack's and the scale-out counters'."""
    built = {n for n in _names_in_wheel(wheel) if n.endswith((".so", ".pyd"))}
    if not built:
        skip_or_fail("the wheel was built without a C compiler: no extension in it")
    for module in ("router/policy/_fastnet", "router/http/_fasthttp", "router/scale/_shared"):
        assert [n for n in built if n.startswith(f"routewise_vllm/{module}.")], f"{module} is not in the wheel: {built}"
    assert len(built) == 3, built


def test_the_wheel_installs_one_top_level_name_and_states_its_licence(wheel):
    names = _names_in_wheel(wheel)
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"routewise_vllm"}  # router, simulator, trainer and fleet are other projects' names on the index
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(meta_name))
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["Name"] == project["name"] == "routewise-vllm"
    assert meta["License-Expression"] == "Apache-2.0"


def test_the_commands_run_from_outside_the_checkout(installed, tmp_path):
    for command in ("router", "simulator", "trainer", "fleet"):
        out = _run([installed / command, "--version"], cwd=tmp_path)
        assert out.stdout.strip() == f"{command} (routewise-vllm) 0.1.0"
    config = _run([installed / "router", "serve", "--print-config"], cwd=tmp_path)
    assert '"replicas": []' in config.stdout and '"policy": "gated"' in config.stdout
    where = _run([installed / "python", "-c", "import routewise_vllm.router as r; print(r.__file__)"], cwd=tmp_path)
    assert str(installed.parent) in where.stdout and str(ROOT) not in where.stdout


def test_a_scenario_of_every_folder_runs_from_the_installed_package(installed, tmp_path, capsys):
    folders: dict[str, str] = {}  # each folder of scenarios in the checkout, and its first scenario
    for path in sorted((ROOT / "simulator/scenarios").rglob("*.yaml")):
        folders.setdefault(str(path.parent.relative_to(ROOT / "simulator/scenarios")), path.stem)
    assert {".", "models", "shapes", "slo"} <= set(folders)
    listed = _run([installed / "simulator", "scenarios"], cwd=tmp_path).stdout
    for folder, name in folders.items():
        with capsys.disabled():  # the CI log shows every folder as found from the installed package
            print(f"\n  installed wheel: scenario folder {folder!r}: {name}", end="")
        assert name in listed
        out = _run([installed / "simulator", "compare", "--scenario", name, "--policies", "least-outstanding",
                    "--seeds", "1"], cwd=tmp_path)
        assert name in out.stdout and "least-outstanding" in out.stdout


def test_the_emulator_serves_from_the_installed_package(installed, tmp_path):
    proc = subprocess.Popen([installed / "fleet", "emulate", "--port", "0"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stderr.readline()  # the serving line, with the port it bound
        assert "serving 'tiny' on http://127.0.0.1:" in line, line
        url = line.rsplit(" ", 1)[1].strip()
        from urllib.request import urlopen

        deadline = time.monotonic() + 60
        while True:
            try:
                with urlopen(f"{url}/v1/models", timeout=5) as resp:
                    assert b'"tiny"' in resp.read()
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_the_wheel_ships_the_traces_and_the_installed_copy_replays_them_from_anywhere(wheel, installed, tmp_path):
    from routewise_vllm.simulator.traces import KNOWN_TRACES, TRACES_DIR_ENV
    from tests.simulator.test_shipped_traces import LICENSES  # each trace folder's licence file

    names = set(_names_in_wheel(wheel))
    for source in KNOWN_TRACES.values():
        assert f"routewise_vllm/simulator/data/traces/{source.relative_path}.gz" in names
    for folder, license_file in LICENSES.items():
        assert f"routewise_vllm/simulator/data/traces/{folder}/{license_file}" in names
    env = os.environ | {TRACES_DIR_ENV: ""}
    probe = _run([installed / "python", "-c", "import routewise_vllm.simulator.traces as t; print(t.trace_path('azure-conv'))"],
                 cwd=tmp_path, env=env)
    assert Path(probe.stdout.strip()).is_relative_to(installed.parent)
    scenario = tmp_path / "short-conv.yaml"
    scenario.write_text(
        "name: short-conv\n"
        "description: 150 requests of the Azure conversation trace on two replicas.\n"
        "workload: {kind: trace, trace: azure-conv, max_requests: 150, target_rps: 10}\n"
        "cluster: {replicas: [{profile: llama3-8b-h100, count: 2}]}\n"
        "slo: {ttft_s: 1.0, tpot_s: 0.1}\n"
    )
    run = _run([installed / "simulator", "run", "--scenario", scenario, "--policy", "least-outstanding", "--split", "train",
                "--json"], cwd=tmp_path, env=env)
    summary = json.loads(run.stdout)
    assert summary["requests"] == 150 and summary["completed_fraction"] == 1.0, summary
