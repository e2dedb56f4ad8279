"""`simulator replay`: a live router's decision log as a simulator workload."""

from __future__ import annotations

import json

import pytest
import yaml

from routewise_vllm.simulator.cli import main as simulator_main
from routewise_vllm.simulator.experiments import run_once
from routewise_vllm.simulator.replay import DecisionLogError, read_decision_log, split_logged, to_sim_requests
from routewise_vllm.simulator.scenario import replay_scenario


def record(i: int, t: float, attempt: int = 0, **kw) -> dict:
    rec = {
        "v": 1, "t": t, "id": f"r{i}", "attempt": attempt, "arm": "main", "policy": "least-outstanding",
        "replica": "10.0.0.1:8000", "index": 0, "primary_index": 0, "fallback": None, "decision_s": 2e-5,
        "shadow": None, "n_replicas": 2, "feature_hash": "x", "features": "", "mask": [1, 1],
        "prompt_tokens_est": 100 + i, "max_tokens": 64, "prefix_blocks": [7, 8 + i % 3], "prefix_block_tokens": 64,
        "stream": True, "status": 200, "ok": True, "ttft_s": 0.05, "e2e_s": 0.4, "output_tokens": 30 + i,
    }
    rec.update(kw)
    return rec


def write_log(directory, records, seq: int = 1, trailer: str = ""):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"decisions-{seq:06d}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + trailer)
    return path


def test_first_attempt_per_request_in_arrival_order(tmp_path):
    log = tmp_path / "log"
    write_log(log, [record(1, 10.0), record(0, 9.0), record(1, 10.2, attempt=1, replica="other")], seq=1)
    write_log(log, [record(2, 11.0, output_tokens=None, stream=False), record(3, 12.0, output_tokens=None,
                                                                              max_tokens=None)], seq=2)
    logged = read_decision_log(log)
    assert [r.request_id for r in logged] == ["r0", "r1", "r2", "r3"]
    reqs = to_sim_requests(logged, time_scale=2.0, default_output_tokens=99)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5]
    assert [r.output_tokens for r in reqs] == [30, 31, 64, 99]  # observed, observed, max_tokens, default
    assert reqs[1].prompt_tokens == 101 and reqs[1].block_ids == (7, 9) and reqs[1].block_tokens == 64
    assert reqs[0].max_tokens == 64 and reqs[3].max_tokens is None


def test_bad_lines_name_file_line_and_field(tmp_path):
    log = tmp_path / "log"
    path = write_log(log, [record(0, 1.0), record(1, 2.0, prompt_tokens_est="many")])
    with pytest.raises(DecisionLogError, match=rf"{path.name}:2: field 'prompt_tokens_est'"):
        read_decision_log(log)
    write_log(log, [record(0, 1.0), {"v": 99}])
    with pytest.raises(DecisionLogError, match="field 'v' = 99"):
        read_decision_log(log)
    write_log(log, [record(0, 1.0)], trailer='{"v": 1, "t": 2.0, "id": "r')  # the writer died mid-line
    assert [r.request_id for r in read_decision_log(log)] == ["r0"]
    with pytest.raises(DecisionLogError, match="no such file"):
        read_decision_log(tmp_path / "nowhere")


def test_splits_by_time(tmp_path):
    log = tmp_path / "log"
    write_log(log, [record(i, float(i)) for i in range(11)])
    logged = read_decision_log(log)
    train, evaluation = split_logged(logged, "train", 0.7), split_logged(logged, "eval", 0.7)
    assert [r.request_id for r in train] == [f"r{i}" for i in range(7)]
    assert [r.request_id for r in evaluation] == [f"r{i}" for i in range(7, 11)]


def test_replay_scenario_simulates(tmp_path):
    log = tmp_path / "log"
    write_log(log, [record(i, 0.05 * i) for i in range(200)])
    scenario = tmp_path / "replay.yaml"
    scenario.write_text(yaml.safe_dump(replay_scenario(log, "steady-chat")))
    summary = run_once(str(scenario), "least-outstanding", 0, split="eval")
    assert summary["requests"] == 60 and summary["completed_fraction"] == 1.0
    assert summary["ttft_p50_s"] > 0


def test_replay_cli(tmp_path, capsys):
    log = tmp_path / "log"
    write_log(log, [record(i, 0.1 * i, arm="treatment" if i % 4 == 0 else "control") for i in range(100)])
    out = tmp_path / "mine.yaml"
    assert simulator_main(["replay", str(log), "--out", str(out), "--policy", "least-outstanding"]) == 0
    text = capsys.readouterr().out
    summary = json.loads(text[: text.index("\n}") + 2])
    assert summary["requests"] == 100 and summary["arms"] == {"treatment": 25, "control": 75}
    assert yaml.safe_load(out.read_text())["workload"]["kind"] == "decision_log"
    assert '"policy": "least-outstanding"' in text
    assert simulator_main(["replay", str(tmp_path / "missing")]) == 2
