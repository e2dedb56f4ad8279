"""The Ray backend (trainer/ray_backend.py): the same seeds give the same training and evaluation as local
worker processes, on a small local Ray instance the tests start and shut down; clear errors otherwise."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from routewise_vllm.trainer.checkpoint import read_checkpoint
from routewise_vllm.trainer.cli import main as trainer_main
from routewise_vllm.trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "trainer/configs/smoke.yaml"
TWO_WORKERS = ["--set", "run.workers=2", "--no-progress"]  # two actors / processes: the work is split as on a cluster


def _ray():
    import ray  # the [test] extra installs the [ray] one: a missing ray is a broken install, not a skip

    return ray


def _rows(run: Path) -> list[dict]:
    with (run / "metrics.csv").open() as f:
        return [{k: v for k, v in row.items() if k != "wall_s"} for row in csv.DictReader(f)]


# ---------------------------------------------------------------- errors (no Ray instance)
def test_a_bad_ray_address_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"run\.ray.*'http//nowhere'"):
        load_config(SMOKE, ["run.ray=http//nowhere"])


def test_ray_requested_but_not_installed_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert trainer_main(["train", "--config", str(SMOKE), "--run-dir", str(tmp_path / "run"), "--ray", "local", *TWO_WORKERS]) == 2
    err = capsys.readouterr().err
    assert "ray is not installed" in err and "routewise-vllm[ray]" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_an_unreachable_cluster_is_named(capsys, tmp_path):
    ray = _ray()
    assert not ray.is_initialized()
    run_dir = tmp_path / "run"
    assert trainer_main(["train", "--config", str(SMOKE), "--run-dir", str(run_dir), "--ray", "ray://127.0.0.1:1", *TWO_WORKERS]) == 2
    err = capsys.readouterr().err
    assert "--ray ray://127.0.0.1:1: cannot reach the Ray cluster at 127.0.0.1:1" in err and "Traceback" not in err
    assert not run_dir.exists()  # nothing half-written


def test_auto_names_the_ray_address_it_resolved_to(monkeypatch, capsys, tmp_path):
    _ray()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert trainer_main(["train", "--config", str(SMOKE), "--run-dir", str(tmp_path / "run"), "--ray", *TWO_WORKERS]) == 2
    assert "--ray auto (RAY_ADDRESS=127.0.0.1:1): cannot reach the Ray cluster at 127.0.0.1:1" in capsys.readouterr().err


# ---------------------------------------------------------------- same seeds, same result
@pytest.fixture(scope="module")
def ray_instance():
    ray = _ray()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def runs(ray_instance, tmp_path_factory) -> tuple[Path, Path]:
    """The smoke training twice: two local worker processes, then two Ray actors (`--ray auto` finds the instance)."""
    local, on_ray = tmp_path_factory.mktemp("local"), tmp_path_factory.mktemp("ray")
    assert trainer_main(["train", "--config", str(SMOKE), "--run-dir", str(local), *TWO_WORKERS]) == 0
    assert trainer_main(["train", "--config", str(SMOKE), "--run-dir", str(on_ray), "--ray", "auto", *TWO_WORKERS]) == 0
    return local, on_ray


# the bench tier: a Ray instance and two trainings, shared with the test below (60-70 s on 2 cores beside the other
# tests); the errors above and the node-local copy below run per change
@pytest.mark.bench
def test_training_on_ray_is_bit_identical_to_local_workers(runs):
    local, on_ray = runs
    for name in ("warm_start.pt", "best.pt", "last.pt"):
        a, b = read_checkpoint(local / name), read_checkpoint(on_ray / name)
        assert a["model"].keys() == b["model"].keys()
        for k, v in a["model"].items():
            assert torch.equal(v, b["model"][k]), f"{name}: {k} differs"
        assert a["progress"]["best_heuristic"] == b["progress"]["best_heuristic"]
        assert a["progress"]["rng_state"] == b["progress"]["rng_state"]
    rows = _rows(local)
    assert [r["phase"] for r in rows].count("ppo") == 2 and rows == _rows(on_ray)  # losses, rollout and eval figures alike
    assert json.loads((on_ray / "summary.json").read_text())["ray"] == "auto"


@pytest.mark.bench
def test_evaluation_on_ray_matches_local_processes(runs, tmp_path, capsys):
    """`trainer evaluate --ray`: compare's (scenario, seed) tasks as Ray tasks, the exported ONNX shipped with them."""
    _local, on_ray = runs
    args = ["evaluate", "--policy", str(on_ray / "best.pt"), "--scenario", "steady-chat", "--seeds", "2",
            "--baselines", "least-outstanding,expected-wait", "--json", "--no-plots", "--no-progress"]  # fmt: skip
    assert trainer_main([*args, "--workers", "2", "--out", str(tmp_path / "local")]) == 0
    local_doc = json.loads(capsys.readouterr().out)
    assert trainer_main([*args, "--ray", "auto", "--out", str(tmp_path / "ray")]) == 0
    ray_doc = json.loads(capsys.readouterr().out)
    strip = [{k: v for k, v in r.items() if k != "policy"} | {"policy": Path(r["policy"]).name} for r in local_doc["results"]]
    assert len(strip) == 3 and strip == [
        {k: v for k, v in r.items() if k != "policy"} | {"policy": Path(r["policy"]).name} for r in ray_doc["results"]
    ]


def test_an_evaluation_task_reads_the_policy_file_from_a_node_local_copy(tmp_path):
    """On a remote node the driver's ONNX path does not exist: the task gets a copy of its bytes, keyed back."""
    from routewise_vllm.trainer.ray_backend import _run_with_files

    model = tmp_path / "best.onnx"
    model.write_bytes(b"onnx bytes")
    seen = {}

    def task(item):  # stands in for simulator.experiments._task
        scenario, policies, seed, split, late = item
        seen["paths"] = policies
        seen["bytes"] = Path(policies[1]).read_bytes()
        return scenario, seed, {p: {"policy": p} for p in policies}

    sc, seed, out = _run_with_files(task, (("steady-chat", ("least-outstanding", str(model)), 3, "eval", False),),
                                    {str(model): b"onnx bytes"})  # fmt: skip
    assert seen["paths"][0] == "least-outstanding" and seen["paths"][1] != str(model) and seen["bytes"] == b"onnx bytes"
    assert (sc, seed) == ("steady-chat", 3) and list(out) == ["least-outstanding", str(model)]
    assert out[str(model)] == {"policy": seen["paths"][1]}
