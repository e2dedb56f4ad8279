"""`fleet calibrate --server`: the measured linear cost form, measured profiles loaded by path, the fit, and
one-line errors with nothing written for a bad server (a fault-injecting fake vLLM; the real one is in tests/e2e)."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest
import yaml

from routewise_vllm.fleet import calibrate, calibrate_fit
from routewise_vllm.simulator import costmodel
from routewise_vllm.fleet.cli import main
from routewise_vllm.simulator.config import ReplicaGroup
from routewise_vllm.simulator.replica import Replica, ReqState
from routewise_vllm.simulator.types import SimRequest
from tests.fakes.fake_vllm import FakeVllm

LINEAR = costmodel.LinearCost(0.004, 1.5e-4, 6e-4, 2e-7, 0.012)


def measured_doc(**over) -> dict:
    doc = {
        "name": "m",
        "model": {"name": "tiny", "max_model_len": 1024},
        "server": {"block_size": 32, "kv_cache_tokens": 2048, "enable_prefix_caching": True, "max_num_seqs": 4},
        "cost_model": {"form": "linear", **{f: getattr(LINEAR, f) for f in costmodel.LINEAR_FIELDS}},
        "request_overhead_s": 0.003,
    }
    doc.update(over)
    return doc


def test_measured_profile_loads_by_path_with_its_kv_size_and_linear_cost(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(measured_doc()))
    prof = costmodel.load_profile(str(path))
    assert prof.num_kv_blocks(32) == 64 and prof.request_overhead_s == 0.003
    for args in [(0, 1, 40), (0, 4, 900), (300, 0, 300), (120, 3, 700)]:
        want = LINEAR.iteration_time(*args, int(args[0] > 0))
        assert prof.coefficients().iteration_time(*args, prefill_seqs=int(args[0] > 0)) == pytest.approx(want)


def test_measured_profile_bad_field_names_file_and_field(tmp_path):
    doc = measured_doc()
    doc["cost_model"]["c_s_per_decode_seq"] = -1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=r"bad.yaml: field 'cost_model.c_s_per_decode_seq' must be >= 0"):
        costmodel.load_profile(str(path))


def _finish_times(closed_form: bool, path) -> list[float]:
    prof = costmodel.load_profile(str(path))
    rep = Replica("r0", ReplicaGroup(profile=str(path), max_num_seqs=4, block_size=32), prof, closed_form=closed_form)
    rng = np.random.default_rng(0)
    states = []
    t = 0.0
    for i in range(30):
        t += float(rng.exponential(0.05))
        while rep.event_s is not None and rep.event_s <= t:
            rep.on_event(rep.event_s)
        st = ReqState(SimRequest(i, t, int(rng.integers(10, 300)), int(rng.integers(2, 120))), i, t)
        states.append(st)
        rep.add(st, t)
    while rep.event_s is not None:
        rep.on_event(rep.event_s)
    return [t for s in states for t in (s.first_token_s, s.finish_s)]


def test_linear_profile_closed_form_jumps_match_one_iteration_at_a_time(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(measured_doc()))
    assert _finish_times(True, path) == pytest.approx(_finish_times(False, path), rel=1e-9)


def test_fit_linear_recovers_known_coefficients():
    rows = [(p, 0, p, p * p / 2, 1, LINEAR.iteration_time(p, 0, p, 1)) for p in (16, 64, 128, 256, 512, 768)]
    rows += [(0, d, c, 0, 0, LINEAR.iteration_time(0, d, c)) for d, c in ((1, 70), (2, 140), (4, 280), (8, 560), (1, 800))]
    fits = calibrate_fit.fit_rows(np.array(rows, dtype=float), None)
    assert fits.chosen == "linear" and fits.in_sample["linear"] < 1e-6 and fits.unidentified == ()
    fit = fits.linear
    for f in costmodel.LINEAR_FIELDS:
        assert getattr(fit, f) == pytest.approx(getattr(LINEAR, f), rel=1e-3, abs=1e-12)


def test_a_linear_term_fitted_below_zero_is_reported_as_not_identified():
    """Prefill iterations that end sooner than a decode iteration's fixed cost would allow (timing noise on a CPU
    server): the per-prefill-sequence term fits negative, the fit drops it, and the profile says so instead of
    presenting 0 as measured."""
    rows = [(p, 0, p, p * p / 2, 1, 0.003 + 1e-5 * p + 1e-8 * p) for p in (16, 64, 128, 256, 512)]
    rows += [(0, d, c, 0, 0, 0.004 + 1e-4 * d + 1e-8 * c) for d, c in ((1, 70), (2, 140), (3, 500), (4, 280))]
    fits = calibrate_fit.fit_rows(np.array(rows, dtype=float), None)
    dropped = {f for f in costmodel.LINEAR_FIELDS if getattr(fits.linear, f) == 0.0}
    assert "e_s_per_prefill_seq" in dropped and fits.linear.a_s > 0 and fits.linear.c_s_per_decode_seq > 0
    assert fits.unidentified == tuple(f"{f} (fitted below zero, written as 0)" for f in costmodel.LINEAR_FIELDS
                                      if f in dropped)


# ---------------------------------------------------------------- bad servers: one line, nothing written


@pytest.fixture
def fake_vllm():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = FakeVllm()
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    yield fake
    asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _calibrate(url: str, out, *extra: str) -> int:
    return main(["calibrate", "--server", url, "-o", str(out), "--quiet", *extra])


def _one_line_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fleet calibrate: error")]
    assert len(err) == 1, err
    return err[0]


def test_unreachable_server_names_url_and_probe(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "p.yaml"
    assert _calibrate(f"http://127.0.0.1:{port}", out) == 1
    line = _one_line_error(capsys)
    assert f"127.0.0.1:{port}/metrics" in line and "probe 'metrics'" in line and "cannot connect" in line
    assert list(tmp_path.iterdir()) == []


def test_non_vllm_server_is_refused_before_any_load(fake_vllm, tmp_path, capsys):
    fake_vllm.metrics_mode = "garbage"
    assert _calibrate(fake_vllm.url, tmp_path / "p.yaml") == 1
    assert "not a vLLM server" in _one_line_error(capsys)
    assert fake_vllm.requests == 0 and list(tmp_path.iterdir()) == []


def test_error_mid_sweep_names_probe_and_status(fake_vllm, tmp_path, capsys):
    fake_vllm.mode = "error_500"
    assert _calibrate(fake_vllm.url, tmp_path / "p.yaml") == 1
    line = _one_line_error(capsys)
    assert "/v1/completions: probe '" in line and "HTTP 500" in line
    assert list(tmp_path.iterdir()) == []


def test_probe_timeout_names_probe_and_limit(fake_vllm, tmp_path, capsys):
    fake_vllm.mode = "hang"
    assert _calibrate(fake_vllm.url, tmp_path / "p.yaml", "--probe-timeout", "0.5") == 1
    line = _one_line_error(capsys)
    assert "/v1/completions: probe '" in line and "timed out after 0.5 s" in line
    assert list(tmp_path.iterdir()) == []


def test_wrong_model_names_what_is_served(fake_vllm, tmp_path, capsys):
    assert _calibrate(fake_vllm.url, tmp_path / "p.yaml", "--model", "llama") == 1
    assert "model 'llama' not served (served: ['tiny'])" in _one_line_error(capsys)


# ---------------------------------------------------------------- what measured profiles change in the cluster


def _cluster(path, **over):
    from routewise_vllm.simulator.config import ClusterConfig, ScrapeConfig

    return ClusterConfig(replicas=[ReplicaGroup(profile=str(path), max_num_seqs=4, block_size=32)],
                         scrape=ScrapeConfig(jitter_s=0.0), estimator_sigma=0.0, **over)


def test_request_overhead_of_a_measured_profile_adds_to_ttft_and_e2e(tmp_path):
    from routewise_vllm.router.policy.served import served_policy
    from routewise_vllm.simulator.cluster import simulate

    runs = {}
    for overhead in (0.0, 0.05):
        path = tmp_path / f"p{overhead}.yaml"
        path.write_text(yaml.safe_dump(measured_doc(request_overhead_s=overhead)))
        [rec] = simulate(_cluster(path), [SimRequest(0, 0.0, 100, 5)], served_policy("least-outstanding"), seed=0)
        runs[overhead] = rec
    alone = LINEAR.iteration_time(100, 0, 100, 1)  # one prefill iteration, then 4 decode steps
    assert runs[0.0].ttft_s == pytest.approx(alone)
    assert runs[0.05].ttft_s == pytest.approx(alone + 0.05)
    assert runs[0.05].e2e_s == pytest.approx(runs[0.0].e2e_s + 0.05)


def test_estimator_scale_biases_what_the_policy_sees(tmp_path):
    from routewise_vllm.simulator.cluster import ClusterSim

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(measured_doc()))
    for scale, want in ((1.0, 400), (0.34, 136)):
        sim = ClusterSim(_cluster(path, estimator_scale=scale), [SimRequest(0, 0.0, 400, 5)], seed=0)
        _, info = sim.next_decision()
        assert info.prompt_tokens_est == want


# ---------------------------------------------------------------- a sweep against the emulator


def test_decode_rows_count_the_batch_a_capped_server_ran():
    """A server capped at 4 sequences runs a 16-request decode probe in waves of 4: the row says 4, or the fit would
    price each sequence of a batch at a quarter of its cost (the real 4-slot CPU server fitted 28 us per sequence
    against its 16-slot twin's 148)."""
    from aiohttp.test_utils import TestServer

    from routewise_vllm.fleet.emulator import EmulatorSettings, make_app

    spec = calibrate.SweepSpec(prefill_tokens=(16, 256), batches=(1, 2), contexts=(32,), long_context_fraction=0.01,
                               mixed_prefill_tokens=(), decode_tokens=24, max_concurrency=16, max_rounds=1)

    async def run() -> calibrate.Result:
        server = TestServer(make_app(EmulatorSettings(max_num_seqs=4, block_size=32)), host="127.0.0.1")
        await server.start_server()
        try:
            return await calibrate._calibrate(str(server.make_url("")).rstrip("/"), None, spec, None,
                                              announce=lambda m: None, progress=False)
        finally:
            await server.close()

    res = asyncio.run(run())
    assert res.max_num_seqs == 4 and res.batch_cap == 4
    assert {p.decode_seqs for p in res.probes if p.kind == "decode"} == {1, 2, 4}


def test_a_repeated_sweep_does_not_prefill_from_the_previous_sweeps_cache():
    """Each sweep's prompts are its own (a per-sweep nonce): a seeded sweep repeated on a server with room in its
    prefix cache prefilled its prompts from the cache (the roomy CPU server fitted ~0 us per prefill token after its
    first sweep). Where the server still reports prefix-cache hits, the row counts only the tokens it computed."""
    from aiohttp.test_utils import TestServer

    from routewise_vllm.fleet.emulator import EmulatorSettings, make_app

    async def run() -> list[calibrate.Probe]:
        server = TestServer(make_app(EmulatorSettings(block_size=16)), host="127.0.0.1")
        await server.start_server()
        client = calibrate.Client(str(server.make_url("")).rstrip("/"), 30.0)
        try:
            info = await calibrate.discover(client, None)
            texts = [calibrate._Text(nonce="same"), calibrate._Text(nonce="same"), calibrate._Text(), calibrate._Text()]
            return [await calibrate._probe_prefill(client, info, t, 256) for t in texts]
        finally:
            await client.close()
            await server.close()

    first, same_again, fresh, fresh_again = asyncio.run(run())
    assert first.prefix_hit_tokens == 0 and fresh.prefix_hit_tokens == 0 and fresh_again.prefix_hit_tokens == 0
    assert same_again.prefix_hit_tokens > 0
    assert same_again.prefill_tokens == same_again.context_tokens - same_again.prefix_hit_tokens < first.prefill_tokens
    assert first.prefill_tokens == first.context_tokens
