import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from routewise_vllm.simulator import costmodel
from routewise_vllm.simulator.cli import COMMANDS, main
from routewise_vllm.simulator.experiments import resolve_policies

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_module_help_lists_every_subcommand():
    out = _python("-m", "routewise_vllm.simulator", "--help")
    assert out.returncode == 0, out.stderr
    for name in ("run", "compare", "bench", "calibrate"):
        assert name in out.stdout


def test_subcommand_help_explains_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--scenario", "--policies", "--seeds", "--split", "--workers", "--json"):
        assert option in text


def test_importing_the_cli_pulls_in_neither_aiohttp_nor_torch():
    code = "import sys, simulator.cli; print(sorted(m for m in ('aiohttp', 'prometheus_client', 'torch') if m in sys.modules))"
    out = _python("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_command_has_a_parser_and_a_runner():
    for name, cmd in COMMANDS.items():
        assert callable(cmd.add_arguments) and callable(cmd.run), name


def test_unknown_scenario_exits_2_naming_it_and_the_known_ones(capsys):
    assert main(["run", "--scenario", "steady", "--policy", "round-robin"]) == 2
    err = capsys.readouterr().err
    assert "unknown scenario 'steady'" in err and "steady-chat" in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_policy_exits_2_naming_it_and_the_known_ones(capsys):
    assert main(["compare", "--scenario", "steady-chat", "--policies", "round-robin,fastest"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'fastest'" in err and "least-outstanding" in err


def test_invalid_scenario_file_exits_2_naming_field(capsys):
    assert main(["run", "--scenario", str(DATA / "scenario_bad_field.yaml"), "--policy", "random"]) == 2
    assert "workload.synthetic.n_requests" in capsys.readouterr().err


def test_all_policies_are_the_baselines_plus_learned_when_shipped():
    from routewise_vllm.router.policy.registry import BASELINES, DEFAULT_MODEL_PATH

    names = resolve_policies("all")
    assert names[: len(BASELINES)] == list(BASELINES)
    assert ("learned" in names) == DEFAULT_MODEL_PATH.is_file()


def test_calibrate_recovers_a_known_overhead(tmp_path):
    truth = dataclasses.replace(costmodel.load_profile("llama3-8b-h100"), overhead_s=0.005)
    lines = ["prefill_tokens,decode_seqs,context_tokens,seconds"]
    for prefill, decode, context in [(0, 8, 4000), (0, 64, 30000), (0, 128, 90000), (2048, 0, 0), (4096, 16, 8000),
                                     (8192, 0, 0), (512, 32, 20000), (0, 16, 9000)]:
        lines.append(f"{prefill},{decode},{context},{truth.iteration_time(prefill, decode, context)}")
    csv = tmp_path / "m.csv"
    csv.write_text("\n".join(lines) + "\n")
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", "--measurements", str(csv), "--profile", "llama3-8b-h100", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["overhead_s"] == pytest.approx(0.005, rel=0.05)
    assert doc["name"] == "llama3-8b-h100-calibrated"
    assert costmodel.profile_from_file(out).overhead_s == pytest.approx(0.005, rel=0.05)


def test_calibrate_bad_row_names_line_field_value(tmp_path, capsys):
    csv = tmp_path / "m.csv"
    csv.write_text("prefill_tokens,decode_seqs,context_tokens,seconds\n1,2,3,0.01\n1,2,x,0.01\n")
    assert main(["calibrate", "--measurements", str(csv), "--profile", "llama3-8b-h100", "-o", str(tmp_path / "o.yaml")]) == 2
    assert "m.csv:3: field 'context_tokens'" in capsys.readouterr().err


def test_run_json_on_a_small_scenario(capsys):
    assert main(["run", "--scenario", str(DATA / "scenario_good.yaml"), "--policy", "least-outstanding", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"] == 200 and doc["completed_fraction"] == 1.0
    assert 0 < doc["ttft_p50_s"] <= doc["ttft_p99_s"]
    assert 0 <= doc["goodput"] <= 1


def test_compare_json_gives_one_record_per_policy_on_identical_arrivals(capsys):
    args = ["compare", "--scenario", str(DATA / "scenario_good.yaml"), "--policies", "round-robin,least-outstanding",
            "--seeds", "2", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["results"]
    assert [r["policy"] for r in rows] == ["round-robin", "least-outstanding"]
    for r in rows:
        assert r["seeds"] == 2
        for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s", "goodput", "throughput_rps"):
            assert isinstance(r[key], float)
    # same arrivals for every policy: the same request count, and the best heuristic's ratio is exactly 1
    assert rows[0]["metrics"]["requests"] == rows[1]["metrics"]["requests"] == 200
    assert min(r["ttft_p99_vs_best_heuristic"] for r in rows) == 1.0


def test_compare_swap_profile_runs_the_same_arrivals_on_other_hardware(capsys):
    base = ["compare", "--scenario", str(DATA / "scenario_good.yaml"), "--policies", "least-outstanding", "--seeds", "1",
            "--json"]
    assert main(base) == 0
    h100 = json.loads(capsys.readouterr().out)
    assert main([*base, "--swap-profile", "llama3-8b-h100=llama3-8b-l4"]) == 0
    l4 = json.loads(capsys.readouterr().out)
    assert l4["profile_swap"] == {"llama3-8b-h100": "llama3-8b-l4"} and "profile_swap" not in h100
    (a,), (b,) = h100["results"], l4["results"]
    assert a["metrics"]["requests"] == b["metrics"]["requests"]
    assert b["ttft_p50_s"] > 3 * a["ttft_p50_s"]  # an L4 prefills a 256-token prompt far slower than an H100


@pytest.mark.parametrize(
    "swap, message",
    [
        ("llama3-8b-h100", "takes OLD=NEW"),
        ("llama3-8b-h100=no-such-gpu", "unknown hardware profile 'no-such-gpu'"),
        ("llama3-8b-a100=llama3-8b-l4", "no chosen scenario has replicas on profile 'llama3-8b-a100'"),
    ],
)
def test_compare_swap_profile_names_what_is_wrong(capsys, swap, message):
    args = ["compare", "--scenario", str(DATA / "scenario_good.yaml"), "--seeds", "1", "--swap-profile", swap]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_compare_late_timeout_sets_the_held_requests_wait_and_is_checked(capsys):
    """--late-timeout S: bursty-code's held requests leave after S seconds (more of them time out at 0.5 s than at
    the router's default 2 s); without --late-binding, or negative, it is a usage error naming the flag."""
    shares = {}
    for flags in ([], ["--late-timeout", "0.5"]):
        assert main(["compare", "--scenario", "bursty-code", "--policies", "least-outstanding", "--seeds", "1",
                     "--late-binding", "--json", *flags]) == 0
        rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
        shares[tuple(flags)] = rows["least-outstanding+late"]["metrics"]["timeout_share"]
    assert shares[("--late-timeout", "0.5")] > shares[()] > 0
    for flags, words in ((["--late-timeout", "1"], "add --late-binding"),
                         (["--late-binding", "--late-timeout", "-1"], "--late-timeout must be >= 0")):
        assert main(["compare", "--scenario", "bursty-code", "--policies", "least-outstanding", "--seeds", "1", *flags]) == 2
        assert words in capsys.readouterr().err


def test_compare_late_room_runs_the_rule_in_tokens_or_time_and_says_which(capsys):
    """--late-room tokens: the awaiting-prefill limit the same for every replica (the earlier rule);
    on the ~8x conversation mix least-outstanding+late routes differently; per-request rows are untouched."""
    docs = {}
    for room in ("time", "tokens"):
        assert main(["compare", "--scenario", "shape-conv-mix8x", "--policies", "least-outstanding", "--seeds", "1",
                     "--late-binding", "--late-room", room, "--json"]) == 0
        docs[room] = json.loads(capsys.readouterr().out)
    rows = {room: {r["policy"]: r for r in doc["results"]} for room, doc in docs.items()}
    assert rows["time"]["least-outstanding"]["ttft_p50_s"] == rows["tokens"]["least-outstanding"]["ttft_p50_s"]
    assert rows["time"]["least-outstanding+late"]["ttft_p50_s"] != rows["tokens"]["least-outstanding+late"]["ttft_p50_s"]
    assert [docs[room]["late_binding"]["room_in_time"] for room in ("time", "tokens")] == [True, False]
    assert main(["compare", "--scenario", "bursty-code", "--seeds", "1", "--late-room", "tokens"]) == 2
    assert "--late-room applies to --late-binding runs: add --late-binding" in capsys.readouterr().err
