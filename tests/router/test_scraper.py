"""vLLM /metrics parsing and the scraper: current and legacy names, garbage and missing metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.router.app import METRICS, REPLICAS, SCRAPER
from routewise_vllm.router.observe.vllm_metrics import MetricsParseError, parse_vllm_metrics
from tests.fakes.fake_vllm import FakeVllm
from tests.router.conftest import wait_for

REAL_PAGE = Path(__file__).resolve().parents[1] / "data" / "vllm_metrics_0.32.0.txt"


def test_parses_a_real_vllm_page():
    text = REAL_PAGE.read_text()
    stats = parse_vllm_metrics(text)
    expected = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert stats.waiting == expected["vllm:num_requests_waiting"] and stats.waiting > 0
    assert stats.running == expected["vllm:num_requests_running"] and stats.running > 0
    assert stats.kv_cache_usage == pytest.approx(expected["vllm:kv_cache_usage_perc"])
    assert stats.kv_capacity_tokens == 64 * 32
    assert stats.prefix_cache_hits == expected["vllm:prefix_cache_hits_total"]
    assert stats.missing() == ()


def test_legacy_name_engine_sum_and_missing():
    fake = FakeVllm()
    fake.metrics_mode = "legacy"
    legacy = parse_vllm_metrics(fake.metrics_text())
    assert legacy.kv_cache_usage == pytest.approx(0.42) and legacy.waiting == 3 and legacy.running == 5
    assert legacy.kv_capacity_tokens == 16000 and legacy.preemptions == 7.0
    two_engines = fake.metrics_text() + fake.metrics_text().replace('engine="0"', 'engine="1"').replace(
        "# HELP", "# XHELP")
    two = parse_vllm_metrics("\n".join(l for l in two_engines.splitlines() if not l.startswith("# X")))
    assert two.waiting == 6 and two.running == 10 and two.kv_cache_usage == pytest.approx(0.42)
    fake.metrics_mode = "missing"
    missing = parse_vllm_metrics(fake.metrics_text())
    assert missing.kv_cache_usage is None and missing.missing() == ("kv_cache_usage",)
    assert parse_vllm_metrics("").missing() == ("waiting", "running", "kv_cache_usage")
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics("<html><body>oops</body></html>")




@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_scraper_pushes_values_and_flags_faults(fakes, router_client):
    a, b = await fakes(2)
    b.metrics_mode = "legacy"
    client = await router_client([a.url, b.url], scrape_interval_s=60, scrape_timeout_s=0.2)
    app = client.app
    reps, scraper, reg = app[REPLICAS], app[SCRAPER], app[METRICS].registry
    ra, rb = reps.by_id[a.url.removeprefix("http://")], reps.by_id[b.url.removeprefix("http://")]
    # the startup scrape already ran
    assert (ra.tracker.waiting, ra.tracker.running, ra.tracker.kv_cache_usage) == (3, 5, 0.42)
    assert rb.tracker.kv_cache_usage == pytest.approx(0.42) and rb.tracker.kv_capacity_tokens == 16000

    def errors(rid, kind):
        return reg.get_sample_value("llm_router_scrape_errors_total", {"replica": rid, "kind": kind}) or 0

    # garbage: counted, previous values kept, age keeps growing
    a.metrics_mode = "garbage"
    t_before = ra.tracker.last_scrape_s
    await scraper.scrape_all()
    assert errors(ra.id, "parse") == 1
    assert ra.tracker.last_scrape_s == t_before and ra.tracker.waiting == 3
    age1 = reg.get_sample_value("llm_router_scrape_age_seconds", {"replica": ra.id})
    await scraper.scrape_all()
    assert reg.get_sample_value("llm_router_scrape_age_seconds", {"replica": ra.id}) > age1

    # a missing metric: flagged, None (not zero), the others updated
    a.metrics_mode = "missing"
    a.waiting = 9
    await scraper.scrape_all()
    assert errors(ra.id, "missing_metric") == 1
    assert ra.tracker.kv_cache_usage is None and ra.tracker.waiting == 9
    assert reg.get_sample_value("llm_router_replica_kv_cache_usage_ratio", {"replica": ra.id}) is None
    assert reg.get_sample_value("llm_router_replica_waiting_requests", {"replica": ra.id}) == 9

    a.metrics_mode = "http_500"
    await scraper.scrape_all()
    assert errors(ra.id, "http") == 1
    a.metrics_mode = "hang"
    await scraper.scrape_all()
    assert errors(ra.id, "timeout") == 1
    assert errors(rb.id, "parse") == errors(rb.id, "missing_metric") == 0


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_scraper_loop_runs_periodically(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url])
    n = a.metrics_scrapes
    await wait_for(lambda: a.metrics_scrapes >= n + 3)
    a.running = 11
    rep = client.app[REPLICAS].ordered[0]
    await wait_for(lambda: rep.tracker.running == 11)
