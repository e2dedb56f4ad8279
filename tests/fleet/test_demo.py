"""The CPU demo end to end: emulated fleet + router + trace replay, a per-arm table, and nothing left running."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
E2E_MARKS = (
    pytest.mark.slow,
    pytest.mark.timeout(120),
)


def end_to_end(test):
    for mark in E2E_MARKS:
        test = mark(test)
    return test

URL = re.compile(r"http://127\.0\.0\.1:(\d+)")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _demo(*args: str, sigint_ignored: bool = False) -> subprocess.Popen:
    """`sigint_ignored`: start it the way a shell without job control starts `demo &` (SIGINT ignored, kept by exec)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "routewise_vllm.fleet", "demo", "--no-progress", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_ignore_sigint if sigint_ignored else None,
    )  # fmt: skip


def _run_demo(*args: str, timeout_s: float = 100) -> tuple[int, str, str]:
    """The demo run to its end: (exit code, stdout, stderr); its process group is killed whatever happens."""
    proc = _demo(*args)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        _kill(proc)
    return proc.returncode, out, err


def _closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM first, so that even a failed run stops the fleet, whose processes are in sessions of their own."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_router_gets_ab_flags_only_when_it_lists_them():
    from routewise_vllm.fleet.demo import router_argv

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    argv, ab = router_argv("py", 9, urls, "least-outstanding", "learned", 0.5, {"--policy", "--ab-treatment", "--ab-share"})
    assert ab and argv[argv.index("--policy") + 1] == "least-outstanding"
    assert argv[argv.index("--ab-treatment") + 1] == "learned" and argv[argv.index("--ab-share") + 1] == "0.5"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--replica"] == urls
    argv, ab = router_argv("py", 9, urls, "least-outstanding", "learned", 0.5, {"--policy", "--replica"})
    assert not ab and "--ab-treatment" not in argv and argv[argv.index("--policy") + 1] == "learned"
    # the default: late binding at the batch limits the router infers from the replicas' /metrics
    assert "--late-binding" in argv and "--late-binding-max-num-seqs" not in argv
    argv, _ = router_argv("py", 9, urls, "least-outstanding", "learned", 0.5, {"--policy"}, late_max_num_seqs=8)
    assert "--late-binding" in argv and argv[argv.index("--late-binding-max-num-seqs") + 1] == "8"
    argv, _ = router_argv("py", 9, urls, "learned", "learned", 0.5, {"--policy", "--no-late-binding"}, late_max_num_seqs=0)
    assert "--no-late-binding" in argv and "--late-binding" not in argv  # off, even for a policy it defaults on for


def test_late_binding_counts_come_from_the_routers_own_metrics():
    from prometheus_client import generate_latest

    from routewise_vllm.fleet.demo import late_binding_summary
    from routewise_vllm.router.telemetry import RouterMetrics

    metrics = RouterMetrics()
    text = generate_latest(metrics.registry).decode()
    assert late_binding_summary(text) == ({}, 0)  # exported at 0: nothing let go yet
    metrics.late_dispatches.labels("room").inc(5)
    metrics.late_dispatches.labels("timeout").inc()
    for held_s in (0.1, 0.2, 2.0):
        metrics.hold_duration.observe(held_s)
    text = generate_latest(metrics.registry).decode()
    assert late_binding_summary(text) == ({"room": 5, "timeout": 1}, 3)


@end_to_end
@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-as-pytest", "sigint-ignored"])
def test_ctrl_c_stops_the_fleet(sigint_ignored: bool):
    proc = _demo("--duration", "60", sigint_ignored=sigint_ignored)
    ports: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        for line in proc.stderr:  # wait until the load starts
            ports.update(int(p) for p in URL.findall(line))
            if line.lstrip().startswith("load") or time.monotonic() > deadline:
                break
        assert len(ports) >= 5
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        _kill(proc)
    assert proc.returncode == 130
    assert all(_closed(p) for p in ports), "a process of the demo is still listening"


def assert_percentiles_per_arm_and_everything_stopped(out: str, err: str) -> None:
    """The demo's table: TTFT and E2E percentiles per arm, requests without errors; and no process of it left
    listening (4 emulated replicas and the router named on stderr)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("metric"))
    arms = lines[head].split()[1:]
    assert arms in (["control", "treatment"], ["all"]), lines[head]
    rows = {line.split("  ")[0].strip(): line.split()[-len(arms):] for line in lines[head + 2 : head + 12]}
    for metric in ("TTFT p50 (ms)", "TTFT p99 (ms)", "E2E p50 (ms)", "E2E p99 (ms)"):
        values = [float(v) for v in rows[metric]]  # "-" (no sample) fails here
        assert all(v > 0 for v in values), (metric, values)
    ok_err = [tuple(map(int, v.split("/"))) for v in rows["requests ok/err"]]
    assert sum(ok for ok, _ in ok_err) > 50 and all(err == 0 for _, err in ok_err)
    ports = {int(p) for p in URL.findall(err)}
    assert len(ports) >= 5  # 4 emulated replicas + the router
    assert all(_closed(p) for p in ports), "a process of the demo is still listening"


# Fallback reasons that mean the model or its inputs are broken (the others are guards doing their job)
BROKEN_REASONS = ("exception", "nan", "masked_pick", "unavailable", "spec_mismatch", "stale_stats")


def model_decided(arm: dict) -> tuple[int, int]:
    """(decisions the model made, decisions it was asked for): every decision but the fallbacks, out of every
    decision but those the decision-budget rule's cool-down kept from it (a shared host's stalls can trip it)."""
    fallbacks = arm["fallbacks"]
    return arm["decisions"] - sum(fallbacks.values()), arm["decisions"] - fallbacks.get("over_budget", 0)


@end_to_end
def test_shipped_learned_policy_decides_live_in_the_demo(tmp_path):
    """The demo prints its percentiles per arm and stops everything it started. The router with the shipped model in front of emulated replicas (the demo's A/B, treatment = the default,
    `gated`, whose gate hands nothing over on this mixed-speed fleet) lets the model decide: most decisions it is asked for are its own, every other decision is a fallback counted under
    a known reason, none under a reason that means the model or its inputs are broken. Most of all its decisions
    are its own, so a model over the CPU-time budget fails it (the rule's stalls: tests/policy/test_budget_rule.py;
    the shipped model never tripping it over 1,000 real-clock decisions: test_budget_real_clock.py there)."""
    import json

    from routewise_vllm.router.policy.fallback import FALLBACK_REASONS

    code, out, err = _run_demo("--duration", "30", "--json", str(tmp_path / "demo.json"))
    assert code == 0, err[-3000:]
    assert_percentiles_per_arm_and_everything_stopped(out, err)
    assert "routing decisions per arm" in out, out[-2000:]
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["treatment"] == "gated" and doc["ab"], doc.get("treatment")
    learned = doc["decisions"]["treatment"]
    assert learned["decisions"] >= 100, learned  # ~230 in 30 s on a shared 2-core machine
    assert set(learned["fallbacks"]) <= set(FALLBACK_REASONS), learned
    assert not {r: n for r, n in learned["fallbacks"].items() if r in BROKEN_REASONS}, learned
    by_model, asked = model_decided(learned)
    # of every decision, not only those the budget rule let it make: a model over budget on every decision trips
    # the rule on its 51st and is skipped for the next 1,000, so it decides 51 of ~230 and fails this
    assert by_model > learned["decisions"] / 2 and by_model >= 50, (by_model, asked, learned)
    # late binding at the batch limits the router inferred: the emulated replicas' 8 slots, read off their /metrics;
    # every request went through its queue rule
    assert doc["late_binding"] and doc["late_binding_max_num_seqs"] is None, doc
    assert doc["batch_limits"] and all(v == [8, "inferred"] for v in doc["batch_limits"].values()), doc["batch_limits"]
    assert "late binding (at the batch limits the router inferred: " in out, out[-2000:]
    assert sum(doc["late_dispatches"].values()) == sum(arm["requests"] for arm in doc["summary"].values()), doc


def test_decision_summary_reads_fallback_share_and_latency_per_arm():
    from routewise_vllm.fleet.demo import decision_summary

    text = "\n".join([
        "# TYPE llm_router_decision_latency_seconds histogram",
        *(f'llm_router_decision_latency_seconds_bucket{{policy="learned",arm="treatment",le="{le}"}} {n}'
          for le, n in (("0.0001", 90), ("0.001", 99), ("0.01", 100), ("+Inf", 100))),
        'llm_router_decision_latency_seconds_count{policy="learned",arm="treatment"} 100',
        'llm_router_decision_latency_seconds_sum{policy="learned",arm="treatment"} 0.01',
        "# TYPE llm_router_fallbacks_total counter",
        'llm_router_fallbacks_total{policy="learned",arm="treatment",reason="over_budget"} 3',
        'llm_router_fallbacks_total{policy="learned",arm="treatment",reason="stale_stats"} 0',
    ]) + "\n"
    d = decision_summary(text)["treatment"]
    assert d["decisions"] == 100 and d["fallbacks"] == {"over_budget": 3} and d["fallback_share"] == 0.03
    assert model_decided(d) == (97, 97)
    assert model_decided({"decisions": 230, "fallbacks": {"over_budget": 170, "overload_guard": 20}}) == (40, 60)
    assert d["decision_p50_s"] == 0.0001 and d["decision_p99_s"] == 0.001


def test_p99_verdict_ranks_the_arms_only_outside_the_noise():
    from routewise_vllm.fleet.demo import p99_intervals, p99_verdict
    from routewise_vllm.fleet.loadgen import RequestResult

    rng = np.random.default_rng(0)

    def arm(name: str, scale: float, n: int = 400) -> list[RequestResult]:
        return [RequestResult(group=name, ok=True, ttft_s=float(x)) for x in rng.exponential(scale, n)]

    apart = p99_intervals(arm("control", 0.1) + arm("treatment", 1.0), ["control", "treatment"])
    assert p99_verdict(apart).endswith("treatment higher, outside the noise")
    same = p99_intervals(arm("control", 0.1) + arm("treatment", 0.1), ["control", "treatment"])
    assert "they overlap" in p99_verdict(same)
    assert p99_verdict(p99_intervals(arm("all", 0.1), ["all"])) is None  # no A/B, nothing to rank


def test_a_negative_late_binding_cap_is_refused_before_anything_starts():
    code, _, err = _run_demo("--late-binding-max-num-seqs", "-1", timeout_s=60)
    assert code == 2 and "--late-binding-max-num-seqs -1: must be 0 (off) or more" in err, err[-2000:]
    assert "replica" not in err  # no fleet was started
