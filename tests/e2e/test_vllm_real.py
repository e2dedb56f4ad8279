"""The real vLLM CPU servers behave the way the router and the simulator assume.

Talks to the servers directly with the official `openai` client (no router in between) and reads their real
`/metrics`. Servers come from the session fixture in conftest.py: index 0 is the small one (4 sequences, 2 MiB KV),
index 1 the roomy one.

Set ROUTEWISE_RECORD_VLLM_METRICS=<path> to save a /metrics page captured under load (how
tests/data/vllm_metrics_0.32.0.txt was made; see tests/data/README.md).
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.fleet.vllm import FLEET_ARGS, ROOMY, SERVED_MODEL_NAME, SMALL
from tests.e2e.conftest import OWN_MODELS

RECORDED_PAGE = Path(__file__).resolve().parents[1] / "data" / "vllm_metrics_0.32.0.txt"
SMALL_MAX_NUM_SEQS = int(FLEET_ARGS[SMALL][FLEET_ARGS[SMALL].index("--max-num-seqs") + 1])
SMALL_KV_TOKENS = 2 * 1024 * 1024 // 1024  # 2 MiB at 1 KiB per token (2 layers x K,V x 2 heads x 64 x bf16)
PROMPT = "Route the request to the replica with the shortest queue and the warmest prefix cache."
LONG_PROMPT = " ".join(f"{PROMPT} Step {i}." for i in range(6))  # well over two 32-token blocks


def client(base_url: str, timeout_s: float = 60.0) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)


def fetch_metrics(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5.0) as resp:
        return resp.read().decode()


@dataclass(frozen=True)
class Reading:
    """The values the router reads, taken from a page with prometheus_client's own parser (independent of router/)."""

    running: float
    waiting: float
    kv_usage: float
    generation_tokens: float
    prompt_tokens: float
    finished_length: float
    prefix_queries: float
    prefix_hits: float
    kv_blocks: int
    block_size: int


def read(page: str) -> Reading:
    values: dict[str, float] = {}
    finished_length = 0.0
    kv_blocks = block_size = -1
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "length":
                finished_length += s.value
            elif s.name == "vllm:cache_config_info":
                kv_blocks, block_size = int(s.labels["num_gpu_blocks"]), int(s.labels["block_size"])
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value

    def need(name: str) -> float:
        assert name in values, f"{name} missing from the /metrics page"
        return values[name]

    return Reading(
        running=need("vllm:num_requests_running"),
        waiting=need("vllm:num_requests_waiting"),
        kv_usage=need("vllm:kv_cache_usage_perc"),
        generation_tokens=need("vllm:generation_tokens_total"),
        prompt_tokens=need("vllm:prompt_tokens_total"),
        finished_length=finished_length,
        prefix_queries=need("vllm:prefix_cache_queries_total"),
        prefix_hits=need("vllm:prefix_cache_hits_total"),
        kv_blocks=kv_blocks,
        block_size=block_size,
    )


class MetricsSampler:
    """Reads /metrics on a thread from `__enter__` (after its first page) until `__exit__`; keeps (start time, page).

    A scrape that fails (a starved server can be slow to answer) is counted in `errors`, and sampling goes on.
    """

    def __init__(self, base_url: str, period_s: float = 0.05):
        self.base_url, self.period_s = base_url, period_s
        self.samples: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.samples.append((t, fetch_metrics(self.base_url)))
            except OSError as exc:  # URLError and timeouts are OSErrors
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.period_s)

    def pages_between(self, t0: float, t1: float) -> list[str]:
        """Pages whose scrape started in [t0, t1)."""
        return [page for t, page in self.samples if t0 <= t < t1]

    def __enter__(self) -> "MetricsSampler":
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not self.samples and time.monotonic() < deadline:  # sampling runs before any load is sent
            time.sleep(0.01)
        assert self.samples, f"no /metrics page from {self.base_url} in 30 s: {self.errors[-3:]}"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)


# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_both_servers_serve_the_tiny_model(vllm_servers):
    assert len(vllm_servers) == 2
    for url, own in zip(vllm_servers, OWN_MODELS):
        assert [m.id for m in client(url).models.list().data] == [SERVED_MODEL_NAME, own]


@pytest.mark.vllm
@pytest.mark.parametrize("server", [SMALL, ROOMY])
def test_completion_returns_exactly_max_tokens(vllm_servers, server):
    resp = client(vllm_servers[server]).completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 16
    assert resp.usage.prompt_tokens > 5
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].text


@pytest.mark.vllm
def test_streamed_completion_arrives_in_token_chunks(vllm_servers):
    stream = client(vllm_servers[ROOMY]).completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=24, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    text_chunks, finish, usage = 0, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text_chunks += bool(choice.text)
            finish = choice.finish_reason or finish
    assert usage is not None and usage.completion_tokens == 24
    assert finish == "length"
    assert text_chunks > 1  # streamed token by token, not one final blob


@pytest.mark.vllm
def test_chat_completion_non_streaming(vllm_servers):
    resp = client(vllm_servers[SMALL]).chat.completions.create(
        model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12, extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 12
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.role == "assistant"


@pytest.mark.vllm
def test_chat_completion_streaming(vllm_servers):
    stream = client(vllm_servers[ROOMY]).chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        max_tokens=20, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    content_chunks, usage = 0, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content_chunks += bool(choice.delta.content)
    assert usage is not None and usage.completion_tokens == 20
    assert content_chunks > 1


@pytest.mark.vllm
def test_repeated_prompt_hits_the_prefix_cache(vllm_servers):
    url = vllm_servers[ROOMY]
    prompt = LONG_PROMPT
    before = read(fetch_metrics(url))
    c = client(url)
    for _ in range(2):
        c.completions.create(model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=1)
    after = read(fetch_metrics(url))
    # the second request reuses the first one's full blocks; hits and queries are counted in tokens
    assert after.prefix_hits - before.prefix_hits >= 2 * after.block_size
    assert after.prefix_queries - before.prefix_queries >= 2 * (after.prefix_hits - before.prefix_hits)


@pytest.mark.vllm
def test_metrics_move_under_concurrent_load(vllm_servers):
    """24 150-token requests, 16 in flight at a time, on the 4-sequence server: it runs 4, queues the rest, fills its KV cache.

    The load lasts by construction: 6 rounds of 150 decode steps (about 3 s on an idle 2-core machine, several
    times that on a busy one), sampled from before the first request until the last one has finished. Each
    sequence (197 prompt + 150 tokens = 11 blocks) fits 4 at a time in the 64-block cache, so nothing is preempted.
    The prompts share a long prefix, so the queued ones hit the prefix cache the first ones filled.
    """
    url = vllm_servers[SMALL]
    n_requests, max_tokens = 24, 150
    before = read(fetch_metrics(url))
    # vLLM's server closes idle keep-alive connections; a pooled connection closed under the client is reported as
    # "Server disconnected without sending a response" (the request never reached vLLM). The client retries those,
    # as a real client would; the exact counter checks below still catch any request vLLM served twice.
    c = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=3, timeout=300.0)

    def one(i: int) -> int:
        resp = c.completions.create(
            model=SERVED_MODEL_NAME, prompt=f"{LONG_PROMPT} Request {i}.", max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )
        return resp.usage.completion_tokens

    with MetricsSampler(url) as sampler:
        t0 = time.monotonic()
        # 16 connections at a time (40 at once made vLLM's server drop a connection now and then): 12 queued at first
        with ThreadPoolExecutor(16) as pool:
            completed = list(pool.map(one, range(n_requests)))
        t1 = time.monotonic()
    pages = sampler.pages_between(t0, t1)
    readings = [read(p) for p in pages]
    load_s = t1 - t0
    print(f"\n{n_requests}x{max_tokens} tokens took {load_s:.1f}s; {len(readings)} scrapes during it, "
          f"{len(sampler.errors)} failed")

    assert completed == [max_tokens] * n_requests
    # at least one scrape per 2 s of load (and 5 in all): the peaks below come from a sampler that kept up
    assert len(readings) >= max(5.0, load_s / 2), \
        f"only {len(readings)} scrapes during {load_s:.1f}s of load; errors {sampler.errors[-3:]}"
    assert max(r.running for r in readings) > 1
    assert max(r.running for r in readings) <= SMALL_MAX_NUM_SEQS
    assert max(r.waiting for r in readings) > 0
    assert max(r.kv_usage for r in readings) > 0
    assert all(0.0 <= r.kv_usage <= 1.0 for r in readings)

    # counters account for exactly this load once it has drained
    deadline = time.monotonic() + 30.0
    after = read(fetch_metrics(url))
    while (after.running or after.waiting) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = read(fetch_metrics(url))
    assert (after.running, after.waiting) == (0, 0)
    assert after.generation_tokens - before.generation_tokens == n_requests * max_tokens
    assert after.finished_length - before.finished_length == n_requests
    # at least the queued requests reuse one full shared block each (hits are counted in tokens)
    assert after.prefix_hits - before.prefix_hits >= (n_requests - SMALL_MAX_NUM_SEQS) * after.block_size
    assert (after.kv_blocks, after.block_size) == (SMALL_KV_TOKENS // 32, 32)

    busy = [p for p, r in zip(pages, readings) if r.running > 1 and r.waiting > 0 and r.kv_usage > 0]
    assert busy, "no single scrape saw running>1, waiting>0 and KV usage>0 together"
    page = busy[len(busy) // 2]
    _assert_router_parser_agrees(page)
    if record_to := os.environ.get("ROUTEWISE_RECORD_VLLM_METRICS"):
        Path(record_to).write_text(page)


def _assert_router_parser_agrees(page: str) -> None:
    """The live router's parser must read a real page the same way prometheus_client does."""
    from routewise_vllm.router.observe.vllm_metrics import parse_vllm_metrics

    expected = read(page)
    stats = parse_vllm_metrics(page)
    assert stats.missing() == ()
    assert stats.running == expected.running
    assert stats.waiting == expected.waiting
    assert stats.kv_cache_usage == pytest.approx(expected.kv_usage)
    assert stats.kv_capacity_tokens == expected.kv_blocks * expected.block_size
    assert stats.prefix_cache_queries == pytest.approx(expected.prefix_queries)
    assert stats.prefix_cache_hits == pytest.approx(expected.prefix_hits)


def test_recorded_page_is_a_busy_real_vllm_page():
    """The golden page in tests/data was captured under load; no vLLM needed to check it."""
    page = RECORDED_PAGE.read_text()
    r = read(page)
    assert r.running > 1 and r.waiting > 0 and 0 < r.kv_usage <= 1
    assert r.prefix_hits > 0
    assert r.kv_blocks * r.block_size == SMALL_KV_TOKENS
    assert 'model_name="tiny"' in page and 'engine="0"' in page
    _assert_router_parser_agrees(page)
