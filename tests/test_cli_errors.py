"""Every command line answers a bad value, a busy port or a missing piece with one line naming what was wrong and
exit 2, before it starts anything; `--version` on each; the distribution name in one place per layer."""

from __future__ import annotations

import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from routewise_vllm.router import cli as router_cli
from routewise_vllm.simulator import commands

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _one_line(out: subprocess.CompletedProcess, code: int = 2) -> str:
    assert out.returncode == code, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def test_the_distribution_name_is_the_projects():
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert router_cli.DISTRIBUTION == commands.DISTRIBUTION == name == "routewise-vllm"


@pytest.mark.parametrize("package", ["router", "simulator", "trainer", "fleet"])
def test_version(package):
    out = _run(f"routewise_vllm.{package}", "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"{package} (routewise-vllm) 0.1.0", out


def test_print_config_needs_no_replica_but_serving_does():
    out = _run("routewise_vllm.router", "serve", "--print-config")
    assert out.returncode == 0 and '"replicas": []' in out.stdout, out.stderr
    line = _one_line(_run("routewise_vllm.router", "serve"))
    assert "no replicas; give --replica URL" in line


@pytest.mark.parametrize(("args", "says"), [
    (["fleet", "demo", "--duration", "-3"], "argument --duration: '-3': must be above 0"),
    (["fleet", "demo", "--ab-share", "3"], "argument --ab-share: '3': must be a share between 0 and 1"),
    (["fleet", "demo", "--max-num-seqs", "0"], "argument --max-num-seqs: '0': must be above 0"),
    (["fleet", "demo", "--slowdown", "-8"], "argument --slowdown: '-8': must be above 0"),
    (["fleet", "loadgen", "--nope"], "unrecognized arguments: --nope"),
    (["simulator", "compare", "--seeds", "x"], "argument --seeds: invalid int value: 'x'"),
    (["trainer", "train"], "the following arguments are required: --config"),
])
def test_a_bad_value_is_one_line_and_exit_2(args, says):
    line = _one_line(_run(f"routewise_vllm.{args[0]}", *args[1:]))
    assert says in line and line.startswith(args[0])


def test_the_demo_names_a_replica_that_is_not_there_before_starting_anything():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    line = _one_line(_run("routewise_vllm.fleet", "demo", "--replica", url, timeout=30))
    assert line == f"fleet demo: error: --replica {url}: not reachable ([Errno 111] Connection refused)"


def test_the_emulator_on_a_busy_port_is_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _one_line(_run("routewise_vllm.fleet", "emulate", "--port", str(port)))
    assert line.startswith(f"fleet emulate: error: cannot listen on 127.0.0.1:{port}: Address already in use")


BLOCK_TRAIN_EXTRA = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "onnx", "tensorboard"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name.split(".")[0])
sys.meta_path.insert(0, Missing())
from routewise_vllm.trainer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_trainer_without_its_extra_helps_and_names_the_extra():
    helped = subprocess.run([sys.executable, "-c", BLOCK_TRAIN_EXTRA, "--help"], capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0 and "train a policy" in helped.stdout, helped.stderr
    out = subprocess.run([sys.executable, "-c", BLOCK_TRAIN_EXTRA, "train", "--config", "x.yaml"], capture_output=True,
                         text=True, timeout=60)
    assert _one_line(out) == ("trainer train: error: torch is not installed; the trainer needs the extra: "
                              "pip install 'routewise-vllm[train]'")


def test_every_router_flag_shows_its_default_and_the_docs():
    text = router_cli._parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "docs/settings.md" in text and "router/settings.py" not in text
    for flag in ("--health-interval-s", "--max-tokens-limit", "--decision-log-max-files"):
        if flag in text:
            help_of = text.split(flag, 1)[1].split("\n  --", 1)[0]
            assert "default" in help_of, (flag, help_of)
