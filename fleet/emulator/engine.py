"""The simulator's replica model (`simulator.replica.Replica`) stepped in wall-clock time.

Driven only through the replica's public interface (add, abort, advance, tokens_generated, take_outputs).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from routewise_vllm.fleet.emulator.metrics import VllmMetrics
from routewise_vllm.simulator.config import LoraConfig, ReplicaGroup
from routewise_vllm.simulator.costmodel import load_profile
from routewise_vllm.simulator.replica import COMPLETE, DECODE, DONE, FIRST, ITER, WAITING, Replica, ReqState
from routewise_vllm.simulator.types import SimRequest


# ---------------------------------------------------------------- one request's stream


@dataclass(slots=True)
class Stream:
    """What the engine loop tells a request handler: tokens so far, when it finished, and a wake-up."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float  # wall clock (time.monotonic)
    generated: int = 0
    notified: int = 0  # tokens the handler has been woken for
    last_token_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    error: str | None = None  # set when the engine loop died
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


# ---------------------------------------------------------------- the replica model in wall-clock time


@dataclass(frozen=True)
class EmulatorSettings:
    profile: str = "llama3-8b-a100"
    model_name: str = "tiny"
    aliases: tuple[str, ...] = ()  # more served names of the same model (vLLM --served-model-name A B: A labels metrics)
    speed: float = 1.0  # emulated seconds per wall second
    slowdown: float = 1.0  # the replica's iteration-time multiplier (a slower GPU)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_blocks: int | None = None  # None: what the profile's memory leaves (vLLM's profiling)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the profile's
    stream_interval: int = 1  # tokens per streamed chunk, like vLLM's --stream-interval
    lora: tuple[str, ...] = ()  # LoRA adapters served besides the model (vLLM --lora-modules)
    max_loras: int = 1  # vLLM --max-loras: distinct adapters in one batch
    max_cpu_loras: int | None = None  # vLLM --max-cpu-loras (None: max_loras)
    lora_load_s: float = 0.1  # reading an adapter not in host memory (stalls the iteration needing it)
    lora_swap_s: float = 0.01  # copying an adapter into a GPU slot
    kv_events: str | None = None  # publish KV-cache events on this ZMQ endpoint (vLLM's --kv-events-config endpoint)
    kv_events_topic: str = "kv"
    kv_events_replay: str | None = None  # vLLM's replay_endpoint


class WallClockEngine:
    """Steps one `simulator.replica.Replica` in real time and hands tokens to the waiting streams.

    Simulated time is `(monotonic() - t0) * speed`. Iterations are planned one at a time
    (`closed_form=False`: no multi-step decode jumps) so every iteration's tokens can be emitted. An
    iteration that the host finishes late ends at the late time: the emulated GPU never outruns the
    machine. Aborts of scheduled requests wait for the end of the current iteration, when no KV block
    is half-allocated; waiting requests leave at once.
    """

    def __init__(self, settings: EmulatorSettings, clock=time.monotonic) -> None:
        if settings.speed <= 0:
            raise ValueError(f"speed must be > 0, got {settings.speed}")
        if settings.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {settings.stream_interval}")
        self.settings = settings
        self.profile = load_profile(settings.profile)
        group = ReplicaGroup(
            profile=settings.profile,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            block_size=settings.block_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enable_prefix_caching=settings.enable_prefix_caching,
            speed_factor=settings.slowdown,
            lora=LoraConfig(adapters=list(settings.lora), max_loras=settings.max_loras,
                            max_cpu_loras=settings.max_cpu_loras, load_s=settings.lora_load_s,
                            swap_s=settings.lora_swap_s) if settings.lora else None,
        )
        self.replica = Replica("0", group, self.profile, closed_form=False)
        if settings.kv_blocks is not None:
            self.replica.resize_kv(settings.kv_blocks)
        self.max_model_len = settings.max_model_len or self.profile.max_model_len
        self.clock = clock
        self.t0 = clock()
        self.streams: dict[ReqState, Stream] = {}
        self._pending_aborts: list[ReqState] = []
        self._kick = asyncio.Event()
        self._ids = itertools.count()
        self.metrics = VllmMetrics(
            settings.model_name, settings.block_size, self.replica.num_blocks, settings.enable_prefix_caching
        )
        self.metrics.bind_state(self)
        self._preemptions_seen = 0
        self.error: str | None = None
        self.kv = None  # a fleet.emulator.kv_publish.KVPublisher when it publishes KV events (set by the server)

    # ---- state read by the gauges
    @property
    def num_running(self) -> int:
        return len(self.replica.running)

    @property
    def num_waiting(self) -> int:
        return len(self.replica.waiting)

    @property
    def kv_usage(self) -> float:
        return self.replica.kv_usage()

    @property
    def lora_state(self) -> tuple[tuple[str, ...], tuple[str, ...], int] | None:
        return self.replica.lora_sample()

    def sim_now(self) -> float:
        return (self.clock() - self.t0) * self.settings.speed

    def wall_of(self, sim_s: float) -> float:
        return self.t0 + sim_s / self.settings.speed

    # ---- requests
    def validate(self, prompt_tokens: int, max_tokens: int) -> None:
        """vLLM's admission checks (400 on failure), plus the model's own: the request must fit the KV cache."""
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        if prompt_tokens + max_tokens - 1 > self.replica.kv_capacity_tokens:
            raise ValueError(
                f"request of {prompt_tokens} prompt + {max_tokens} output tokens does not fit the KV cache "
                f"({self.replica.kv_capacity_tokens} tokens)"
            )

    def submit(self, prompt_tokens: int, max_tokens: int, prefix_keys: tuple[int, ...],
               model: str | None = None) -> tuple[ReqState, Stream]:
        if self.error:
            raise RuntimeError(self.error)
        self.validate(prompt_tokens, max_tokens)
        rid = next(self._ids)
        bs = self.settings.block_size
        req = SimRequest(
            request_id=rid,
            arrival_s=0.0,
            prompt_tokens=prompt_tokens,
            output_tokens=max_tokens,
            block_ids=prefix_keys,
            block_tokens=bs,
            max_tokens=max_tokens,
            model=model,
        )
        now = self.sim_now()
        st = ReqState(req, rid, now, keys=prefix_keys)
        stream = Stream(f"{rid}", prompt_tokens, max_tokens, arrival=self.clock())
        self.streams[st] = stream
        self.replica.add(st, now)
        self._kick.set()
        return st, stream

    def abort(self, st: ReqState) -> None:
        """The client went away: free the request's slot and KV blocks."""
        stream = self.streams.pop(st, None)
        if stream is None or st.phase == DONE:
            return
        if st.phase == WAITING:
            self.replica.abort(st)
        else:
            self._pending_aborts.append(st)
            self._kick.set()

    # ---- the loop
    async def run(self) -> None:
        """The engine loop; if the model raises, every stream fails and the server reports unhealthy."""
        try:
            await self._run()
        except Exception as e:  # noqa: BLE001 - surfaced through /health and every request
            import traceback

            traceback.print_exc()
            self.error = f"engine loop failed: {e!r}"
            for stream in self.streams.values():
                stream.error = self.error
                stream.wake.set()
            raise

    async def _run(self) -> None:
        rep = self.replica
        while True:
            if rep.mode != ITER:
                if self._pending_aborts:
                    if outputs := self._advance_replica(self.sim_now()):
                        self._emit(rep, outputs)
                    continue
                self._kick.clear()
                await self._kick.wait()
                continue
            delay = self.wall_of(rep.event_s) - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            now = max(rep.event_s, self.sim_now())
            outputs = self._advance_replica(now)
            self._emit(rep, outputs)

    def _advance_replica(self, now: float) -> list:
        """Finish the replica's iteration, apply the aborts asked meanwhile, plan the next; its token events."""
        aborts = [st for st in self._pending_aborts if st.phase != DONE]
        self._pending_aborts.clear()
        self.replica.advance(now, aborts)
        if self.kv is not None:
            self.kv.flush()  # this iteration's stored and evicted blocks, one batch
        return self.replica.take_outputs()

    def _emit(self, rep: Replica, outputs: list) -> None:
        """Hand this iteration's tokens to the streams; one wake-up per stream per iteration at most."""
        wall = self.clock()
        m = self.metrics
        interval = self.settings.stream_interval
        new_tokens = 0
        if outputs:
            for kind, st, _t in outputs:
                stream = self.streams.get(st)
                if stream is None:
                    continue
                if kind == FIRST:
                    stream.first_token_at = wall
                    stream.cached_tokens = st.prefix_hit_tokens
                    m.ttft.observe(wall - stream.arrival)
                    m.queue_time.observe(max(0.0, (st.first_scheduled_s - st.dispatch_s) / self.settings.speed))
                    m.prompt_tokens.inc(st.prompt)
                    m.prefix_queries.inc(st.prompt)
                    if st.prefix_hit_tokens:
                        m.prefix_hits.inc(st.prefix_hit_tokens)
                elif kind == COMPLETE:
                    new_tokens += self._advance(stream, st.output, wall)
                    stream.finished_at = wall
                    del self.streams[st]
                    m.e2e.observe(wall - stream.arrival)
                    m.success_length.inc()
                    stream.wake.set()
        for st in rep.running:
            if st.phase == DECODE:
                stream = self.streams.get(st)
                if stream is None:
                    continue
                g = rep.tokens_generated(st)
                if g > stream.generated:
                    new_tokens += self._advance(stream, g, wall)
                    if g - stream.notified >= interval or stream.notified == 0:
                        stream.notified = g
                        stream.wake.set()
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
        if rep.n_preemptions != self._preemptions_seen:
            m.preemptions.inc(rep.n_preemptions - self._preemptions_seen)
            self._preemptions_seen = rep.n_preemptions

    def _advance(self, stream: Stream, g: int, wall: float) -> int:
        new = g - stream.generated
        if new <= 0:
            return 0
        if stream.last_token_at is not None:
            gap = (wall - stream.last_token_at) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        elif new > 1:
            for _ in range(new - 1):
                self.metrics.itl.observe(0.0)
        stream.generated = g
        stream.last_token_at = wall
        return new
