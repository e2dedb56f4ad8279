"""The real router (`router serve`) in front of real vLLM CPU servers, driven by the official openai client.

- OpenAI endpoints pass through unchanged (completions, chat, streaming, /v1/models).
- Under load the router's own state (its /metrics gauges and /admin/replicas) follows the replicas' real /metrics,
  and `llm_router_requests_total` agrees request for request with each vLLM's own success counter.
- Failover: SIGKILL one replica's whole process group mid-load; nothing that had not yet received a byte fails,
  streams cut mid-way end promptly with an error, and traffic moves entirely to the survivor.
- The learned policy serves real traffic without falling back for bad reasons (skipped until a model ships).

Servers come from conftest.py (index 0 = SMALL: 4 sequences, 2 MiB KV; 1 = ROOMY). The failover test boots one
extra server of its own (tests/e2e/conftest.py launches it at the session's start, beside the shared pair) so the
shared ones stay up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from openai import APIConnectionError, APIError, AsyncOpenAI, NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.router.settings import replica_id

from routewise_vllm.fleet.router_process import RouterMetricsPage, RouterProcess, start_router
from routewise_vllm.fleet.vllm import (
    FLEET_ARGS,
    ROOMY,
    SERVED_MODEL_NAME,
    SMALL,
    _group_alive,
)

from tests.e2e.conftest import EXTRA_MAX_MODEL_LEN, EXTRA_STARTUP_TIMEOUT_S, LONG_STREAM_INTERVAL, OWN_MODELS

PROMPT = "Route the request to the replica with the shortest queue and the warmest prefix cache."
SMALL_MAX_NUM_SEQS = int(FLEET_ARGS[SMALL][FLEET_ARGS[SMALL].index("--max-num-seqs") + 1])
# A vLLM server decoding 16-24 sequences on a shared 2-core machine can take longer than 0.2 s to answer /metrics;
# the timeout equals the interval, so 0.5 s keeps scrapes succeeding and still gives 10+ per load.
FLEET_SCRAPE_INTERVAL_S = 0.5

pytestmark = pytest.mark.vllm


def openai_client(router: RouterProcess, timeout_s: float = 60.0) -> AsyncOpenAI:
    # no client retries: every retry seen here is the router's
    return AsyncOpenAI(base_url=f"{router.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)


@dataclass(frozen=True)
class VllmCounters:
    """What a vLLM server itself says it did, read from its /metrics with prometheus_client's parser."""

    succeeded: float
    generation_tokens: float
    running: float
    waiting: float
    kv_usage: float
    kv_capacity_tokens: int


def vllm_counters(base_url: str) -> VllmCounters:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10.0) as resp:
        page = resp.read().decode()
    values: dict[str, float] = {}
    capacity = -1
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                capacity = int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return VllmCounters(values["vllm:request_success_total"], values["vllm:generation_tokens_total"],
                        values["vllm:num_requests_running"], values["vllm:num_requests_waiting"],
                        values["vllm:kv_cache_usage_perc"], capacity)


@pytest.fixture(scope="module")
def log_dir(vllm_work_dir: Path) -> Path:
    return vllm_work_dir / "router-e2e"


@pytest.fixture(scope="module")
def fleet_router(vllm_servers, log_dir) -> Iterator[RouterProcess]:
    """The router over the two shared servers, least-outstanding, scraping every FLEET_SCRAPE_INTERVAL_S."""
    router = start_router(list(vllm_servers), "least-outstanding", log_dir, scrape_interval_s=FLEET_SCRAPE_INTERVAL_S)
    try:
        yield router
    finally:
        rc = router.stop()
    assert rc == 0, f"router did not drain and exit cleanly (rc={rc}); log:\n{router.log_tail()}"


# ------------------------------------------------------------------------------------------------------------------
# 1. The OpenAI API through the router
# ------------------------------------------------------------------------------------------------------------------


async def test_openai_endpoints_pass_through_the_router(fleet_router, vllm_servers):
    before = fleet_router.metrics()
    async with AsyncOpenAI(base_url=f"{vllm_servers[ROOMY]}/v1", api_key="unused", max_retries=0) as direct:
        direct_resp = await direct.completions.create(model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                                      extra_body={"ignore_eos": True})
    c = openai_client(fleet_router)
    async with c:
        assert sorted(m.id for m in (await c.models.list()).data) == sorted([SERVED_MODEL_NAME, *OWN_MODELS])

        resp = await c.completions.create(model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                          extra_body={"ignore_eos": True})
        # the same answer shape and token accounting as vLLM gives directly
        assert resp.model_dump().keys() == direct_resp.model_dump().keys()
        assert resp.usage == direct_resp.usage
        assert resp.usage.completion_tokens == 16 and resp.usage.prompt_tokens > 5
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + 16
        assert resp.choices[0].finish_reason == "length" and resp.choices[0].text
        assert resp.model == SERVED_MODEL_NAME and resp.id.startswith("cmpl-")

        stream = await c.completions.create(model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text_chunks, finish, usage = 0, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text_chunks += bool(choice.text)
                finish = choice.finish_reason or finish
        assert usage is not None and usage.completion_tokens == 24
        assert finish == "length" and text_chunks > 1  # relayed chunk by chunk, not one blob

        chat = await c.chat.completions.create(model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=12, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 12
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"

        stream = await c.chat.completions.create(
            model=SERVED_MODEL_NAME, max_tokens=20, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
            extra_body={"ignore_eos": True},
        )
        content_chunks, roles, usage = 0, set(), None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content_chunks += bool(choice.delta.content)
                roles.add(choice.delta.role)
        assert usage is not None and usage.completion_tokens == 20
        assert content_chunks > 1 and "assistant" in roles

        with pytest.raises(NotFoundError) as err:  # the router knows the served models from the replicas
            await c.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
        assert err.value.body["code"] == "model_not_found"

    page = fleet_router.metrics()
    ids = {replica_id(u) for u in vllm_servers}
    assert set(page.requests) <= ids
    # four generations, all 2xx; the 404 was answered by the router itself
    assert sum(page.requests_of(r) - before.requests_of(r) for r in ids) == 4
    assert sum(page.requests[r].get("2xx", 0) - before.requests.get(r, {}).get("2xx", 0) for r in page.requests) == 4


# ------------------------------------------------------------------------------------------------------------------
# 2. The router's state follows the replicas' real /metrics
# ------------------------------------------------------------------------------------------------------------------

GAUGES = ("llm_router_replica_waiting_requests", "llm_router_replica_running_requests",
          "llm_router_replica_kv_cache_usage_ratio", "llm_router_outstanding_requests")


class RouterSampler:
    """Reads the router's /metrics and /admin/replicas on a thread (independent of the test's busy event loop)
    from `__enter__` (after its first sample) until `__exit__`, keeping the peak of every gauge per replica."""

    def __init__(self, router: RouterProcess, ids: list[str], period_s: float = 0.05):
        self.router, self.ids, self.period_s = router, ids, period_s
        self.peaks = {name: {r: 0.0 for r in ids} for name in GAUGES}
        self.admin_peaks = {r: {"waiting": 0.0, "running": 0.0, "kv_cache_usage": 0.0} for r in ids}
        self.ages: list[float | None] = []
        self.routable: dict[str, set[bool]] = {r: set() for r in ids}  # /admin/replicas "routable" values seen
        self.times: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                page = self.router.metrics()
                admin = self.router.admin_replicas()
            except OSError as exc:  # a starved router can be slow to answer; keep sampling
                self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                self.times.append(t)
                for name in GAUGES:
                    for r in self.ids:
                        self.peaks[name][r] = max(self.peaks[name][r], page.gauge(name, r) or 0.0)
                for r in self.ids:
                    self.ages.append(page.gauge("llm_router_scrape_age_seconds", r))
                    self.routable[r].add(admin[r]["routable"])
                    for k in self.admin_peaks[r]:
                        self.admin_peaks[r][k] = max(self.admin_peaks[r][k], admin[r]["scrape"][k] or 0.0)
            self._stop.wait(self.period_s)

    def __enter__(self) -> "RouterSampler":
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not self.times and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.times, f"no router sample in 30 s: {self.errors[-3:]}"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)


async def test_router_state_follows_real_replica_metrics_under_load(fleet_router, vllm_servers):
    """40 concurrent 240-token requests, least-outstanding: about 20 per replica, so the 4-sequence one queues for
    5 rounds of 240 decode steps (about 3 s on an idle 2-core machine, longer on a busy one): requests wait there
    through several of the router's 0.5 s scrapes."""
    n_requests, max_tokens = 40, 240
    ids = [replica_id(u) for u in vllm_servers]
    small, roomy = ids[SMALL], ids[ROOMY]
    vllm_before = [vllm_counters(u) for u in vllm_servers]
    router_before = fleet_router.metrics()

    async with openai_client(fleet_router, timeout_s=300.0) as c:
        async def one(i: int) -> int:
            if i % 2:  # half streamed, half not
                stream = await c.completions.create(
                    model=SERVED_MODEL_NAME, prompt=f"{PROMPT} Request {i}.", max_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                usage = None
                async for chunk in stream:
                    usage = chunk.usage or usage
                return usage.completion_tokens
            resp = await c.completions.create(model=SERVED_MODEL_NAME, prompt=f"{PROMPT} Request {i}.",
                                              max_tokens=max_tokens, extra_body={"ignore_eos": True})
            return resp.usage.completion_tokens

        with RouterSampler(fleet_router, ids) as sampler:  # sampling starts before the load and ends after it
            t0 = time.monotonic()
            completed = await asyncio.gather(*(one(i) for i in range(n_requests)))
            t1 = time.monotonic()
    load_s = t1 - t0
    n_samples = sum(t0 <= t < t1 for t in sampler.times)
    peaks, admin_peaks = sampler.peaks, sampler.admin_peaks
    ages = sorted(a for a in sampler.ages if a is not None)
    assert len(ages) == len(sampler.ages), "a replica lost its scrape-age sample"

    assert completed == [max_tokens] * n_requests
    # at least one sample per 2 s of load (and 5 in all): the peaks come from a sampler that kept up
    assert n_samples >= max(5.0, load_s / 2), \
        f"only {n_samples} router samples during {load_s:.1f}s of load; errors {sampler.errors[-3:]}"
    # queueing on the small replica (4 sequences for ~20 requests) and work on both is visible in the router
    assert all(v == {True} for v in sampler.routable.values()), f"a replica left the rotation: {sampler.routable}"
    # scrapes every interval with the same timeout: on a starved CPU a few time out, but the stats stay fresh
    median_age = ages[len(ages) // 2]
    assert median_age < 3 * FLEET_SCRAPE_INTERVAL_S, f"median scrape age {median_age:.2f}s; ages {ages}"
    assert ages[-1] < 5.0, f"the stats got {ages[-1]:.2f}s old (a learned policy calls them stale at 10 s)"
    assert peaks["llm_router_replica_waiting_requests"][small] > 0, peaks
    assert 0 < peaks["llm_router_replica_running_requests"][small] <= SMALL_MAX_NUM_SEQS, peaks
    assert peaks["llm_router_replica_running_requests"][roomy] > 0, peaks
    for r in ids:
        assert 0 < peaks["llm_router_replica_kv_cache_usage_ratio"][r] <= 1.0, peaks
        assert peaks["llm_router_outstanding_requests"][r] > 0, peaks
        assert admin_peaks[r]["running"] > 0 and admin_peaks[r]["kv_cache_usage"] > 0, admin_peaks
    assert admin_peaks[small]["waiting"] > 0, admin_peaks

    # after the load: every gauge back to 0, in the router and in vLLM
    deadline = time.monotonic() + 30.0
    while True:
        page = fleet_router.metrics()
        idle = all(page.gauge(name, r) == 0 for name in GAUGES for r in ids)
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert idle, {name: page.gauges.get(name) for name in GAUGES}
    admin = fleet_router.admin_replicas()
    vllm_after = [vllm_counters(u) for u in vllm_servers]
    for r, v in zip(ids, vllm_after):
        s = admin[r]["scrape"]
        assert (s["waiting"], s["running"], s["kv_cache_usage"]) == (v.waiting, v.running, v.kv_usage) == (0, 0, 0)
        assert s["kv_capacity_tokens"] == v.kv_capacity_tokens > 0  # from vllm:cache_config_info
        assert s["age_s"] < 2.0 and s["error"] is None
        assert admin[r]["outstanding"] == 0

    # llm_router_requests_total agrees with what each vLLM says it completed, replica by replica
    for r, before, after in zip(ids, vllm_before, vllm_after):
        routed = page.requests_of(r) - router_before.requests_of(r)
        served = after.succeeded - before.succeeded
        assert routed == served > 0, f"{r}: router counted {routed}, vLLM completed {served}"
        assert page.requests[r].get("2xx", 0) - router_before.requests.get(r, {}).get("2xx", 0) == routed
    assert sum(page.requests_of(r) - router_before.requests_of(r) for r in ids) == n_requests
    assert sum(a.generation_tokens - b.generation_tokens for a, b in zip(vllm_after, vllm_before)) \
        == n_requests * max_tokens
    print(f"\nload of {n_requests}x{max_tokens} tokens took {load_s:.1f}s; router peaks {peaks}; "
          f"scrape age median {ages[len(ages) // 2]:.2f}s max {ages[-1]:.2f}s over {n_samples} samples; "
          f"scrape errors {page.scrape_errors}")


# ------------------------------------------------------------------------------------------------------------------
# 3. Failover when a replica dies mid-load
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # "short", "long" or "held" (see the failover test)
    stream: bool
    started: float
    ended: float = 0.0
    chunks: int = 0  # streamed chunks received before the end
    first_chunk: float | None = None  # when the first streamed chunk arrived
    ok: bool = False
    error: str | None = None


@dataclass
class FailoverLoad:
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def request(self, c: AsyncOpenAI, kind: str, stream: bool, max_tokens: int, prompt: str,
                      stream_interval: int | None = None) -> None:
        """One completion; its outcome says whether it succeeded and how many chunks came before any error."""
        o = Outcome(kind, stream, time.monotonic())
        self.outcomes.append(o)
        extra_body = {"ignore_eos": True}
        if stream_interval is not None:
            extra_body["stream_interval"] = stream_interval
        try:
            if stream:
                s = await c.completions.create(model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body=extra_body)
                usage = None
                async for chunk in s:
                    o.chunks += 1
                    if o.first_chunk is None:
                        o.first_chunk = time.monotonic()
                    usage = chunk.usage or usage
                o.ok = usage is not None and usage.completion_tokens == max_tokens
            else:
                r = await c.completions.create(model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                               extra_body=extra_body)
                o.ok = r.usage.completion_tokens == max_tokens
            if not o.ok:
                o.error = "incomplete answer"
        except (APIError, APIConnectionError) as exc:
            o.error = f"{type(exc).__name__}: {exc}"
        o.ended = time.monotonic()

    async def worker(self, c: AsyncOpenAI, w: int) -> None:
        """Back-to-back short requests, alternately streamed and not, until stopped."""
        i = 0
        while not self.stop.is_set():
            await self.request(c, "short", (w + i) % 2 == 0, 32, f"{PROMPT} w{w} #{i}")
            i += 1


async def test_failover_when_a_replica_is_killed_mid_load(extra_server, vllm_servers, log_dir):
    assert extra_server is not None
    server = extra_server.server
    loop = asyncio.get_running_loop()
    t_wait = time.monotonic()
    await loop.run_in_executor(None, server.wait_healthy, extra_server.launched_at + EXTRA_STARTUP_TIMEOUT_S)
    print(f"\nextra vLLM server healthy {time.monotonic() - extra_server.launched_at:.1f}s after launch "
          f"(waited {time.monotonic() - t_wait:.1f}s here)")
    survivor_url = vllm_servers[ROOMY]
    extra, survivor = replica_id(server.base_url), replica_id(survivor_url)
    # round-robin sends every other request to the doomed replica; probes every 0.25 s. A probe times out only on a
    # live but slow replica (a killed one refuses connections at once), so the timeout is generous: a vLLM server
    # streaming on a loaded 2-core machine can take over 0.5 s to answer /health, and must stay in rotation.
    router = start_router([server.base_url, survivor_url], "round-robin", log_dir,
                          env={"ROUTEWISE_HEALTH_INTERVAL_S": "0.25", "ROUTEWISE_HEALTH_TIMEOUT_S": "2.0"})
    n_long, long_tokens, n_workers, n_held = 4, EXTRA_MAX_MODEL_LEN - 256, 6, 6
    load = FailoverLoad()
    try:
        async with openai_client(router, timeout_s=30.0) as c:
            # the long streams go to the doomed replica only: drain the survivor while they start, then restore it
            router.admin_post(f"/admin/replicas/{survivor}/drain")
            longs = [asyncio.create_task(load.request(c, "long", True, long_tokens, f"{PROMPT} long {i}",
                                                      stream_interval=LONG_STREAM_INTERVAL))
                     for i in range(n_long)]
            # Wait on the router, not on the client: one asyncio client reading four fast streams can starve some
            # of them for seconds (a raw-socket client through the same router sees every first chunk within
            # ~0.2 s), so the client's first-chunk times say nothing about the relay. The router must have relayed
            # each long stream's first token (TTFT observed) while all of them are still open upstream.
            deadline = time.monotonic() + 30.0
            while True:
                at_first = await loop.run_in_executor(None, router.metrics)
                relayed = at_first.ttft_counts.get(extra, 0.0)
                if relayed >= n_long:
                    break
                assert time.monotonic() < deadline, f"the router relayed {relayed} of {n_long} first tokens in 30 s"
                await asyncio.sleep(0.05)
            t_relayed = time.monotonic()
            assert at_first.gauge("llm_router_outstanding_requests", extra) == n_long, (
                "some long streams finished upstream before the kill could test them; make them longer")
            assert router.admin_post(f"/admin/replicas/{survivor}/restore")["routable"] is True
            workers = [asyncio.create_task(load.worker(c, w)) for w in range(n_workers)]
            await asyncio.sleep(0.5)
            # non-streamed requests mid-generation at the kill: no byte has reached the client, so the ones on the
            # killed replica must be retried on the survivor
            held = [asyncio.create_task(load.request(c, "held", False, 200, f"{PROMPT} held {i}"))
                    for i in range(n_held)]
            await asyncio.sleep(0.3)
            before_kill = await loop.run_in_executor(None, router.metrics)
            assert before_kill.gauge("llm_router_replica_healthy", extra) == 1, (
                f"the doomed replica left the rotation before the kill: {router.admin_replicas()[extra]}")
            assert before_kill.gauge("llm_router_outstanding_requests", extra) >= n_long, before_kill.gauges
            long_running_at_kill = sum(not t.done() for t in longs)

            t_kill = time.monotonic()
            os.killpg(server.process.pid, signal.SIGKILL)
            gone_deadline = time.monotonic() + 10.0
            while _group_alive(server.process.pid) and time.monotonic() < gone_deadline:
                server.process.poll()
                await asyncio.sleep(0.05)
            assert not _group_alive(server.process.pid), "the killed server's process group is still alive"

            await asyncio.sleep(2.0)  # health probes and the breaker take the dead replica out
            shifted = await loop.run_in_executor(None, router.metrics)
            await asyncio.sleep(2.0)  # then all traffic must go to the survivor
            load.stop.set()
            await asyncio.wait_for(asyncio.gather(*workers, *held), 30.0)
            end = await loop.run_in_executor(None, router.metrics)
            # streams cut by the kill end promptly; the ones on the survivor finish
            await asyncio.wait_for(asyncio.gather(*longs), 60.0)
        admin = router.admin_replicas()
    finally:
        rc = router.stop()
        server.stop()

    shorts = [o for o in load.outcomes if o.kind == "short"]
    long_outcomes = [o for o in load.outcomes if o.kind == "long"]
    failed = [o for o in load.outcomes if not o.ok]
    failed_before_byte = [o for o in failed if o.chunks == 0]
    failed_after_byte = [o for o in failed if o.chunks > 0]
    print(f"\nfailover: sent {len(load.outcomes)} ({len(shorts)} short, {n_long} long, {n_held} held), "
          f"ok {len(load.outcomes) - len(failed)}, failed after first byte {len(failed_after_byte)} "
          f"({sum(o.kind == 'long' for o in failed_after_byte)} long), failed before first byte "
          f"{len(failed_before_byte)}; retries {end.retries - before_kill.retries:.0f}; "
          f"long streams running at kill {long_running_at_kill}, killed {t_kill - t_relayed:.1f}s after their first "
          f"tokens were relayed")

    assert rc == 0, f"router did not exit cleanly (rc={rc}); log:\n{router.log_tail()}"
    assert not failed_before_byte, [o.error for o in failed_before_byte]
    for o in failed_after_byte:  # only streams already under way on the killed replica may break ...
        assert o.started < t_kill, o
        assert o.ended - t_kill < 5.0, f"a broken stream took {o.ended - t_kill:.1f}s to end: {o}"
        assert "failed mid-stream" in (o.error or ""), o.error  # ... with the router's SSE error event
    # every long stream was under way on the killed replica: each broke, promptly, after its first byte
    assert long_running_at_kill == n_long, "a long stream finished before the kill; make them longer"
    assert all(o in failed_after_byte for o in long_outcomes), [o.error for o in long_outcomes]
    assert len(shorts) >= 20 and sum(o.ok for o in shorts if o.started > t_kill) >= 10
    assert all(o.ok for o in load.outcomes if o.kind == "held")

    # the retries happened in the router, and the dead replica got nothing once it was taken out
    assert end.retries > before_kill.retries
    assert end.upstream_errors.get(extra, 0) > before_kill.upstream_errors.get(extra, 0)
    assert end.requests_of(extra) == shifted.requests_of(extra)
    assert end.upstream_errors.get(extra, 0) == shifted.upstream_errors.get(extra, 0)
    assert end.requests_of(survivor) > shifted.requests_of(survivor)
    assert end.gauge("llm_router_replica_healthy", extra) == 0
    assert end.gauge("llm_router_replica_healthy", survivor) == 1
    # the dead replica's stats only age (failed scrapes leave them as they were); the survivor's stay fresh
    assert end.gauge("llm_router_scrape_age_seconds", extra) > end.gauge("llm_router_scrape_age_seconds", survivor)
    assert admin[extra]["routable"] is False and admin[extra]["outstanding"] == 0
    assert admin[survivor]["outstanding"] == 0


# ------------------------------------------------------------------------------------------------------------------
# 4. Policies on real traffic
# ------------------------------------------------------------------------------------------------------------------

BAD_FALLBACK_REASONS = ("exception", "nan", "masked_pick", "unavailable", "spec_mismatch", "stale_stats")


async def route_completions(servers, policy: str, log_dir: Path, n: int, max_tokens: int,
                            concurrency: int | None = None) -> tuple[list[int], RouterMetricsPage, dict]:
    """n completions (`max_tokens` each, ignore_eos) through a fresh router with `policy` in front of `servers`:
    the completion token counts, the router's /metrics page and its arms (admin), once it stopped cleanly."""
    router = start_router(list(servers), policy, log_dir)
    gate = asyncio.Semaphore(concurrency or n)
    try:
        async with openai_client(router) as c:
            async def one(i: int) -> int:
                async with gate:
                    resp = await c.completions.create(model=SERVED_MODEL_NAME, prompt=f"{PROMPT} {i}",
                                                      max_tokens=max_tokens, extra_body={"ignore_eos": True})
                    return resp.usage.completion_tokens

            completed = await asyncio.gather(*(one(i) for i in range(n)))
        page = router.metrics()
        arms = router.admin_policy()["arms"]
    finally:
        rc = router.stop()
    assert rc == 0, router.log_tail()
    return completed, page, arms


async def test_learned_policy_decides_real_traffic(vllm_servers, log_dir):
    """Over more decisions than the decision-budget rule judges at once, the shipped model decides most of the
    requests it is asked for; every other decision is a fallback counted under a known reason, none under a
    reason that means the model or its inputs are broken, and the compiled fast path serves where it is built.
    Most of all the decisions are the model's own, so a model over the CPU-time budget (the deciding thread's CPU
    time, which a busy host barely moves) fails it."""
    from routewise_vllm.router.policy import fastnet
    from routewise_vllm.router.policy.fallback import FALLBACK_REASONS

    n_requests = 150  # more than one budget window (100 decisions)
    completed, page, arms = await route_completions(vllm_servers, "learned", log_dir, n_requests, 2, concurrency=8)
    assert completed == [2] * n_requests
    assert arms["main"]["decisions"] == n_requests
    fallbacks = {k: v for k, v in page.fallbacks.items() if v}
    assert set(fallbacks) <= set(FALLBACK_REASONS), fallbacks
    bad = {k: v for k, v in fallbacks.items() if k in BAD_FALLBACK_REASONS}
    assert not bad, f"fallbacks for bad reasons {bad}; all {fallbacks}"
    by_model = n_requests - sum(fallbacks.values())
    # of every decision: a model over budget on every decision trips the rule on its 51st and decides 51 of 150
    assert by_model > n_requests / 2, (by_model, fallbacks)
    executor = arms["main"]["describe"]["primary"]["executor"]
    assert executor == ("fastnet" if fastnet.available() else "onnxruntime"), arms["main"]["describe"]


@pytest.mark.parametrize("policy", [
    "kv-aware",
    "learned",
])
async def test_policy_routes_real_traffic_without_bad_fallbacks(policy, vllm_servers, log_dir):
    n_requests = 16
    completed, page, arms = await route_completions(vllm_servers, policy, log_dir, n_requests, 48)
    assert completed == [48] * n_requests
    ids = [replica_id(u) for u in vllm_servers]
    assert sum(page.requests.get(r, {}).get("2xx", 0) for r in ids) == n_requests
    assert arms["main"]["decisions"] == n_requests and arms["main"]["last_error"] is None
    bad = {k: v for k, v in page.fallbacks.items() if k in BAD_FALLBACK_REASONS and v}
    assert not bad, f"{policy}: fallbacks for bad reasons {bad}; all {page.fallbacks}"
    if policy == "learned":
        (info,) = page.policy_info
        assert info["version"] != "builtin" and info["feature_hash"]
        # over_budget / low_confidence / overload_guard may happen; they must not be the rule
        assert sum(page.fallbacks.values()) < n_requests, page.fallbacks
    else:
        assert sum(page.fallbacks.values()) == 0, page.fallbacks
