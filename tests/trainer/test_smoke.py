"""End to end in seconds: train (selection, warm start, 2 PPO updates), resume, export, ONNX parity, bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from routewise_vllm.router.policy.features import FEATURE_SPEC_HASH, N_FEATURES
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.trainer.checkpoint import CheckpointError, load_network, read_checkpoint
from routewise_vllm.trainer.cli import main
from routewise_vllm.trainer.config import load_config
from routewise_vllm.trainer.export import ExportError, check_onnx_file, export_onnx, parity_check
from routewise_vllm.trainer.observations import simulator_observations
from routewise_vllm.trainer.ppo import train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(smoke_run: Path) -> Path:
    return smoke_run


def test_train_writes_checkpoints_logs_and_summary(run: Path):
    for name in ("warm_start.pt", "best.pt", "last.pt", "metrics.csv", "summary.json"):
        assert (run / name).is_file(), name
    assert list((run / "tb").glob("events.out.tfevents.*"))
    header, *rows = (run / "metrics.csv").read_text().splitlines()
    assert "losses/approx_kl" in header and "eval/fallback_free_share" in header
    assert [r.split(",")[0] for r in rows].count("ppo") == 2
    doc = read_checkpoint(run / "last.pt")
    assert doc["config"]["env"]["scenarios"] == ["steady-chat", "heterogeneous"]
    assert doc["progress"]["update"] == 2
    assert float(doc["model"]["normaliser.count"]) > 100  # statistics from the warm-start data are saved
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["best_heuristic"]) == {"steady-chat", "heterogeneous"}


def test_resume_continues_from_last_checkpoint(run: Path, tmp_path: Path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    cfg = load_config(ROOT / "trainer/configs/smoke.yaml", [f"run.run_dir={copy}", "ppo.updates=3"])
    summary = train(cfg, resume=copy / "last.pt", progress=False)
    assert summary["updates"] == 3
    rows = (copy / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[:2] for r in rows if r.startswith("ppo")] == [["ppo", "1"], ["ppo", "2"], ["ppo", "3"]]


def test_init_fine_tunes_a_checkpoint_behind_late_binding(run: Path, tmp_path: Path):
    """run.init: no warm start; the checkpoint's network is the starting point and PPO's KL reference, and the
    run (heuristics, selection) is under its own configuration, here behind late binding."""
    init = run / "best.pt"
    cfg = load_config(ROOT / "trainer/configs/smoke.yaml", [f"run.run_dir={tmp_path / 'ft'}", f"run.init={init}",
                                                             "env.late_binding=true", "ppo.updates=1"])
    summary = train(cfg, progress=False)
    assert summary["updates"] == 1
    rows = (tmp_path / "ft" / "metrics.csv").read_text().splitlines()
    assert not [r for r in rows if r.startswith("warm-start,")]  # no fitting, only the evaluation of the start
    start = load_network(tmp_path / "ft" / "warm_start.pt")[0].state_dict()
    assert all(torch.equal(v, start[k]) for k, v in load_network(init)[0].state_dict().items())
    assert read_checkpoint(tmp_path / "ft" / "last.pt")["config"]["env"]["late_binding"] is True
    wider = load_config(ROOT / "trainer/configs/smoke.yaml", [f"run.run_dir={tmp_path / 'x'}", f"run.init={init}",
                                                               "network.hidden=32"])
    with pytest.raises(ValueError, match="differs from this run's"):
        train(wider, progress=False)
    same_dir = load_config(ROOT / "trainer/configs/smoke.yaml", [f"run.run_dir={run}", f"run.init={init}"])
    with pytest.raises(ValueError, match="its own run.run_dir"):
        train(same_dir, progress=False)


def test_a_run_from_before_the_rename_resumes_with_its_bc_checkpoint_as_kl_reference(run: Path, tmp_path: Path):
    """Run directories written before the warm start was renamed hold `bc.pt`; PPO's KL reference is read from it."""
    from types import SimpleNamespace

    from routewise_vllm.trainer.ppo import _reference_net

    old = tmp_path / "old"
    shutil.copytree(run, old)
    (old / "warm_start.pt").rename(old / "bc.pt")
    cfg = load_config(ROOT / "trainer/configs/smoke.yaml", [f"run.run_dir={old}"])
    ref = _reference_net(SimpleNamespace(cfg=cfg, run_dir=old))
    expected = load_network(run / "warm_start.pt")[0].state_dict()
    assert ref is not None and all(torch.equal(v, expected[k]) for k, v in ref.state_dict().items())
    (old / "bc.pt").unlink()
    assert _reference_net(SimpleNamespace(cfg=cfg, run_dir=old)) is None


@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
def test_export_parity_and_router_loads_it(run: Path, tmp_path: Path):
    net, cfg, _ = load_network(run / "best.pt")
    out = export_onnx(net, tmp_path / "p.onnx", "test", cfg.model_dump(mode="json"))
    model = onnx.load(str(out))
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["feature_spec_hash"] == FEATURE_SPEC_HASH
    assert json.loads(meta["training_config"])["env"]["max_replicas"] == 8
    assert model.opset_import[0].version >= 17
    assert out.stat().st_size < 1_000_000
    feats, masks = simulator_observations(net, cfg, 1500)
    assert feats.shape == (1500, cfg.env.max_replicas, N_FEATURES)
    report = parity_check(net, out, feats, masks)
    assert report.n_observations == 1500 and report.ok, report
    assert len(report.replica_counts) >= 2  # the dynamic replica axis was exercised
    policy = make_policy(str(out))
    assert policy.load_error is None


def test_cli_export_prints_parity(run: Path, tmp_path: Path, capsys):
    rc = main(["export", "--checkpoint", str(run / "best.pt"), "--out", str(tmp_path / "m.onnx"),
               "--parity-observations", "300", "--card", str(tmp_path / "card.json"), "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "identical argmax = 100.00%" in out
    card = json.loads((tmp_path / "card.json").read_text())
    assert card["parity"]["observations"] == 300 and card["training"]["ppo_updates"] == 2


def test_bad_files_are_named(run: Path, tmp_path: Path, capsys):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt.pt: not a readable checkpoint"):
        read_checkpoint(corrupt)
    import torch

    doc = torch.load(run / "best.pt", weights_only=False)
    doc["feature_spec_hash"] = "0000000000000000"
    torch.save(doc, tmp_path / "other_spec.pt")
    with pytest.raises(CheckpointError, match=r"other_spec.pt: feature_spec_hash '0000000000000000' does not match"):
        read_checkpoint(tmp_path / "other_spec.pt")
    doc = torch.load(run / "best.pt", weights_only=False)
    doc["config"]["network"]["hidden"] = 32
    torch.save(doc, tmp_path / "other_shape.pt")
    with pytest.raises(CheckpointError, match="other_shape.pt: weights do not fit the configured network"):
        load_network(tmp_path / "other_shape.pt")
    rc = main(["export", "--checkpoint", str(tmp_path / "other_shape.pt"), "--out", str(tmp_path / "x.onnx")])
    assert rc == 2 and "other_shape.pt" in capsys.readouterr().err

    bad_onnx = tmp_path / "bad.onnx"
    bad_onnx.write_bytes(b"\x00garbage")
    with pytest.raises(ExportError, match="bad.onnx: not a loadable ONNX model"):
        check_onnx_file(bad_onnx)
    net, cfg, _ = load_network(run / "best.pt")
    good = export_onnx(net, tmp_path / "g.onnx", "t", {})
    model = onnx.load(str(good))
    for p in model.metadata_props:
        if p.key == "feature_spec_hash":
            p.value = "ffffffffffffffff"
    onnx.save(model, str(tmp_path / "spec.onnx"))
    with pytest.raises(ExportError, match=r"spec.onnx: feature_spec_hash 'ffffffffffffffff' does not match"):
        check_onnx_file(tmp_path / "spec.onnx")
    rc = main(["evaluate", "--policy", str(tmp_path / "spec.onnx"), "--scenarios", "steady-chat", "--seeds", "1", "--no-plots"])
    assert rc == 2 and "spec.onnx" in capsys.readouterr().err


def test_parity_check_detects_a_different_model(run: Path, tmp_path: Path):
    net, cfg, _ = load_network(run / "best.pt")
    out = export_onnx(net, tmp_path / "a.onnx", "t", {})
    with __import__("torch").no_grad():
        net.policy_head[-1].bias += 1.0  # shifts all logits: diff shows, argmax unchanged
        net.policy_head[-1].weight.mul_(-1.0)  # flips the ranking
    rng = np.random.default_rng(0)
    feats = rng.random((200, 6, N_FEATURES)).astype(np.float32)
    feats[..., 0] = 1
    report = parity_check(net, out, feats, np.ones((200, 6), np.float32))
    assert not report.ok and report.max_abs_diff > 0.5


def test_pick_agreement_counts_ties_within_the_fast_path_tolerance_and_nothing_else():
    """A different pick among replicas the reference scores within PARITY_TIE agrees (as a tie); any other
    different pick does not; masked replicas never count; an observation with no valid replica agrees."""
    from routewise_vllm.router.policy.fastnet import PARITY_TIE
    from routewise_vllm.trainer.export import pick_agreement

    want = np.array([[1.0, 1.0 + PARITY_TIE / 2, 0.0],   # ref picks 1, got picks 0: a tie
                     [1.0, 2.0, 0.0],                    # ref picks 1, got picks 0: a real disagreement
                     [5.0, 1.0, 0.0],                    # same pick
                     [9.0, 1.0, 0.0],                    # replica 0 masked: ref picks 1, got picks 1
                     [1.0, 1.0, 1.0]], np.float32)       # no valid replica
    got = np.array([[1.1, 1.0, 0.0], [1.1, 1.0, 0.0], [5.0, 1.0, 0.0], [0.0, 1.0, 0.5], [0.0, 0.0, 0.0]], np.float32)
    valid = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 0, 0]], bool)
    assert pick_agreement(got, want, valid) == (4, 1)
    assert pick_agreement(got[1:2], want[1:2], valid[1:2]) == (0, 0)
