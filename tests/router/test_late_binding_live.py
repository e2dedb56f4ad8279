"""Live late binding (router/hold_queue.py): the real router app in front of fake vLLM replicas, loopback only.

`late_binding_max_num_seqs=1` makes one request in flight saturate a replica, so holds are easy to provoke.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from routewise_vllm.router.app import METRICS, PROXY, REPLICAS, ROUTER
from routewise_vllm.router.hold_queue import HoldQueue, late_binding_config
from routewise_vllm.router.policy import LeastOutstanding
from routewise_vllm.router.policy.pipeline import Pipeline, Routed
from routewise_vllm.router.policy.late_binding import DISPATCH_REASONS
from routewise_vllm.router.policy.types import RequestInfo
from routewise_vllm.router.replicas import ReplicaSet
from routewise_vllm.router.serving.decision_log import log_files
from routewise_vllm.router.settings import RouterSettings
from routewise_vllm.router.telemetry import RouterMetrics
from tests.router.conftest import wait_for

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

LATE = dict(late_binding=True, late_binding_max_num_seqs=1, late_binding_timeout_s=30.0)
# no periodic wake-ups (health probes, scrapes): only the events under test can release a held request
QUIET = dict(health_interval_s=30.0, scrape_interval_s=30.0)


def sample(client, name: str, **labels) -> float | None:
    return client.app[METRICS].registry.get_sample_value(name, labels)


def held(client) -> int:
    return len(client.app[ROUTER].holds)


def outstanding(client) -> int:
    return sum(r.tracker.outstanding for r in client.app[REPLICAS].ordered)


async def post(client, prompt: str, max_tokens: int = 1, stream: bool = True) -> tuple[int, str]:
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                      "stream": stream})
    return resp.status, await resp.text()


def prompts(fake) -> list[str]:
    return [b["prompt"] for b in fake.bodies]


async def test_held_while_saturated_then_dispatched_in_arrival_order(fakes, router_client, tmp_path):
    (a,) = await fakes(1, token_delay_s=0.05)
    end_a, end_z = a.hold("A"), a.hold("Z")  # both keep their slots until the test lets them finish
    client = await router_client([a.url], decision_log_dir=tmp_path, admin_token="tok",
                                 **{**LATE, **QUIET, "late_binding_max_num_seqs": 2})
    first = asyncio.create_task(post(client, "A", max_tokens=16))
    await wait_for(lambda: a.active == 1)
    busy = asyncio.create_task(post(client, "Z", max_tokens=50))  # the replica is never idle until Z ends
    await wait_for(lambda: a.active == 2)
    later, sent, seen_held = [], {}, {}
    for p in "BCD":  # one at a time, so the arrival order is known
        sent[p] = time.time()
        later.append(asyncio.create_task(post(client, p)))
        await wait_for(lambda n=len(later): held(client) == n)
        seen_held[p] = time.time()
    assert a.requests == 2  # B, C, D wait in the router, not on the replica
    assert sample(client, "llm_router_held_requests") == 3
    status = await (await client.get("/admin/status", headers={"Authorization": "Bearer tok"})).json()
    assert (status["held"], status["inflight"]) == (3, 5)
    freed_at = time.time()
    end_a.set()  # A's end frees a slot: B goes, and C and D each after the one before it completed
    results = await asyncio.gather(first, *later)
    assert [status for status, _ in results] == [200] * 4
    assert prompts(a) == ["A", "Z", "B", "C", "D"]  # FIFO, each as a slot frees (Z still runs)
    assert not busy.done()
    assert held(client) == 0 and sample(client, "llm_router_held_requests") == 0
    assert sample(client, "llm_router_hold_duration_seconds_count") == 3
    assert sample(client, "llm_router_late_dispatches_total", reason="room") == 4  # Z at once, B, C, D held
    assert sample(client, "llm_router_late_dispatches_total", reason="idle") == 1  # A
    end_z.set()
    assert (await busy)[0] == 200
    hold_sum = sample(client, "llm_router_hold_duration_seconds_sum")
    await client.close()  # flushes the decision log
    records = [json.loads(line) for f in log_files(tmp_path) for line in f.read_text().splitlines()]
    by_prompt = dict(zip("AZBCD", sorted(records, key=lambda r: int(r["id"][1:]))))
    assert (by_prompt["A"]["late"], by_prompt["A"]["held_s"]) == ("idle", 0.0)
    assert (by_prompt["Z"]["late"], by_prompt["Z"]["held_s"]) == ("room", 0.0)
    assert hold_sum == pytest.approx(sum(by_prompt[p]["held_s"] for p in "BCD"), abs=1e-5)  # the log's own figures
    rounding = 1e-5  # the log rounds times to the microsecond
    dispatched = []
    for p in "BCD":
        r = by_prompt[p]
        assert r["late"] == "room" and r["ttft_s"] >= r["held_s"] > 0  # holding counts in TTFT
        # `t` stays the arrival (replays read it so): after the test sent it, before the test saw it held ...
        assert sent[p] - rounding <= r["t"] <= seen_held[p] + rounding, (p, sent[p], r["t"], seen_held[p])
        # ... and the decision, held_s later, came after A's end freed a slot
        dispatched.append(r["t"] + r["held_s"])
        assert dispatched[-1] >= freed_at - rounding, (p, dispatched[-1], freed_at)
    assert dispatched == sorted(dispatched)  # in arrival order


async def test_queue_timeout_dispatches_to_the_busy_replica_and_is_counted(fakes, router_client):
    (a,) = await fakes(1, token_delay_s=0.05)
    end_a = a.hold("A")  # A keeps the only slot until the test ends it: only the queue's timer can send B
    client = await router_client([a.url], **{**LATE, **QUIET, "late_binding_timeout_s": 0.2})  # the timer wakes it
    first = asyncio.create_task(post(client, "A", max_tokens=40))
    await wait_for(lambda: a.active == 1)
    second = asyncio.create_task(post(client, "B"))
    await wait_for(lambda: held(client) == 1)
    await wait_for(lambda: a.requests == 2)  # sent while A still holds the replica
    assert not first.done()
    assert sample(client, "llm_router_late_dispatches_total", reason="timeout") == 1
    assert sample(client, "llm_router_hold_duration_seconds_sum") >= 0.2  # not before the timeout
    end_a.set()
    assert (await second)[0] == 200 and (await first)[0] == 200


async def test_a_full_queue_dispatches_the_arrival_at_once(fakes, router_client):
    (a,) = await fakes(1, token_delay_s=0.05)
    end_a = a.hold("A")
    client = await router_client([a.url], **{**LATE, "late_binding_queue_per_replica": 1})  # room for 1 held
    first = asyncio.create_task(post(client, "A", max_tokens=30))
    await wait_for(lambda: a.active == 1)
    second = asyncio.create_task(post(client, "B"))
    await wait_for(lambda: held(client) == 1)
    third = asyncio.create_task(post(client, "C"))
    await wait_for(lambda: a.requests == 2)  # C went straight to the replica, B still waits
    assert prompts(a) == ["A", "C"] and held(client) == 1 and not first.done()
    assert sample(client, "llm_router_late_dispatches_total", reason="full") == 1
    end_a.set()
    assert [r[0] for r in await asyncio.gather(first, second, third)] == [200] * 3
    assert prompts(a) == ["A", "C", "B"]


async def test_a_client_that_leaves_while_held_leaves_the_queue(fakes, router_client):
    (a,) = await fakes(1, token_delay_s=0.05)
    end_a = a.hold("A")
    client = await router_client([a.url], **LATE)
    first = asyncio.create_task(post(client, "A", max_tokens=16))
    await wait_for(lambda: a.active == 1)
    async with aiohttp.ClientSession() as s:
        gone = asyncio.create_task(s.post(client.make_url("/v1/completions"),
                                          json={"model": "tiny", "prompt": "B", "max_tokens": 1}))
        await wait_for(lambda: held(client) == 1)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
    await wait_for(lambda: held(client) == 0)
    assert sample(client, "llm_router_held_requests") == 0
    end_a.set()  # the slot frees only now, with B gone
    assert (await first)[0] == 200
    # held requests leave in arrival order: C, arriving after B, is answered only after B would have been sent
    assert (await post(client, "C", max_tokens=1))[0] == 200
    assert prompts(a) == ["A", "C"]  # B was never sent
    assert outstanding(client) == 0
    assert sample(client, "llm_router_hold_duration_seconds_count") == 0  # never dispatched


async def test_held_requests_are_answered_when_no_replica_is_healthy(fakes, router_client):
    (a,) = await fakes(1, token_delay_s=0.05)
    end_a = a.hold("A")  # A never frees the replica: only the failed probe can answer B
    client = await router_client([a.url], **LATE)
    first = asyncio.create_task(post(client, "A", max_tokens=40))
    await wait_for(lambda: a.active == 1)
    second = asyncio.create_task(post(client, "B"))
    await wait_for(lambda: held(client) == 1)
    a.health_ok = False  # the next probe (every 50 ms) takes the only replica out of rotation
    status, body = await second
    assert status == 503 and "no_healthy_replica" in body and not first.done()
    assert sample(client, "llm_router_late_dispatches_total", reason="no_healthy") == 1
    status, body = await post(client, "C")  # an arrival that finds none healthy is answered, and counted once
    assert status == 503 and "no_healthy_replica" in body
    assert sample(client, "llm_router_late_dispatches_total", reason="no_healthy") == 2
    a.health_ok = True
    end_a.set()
    await first


async def test_a_replica_restored_to_rotation_takes_the_held_request_at_once(fakes, router_client):
    a, b = await fakes(2, token_delay_s=0.05)
    client = await router_client([a.url, b.url], admin_token="tok", **{**LATE, **QUIET})
    auth = {"Authorization": "Bearer tok"}
    rid_b = b.url.removeprefix("http://")
    assert (await client.post(f"/admin/replicas/{rid_b}/drain", headers=auth)).status == 200
    end_a = a.hold("A")  # A does not end until the test lets it: only the restore can wake B
    first = asyncio.create_task(post(client, "A", max_tokens=40))  # on a, the only replica in rotation
    await wait_for(lambda: a.generation_tokens >= 2)  # past A's first token
    second = asyncio.create_task(post(client, "B"))
    await wait_for(lambda: held(client) == 1)
    assert (await client.post(f"/admin/replicas/{rid_b}/restore", headers=auth)).status == 200
    assert (await second)[0] == 200  # woken by the restore: A has not ended
    assert prompts(b) == ["B"] and not first.done()
    end_a.set()
    assert (await first)[0] == 200


async def test_a_held_request_outlives_the_removal_of_a_busy_replica(fakes, router_client):
    a, b = await fakes(2, token_delay_s=0.05)
    ends = {p: [f.hold(p) for f in (a, b)] for p in "AZ"}  # A and Z end when the test lets them
    client = await router_client([a.url, b.url], **{**LATE, **QUIET})
    first = asyncio.create_task(post(client, "A", max_tokens=40))
    await wait_for(lambda: a.active + b.active == 1)
    short = asyncio.create_task(post(client, "Z", max_tokens=10))  # on the other replica
    await wait_for(lambda: a.generation_tokens >= 2 and b.generation_tokens >= 2)
    gone, stays = (a, b) if prompts(a) == ["A"] else (b, a)
    second = asyncio.create_task(post(client, "B"))
    await wait_for(lambda: held(client) == 1)
    client.app[REPLICAS].remove(gone.url.removeprefix("http://"))  # discovery dropped it; A streams on
    # a request through the router's own event loop: whatever the removal scheduled there has run by its answer
    assert (await client.get("/health")).status == 200
    assert held(client) == 1  # the remaining replica is still busy: B waits, neither lost nor refused
    assert prompts(stays) == ["Z"]
    for end in ends["Z"]:
        end.set()
    assert (await second)[0] == 200  # taken when Z freed the remaining replica
    assert prompts(stays) == ["Z", "B"] and not first.done()
    for end in ends["A"]:
        end.set()
    assert (await short)[0] == 200 and (await first)[0] == 200


async def test_shutdown_dispatches_held_requests(fakes, router_client):
    (a,) = await fakes(1, token_delay_s=0.05)
    end_a = a.hold("A")  # A keeps the slot: only the shutdown can send B
    client = await router_client([a.url], **LATE)
    first = asyncio.create_task(post(client, "A", max_tokens=30))
    await wait_for(lambda: a.active == 1)
    second = asyncio.create_task(post(client, "B"))
    await wait_for(lambda: held(client) == 1)
    await client.app.shutdown()  # what `router serve` runs on SIGTERM before the drain
    await wait_for(lambda: a.requests == 2)
    assert held(client) == 0 and not first.done()
    assert sample(client, "llm_router_late_dispatches_total", reason="shutdown") == 1
    end_a.set()
    assert [r[0] for r in await asyncio.gather(first, second)] == [200, 200]


async def test_off_by_default_every_request_goes_at_once(fakes, router_client):
    (a,) = await fakes(1, token_delay_s=0.05)
    client = await router_client([a.url], late_binding_max_num_seqs=1)  # limits set, late binding not on
    assert client.app[ROUTER].holds is None
    ends = [a.hold(p) for p in "ABCD"]  # none ends before all four are on the replica
    tasks = [asyncio.create_task(post(client, p, max_tokens=8)) for p in "ABCD"]
    await wait_for(lambda: a.active == 4)  # all four on the replica together: nothing held
    for end in ends:
        end.set()
    assert [r[0] for r in await asyncio.gather(*tasks)] == [200] * 4
    assert sample(client, "llm_router_held_requests") == 0
    assert sample(client, "llm_router_hold_duration_seconds_count") == 0
    for reason in DISPATCH_REASONS:
        assert sample(client, "llm_router_late_dispatches_total", reason=reason) is None
    resp = await client.get("/metrics")
    text = await resp.text()
    for name in ("llm_router_held_requests", "llm_router_hold_duration_seconds", "llm_router_late_dispatches_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in text


async def test_a_request_routed_as_its_client_leaves_is_released():
    """The queue routed the head (tracker counts it) but the handler was cancelled before it resumed."""
    settings = RouterSettings(replicas=["http://127.0.0.1:9"], policy="least-outstanding", **LATE)
    replicas = ReplicaSet(settings.replica_config(), lambda: None)
    rep = replicas.ordered[0]
    rep.probe_ok = True
    rep.sync()
    routed, released = [], []

    class FakeRoute:
        def __init__(self, late):
            self.late = late

    class FakeRouter:  # router.routing.Router's part the queue uses: the pipeline's decision, dispatched
        def decide(self, info, *, view, room, started, held_s=None):
            out = Pipeline().decide(view, info, LeastOutstanding(), room=room)
            if type(out) is not Routed:
                return out
            replicas.cluster.dispatch(out.index, info)
            routed.append(info.request_id)
            return FakeRoute(out.late)

        def release(self, route):
            released.append(route)
            rep.tracker.on_complete("r2")

    q = HoldQueue(late_binding_config(settings), replicas, RouterMetrics(), replicas.clock, FakeRouter())
    await q.route(RequestInfo("r1", 10))  # idle fleet: goes at once, and now fills the replica
    task = asyncio.create_task(q.route(RequestInfo("r2", 10)))
    await wait_for(lambda: len(q) == 1)
    rep.tracker.on_complete("r1")  # room again ...
    q._pump()  # ... the head is routed (as a wake-up would) ...
    task.cancel()  # ... and its client leaves before the handler resumed
    with pytest.raises(asyncio.CancelledError):
        await task
    assert routed == ["r1", "r2"] and len(released) == 1
    assert rep.tracker.outstanding == 0 and len(q) == 0


@pytest.mark.timeout(90)
async def test_with_workers_each_holds_on_the_host_wide_load_and_sees_the_others_completions(fakes, tmp_path):
    from tests.router.test_workers import _metric, workers

    reps = await fakes(2, token_delay_s=0.05)
    cfg = tmp_path / "late.yaml"
    # no periodic scrapes or probes in the way: only the worker-sync tick can carry worker A's completions to B
    cfg.write_text("late_binding: true\nlate_binding_max_num_seqs: 1\nlate_binding_timeout_s: 30\n"
                   "scrape_interval_s: 30\nhealth_interval_s: 30\n")
    async with workers(reps, "--config", str(cfg)) as w:
        pid_a, pid_b = w.by_pid
        sb = w.by_pid[pid_b]
        a_long, a_short = await w.pinned(pid_a), await w.pinned(pid_a)
        body = {"model": "tiny", "prompt": "busy", "max_tokens": 60}
        ends = [f.hold("long") for f in reps]  # the long request ends when the test lets it
        long_ = asyncio.create_task(a_long.post(w.url + "/v1/completions", json={**body, "prompt": "long"}))
        await wait_for(lambda: reps[0].active + reps[1].active == 1)
        short = asyncio.create_task(a_short.post(w.url + "/v1/completions", json={**body, "max_tokens": 10}))
        await wait_for(lambda: reps[0].active + reps[1].active == 2)  # both replicas full, through worker A
        held_b = asyncio.create_task(sb.post(w.url + "/v1/completions", json={**body, "prompt": "B", "max_tokens": 1}))
        async with aiohttp.ClientSession() as any_worker:  # sb's one connection is the held request's
            for _ in range(400):  # an outer bound for a busy host: B's request reached worker B and is held there
                if await _metric(any_worker, w.url, "llm_router_held_requests") == 1:  # summed over workers
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("worker B never held the request")
        assert reps[0].requests + reps[1].requests == 2  # worker B holds on worker A's load
        resp = await asyncio.wait_for(held_b, 10)  # released once worker A's short request completed
        assert resp.status == 200
        assert not long_.done()
        for end in ends:
            end.set()
        assert (await (await short).read()) and (await (await long_).read())
        assert await _metric(sb, w.url, "llm_router_late_dispatches_total") >= 3
        w.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(w.proc.wait(), 20) == 0


async def test_turned_on_by_flag_or_environment_and_bad_values_named(monkeypatch, capsys):
    from routewise_vllm.router.cli import _parser, main
    from routewise_vllm.router.settings import build_settings

    # unset: on for a learned policy (the default, learned = any-fleet, or any other model), off for a baseline
    assert build_settings(replicas=["http://a:1"]).late_binding is True
    assert build_settings(replicas=["http://a:1"], policy="suite-fleet").late_binding is True
    assert build_settings(replicas=["http://a:1"], policy="least-outstanding").late_binding is False
    assert build_settings(replicas=["http://a:1"], policy="least-outstanding", late_binding=True).late_binding is True
    assert build_settings(replicas=["http://a:1"], late_binding=False).late_binding is False
    args = vars(_parser().parse_args(["serve", "--replica", "http://a:1", "--late-binding",
                                      "--late-binding-timeout", "0.5", "--late-binding-max-num-seqs", "8"]))
    s = build_settings(None, **{k: v for k, v in args.items() if k not in ("command", "config")})
    assert (s.late_binding, s.late_binding_timeout_s, s.late_binding_max_num_seqs) == (True, 0.5, 8)
    monkeypatch.setenv("ROUTEWISE_LATE_BINDING", "1")
    assert build_settings(replicas=["http://a:1"], policy="least-outstanding").late_binding is True
    assert main(["serve", "--replica", "http://a:1", "--late-binding-timeout", "-1"]) == 2
    assert "late_binding_timeout_s" in capsys.readouterr().err
    assert main(["serve", "--replica", "http://a:1", "--late-binding-max-num-seqs", "0"]) == 2
    assert "late_binding_max_num_seqs" in capsys.readouterr().err


async def test_a_replica_with_its_own_batch_cap_takes_that_many(fakes, router_client):
    """late_binding_replica_max_num_seqs: one server runs --max-num-seqs 3 where the rest run 1; the router fills
    each to its own cap and holds what is left."""
    a, b = await fakes(2, token_delay_s=0.05)
    b_id = b.url.split("://", 1)[1]
    client = await router_client([a.url, b.url], **{**LATE, **QUIET, "late_binding_replica_max_num_seqs": {b_id: 3}})
    ends = [f.hold(f"P{i}") for i in range(5) for f in (a, b)]  # nothing completes until all five are placed
    tasks = []
    for i in range(5):  # one at a time
        tasks.append(asyncio.create_task(post(client, f"P{i}", max_tokens=40)))
        await wait_for(lambda n=i + 1: a.requests + b.requests + held(client) == n)
    assert (a.requests, b.requests, held(client)) == (1, 3, 1)
    for end in ends:
        end.set()
    assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 5  # the held one left when a slot freed
    assert a.requests + b.requests == 5 and held(client) == 0


async def test_per_replica_caps_from_flags_or_environment_and_bad_ones_named(monkeypatch, capsys):
    from routewise_vllm.router.cli import _parser, main
    from routewise_vllm.router.settings import build_settings

    args = vars(_parser().parse_args(["serve", "--replica", "http://a:1", "--replica-max-num-seqs", "a:1=4",
                                      "--replica-max-num-seqs", "http://b:2=16"]))
    s = build_settings(None, **{k: v for k, v in args.items() if k not in ("command", "config")})
    assert s.late_binding_replica_max_num_seqs == {"a:1": 4, "b:2": 16}
    monkeypatch.setenv("ROUTEWISE_LATE_BINDING_REPLICA_MAX_NUM_SEQS", '{"http://c:3": 8}')
    assert build_settings(replicas=["http://a:1"]).late_binding_replica_max_num_seqs == {"c:3": 8}
    monkeypatch.setenv("ROUTEWISE_LATE_BINDING_REPLICA_MAX_NUM_SEQS", "a:1=4,b:2=8")  # or HOST:PORT=N, comma-separated
    assert build_settings(replicas=["http://a:1"]).late_binding_replica_max_num_seqs == {"a:1": 4, "b:2": 8}
    monkeypatch.delenv("ROUTEWISE_LATE_BINDING_REPLICA_MAX_NUM_SEQS")
    for bad, words in ((["a:1=0"], "'a:1'=0: need at least 1"), (["a:1"], "'a:1' is not HOST:PORT=N"),
                       (["nohost=4"], "'nohost' is not a replica's host:port"), (["a:1=x"], "a:1")):
        flags = [f for item in bad for f in ("--replica-max-num-seqs", item)]
        assert main(["serve", "--replica", "http://a:1", *flags]) == 2
        assert words in capsys.readouterr().err, bad


async def test_decision_latency_counts_the_view_the_hold_queue_built(fakes, router_client):
    """With late binding the hold queue builds the view the policy decides on; the decision latency metric
    (view + rule + policy) starts when that view was built (Router.decide's `started`), not after it."""
    (a,) = await fakes(1)
    client = await router_client([a.url], **{**LATE, **QUIET})

    def total() -> float:
        return sum(s.value for fam in client.app[METRICS].registry.collect() for s in fam.samples
                   if s.name == "llm_router_decision_latency_seconds_sum")

    before, earlier = total(), 10.0  # a view built 10 s before the decision
    route = client.app[ROUTER].decide(RequestInfo("x", 10), started=time.perf_counter() - earlier)
    await asyncio.sleep(0)  # observed by a callback once the request is on its way
    assert total() - before >= earlier
    client.app[ROUTER].release(route)
    status, _ = await post(client, "A")  # through the hold queue: counted once, from its own view
    assert status == 200 and 0 < total() - before - earlier < earlier  # not from the earlier `started` again


@pytest.mark.parametrize("room_in_time", [True, False])
@pytest.mark.slow  # over 5 s on 2 cores: outside the fast loop
async def test_a_replica_measured_faster_takes_more_awaiting_prefill_when_room_is_time(fakes, router_client, monkeypatch,
                                                                                      room_in_time):
    """Room in time (late_binding_room_in_time, the rule's speed_scales): the router measures a far faster TPOT on
    one replica, so that replica may hold more awaiting prompt tokens than the slow one (2x: the cap) before the
    router holds."""
    from routewise_vllm.router.policy import tracking

    monkeypatch.setattr(tracking, "TPOT_FLOOR_MIN_SAMPLES", 2)
    fast, slow = await fakes(2)
    fast.token_delay_s, slow.token_delay_s = 0.002, 0.1  # 50x apart: a busy host's loop delays cannot close the gap
    client = await router_client([fast.url, slow.url], **{**LATE, **QUIET, "late_binding_max_num_seqs": 100,
                                 "late_binding_max_batched_tokens": 100, "late_binding_room_in_time": room_in_time,
                                 "first_byte_timeout_s": 10.0})
    trackers = [client.app[REPLICAS].by_id[f.url.removeprefix("http://")].tracker for f in (fast, slow)]
    for _ in range(20):  # rounds of two short requests until the router has measured both speeds
        # (the second goes to the other replica while the first is in flight; a busy host may let the first
        # finish before, so the round repeats rather than assume where each went)
        first = asyncio.create_task(post(client, "w", max_tokens=4))
        sent = fast.requests + slow.requests
        await wait_for(lambda: fast.requests + slow.requests == sent + 1)
        await asyncio.gather(first, post(client, "w", max_tokens=4))
        if all(t.tpot_floor_s is not None for t in trackers):
            break
    assert [t.tpot_floor_s is not None for t in trackers] == [True, True]
    assert trackers[1].tpot_floor_s > 2 * trackers[0].tpot_floor_s  # at least the cap of the speed scale apart
    for f in (fast, slow):  # now every request awaits its first token for 3 s
        f.mode, f.first_byte_delay_s = "first_byte_delay", 3.0
    long_prompt = "x" * 480  # ~120 estimated tokens, above the 100-token limit on its own
    f0, s0 = fast.requests, slow.requests
    tasks = []
    for i in range(6):
        tasks.append(asyncio.create_task(post(client, long_prompt)))
        await wait_for(lambda n=i + 1: fast.requests + slow.requests + held(client) == n + f0 + s0)
    if room_in_time:  # the fast replica's limit is 2 x 100 tokens (the scale is capped at 2): two requests there
        assert (fast.requests - f0, slow.requests - s0, held(client)) == (2, 1, 3)
    else:  # 100 tokens each: one request apiece, the rest held
        assert (fast.requests - f0, slow.requests - s0, held(client)) == (1, 1, 4)
    assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 6


class _Answered:
    """A Downstream (router.http.transport) for calling Proxy.generate directly: records the whole answer."""

    def __init__(self, body: dict) -> None:
        self.headers: dict[str, str] = {}
        self.remote = "127.0.0.1"
        self.body = json.dumps(body).encode()
        self.status: int | None = None

    def respond(self, status: int, headers, body: bytes):
        self.status = status
        return status

    def stream(self, status: int, headers):
        raise AssertionError("a non-streamed request was answered as a stream")

    def refuse(self, resp):
        return resp


async def test_a_request_with_room_is_dispatched_before_its_task_runs_and_a_full_one_when_room_comes(
        fakes, router_client):
    (a,) = await fakes(1)
    end_a = a.hold("A")
    client = await router_client([a.url], **LATE, **QUIET)
    proxy = client.app[PROXY]
    first = _Answered({"model": "tiny", "prompt": "A", "max_tokens": 1})
    answer = proxy.generate(first, chat=False)
    assert outstanding(client) == 1 and held(client) == 0  # decided in the call, as without late binding
    running = asyncio.ensure_future(answer)
    await wait_for(lambda: prompts(a) == ["A"])
    second = _Answered({"model": "tiny", "prompt": "B", "max_tokens": 1})
    later = asyncio.ensure_future(proxy.generate(second, chat=False))
    assert outstanding(client) == 1  # the replica is full: not dispatched in the call
    await wait_for(lambda: held(client) == 1)  # its task queued it
    end_a.set()
    assert await running == 200 and await later == 200
    assert prompts(a) == ["A", "B"] and held(client) == 0 and outstanding(client) == 0
    assert sample(client, "llm_router_late_dispatches_total", reason="idle") == 2  # each found nothing in flight
