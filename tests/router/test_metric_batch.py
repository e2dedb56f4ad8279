"""router.metric_batch: observations applied in batches give what prometheus_client's own observe and inc give,
sample for sample, and no reader sees them late."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, values

from routewise_vllm.router.observe.metric_batch import Batch, FlushingRegistry
from routewise_vllm.router.telemetry import DECISION_BUCKETS, LATENCY_BUCKETS, RouterMetrics

# bounds hit exactly, between bounds, below the first, above the last finite one, zero, negative, repeats
VALUES = [0.0, -1.0, LATENCY_BUCKETS[0], LATENCY_BUCKETS[3], LATENCY_BUCKETS[3] * 1.0001, 0.0049, 119.9, 120.0,
          1e9, 0.5, 0.5, 0.5, DECISION_BUCKETS[5], 3e-6]


def _samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    return sorted(((s.name, s.labels, s.value) for m in registry.collect() for s in m.samples
                   if not s.name.endswith("_created")), key=lambda s: (s[0], sorted(s[1].items())))


def _pair(buckets) -> tuple[CollectorRegistry, object, FlushingRegistry, object, Batch]:
    plain = CollectorRegistry()
    batch = Batch()
    flushing = FlushingRegistry(batch)
    h = Histogram("h_seconds", "h", ["a"], buckets=buckets, registry=plain).labels("x")
    hb = batch.tally(Histogram("h_seconds", "h", ["a"], buckets=buckets, registry=flushing).labels("x"))
    return plain, h, flushing, hb, batch


@pytest.mark.parametrize("buckets", [LATENCY_BUCKETS, DECISION_BUCKETS])
@pytest.mark.parametrize("per_flush", [1, 3, len(VALUES)])
def test_a_batched_histogram_is_observes(buckets, per_flush: int) -> None:
    plain, h, flushing, hb, batch = _pair(buckets)
    for i, v in enumerate(VALUES):
        h.observe(v)
        hb.observe(v)
        if (i + 1) % per_flush == 0:
            batch.flush()
    got, want = _samples(flushing), _samples(plain)
    assert [(n, lbl) for n, lbl, _ in got] == [(n, lbl) for n, lbl, _ in want]
    for (name, labels, g), (_, _, w) in zip(got, want):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-12), (name, labels)


def test_a_batched_counter_is_incs_and_a_collection_applies_the_batch() -> None:
    plain, batch = CollectorRegistry(), Batch()
    flushing = FlushingRegistry(batch)
    c = Counter("c", "c", ["a"], registry=plain).labels("x")
    cb = batch.count(Counter("c", "c", ["a"], registry=flushing).labels("x"))
    for n in (1, 1, 5, 0, 2):
        c.inc(n)
        cb.inc(n)
    # no loop running: applied at once; and get_sample_value collects, which applies whatever waits
    assert flushing.get_sample_value("c_total", {"a": "x"}) == plain.get_sample_value("c_total", {"a": "x"}) == 9


async def test_in_a_loop_observations_wait_for_the_timer_or_a_reader() -> None:
    plain, h, flushing, hb, batch = _pair(LATENCY_BUCKETS)
    child = hb._child
    hb.observe(0.5)
    hb.observe(0.7)
    assert child._sum.get() == 0.0  # waiting: nothing applied on the request's path
    assert flushing.get_sample_value("h_seconds_count", {"a": "x"}) == 2  # a reader applies it first
    hb.observe(0.25)
    async with asyncio.timeout(30):
        while child._sum.get() != pytest.approx(1.45):  # the timer applies it without a reader
            await asyncio.sleep(0.005)
    assert hb.values == []


async def test_with_shared_metric_files_the_batch_is_applied_after_each_loop_turn(monkeypatch) -> None:
    monkeypatch.setattr(values.ValueClass, "_multiprocess", True, raising=False)
    batch = Batch()
    assert batch.interval_s is None
    registry = CollectorRegistry()  # a plain one: another process reading files does not flush this one
    cb = batch.count(Counter("c", "c", registry=registry))
    cb.inc()
    assert registry.get_sample_value("c_total") == 0
    await asyncio.sleep(0)
    assert registry.get_sample_value("c_total") == 1


def test_the_router_metrics_read_through_their_registry_see_every_request_counted() -> None:
    m = RouterMetrics()
    child = m.batch.count(m.requests.labels("r", "p", "a", "2xx"))
    child.inc()
    assert m.registry.get_sample_value("llm_router_requests_total",
                                       {"replica": "r", "policy": "p", "arm": "a", "code_class": "2xx"}) == 1
