"""Load generator: plans from traces and synthetic processes, prompt synthesis, and replay against an emulator."""

from __future__ import annotations

import math

import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from routewise_vllm.router.policy.estimate import TokenEstimator, text_prefix_blocks
from routewise_vllm.fleet.emulator import EmulatorSettings, make_app
from routewise_vllm.fleet.loadgen import ClientSpec, format_side_by_side, format_table, run_load, summarize
from routewise_vllm.fleet.loadplan import PlannedRequest, PlanSpec, PromptSynth, build_plan
from routewise_vllm.simulator.traces import TraceLibrary

pytestmark = pytest.mark.timeout(60)
EST = TokenEstimator()


def test_prompts_have_the_planned_token_counts_and_are_unique_without_block_ids():
    synth = PromptSynth(seed=3, block_tokens=32)
    a, b = synth.prompt(100), synth.prompt(100)
    assert EST.from_text(a) == 100 and EST.from_text(b) == 100
    assert text_prefix_blocks(a)[0] != text_prefix_blocks(b)[0]


def test_shared_hash_ids_give_shared_text_prefixes():
    synth = PromptSynth(seed=0, block_tokens=64)  # one trace block = one router prefix block (64 tokens)
    x = synth.prompt(64 * 3, (7, 8, 9))
    y = synth.prompt(64 * 3 + 20, (7, 8, 10, 11))
    z = synth.prompt(64 * 3, (1, 8, 9))
    assert EST.from_text(y) == 64 * 3 + 20
    bx, by, bz = text_prefix_blocks(x), text_prefix_blocks(y), text_prefix_blocks(z)
    assert bx[:2] == by[:2] and bx[2] != by[2]
    assert not set(bx) & set(bz)  # chained: a different first block shares nothing


def test_trace_plan_follows_the_trace_window_and_scales():
    lib = TraceLibrary()
    plan, info = build_plan(
        PlanSpec(trace="azure-conv", time_scale=4.0, duration_s=5.0, token_scale=0.1, max_tokens_cap=20), lib
    )
    trace = lib.load("azure-conv")
    expected = int(np.sum(trace.arrival_s < 20.0))  # 5 s of wall time = 20 s of trace at 4x
    assert len(plan) == expected == info["requests"]
    assert all(0 <= r.send_s < 5.0 for r in plan)
    assert [r.send_s for r in plan] == sorted(r.send_s for r in plan)
    for r, p, o in zip(plan, trace.prompt_tokens, trace.output_tokens):
        assert r.prompt_tokens == max(1, round(int(p) * 0.1)) == EST.from_text(r.prompt)
        assert r.max_tokens == min(20, max(1, round(int(o) * 0.1)))
    with pytest.raises(ValueError, match="unknown trace"):
        build_plan(PlanSpec(trace="nope"), lib)


def test_mooncake_plan_shares_prefixes_where_the_trace_does():
    lib = TraceLibrary()
    plan, _ = build_plan(PlanSpec(trace="mooncake-synth", duration_s=60.0, token_scale=0.125), lib)
    trace = lib.load("mooncake-synthetic")
    ids = trace.block_ids[: len(plan)]
    # 512-token blocks at scale 1/8 are 64 tokens: exactly the router's prefix block.
    # Pairs that share a first block id, and neighbours (which mostly share nothing).
    pairs = [(i, j) for i in range(len(plan)) for j in range(i) if ids[i][0] == ids[j][0] or j == i - 1]
    shared_seen = 0
    for i, j in pairs:
        same = 0
        while same < min(len(ids[i]), len(ids[j])) and ids[i][same] == ids[j][same]:
            same += 1
        bi, bj = text_prefix_blocks(plan[i].prompt), text_prefix_blocks(plan[j].prompt)
        common = 0
        while common < min(len(bi), len(bj)) and bi[common] == bj[common]:
            common += 1
        full_i, full_j = plan[i].prompt_tokens // 64, plan[j].prompt_tokens // 64
        assert common == min(same, full_i, full_j), (i, j, same, common)
        shared_seen += common > 0
    assert shared_seen > 0


def test_poisson_plan_rate_and_bounds():
    plan, info = build_plan(PlanSpec(trace="poisson", rate=50.0, duration_s=4.0, prompt_tokens=30, output_tokens=5, seed=1))
    assert 150 < len(plan) < 250
    assert all(r.send_s < 4.0 and r.prompt_tokens == 30 and r.max_tokens == 5 for r in plan)
    capped, _ = build_plan(PlanSpec(trace="poisson", rate=50.0, duration_s=4.0, max_requests=7))
    assert len(capped) == 7


async def _serve(arm_header: bool = False, **kw) -> TestServer:
    app = make_app(EmulatorSettings(**kw))
    if arm_header:  # stand-in for the router's A/B split: alternate arms by request count
        count = {"n": 0}

        async def add_arm(request, response):
            if request.path.startswith("/v1/"):
                count["n"] += 1
                response.headers["x-routewise-arm"] = "control" if count["n"] % 2 else "treatment"

        app.on_response_prepare.append(add_arm)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.mark.parametrize("client", ["aiohttp", "openai"])
async def test_replay_against_an_emulator_reports_every_request(client):
    server = await _serve(profile="llama3-8b-h100", max_num_seqs=4)
    try:
        plan, _ = build_plan(PlanSpec(trace="poisson", rate=20.0, duration_s=1.5, prompt_tokens=120, output_tokens=12, seed=2))
        results, wall = await run_load(plan, ClientSpec(url=str(server.make_url("")), client=client), progress=False)
    finally:
        await server.close()
    assert len(results) == len(plan) and all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert all(r.output_tokens == 12 and r.group == "all" for r in results)
    assert all(0 < r.ttft_s < r.e2e_s for r in results)
    s = summarize(results)["all"]
    assert s["ok"] == len(plan) and s["errors"] == 0
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    ttfts = sorted(r.ttft_s for r in results)
    assert math.isclose(s["ttft_s"]["p50"], float(np.percentile(ttfts, 50)))
    # TPOT is the time after the first token spread over the other 11 (how near it sits to the emulated H100's
    # decode step is a timing figure: tests/bench/loadgen_timing.py)
    for r in results:
        assert 0 < r.tpot_s and r.ttft_s + 11 * r.tpot_s <= r.e2e_s * (1 + 1e-9)
    assert math.isclose(s["tpot_s"]["p50"], float(np.percentile([r.tpot_s for r in results], 50)))
    assert wall >= plan[-1].send_s
    assert "TTFT p99" in format_table(summarize(results))


async def test_results_are_grouped_by_the_arm_header():
    server = await _serve(arm_header=True, profile="llama3-8b-h100")
    try:
        plan, _ = build_plan(PlanSpec(trace="poisson", rate=30.0, duration_s=1.0, prompt_tokens=40, output_tokens=4, seed=5))
        results, _ = await run_load(plan, ClientSpec(url=str(server.make_url(""))), progress=False)
    finally:
        await server.close()
    summary = summarize(results)
    assert set(summary) == {"control", "treatment"}
    assert summary["control"]["ok"] + summary["treatment"]["ok"] == len(plan)
    assert abs(summary["control"]["ok"] - summary["treatment"]["ok"]) <= 1
    table = format_side_by_side(summary, ["control", "treatment"])
    assert "TTFT p99 (ms)" in table and "-" not in table.splitlines()[3].split()[-1]


async def test_several_urls_take_the_requests_in_turn():
    """Router pods behind a Service: requests alternate over --url given twice, each served by its own emulator."""
    servers = [await _serve(profile="llama3-8b-h100"), await _serve(profile="llama3-8b-h100")]
    try:
        plan, _ = build_plan(PlanSpec(trace="poisson", rate=30.0, duration_s=1.0, prompt_tokens=40, output_tokens=4, seed=7))
        urls = [str(s.make_url("")) for s in servers]
        results, _ = await run_load(plan, ClientSpec(url=urls[0], also=(urls[1],)), progress=False)
        counts = [await _completed(s) for s in servers]
    finally:
        for s in servers:
            await s.close()
    assert all(r.ok for r in results) and len(results) == len(plan)
    assert sum(counts) == len(plan) and abs(counts[0] - counts[1]) <= 1, counts


async def _completed(server) -> int:
    """Requests the emulator finished, from its vLLM-style /metrics."""
    import aiohttp

    from routewise_vllm.fleet.calibrate import _total, parse_metrics

    async with aiohttp.ClientSession() as session:
        async with session.get(str(server.make_url("/metrics"))) as resp:
            return int(_total(parse_metrics(await resp.text()), "vllm:e2e_request_latency_seconds_count"))


async def test_timeouts_are_counted_as_errors():
    """A request past the client timeout is an error of kind timeout, and the run does not wait for its answer:
    1,000 tokens at ~70 ms a step would take ~70 s; a 5 s timeout ends the run long before (a 30 s outer bound;
    how close to the timeout it ends is a timing figure: tests/bench/loadgen_timing.py)."""
    server = await _serve(profile="llama3-8b-l4")
    try:
        plan = [PlannedRequest(0.0, "x" * 40, 10, 1000), PlannedRequest(0.05, "y" * 40, 10, 2)]
        results, wall = await run_load(plan, ClientSpec(url=str(server.make_url("")), timeout_s=5.0), progress=False,
                                       drain_timeout_s=20.0)  # the timeout, not the drain, ends the long one
    finally:
        await server.close()
    assert [r.ok for r in results] == [False, True]
    assert results[0].error == "timeout"
    assert wall < 30.0
