"""`fleet fidelity` against the two real vLLM CPU servers of the session. CI runs a short one (one policy, the
warming calibration sweep kept: `--calibrations 0`); the `bench` tier runs two policies with three calibrations
after the warming one (about 5 minutes). Both check that calibration writes loadable measured profiles and that the report is
produced and internally consistent. Accuracy figures are not asserted: they come from the benchmark command
(`fleet fidelity`, see its module docstring) and vary with the machine's load.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from routewise_vllm.fleet.fidelity import capacity_rps
from routewise_vllm.fleet.fidelity_report import METRICS, PERCENTILES
from routewise_vllm.fleet.cli import main
from routewise_vllm.fleet.vllm import SMALL
from routewise_vllm.simulator.costmodel import load_profile

POLICIES = ("least-outstanding", "expected-wait")


# name: (policies, calibration sweeps after the warming one, seconds of replay, calibration budget, warm-up s)
RUNS = {
    "short": (POLICIES[:1], 0, 5, 25, 2),
    "full": (POLICIES, 3, 8, 90, 4),
}


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", [pytest.param("short"), pytest.param("full", marks=pytest.mark.bench)])
def test_fidelity_report_is_produced_and_consistent(run, vllm_servers, tmp_path, capsys):
    policies, calibrations, duration, budget, warmup = RUNS[run]
    affinity = os.sched_getaffinity(0)
    client = max(affinity)  # the router and the load generator confined to one CPU (the servers are the session's)
    args = ["fidelity", "--policies", ",".join(policies), "--duration", str(duration), "--load", "0.5",
            "--calibrate-budget", str(budget), "--calibrations", str(calibrations), "--warmup", str(warmup),
            "--out", str(tmp_path), "--json", "--quiet", "--client-cpus", str(client)]
    for url in vllm_servers:
        args += ["--server", url]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["servers"] == vllm_servers
    assert report["client_cpus"] == [client] and os.sched_getaffinity(0) == affinity  # given back on return
    assert len(report["speed_factors"]) == len(vllm_servers) and all(f > 0 for f in report["speed_factors"])
    assert report["extra_request_overhead_s"] >= 0 and report["warmup_engine_itl_s"] > 0
    # per policy and server, the line of median TTFT against its load, real and simulated
    assert set(report["ttft_vs_in_flight"]) == set(policies)
    assert all(len(lines) == len(vllm_servers) for lines in report["ttft_vs_in_flight"].values())
    for i, path in enumerate(report["profiles"]):
        # a warming sweep, then --calibrations sweeps: the kept profile is the median-capacity one of those at the
        # segment's mean lengths (the warming one itself when there are none)
        sweeps = sorted(tmp_path.glob(f"profile-{i}-sweep-*.yaml"))
        assert len(sweeps) == 1 + calibrations
        lengths = report["mean_tokens"]["prompt"], report["mean_tokens"]["output"]
        settled = sorted(sweeps[1:] or sweeps, key=lambda p: capacity_rps([p], *lengths))
        assert open(path).read() == settled[len(settled) // 2].read_text()
        doc = yaml.safe_load(open(path))
        assert doc["fit"]["chosen"] == "linear" and doc["fit"]["held_out_rms_relative_error"]["linear"] >= 0
        assert doc["calibration"]["measurements"] and doc["server"]["kv_cache_tokens"] > 0
        assert load_profile(path).linear is not None
        # the small server runs 4 sequences at most: its decode rows record the batch it ran, not the probe's
        # concurrency (up to 16), or the fit prices a sequence of a batch at a fraction of its cost
        batches = [m["decode_seqs"] for m in doc["calibration"]["measurements"] if m["decode_seqs"] > 0]
        assert max(batches) == 4 if i == SMALL else max(batches) > 4
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert set(report["policies"]) == set(policies) == set(raw)
    for policy, row in report["policies"].items():
        real, sim = raw[policy]["real"], raw[policy]["sim"]
        assert row["requests"] == len(real) == len(sim) > 0
        assert all(0 <= r["replica"] < len(vllm_servers) for r in real)  # the router named each request's server
        # the simulation got exactly the real arrivals and lengths
        assert [(r["arrival_s"], r["prompt_tokens"]) for r in real] == [(s["arrival_s"], s["prompt_tokens"]) for s in sim]
        for m in METRICS:
            for src in ("real", "sim"):
                values = [row[m][f"p{p}"][src] for p in PERCENTILES]
                assert all(v is not None and v >= 0 for v in values) and values == sorted(values)
            for p in PERCENTILES:
                cell = row[m][f"p{p}"]
                assert cell["rel_err"] == pytest.approx((cell["sim"] - cell["real"]) / cell["real"])
    for src in ("real", "sim"):
        order = report["ranking_by_ttft_p99"][src]
        assert sorted(order) == sorted(policies)
        p99 = [report["policies"][p]["ttft_s"]["p99"][src] for p in order]
        assert p99 == sorted(p99)
    # the server model alone: each policy's requests re-simulated on the servers that served them
    assert set(report["real_routing"]) == set(policies)
    assert all(set(errs) == {"ttft_s", "tpot_s", "e2e_s"} for errs in report["real_routing"].values())
    # each request's client TTFT spans its router TTFT, which spans its server's: so do the means
    for hop in report["mean_ttft_by_hop"].values():
        assert hop["client_s"] >= hop["router_s"] >= hop["servers_s"] > 0 and hop["sim_s"] > 0
    assert set(report["tracked_speed"]) == set(policies)
    assert all(len(t["speed_factors"]) == 1 and all(f > 0 for f in t["speed_factors"][0]) for t in report["tracked_speed"].values())
    # heuristics never fall back, live or simulated (a learned arm's share is reported, not asserted)
    assert report["fallback_share"] == {p: {"real": 0.0, "sim": 0.0, "real_reasons": {}} for p in policies}
    assert report["ranking_by_ttft_p99"]["same"] == (
        report["ranking_by_ttft_p99"]["real"] == report["ranking_by_ttft_p99"]["sim"]
    )
