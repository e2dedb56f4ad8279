"""A replica's batch limit (vLLM's max_num_seqs) for late binding: the operator's where given, else inferred from
the replica's /metrics (router/batch_limit.py), exported as llm_router_replica_batch_limit{replica, source}."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.fleet.emulator import EmulatorSettings, make_app
from routewise_vllm.router.app import REPLICAS, ROUTER
from routewise_vllm.router.batch_limit import PROBE_SCRAPES, BatchLimitInference
from routewise_vllm.router.replicas import ReplicaSet
from routewise_vllm.router.settings import RouterSettings
from tests.router.conftest import wait_for

pytestmark = pytest.mark.timeout(180)


def observe(seq: list[tuple[int, int]]) -> int | None:
    inf = BatchLimitInference()
    for running, waiting in seq:
        inf.observe(running, waiting)
    return inf.limit


def test_the_running_count_plateaued_while_requests_wait_is_the_limit():
    assert observe([(4, 3), (4, 5)]) == 4
    assert observe([(8, 1), (8, 1), (8, 0)]) == 8


def test_a_burst_seen_once_is_not_a_plateau():
    # one scheduler step's token budget admitted 3 prompts and left 7 waiting; the next scrape runs 8
    assert observe([(3, 7), (8, 2), (8, 1)]) == 8
    assert observe([(3, 7)]) is None
    assert observe([(3, 7), (5, 4), (3, 2)]) is None  # no two scrapes in a row at one count


def test_nothing_waiting_never_infers_and_nothing_known_is_no_limit():
    assert observe([(5, 0)] * 10) is None
    assert observe([(None, 3), (4, None)]) is None  # type: ignore[list-item]


def test_a_larger_running_count_raises_it_and_it_never_falls():
    inf = BatchLimitInference()
    for running, waiting in [(4, 2), (4, 2), (2, 6), (2, 6), (3, 0)]:  # a KV-limited plateau lower later
        inf.observe(running, waiting)
    assert inf.limit == 4
    inf.observe(6, 0)  # no server runs more than its cap
    assert inf.limit == 6


def test_a_plateau_below_the_limit_is_probed_and_corrected():
    """Two scrapes at 7 with one waiting (the token budget's, not the cap's) infer 7 for a server of 8. Late binding
    then holds it at 7: seven running, nothing waiting. After PROBE_SCRAPES such scrapes one more may go, the server
    runs it, and the limit is 8."""
    inf = BatchLimitInference()
    for running, waiting in [(7, 1), (7, 1)]:
        inf.observe(running, waiting)
    assert (inf.limit, inf.cap) == (7, 7)
    for _ in range(PROBE_SCRAPES - 1):
        inf.observe(7, 0)
    assert (inf.cap, inf.probing) == (7, False)  # not yet: one scrape short
    inf.observe(7, 0)
    assert (inf.limit, inf.cap, inf.probing) == (7, 8, True)
    inf.observe(8, 0)  # the probe's request runs
    assert (inf.limit, inf.cap, inf.probing) == (8, 8, False)


def test_a_probe_into_the_real_limit_waits_and_ends():
    inf = BatchLimitInference()
    for running, waiting in [(8, 2), (8, 2)] + [(8, 0)] * PROBE_SCRAPES:
        inf.observe(running, waiting)
    assert (inf.limit, inf.cap) == (8, 9)
    inf.observe(8, 1)  # the ninth request waits at the server: 8 is its limit
    assert (inf.limit, inf.cap, inf.probing) == (8, 8, False)
    inf.observe(7, 0)  # below the limit: no run of full scrapes, no probe
    inf.observe(8, 0)
    assert inf.cap == 8
    inf = BatchLimitInference()
    for running, waiting in [(4, 1), (4, 1), (4, 0), (3, 0), (4, 0), (4, 0)]:  # the full scrapes must be in a row
        inf.observe(running, waiting)
    assert (inf.limit, inf.cap) == (4, 4)


def test_late_binding_holds_a_replica_to_its_cap():
    s = RouterSettings(replicas=["http://a:1", "http://b:2"], policy="least-outstanding",
                       late_binding_replica_max_num_seqs={"a:1": 3})
    reps = ReplicaSet(s.replica_config(), lambda: None)
    for running, waiting in [(5, 1), (5, 1)] + [(5, 0)] * PROBE_SCRAPES:
        reps.by_id["a:1"].batch.observe(running, waiting)
        reps.by_id["b:2"].batch.observe(running, waiting)
    assert reps.batch_cap("a:1") == 3  # the operator's, never probed
    assert (reps.batch_limit("b:2"), reps.batch_cap("b:2")) == ((5, "inferred"), 6)


def test_the_operators_limit_wins_over_the_inferred_one():
    s = RouterSettings(replicas=["http://a:1", "http://b:2", "http://c:3"], policy="least-outstanding",
                       late_binding_replica_max_num_seqs={"a:1": 3})
    reps = ReplicaSet(s.replica_config(), lambda: None)
    for rid in ("a:1", "b:2"):
        reps.by_id[rid].batch.observe(5, 1)
        reps.by_id[rid].batch.observe(5, 1)
    assert reps.batch_limit("a:1") == (3, "operator")
    assert reps.batch_limit("b:2") == (5, "inferred")
    assert reps.batch_limit("c:3") == (None, None)
    s = RouterSettings(replicas=["http://a:1", "http://b:2"], policy="least-outstanding",
                       late_binding_max_num_seqs=16, late_binding_replica_max_num_seqs={"a:1": 3})
    reps = ReplicaSet(s.replica_config(), lambda: None)
    assert (reps.batch_limit("a:1"), reps.batch_limit("b:2")) == ((3, "operator"), (16, "operator"))


@asynccontextmanager
async def emulated(max_num_seqs: int):
    """`fleet emulate --max-num-seqs N` in process (the same app the command serves)."""
    server = TestServer(make_app(EmulatorSettings(profile="llama3-8b-a100", max_num_seqs=max_num_seqs)),
                        host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def batch_limit_samples(client) -> dict[tuple[str, str], float]:
    resp = await client.get("/metrics")
    text = await resp.text()
    return {(s.labels["replica"], s.labels["source"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "llm_router_replica_batch_limit"}


@pytest.mark.parametrize("max_num_seqs", [4, 8])
@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
async def test_the_default_configuration_infers_the_emulated_servers_max_num_seqs(router_client, max_num_seqs):
    """No --policy, no limit given: the learned policy behind late binding sends everything while the limit is
    unknown, the emulator queues past its --max-num-seqs, the router infers exactly that, exports it, and from then
    on holds what exceeds it."""
    async with emulated(max_num_seqs) as emu:
        url = str(emu.make_url("")).rstrip("/")
        client = await router_client([url], policy="learned", scrape_interval_s=0.1, scrape_timeout_s=0.1,
                                     first_byte_timeout_s=60, late_binding_timeout_s=60)
        assert client.app[ROUTER].holds is not None  # late binding is on by default for the learned policy
        rid = client.app[REPLICAS].ordered[0].id
        assert await batch_limit_samples(client) == {}  # nothing known yet: no sample

        async def one(i: int) -> int:
            resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": f"p{i} " * 50,
                                                              "max_tokens": 120, "stream": True})
            await resp.read()
            return resp.status

        first = [asyncio.create_task(one(i)) for i in range(3 * max_num_seqs)]
        await wait_for(lambda: client.app[REPLICAS].batch_limit(rid)[1] == "inferred", timeout=90)
        assert await batch_limit_samples(client) == {(rid, "inferred"): float(max_num_seqs)}
        late = asyncio.create_task(one(99))  # the replica has more than its limit in flight: held now
        await wait_for(lambda: len(client.app[ROUTER].holds) == 1, timeout=30)
        assert await asyncio.gather(*first, late) == [200] * (3 * max_num_seqs + 1)
        assert client.app[REPLICAS].batch_limit(rid) == (max_num_seqs, "inferred")
