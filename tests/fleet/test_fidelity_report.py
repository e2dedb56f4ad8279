"""The fidelity report's arithmetic (fleet/fidelity_report.py) on hand-made results, and the steps of the runner
(fleet/fidelity.py) that need no fleet; the real run is tests/e2e."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from routewise_vllm.fleet.fidelity_report import Served, compare, format_report

ROOT = Path(__file__).resolve().parents[2]


def _served(ttfts: list[float]) -> list[Served]:
    return [Served(float(i), 100, 10, t, 0.01, t + 0.09) for i, t in enumerate(ttfts)]


def test_errors_ranking_and_gain_ratio():
    real = {"least-outstanding": _served([0.1] * 99 + [1.0]), "learned": _served([0.1] * 99 + [0.6])}
    sim = {"least-outstanding": _served([0.11] * 99 + [0.8]), "learned": _served([0.1] * 99 + [0.4])}
    rep = compare(real, sim)
    cell = rep["policies"]["least-outstanding"]["ttft_s"]["p50"]
    assert cell["real"] == pytest.approx(0.1) and cell["sim"] == pytest.approx(0.11)
    assert cell["rel_err"] == pytest.approx(0.1)
    rank = rep["ranking_by_ttft_p99"]
    assert {k: rank[k] for k in ("real", "sim", "same")} == {"real": ["learned", "least-outstanding"],
                                                            "sim": ["learned", "least-outstanding"], "same": True}
    assert rank["separated"] == {"real": False, "sim": False}  # one slow request in 100 each: inside the noise
    g = rep["learned_gain_ttft_p99"]
    real_p99 = [rep["policies"][p]["ttft_s"]["p99"]["real"] for p in ("learned", "least-outstanding")]
    sim_p99 = [rep["policies"][p]["ttft_s"]["p99"]["sim"] for p in ("learned", "least-outstanding")]
    assert g["real"] == pytest.approx(1 - real_p99[0] / real_p99[1])
    assert g["predicted"] == pytest.approx(1 - sim_p99[0] / sim_p99[1])
    assert g["ratio"] == pytest.approx(g["real"] / g["predicted"])
    text = format_report(rep)
    assert "ranking by p99 TTFT: real learned < least-outstanding" in text and "(same)" in text
    assert "ratio" in text


def test_different_ranking_is_reported():
    real = {"a": _served([0.1] * 10), "b": _served([0.2] * 10)}
    sim = {"a": _served([0.3] * 10), "b": _served([0.2] * 10)}
    rep = compare(real, sim)
    assert rep["ranking_by_ttft_p99"]["same"] is False and "learned_gain_ttft_p99" not in rep
    assert "DIFFERENT" in format_report(rep)


def test_a_request_over_max_model_len_names_server_request_and_value(tmp_path):
    import yaml

    from routewise_vllm.fleet.fidelity import FidelityError, check_fits
    from routewise_vllm.fleet.loadplan import PlannedRequest

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"model": {"max_model_len": 1024}}))
    plan = [PlannedRequest(0.0, "x", 100, 10), PlannedRequest(1.5, "y", 1000, 64)]
    with pytest.raises(FidelityError, match=r"http://s:1: trace segment request 1 \(sent at 1.50 s\) needs 1000 prompt "
                                            r"\+ 64 output tokens, over the server's max_model_len 1024"):
        check_fits(plan, [path], ["http://s:1"])
    check_fits(plan[:1], [path], ["http://s:1"])


def test_unreachable_fleet_is_one_line(capsys):
    import socket

    from routewise_vllm.fleet.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["fidelity", "--server", f"http://127.0.0.1:{port}", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{port}/v1/models: probe 'models'" in err[0]


def test_in_flight_at_arrival_counts_the_same_server_only():
    from routewise_vllm.fleet.fidelity_report import Served, in_flight_at_arrival

    rows = [Served(0.0, 10, 5, 0.01, 0.01, 1.0, 0), Served(0.1, 10, 5, 0.01, 0.01, 1.0, 1),
            Served(0.5, 10, 5, 0.01, 0.01, 0.2, 0), Served(0.6, 10, 5, 0.01, 0.01, 0.2, 0),
            Served(1.5, 10, 5, 0.01, 0.01, 0.2, 0)]
    # request 3 arrives while 0 and 2 run on server 0 (1 runs on server 1); request 4 after all finished
    assert list(in_flight_at_arrival(rows)) == [0, 0, 1, 2, 0]


def test_ttft_line_finds_a_per_request_delay_and_ignores_a_queued_tail():
    """Median TTFT = 20 ms + 3 ms per request in flight at arrival, with a tenth of the requests queued for
    seconds: the line is the 20 ms + 3 ms one (medians per in-flight count), which ordinary least squares on
    the requests would tilt."""
    from routewise_vllm.fleet.fidelity_report import Served, in_flight_at_arrival, ttft_line

    rng = np.random.default_rng(0)
    rows, t = [], 0.0
    for _ in range(3000):
        t += float(rng.exponential(0.02))
        rows.append(Served(t, 100, 10, 0.0, 0.01, float(rng.uniform(0.05, 0.3)), int(rng.integers(0, 2))))
    n = in_flight_at_arrival(rows)
    for row, k in zip(rows, n):
        row.ttft_s = 0.020 + 0.003 * k + float(rng.normal(0, 0.002)) + (2.0 if rng.random() < 0.1 else 0.0)
    assert len(set(n.tolist())) >= 4  # the load varies enough for a line
    a, b = ttft_line(rows)
    assert a == pytest.approx(0.020, abs=0.002) and b == pytest.approx(0.003, abs=0.0007)
    flat = [Served(r.arrival_s, 1, 1, 0.05, 0.01, r.e2e_s, r.replica) for r in rows]
    assert ttft_line(flat) == pytest.approx((0.05, 0.0), abs=1e-9)


def test_ttft_line_with_slots_leaves_out_requests_that_queued_for_a_batch_slot():
    from routewise_vllm.fleet.fidelity_report import Served, in_flight_at_arrival, ttft_line

    rng = np.random.default_rng(1)
    rows, t = [], 0.0
    for _ in range(3000):
        t += float(rng.exponential(0.01))
        rows.append(Served(t, 100, 10, 0.0, 0.01, float(rng.uniform(0.02, 0.12)), 0))
    n = in_flight_at_arrival(rows)
    for row, k in zip(rows, n):  # 4 slots: from the 5th request on, each one ahead adds 100 ms of queueing
        row.ttft_s = 0.010 + 0.002 * k + 0.1 * max(0, k - 3)
    a, b = ttft_line(rows, slots=[4])
    assert a == pytest.approx(0.010, abs=1e-6) and b == pytest.approx(0.002, abs=1e-6)
    assert ttft_line(rows)[1] > 0.02  # without the slots the queueing tilts the line


def test_extra_overhead_is_a_constant_shift_not_a_queueing_tail():
    """A real fleet that adds 8 ms to every request: 8 ms. One that queues its busiest half for seconds the
    simulator did not (no constant shift): nothing, where the median gap would have said ~1 s."""
    from routewise_vllm.fleet.fidelity_report import extra_overhead

    rng = np.random.default_rng(0)
    sim = list(rng.uniform(0.02, 0.2, 2000))
    assert extra_overhead([t + 0.008 for t in sim], sim) == pytest.approx(0.008, abs=1e-9)
    queued = sorted(sim)
    real = queued[:1000] + [t + 2.0 for t in queued[1000:]]
    assert extra_overhead(real, sim) == 0.0
    assert float(np.median(np.array(real) - np.array(queued))) > 0.9  # what the old estimator measured
    assert extra_overhead([t - 0.01 for t in sim], sim) == 0.0  # never negative


def test_p99_intervals_say_whether_a_ranking_is_outside_the_noise():
    """Two policies 10x apart at the tail with hundreds of requests: separated. Two drawn from the same
    distribution: their intervals overlap, so whatever order their p99s fall in is inside the noise."""
    rng = np.random.default_rng(0)
    fast = list(rng.uniform(0.01, 0.1, 800))
    slow = [t * 10 for t in rng.uniform(0.01, 0.1, 800)]
    rep = compare({"a": _served(fast), "b": _served(slow)}, {"a": _served(fast), "b": _served(slow)})
    ci_a, ci_b = (rep["policies"][p]["ttft_s"]["p99"]["ci95"]["real"] for p in ("a", "b"))
    p99_a = rep["policies"]["a"]["ttft_s"]["p99"]["real"]
    assert ci_a[0] <= p99_a <= ci_a[1] and ci_a[1] < ci_b[0]
    assert rep["ranking_by_ttft_p99"]["separated"] == {"real": True, "sim": True}
    assert "the real ranking is outside that noise" in format_report(rep)

    twin = list(rng.uniform(0.01, 0.1, 800))
    rep = compare({"a": _served(fast), "b": _served(twin)}, {"a": _served(fast), "b": _served(twin)})
    assert rep["ranking_by_ttft_p99"]["separated"] == {"real": False, "sim": False}
    assert "the real ranking is inside that noise" in format_report(rep)


def test_gain_interval_brackets_the_gain_and_is_reproducible():
    rng = np.random.default_rng(3)
    base = list(rng.uniform(0.01, 1.0, 600))
    learned = [t * 0.6 for t in rng.uniform(0.01, 1.0, 600)]
    real = {"least-outstanding": _served(base), "learned": _served(learned)}
    rep = compare(real, real)
    g = rep["learned_gain_ttft_p99"]
    assert g["real_ci95"][0] < g["real"] < g["real_ci95"][1] and g["real_ci95"] == g["predicted_ci95"]
    assert compare(real, real)["learned_gain_ttft_p99"] == g  # a fixed seed: the same report for the same data


def test_plot_draws_a_png_of_the_report(tmp_path):
    from routewise_vllm.fleet.fidelity_plot import plot_fidelity

    rng = np.random.default_rng(5)
    real = {p: _served(list(rng.uniform(0.01, s, 300))) for p, s in (("least-outstanding", 1.0), ("learned", 0.5))}
    sim = {p: _served(list(rng.uniform(0.01, s, 300))) for p, s in (("least-outstanding", 0.9), ("learned", 0.6))}
    out = plot_fidelity(real, sim, compare(real, sim), tmp_path / "sub" / "fidelity.png")
    assert out == tmp_path / "sub" / "fidelity.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch, capsys, tmp_path):
    import importlib.util

    from routewise_vllm.fleet.cli import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    # an unreachable server would fail later: the missing matplotlib must be named first
    assert main(["fidelity", "--server", "http://127.0.0.1:9", "--plot", str(tmp_path / "f.png"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "--plot" in err and "matplotlib" in err and "routewise-vllm[sim]" in err
    assert not (tmp_path / "f.png").exists()


def test_repeats_rotate_the_order_and_pool_without_mixing_in_flight_counts():
    from routewise_vllm.fleet.fidelity_report import in_flight_at_arrival, pool_repeats, rotated

    pols = ["least-outstanding", "expected-wait", "learned"]
    assert [rotated(pols, r) for r in range(4)] == [pols, pols[1:] + pols[:1], pols[2:] + pols[:2], pols]
    # two repeats of the same two overlapping requests: pooled, each still sees only its own repeat in flight
    one = [Served(0.0, 10, 5, 0.01, 0.01, 2.0, 0), Served(1.0, 10, 5, 0.01, 0.01, 2.0, 0)]
    pooled = pool_repeats([{"a": one}, {"a": [Served(**x.__dict__) for x in one]}])["a"]
    assert len(pooled) == 4 and [x.ttft_s for x in pooled] == [0.01] * 4
    assert list(in_flight_at_arrival(pooled)) == [0, 1, 0, 1]
    assert one[0].arrival_s == 0.0  # the repeats' own rows are not shifted in place


def test_repeats_below_one_is_one_line(capsys):
    from routewise_vllm.fleet.cli import main

    assert main(["fidelity", "--server", "http://127.0.0.1:9", "--repeats", "0", "--quiet"]) == 1
    assert "--repeats 0: must be 1 or more" in capsys.readouterr().err


def test_per_repeat_gives_each_repeat_its_order_ranking_and_gain():
    from routewise_vllm.fleet.fidelity_report import per_repeat, repeat_lines

    pols = ["least-outstanding", "learned"]
    fast, slow = _served([0.1] * 99 + [0.5]), _served([0.1] * 99 + [1.0])
    runs_real = [{"least-outstanding": slow, "learned": fast}, {"least-outstanding": fast, "learned": slow}]
    runs_sim = [{"least-outstanding": slow, "learned": fast}, {"least-outstanding": slow, "learned": fast}]
    reps = per_repeat(runs_real, runs_sim, pols)
    assert [r["order"] for r in reps] == [pols, pols[::-1]]
    assert reps[0]["ranking_by_ttft_p99"]["same"] and not reps[1]["ranking_by_ttft_p99"]["same"]
    assert reps[0]["learned_gain_ttft_p99"]["real"] > 0 > reps[1]["learned_gain_ttft_p99"]["real"]
    # each repeat's own errors: the first is simulated exactly, the second's p99s are off in opposite directions
    assert all(e == 0.0 for p in pols for m in reps[0]["errors"][p].values() for e in m.values())
    p99 = {name: float(np.percentile([x.ttft_s for x in runs], 99)) for name, runs in (("fast", fast), ("slow", slow))}
    assert reps[1]["errors"]["least-outstanding"]["ttft_s"]["p99"] == pytest.approx(p99["slow"] / p99["fast"] - 1)
    assert reps[1]["errors"]["learned"]["ttft_s"]["p99"] == pytest.approx(p99["fast"] / p99["slow"] - 1)
    assert reps[1]["errors"]["learned"]["ttft_s"]["p50"] == 0.0
    lines = repeat_lines(reps)
    assert len(lines) == 2 and lines[0].startswith("repeat 1 (replayed least-outstanding, learned)")
    assert lines[0].endswith("TTFT p50 / p99 error least-outstanding +0.0% / +0.0%, learned +0.0% / +0.0%")
    assert f"least-outstanding +0.0% / {reps[1]['errors']['least-outstanding']['ttft_s']['p99'] * 100:+.1f}%" in lines[1]


def test_late_policies_run_behind_late_binding_live_and_simulated(monkeypatch):
    """`NAME+late`: the simulation runs the live rule (simulate_late) with the run's tokens per request, and the
    router gets the same setting and each server's batch cap through its environment."""
    from routewise_vllm.fleet.fidelity import FidelityError, LateBinding, simulate_same
    from routewise_vllm.fleet.fidelity_report import Served
    from routewise_vllm.router.policy.late_binding import LateBindingConfig
    from routewise_vllm.router.policy.served import served_policy
    from routewise_vllm.router.settings import build_settings
    from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
    from routewise_vllm.simulator.late_binding import simulate_late, split_late
    from routewise_vllm.simulator.types import SimRequest

    assert split_late("learned+late") == ("learned", True) and split_late("learned") == ("learned", False)
    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=1, max_num_seqs=2),
                                      ReplicaGroup(profile="llama3-8b-h100", count=1, max_num_seqs=2)])
    served = [Served(0.005 * i, 300, 40, 0.0, 0.0, 0.0) for i in range(30)]  # a burst: more than the 4 slots
    late = LateBinding({"10.0.0.1:8000": 2, "10.0.0.2:8000": 2}, 340)
    held, _ = simulate_same(served, cluster, "least-outstanding+late", 1.0, late=late)
    plain, _ = simulate_same(served, cluster, "least-outstanding", 1.0)
    reqs = [SimRequest(i, s.arrival_s, s.prompt_tokens, s.output_tokens, max_tokens=s.output_tokens) for i, s in enumerate(served)]
    direct, reasons = simulate_late(cluster.model_copy(update={"estimator_scale": 1.0}), reqs, served_policy("least-outstanding", seed=0),
                                    seed=0, late=LateBindingConfig(tokens_per_request=340))
    assert [s.ttft_s for s in held] == [r.ttft_s for r in direct] and reasons["held_requests"] > 0
    assert [s.ttft_s for s in held] != [s.ttft_s for s in plain]
    with pytest.raises(FidelityError, match="least-outstanding\\+late"):
        simulate_same(served, cluster, "least-outstanding+late", 1.0)
    for k, v in late.router_env().items():
        monkeypatch.setenv(k, v)
    s = build_settings(replicas=["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    assert s.late_binding and s.late_binding_tokens_per_request == 340
    assert s.late_binding_replica_max_num_seqs == {"10.0.0.1:8000": 2, "10.0.0.2:8000": 2}


def test_real_routing_sends_each_request_where_the_real_router_did():
    """simulate_routed: the server model alone. Every request lands on the server recorded for it (here all on the
    slower one, where least-outstanding would alternate), and the errors against the real runs are per policy."""
    from routewise_vllm.fleet.fidelity import FidelityError, simulate_routed, simulate_same
    from routewise_vllm.fleet.fidelity_report import pct_errors
    from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup

    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=1, max_num_seqs=2),
                                      ReplicaGroup(profile="llama3-8b-h100", count=1, max_num_seqs=2)])
    served = [Served(0.01 * i, 300, 40, 0.05, 0.01, 0.5, replica=0) for i in range(20)]
    routed = simulate_routed(served, cluster, 1.0)
    assert [s.replica for s in routed] == [0] * 20
    assert {s.replica for s in simulate_same(served, cluster, "least-outstanding", 1.0)[0]} == {0, 1}
    # one server for a burst of 20 with 2 slots: requests queue for a slot, so TTFT grows along the burst
    assert routed[-1].ttft_s > 3 * routed[0].ttft_s
    errs = pct_errors({"p": served}, {"p": routed})
    assert errs["p"]["ttft_s"]["p50"] == pytest.approx(float(np.median([s.ttft_s for s in routed])) / 0.05 - 1)
    with pytest.raises(FidelityError, match="without the server"):
        simulate_routed([Served(0.0, 300, 40, 0.05, 0.01, 0.5)], cluster, 1.0)


WARM_UP_CASES = {
    # the same rate offers more work on the train window's first seconds than on the evaluated segment
    "busier-train-start": dict(rate=30.0, seqs=16, kv=16384, cost=(0.0024, 9.6e-6, 1.4e-4, 9.6e-4), same_rate=(1.3, None)),
    # a 4-slot server at half its capacity: the train window's first seconds are sparse, offered load grows faster
    # than the rate, and rescaling by the ratio alone ended four steps later at 2.46 of capacity for 0.54 (both
    # fleets then queued for seconds in the warm-up, and 119 ms of that was fitted as request overhead)
    "sparse-train-start": dict(rate=5.19, seqs=4, kv=2048, cost=(0.00664, 4.98e-6, 0.0, 0.0), same_rate=(None, 0.5)),
}


@pytest.mark.parametrize("case", list(WARM_UP_CASES))
def test_warm_up_plan_offers_the_evaluated_segments_load(tmp_path, case):
    """A rate sets the time scale from a window's first requests, so the warm-up's train segment at the evaluated
    rate offers another load than the evaluated segment: plan_at_load finds the rate that offers the same."""
    import yaml

    from routewise_vllm.fleet.fidelity import offered_load, plan_at_load
    from routewise_vllm.fleet.loadplan import PlanSpec, build_plan

    c = WARM_UP_CASES[case]
    a, b, cs, e = c["cost"]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "name": "m", "model": {"name": "tiny", "max_model_len": 1024},
        "server": {"block_size": 32, "kv_cache_tokens": c["kv"], "enable_prefix_caching": True, "max_num_seqs": c["seqs"]},
        "cost_model": {"form": "linear", "a_s": a, "b_s_per_prefill_token": b, "c_s_per_decode_seq": cs,
                       "d_s_per_context_token": 0.0, "e_s_per_prefill_seq": e},
    }))
    spec = PlanSpec(trace="azure-conv", window="eval", duration_s=30, rate=c["rate"], token_scale=0.25,
                    max_tokens_cap=128, max_prompt_tokens=600)
    evaluated, _ = build_plan(spec)
    target = offered_load(evaluated, 30, [path])
    warm = PlanSpec(**{**spec.__dict__, "window": "train", "duration_s": 20})
    same_rate = offered_load(build_plan(warm)[0], 20, [path])
    above, below = c["same_rate"]
    assert (above is None or same_rate > above * target) and (below is None or same_rate < below * target)
    assert offered_load(plan_at_load(warm, target, [path]), 20, [path]) == pytest.approx(target, rel=0.05)


def test_fit_speed_finds_the_factors_at_which_the_engines_run_as_fast_as_the_real_ones():
    from routewise_vllm.fleet.fidelity import fit_speed, simulate_same
    from routewise_vllm.fleet.fidelity_report import mean_itl
    from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup

    cluster = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=1, max_num_seqs=8),
                                      ReplicaGroup(profile="llama3-8b-h100", count=1, max_num_seqs=8)])
    served = [Served(0.02 * i, 300, 60, 0.0, 0.0, 0.0) for i in range(200)]
    same = lambda c: simulate_same(served, c, "least-outstanding", 1.0)[0]  # noqa: E731
    before = same(cluster)
    target = [1.5 * mean_itl(before, 0), 2.0 * mean_itl(before, 1)]
    fitted, factors = fit_speed(cluster, [(t * 1000, 1000) for t in target], same)
    assert [g.speed_factor for g in fitted.replicas] == factors and factors[0] > 1.2 and factors[1] > factors[0]
    after = same(fitted)
    assert [mean_itl(after, i) for i in (0, 1)] == pytest.approx(target, rel=0.05)


def test_ttft_by_hop_weighs_each_hop_by_its_own_counts():
    from routewise_vllm.fleet.fidelity_report import Replay, ttft_by_hop

    a = Replay(_served([0.03, 0.05]), [], [(0.02, 1), (0.06, 2)], (0.07, 2), 0.0, {})
    b = Replay(_served([0.04]), [], [(0.0, 0), (0.03, 1)], (0.02, 1), 0.0, {})
    hop = ttft_by_hop([a, b], _served([0.01, 0.02]))
    assert hop == pytest.approx({"client_s": 0.04, "router_s": 0.03, "servers_s": 0.11 / 4, "sim_s": 0.015})
    assert ttft_by_hop([Replay([], [], [], (0.0, 0), 0.0, {})], []) == {k: None for k in hop}


def test_client_cpus_are_checked_before_anything_starts(monkeypatch, capsys):
    from routewise_vllm.fleet import vllm
    from routewise_vllm.fleet.cli import main

    monkeypatch.setattr(vllm, "cpu_ids", lambda: [0, 1])
    cases = {
        ("--client-cpus", "x"): "--client-cpus: CPU list 'x': 'x' is not a CPU number or a range like 2-3",
        ("--client-cpus", "7"): "--client-cpus 7: CPUs [7] are not available here (this process may use [0, 1])",
        ("--client-cpus", "1", "--servers", "2"):
            "--client-cpus 1: 2 servers need a CPU each besides those, and 1 are left ([0]); use --servers 1",
        ("--client-cpus", "0-1", "--servers", "1"): "--client-cpus 0-1: no CPU left for the servers",
    }
    for extra, message in cases.items():
        assert main(["fidelity", *extra, "--quiet"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (extra, err)


def test_client_cpus_with_external_servers_need_no_cpu_left(monkeypatch):
    from routewise_vllm.fleet import vllm
    from routewise_vllm.fleet.fidelity import _split_cpus

    monkeypatch.setattr(vllm, "cpu_ids", lambda: [0, 1, 2, 3])
    assert _split_cpus(None, 2) == (None, None)
    assert _split_cpus("2-3", 2) == ([2, 3], [0, 1])
    assert _split_cpus("0-3", 0) == ([0, 1, 2, 3], [])  # --server URLs: only the client is confined


def test_a_run_on_a_stubbed_fleet_goes_through_every_step_to_the_report(monkeypatch, tmp_path, capsys):
    """The runner's steps end to end with the fleet stubbed (replays made up, given profiles, no warm-up): the JSON
    report has every section in order, and the printed one a line of each kind per policy."""
    import json
    import os

    import yaml

    from routewise_vllm.fleet import fidelity
    from routewise_vllm.fleet.cli import main
    from routewise_vllm.fleet.fidelity_report import Replay, Served

    src = yaml.safe_load((ROOT / "simulator/profiles/measured/cpu-tiny-linear.yaml").read_text())
    profiles = []
    for i, seqs in enumerate((8, 16)):
        doc = {**src, "server": {**src["server"], "chars_per_token": 3.5 + i, "enable_prefix_caching": True,
                                 "max_num_seqs": seqs}}
        profiles.append(tmp_path / f"p{i}.yaml")
        profiles[-1].write_text(yaml.safe_dump(doc))
    replayed = []

    def replay_real(urls, policy, plan, model, work, scrape_interval_s, progress, late=None):
        replayed.append(policy)
        served = [Served(r.send_s, r.prompt_tokens, r.max_tokens, 0.05 + 0.002 * (i % 13), 0.01, 0.5 + 0.01 * i, i % 2)
                  for i, r in enumerate(plan)]
        return Replay(served, [(1.0, 100.0), (1.2, 90.0)], [(0.5, 10.0), (0.6, 10.0)], (0.8, 20.0), 0.1, {"budget": 2})

    monkeypatch.setattr(fidelity, "replay_real", replay_real)
    monkeypatch.setattr(fidelity, "vllm_model", lambda url: "tiny")
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 2.0, 3.0))
    policies = ["least-outstanding", "expected-wait"]
    common = ["fidelity", "--server", "http://a:1", "--server", "http://b:2", "--profiles", *map(str, profiles),
              "--policies", ",".join(policies), "--duration", "2", "--warmup", "0", "--repeats", "2", "--quiet"]
    assert main([*common, "--json"]) == 0
    assert replayed == ["least-outstanding", "expected-wait", "expected-wait", "least-outstanding"]  # rotated
    report = json.loads(capsys.readouterr().out)
    assert list(report) == [
        "policies", "ranking_by_ttft_p99", "max_abs_rel_err_ttft_e2e", "per_repeat", "ttft_vs_in_flight",
        "mean_inter_token_latency", "fallback_share", "real_routing", "mean_ttft_by_hop", "tracked_speed",
        "speed_factors", "extra_request_overhead_s", "warmup_engine_itl_s", "mean_tokens", "warmup_s", "repeats",
        "trace", "window", "duration_s", "offered_rps", "capacity_rps", "servers", "profiles", "load_average",
        "client_cpus", "wall_s"]
    assert list(report["policies"]) == policies and len(report["per_repeat"]) == 2
    assert report["fallback_share"]["expected-wait"]["real"] == pytest.approx(0.1)
    assert report["fallback_share"]["expected-wait"]["real_reasons"] == {"budget": 4}  # both repeats
    assert report["mean_inter_token_latency"]["least-outstanding"]["real_server_side_s"] == pytest.approx(4.4 / 380)
    assert main(common) == 0
    text = capsys.readouterr().out.splitlines()
    for start in ("repeat ", "least-outstanding: mean inter-token latency", "expected-wait: median TTFT (ms) vs",
                  "least-outstanding: with the real routing", "expected-wait: mean TTFT (ms) as the client",
                  "least-outstanding: with each engine's speed fitted", "offered "):
        assert any(line.startswith(start) for line in text), start
    assert text[-1].startswith("offered ") and "load average 1.00 2.00 3.00" in text[-1]
