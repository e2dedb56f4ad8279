"""tests/bench/gate_modes.py: the gate's modes per instance, its settings and another model inside it."""

from __future__ import annotations

import numpy as np

from tests.bench import gate_modes
from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH, MODELS_DIR
from routewise_vllm.simulator.late_binding import simulate_late
from routewise_vllm.simulator.metrics import summarize
from routewise_vllm.simulator.scenario import load_scenario


SCENARIO = load_scenario("uniform-tenants-2", split="eval")


def _routed(policy, cluster, requests) -> tuple[float, list]:
    """p99 TTFT and where each request went."""
    records = simulate_late(cluster, requests, policy, seed=0)[0]
    return summarize(records, SCENARIO.slo)["ttft_p99_s"], [(r.request_id, r.replica_id) for r in records]


def test_model_puts_that_model_inside_the_gate():
    """--model: the gate around the named model. The shipped model's file routes exactly as the shipped gate does;
    another model changes the learned decisions (uniform-tenants-2's cache share stays near its threshold, so the
    learned policy routes part of the run)."""
    cluster, requests = SCENARIO.build(np.random.default_rng(0))
    requests = requests[:400]
    shipped = gate_modes.gate(0, {})
    same = gate_modes.gate(0, {}, DEFAULT_MODEL_PATH)
    other_path = next(p for p in sorted(MODELS_DIR.glob("*.onnx")) if p != DEFAULT_MODEL_PATH)
    other = gate_modes.gate(0, {"cache_on": float("inf")}, other_path)
    assert other.primary.learned.path == other_path and same.primary.learned.path == DEFAULT_MODEL_PATH
    a, b = _routed(shipped, cluster, requests), _routed(same, cluster, requests)
    assert a == b
    c = _routed(other, cluster, requests)
    assert other.primary.decisions["heuristic"] == 0 and other.primary.decisions["learned"] > 0
    assert c[1] != a[1]


def test_warm_up_compares_the_gates_without_the_first_requests(capsys):
    """--warm-up: the same instance scored without its first requests. uniform-tenants-2 seed 0's p99 is its cold
    start (1.049 s, docs/peers.md); past the first 1,000 of its 1,500 requests the shipped gate's is well below."""
    gate_modes.main(["--scenario", "uniform-tenants-2", "--seeds", "1", "--vs-default"])
    cold = capsys.readouterr().out
    gate_modes.main(["--scenario", "uniform-tenants-2", "--seeds", "1", "--vs-default", "--warm-up", "1000"])
    warm = capsys.readouterr().out

    def p99(text: str) -> float:
        return float(text.split("the shipped gate ")[1].split(" s")[0])

    assert p99(cold) > 0.9 and p99(warm) < 0.5 * p99(cold)


def test_tail_says_how_early_the_slowest_requests_arrive():
    """--tail on hand-made records: 200 requests by arrival, TTFT 1 s for the 3rd and 5th, 0.1 s for the others."""
    from routewise_vllm.simulator.types import RequestRecord

    records = [RequestRecord(i, "r0", float(i), 100, 10, first_token_s=i + (1.0 if i in (2, 4) else 0.1),
                             finish_s=i + 2.0) for i in range(200)]
    text = gate_modes.tail(records, first=100)
    # p99 of 200 (linear interpolation, as simulator.metrics) is 0.109 s: the two slow ones are at or above it; of the
    # first 100, which hold both, 1.0 s; of the rest, 0.1 s
    assert "slowest 1 %: 2 among the first 5 of 200; p99 TTFT first 100 1.000 s, rest 0.100 s" in text
