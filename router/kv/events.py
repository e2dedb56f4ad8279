"""The live KV view: subscribes to every replica's KV-cache events (vLLM's ZMQ publisher) and keeps
`router.policy.kv_view.KVView` up to date, off the request path.

Found by itself: each replica's `GET /kv_event_sources` names its publisher. An endpoint with a wildcard
(`tcp://*:5557`) is bound by the replica: the router connects to the replica's host at that port. A concrete
endpoint (`tcp://router:5557`) is one the replica connects to: the router binds `--kv-events-bind ADDR` and tells
replicas apart by their topic. One task per subscription reads batches at a bounded rate, decodes them and applies
them to the view; a sequence gap asks the replica's replay endpoint, when it has one, for what was missed. A replica
that loses its health has its view cleared (its next events show whether it kept its cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from yarl import URL

from routewise_vllm.router.kv.wire import END_SEQ, BadBatch, decode_frames, decode_payload
from routewise_vllm.router.logsafe import safe
from routewise_vllm.router.policy.kv_view import EVENT_KINDS, IGNORED_REASONS, KVView
from routewise_vllm.router.policy.tracking import MATCH_SOURCES
from routewise_vllm.router.kv.prompt_tokens import BLOCK_SOURCES, LocalTokenizer, PromptBlocks

log = logging.getLogger("router.kv_events")

REPLAY_TIMEOUT_S = 2.0
NO_SOURCE_RETRY_S = 60.0
WORKER_FLUSH_S = 1.0  # with --workers N: how often a worker adds its decisions' counts to the host's
RCVHWM = 10_000  # batches queued per subscription before ZMQ drops (a gap, then a replay or a stale view)
TOKENIZE_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


def connect_address(endpoint: str, replica_url: URL) -> str:
    """Where to connect for an endpoint the replica binds: its wildcard host replaced by the replica's host."""
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc:// and inproc:// are local to the replica's host
    hostport = endpoint[len("tcp://"):]
    host, _, port = hostport.rpartition(":")
    if host in ("*", "", "0.0.0.0", "::", "[::]"):
        host = replica_url.host or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    return f"tcp://{host}:{port}"


def binds(endpoint: str) -> bool:
    """vLLM's rule (ZmqEventPublisher._is_bind_endpoint): the replica binds a wildcard, ipc and inproc."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(slots=True)
class Source:
    replica_id: str
    endpoint: str  # as the replica reports it
    topic: bytes
    replay: str | None  # where to connect for replays


def parse_sources(answer: Any, replica_url: URL, replica_id: str) -> Source | None:
    """The first enabled ZMQ publisher of a /kv_event_sources answer ({engine: config}), or None."""
    if not isinstance(answer, dict):
        return None
    for engine in sorted(answer, key=str):
        cfg = answer[engine]
        if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events") or cfg.get("publisher") != "zmq":
            continue
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            continue
        topic = cfg.get("topic") if isinstance(cfg.get("topic"), str) else ""
        replay = cfg.get("replay_endpoint")
        replay = connect_address(replay, replica_url) if isinstance(replay, str) and replay else None
        if len(answer) > 1:
            log.warning("replica %s: %d engines publish KV events; the view follows engine %s only", replica_id,
                        len(answer), safe(str(engine)))
        return Source(replica_id, endpoint, topic.encode(), replay)
    return None


class RateLimit:
    """At most `rate` batches a second, in bursts of `rate` / 10: a flooding publisher waits (its excess is dropped
    by ZMQ's high-water mark and seen as a gap)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.burst = max(1.0, rate / 10)
        self.tokens = self.burst
        self.t = clock()

    async def take(self) -> None:
        if self.rate <= 0:
            return
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens < 1:
            await asyncio.sleep((1 - self.tokens) / self.rate)
            self.tokens = 1
            self.t = self.clock()
        self.tokens -= 1


class KVEvents:
    """Subscriptions, the view they feed and the request-side tokenization (`prompt_blocks`)."""

    def __init__(self, settings, replicas, registry: CollectorRegistry, session: Callable[[], aiohttp.ClientSession],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.replicas = replicas
        self.clock = clock
        self.session = session
        self.view = KVView(settings.kv_events_max_blocks, settings.kv_events_stale_hold_s,
                           settings.kv_events_inflight_s)
        self.ctx = zmq.asyncio.Context()
        self.tasks: dict[str, asyncio.Task] = {}  # connect topology: by replica id
        self.sources: dict[str, Source] = {}
        self.topics: dict[bytes, str] = {}  # bind topology: topic -> replica id
        self.unknown_topics = 0
        self.healthy: dict[str, bool] = {}
        self._retry: dict[str, float] = {}  # replicas without a publisher: when to ask again
        self._bind_task: asyncio.Task | None = None
        self._flush_task: asyncio.Task | None = None
        self._lora_models: frozenset[str] | None = None
        self._lora: dict[str, str] = {}
        self.tokenize_seconds = Histogram(
            "llm_router_tokenize_seconds", "Time to tokenize a request's prompt prefix for the KV view, in the "
            "background (requests meanwhile decide on a shorter cached prefix or the estimate): with the router's "
            "own tokenizer (source local) or a replica's /tokenize (replica).", ["source"], buckets=TOKENIZE_BUCKETS,
            registry=registry)
        local = LocalTokenizer(settings.tokenizer) if settings.tokenizer else None
        self.prompt_blocks = PromptBlocks(self.view.block_size, local, None if local else self._tokenize,
                                          lambda source, s: self.tokenize_seconds.labels(source).observe(s))
        registry.register(KVCollector(self))
        self._decision_counters: tuple[Counter, Counter] | None = None  # with --workers N (expose)
        self._flushed: dict[tuple[str, str], int] = {}

    def expose(self, registry: CollectorRegistry) -> None:
        """With --workers N: the view's figures on the host's registry (every worker follows the same publishers, so
        the worker that answers the scrape reports them), and each worker's per-decision counts (match sources,
        prompt block sources) summed over the workers through prometheus_client's multiprocess files."""
        registry.register(KVCollector(self, decisions=False))
        self._decision_counters = (
            Counter("llm_router_prefix_match_source", MATCH_SOURCE_HELP, ["source"], registry=None),
            Counter("llm_router_prompt_blocks", BLOCK_SOURCE_HELP, ["source"], registry=None),
        )
        for name in MATCH_SOURCES:
            self._decision_counters[0].labels(name)
        for name in BLOCK_SOURCES:
            self._decision_counters[1].labels(name)

    def flush_decisions(self) -> None:
        """Add the decisions counted since the last flush to the multiprocess counters (off the request path)."""
        if self._decision_counters is None:
            return
        match, blocks = self._decision_counters
        current = [(("match", name), n, match) for name, n in zip(MATCH_SOURCES, self.replicas.cluster.match_sources)]
        current += [(("blocks", name), self.prompt_blocks.sources.get(name, 0), blocks) for name in BLOCK_SOURCES]
        for key, n, counter in current:
            delta = n - self._flushed.get(key, 0)
            if delta > 0:
                counter.labels(key[1]).inc(delta)
                self._flushed[key] = n

    # ---- the replicas' cache view, installed on the cluster tracker
    def install(self, router) -> None:
        cluster = self.replicas.cluster
        cluster.kv_view = self.view
        cluster.kv_lora = self.lora_of
        router.prompt_blocks = self.prompt_blocks

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's model names (an entry with a parent in some replica's /v1/models)."""
        if model is None:
            return None
        if self._lora_models is not self.replicas.known_models:
            self._lora_models = self.replicas.known_models
            self._lora = {e["id"]: e["id"] for r in self.replicas.ordered for e in r.model_entries
                          if isinstance(e, dict) and e.get("parent") and isinstance(e.get("id"), str)}
        return self._lora.get(model)

    # ---- lifecycle
    async def run(self) -> None:
        if self.settings.kv_events_bind:
            self._bind_task = asyncio.create_task(self._bound(self.settings.kv_events_bind), name="kv-events-bind")
        if self._decision_counters is not None:
            self._flush_task = asyncio.create_task(self._flush_loop(), name="kv-events-flush")
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - one bad round does not end the subscriptions
                log.exception("kv events: refresh failed")
            await asyncio.sleep(self.settings.kv_events_refresh_s)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(WORKER_FLUSH_S)
            self.flush_decisions()

    async def refresh(self) -> None:
        """Find new replicas' publishers, clear the views of replicas that lost their health, drop removed ones."""
        now = self.clock()
        current = {r.id: r for r in self.replicas.ordered}
        for rid in [rid for rid in self.sources if rid not in current]:
            await self._drop(rid)
        for rid, rep in current.items():
            healthy = rep.probe_ok
            if self.healthy.get(rid, healthy) and not healthy:
                self.view.clear(rid, now, stale=True)  # restarted or gone: what it held is unknown
            self.healthy[rid] = healthy
        due = [rep for rid, rep in current.items()
               if rid not in self.sources and self.healthy[rid] and self._retry.get(rid, 0.0) <= now]
        await asyncio.gather(*(self._discover(rep) for rep in due))

    async def _discover(self, rep) -> None:
        try:
            async with self.session().get(rep.url / "kv_event_sources",
                                          timeout=aiohttp.ClientTimeout(total=self.settings.health_timeout_s * 2)) as resp:
                answer = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            answer = None
        src = parse_sources(answer, rep.url, rep.id)
        if src is None:  # not a vLLM with KV events (yet): asked again later, rarely
            self._retry[rep.id] = self.clock() + NO_SOURCE_RETRY_S
            return
        self.sources[rep.id] = src
        self.view.attach(rep.id, self.clock(), replay=src.replay is not None)
        if binds(src.endpoint):
            address = connect_address(src.endpoint, rep.url)
            log.info("replica %s: KV events from %s (topic %r)", rep.id, safe(address), src.topic)
            self.tasks[rep.id] = asyncio.create_task(self._connected(rep.id, address, src), name=f"kv-events-{rep.id}")
        elif self.settings.kv_events_bind:
            other = self.topics.get(src.topic)
            if other is not None and other != rep.id:
                log.warning("replicas %s and %s publish KV events on the same topic %r: neither is followed", other,
                            rep.id, src.topic)
                self.view.reject(rep.id, self.clock(), "unknown_topic")
                self.view.reject(other, self.clock(), "unknown_topic")
                self.topics[src.topic] = ""
                return
            self.topics[src.topic] = rep.id
            if src.replay is not None:
                self.view.attach(rep.id, self.clock(), replay=True)
            log.info("replica %s: KV events on %s, topic %r", rep.id, safe(self.settings.kv_events_bind), src.topic)
        else:
            log.warning("replica %s connects to %s to publish KV events: bind it with --kv-events-bind", rep.id,
                        safe(src.endpoint))
            self.view.detach(rep.id)

    async def _drop(self, rid: str) -> None:
        src = self.sources.pop(rid, None)
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if src is not None and self.topics.get(src.topic) == rid:
            del self.topics[src.topic]
        self.view.detach(rid)
        self.healthy.pop(rid, None)
        self._retry.pop(rid, None)

    async def close(self) -> None:
        for rid in list(self.sources):
            await self._drop(rid)
        for task in (self._bind_task, self._flush_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.flush_decisions()
        await self.prompt_blocks.close()
        self.ctx.destroy(linger=0)

    # ---- reading
    def _socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.kv_events_max_batch_bytes + 4096)
        return sock

    async def _connected(self, rid: str, address: str, src: Source) -> None:
        sock = self._socket()
        sock.setsockopt(zmq.SUBSCRIBE, src.topic)
        sock.connect(address)
        if src.replay is not None:  # what it cached before the router subscribed, as far as its buffer reaches
            self.view.follow_from(rid, 0)
        try:
            await self._read(sock, lambda topic: rid if topic == src.topic else None)
        finally:
            sock.close(linger=0)

    async def _bound(self, address: str) -> None:
        sock = self._socket()
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.bind(address)
        try:
            await self._read(sock, lambda topic: self.topics.get(topic) or None)
        finally:
            sock.close(linger=0)

    async def _read(self, sock: zmq.asyncio.Socket, replica_of: Callable[[bytes], str | None]) -> None:
        limit = RateLimit(self.settings.kv_events_max_batches_per_s, self.clock)
        while True:
            frames = await sock.recv_multipart(copy=True)
            await limit.take()
            self.handle(frames, replica_of)

    def handle(self, frames: list[bytes], replica_of: Callable[[bytes], str | None]) -> None:
        """One message: decoded and applied, or ignored and counted. Never raises."""
        now = self.clock()
        topic = frames[0] if frames else b""
        rid = replica_of(topic)
        if rid is None:
            self.unknown_topics += 1
            return
        view = self.view
        try:
            d = decode_frames(frames, self.settings.kv_events_max_batch_events, self.settings.kv_events_max_batch_bytes)
        except BadBatch as e:
            seq = _seq_of(frames)
            if seq is not None:
                self._start_replay(rid, view.apply(rid, seq, [], now))  # its place in the sequence is kept
            view.reject(rid, now, e.reason)
            return
        self._start_replay(rid, view.apply(rid, d.seq, d.events, now))
        for reason, n in d.bad.items():
            view.reject(rid, now, reason, n)

    # ---- replay
    def _start_replay(self, rid: str, start: int | None) -> None:
        if start is None:
            return
        src = self.sources.get(rid)
        if src is None or src.replay is None:
            self.view.replay_done(rid, self.clock(), complete=False)
            return
        asyncio.get_running_loop().create_task(self._replay(rid, src, start), name=f"kv-replay-{rid}")

    async def _replay(self, rid: str, src: Source, start: int) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        complete = False
        try:
            sock.connect(src.replay)
            await sock.send_multipart([b"", max(0, start).to_bytes(8, "big")])
            deadline = self.clock() + REPLAY_TIMEOUT_S
            while (left := deadline - self.clock()) > 0:
                if not await sock.poll(left * 1000):
                    break
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                seq = _seq_of(frames)
                if seq == END_SEQ:
                    complete = True
                    break
                if seq is None or len(frames) != 3:
                    self.view.reject(rid, self.clock(), "garbage")
                    continue
                try:
                    events, bad = decode_payload(frames[2], self.settings.kv_events_max_batch_events,
                                                 self.settings.kv_events_max_batch_bytes)
                except BadBatch as e:
                    self.view.reject(rid, self.clock(), e.reason)
                    events, bad = [], {}
                self.view.apply(rid, seq, events, self.clock(), replay=True)
        except (zmq.ZMQError, OSError) as e:
            log.warning("replica %s: KV event replay from %s failed: %s", rid, safe(src.replay or ""), safe(str(e)))
        finally:
            sock.close(linger=0)
            self.view.replay_done(rid, self.clock(), complete)

    # ---- /tokenize of a replica (no --tokenizer)
    async def _tokenize(self, model: str | None, body: dict) -> list[int] | None:
        members = self.replicas.members(model) if model else None
        candidates = [r for i, r in enumerate(self.replicas.ordered) if r.routable and (members is None or i in members)]
        if not candidates:
            return None
        rep = min(candidates, key=lambda r: r.tracker.outstanding)
        payload = dict(body, model=model) if model else body
        # the proxy's session sends no Content-Type of its own, and vLLM refuses a body without one (400)
        async with self.session().post(rep.url / "tokenize", data=json.dumps(payload),
                                       headers={"Content-Type": "application/json"},
                                       timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            if resp.status != 200:
                return None
            answer = await resp.json(content_type=None)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return None
        return tokens


def _seq_of(frames: list[bytes]) -> int | None:
    if len(frames) >= 2 and len(frames[1]) == 8:
        return int.from_bytes(frames[1], "big", signed=True)
    return None


MATCH_SOURCE_HELP = ("Routing decisions by where their prefix matches came from: precise (every replica's KV view), "
                     "guess (the router's approximate index), mixed (stale views guessed).")
BLOCK_SOURCE_HELP = ("Requests by where their prompt's token blocks came from: cached (its longest prefix tokenized "
                     "before), prefix (a shorter cached prefix; the longer one tokenized in the background), head (its "
                     "first 512 characters tokenized on the path by the router's own tokenizer, the rest in the "
                     "background), estimate (nothing cached, no tokenizer: the character estimate, the prefix asked "
                     "of a replica's /tokenize), ids (the request sent token ids).")
DECISION_FAMILIES = ("source", "blocks_source")


class KVCollector:
    """The view's counters and sizes, read at scrape time (the view itself stays pure)."""

    def __init__(self, kv: KVEvents, decisions: bool = True) -> None:
        """decisions: also the per-decision counts (match sources, prompt block sources); without them (--workers N)
        they come summed over the workers from the multiprocess counters."""
        self.kv = kv
        self.decisions = decisions

    def describe(self):
        return [f for k, f in self._families().items() if self.decisions or k not in DECISION_FAMILIES]

    @staticmethod
    def _families() -> dict:
        c, g = CounterMetricFamily, GaugeMetricFamily
        return {
            "events": c("llm_router_kv_events", "KV-cache events applied to the router's view, by replica and kind "
                        "(BlockStored, BlockRemoved, AllBlocksCleared).", labels=["replica", "kind"]),
            "ignored": c("llm_router_kv_events_ignored", "KV-cache event input ignored, by replica and reason "
                         "(garbage, unknown_kind, huge_batch, bad_tokens, unknown_lora, unknown_topic, orphan, medium, "
                         "replay_overflow); all but orphan and medium mark the view stale.", labels=["replica", "reason"]),
            "gaps": c("llm_router_kv_event_gaps", "Sequence gaps in a replica's KV events (missed batches).",
                      labels=["replica"]),
            "replays": c("llm_router_kv_event_replays", "Replays asked of a replica's replay endpoint, by outcome "
                         "(complete: the gap filled; incomplete: the view stale for a while).", labels=["replica", "outcome"]),
            "dropped": c("llm_router_kv_view_dropped_blocks", "Blocks the view forgot, oldest first, to stay within "
                         "kv_events_max_blocks.", labels=["replica"]),
            "blocks": g("llm_router_kv_view_blocks", "Blocks the router's KV view holds for the replica.",
                        labels=["replica"]),
            "age": g("llm_router_kv_view_age_seconds", "Seconds since the replica's last KV event batch (absent before "
                     "the first).", labels=["replica"]),
            "fresh": g("llm_router_kv_view_fresh", "1 when decisions take the replica's prefix match from its KV view, "
                       "0 while it is stale (a gap, bad input, lost health).", labels=["replica"]),
            "source": c("llm_router_prefix_match_source", MATCH_SOURCE_HELP, labels=["source"]),
            "unknown": c("llm_router_kv_events_unknown_topic", "KV event messages on the bound socket whose topic "
                         "names no replica."),
            "blocks_source": c("llm_router_prompt_blocks", BLOCK_SOURCE_HELP, labels=["source"]),
        }

    def collect(self):
        kv = self.kv
        now = kv.clock()
        f = self._families()
        events, ignored, gaps, replays, dropped = f["events"], f["ignored"], f["gaps"], f["replays"], f["dropped"]
        blocks, age, fresh, source, unknown = f["blocks"], f["age"], f["fresh"], f["source"], f["unknown"]
        for rid, r in list(kv.view.replicas.items()):
            for k in EVENT_KINDS:
                events.add_metric([rid, k], r.events.get(k, 0))
            for reason in IGNORED_REASONS:
                ignored.add_metric([rid, reason], r.ignored.get(reason, 0))
            gaps.add_metric([rid], r.gaps)
            for outcome in ("complete", "incomplete"):
                replays.add_metric([rid, outcome], r.replays.get(outcome, 0))
            dropped.add_metric([rid], r.dropped)
            blocks.add_metric([rid], len(r.blocks))
            if r.last_event_s is not None:
                age.add_metric([rid], max(0.0, now - r.last_event_s))
            fresh.add_metric([rid], 1.0 if kv.view.fresh(rid, now) else 0.0)
        unknown.add_metric([], kv.unknown_topics)
        yield from (events, ignored, gaps, replays, dropped, blocks, age, fresh, unknown)
        if self.decisions:
            for name, n in zip(MATCH_SOURCES, kv.replicas.cluster.match_sources):
                source.add_metric([name], n)
            blocks_source = f["blocks_source"]
            for name in BLOCK_SOURCES:
                blocks_source.add_metric([name], kv.prompt_blocks.sources.get(name, 0))
            yield from (source, blocks_source)
