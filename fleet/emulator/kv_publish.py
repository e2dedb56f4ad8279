"""The emulator's tokens and its KV-cache events, as vLLM publishes them.

Tokens: a prompt's text in chunks of 4 characters, each chunk one token id (so the count is the estimator's
`ceil(len / 4)`); `POST /tokenize` answers these ids, and the prefix cache keys a prompt's KV blocks by the chain
hash of their ids (`router.policy.kv_view.token_prefix_blocks`), so what it publishes is what it tokenizes.

Events: the replica model's prefix cache (`simulator.replica.Replica.cache`, one entry per KV block here since the
emulator's id blocks are KV blocks) is observed; every entry added is a `BlockStored` (grouped by chain, with the
block's token ids and its parent), every entry evicted a `BlockRemoved`, sent after each engine iteration as one
batch: multipart `[topic, 8-byte big-endian sequence, msgpack KVEventBatch]` on a ZMQ PUB socket (vLLM's wire
format, router/kv/wire.py), with an optional replay ROUTER socket as vLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from typing import Any

import time
from typing import Sequence

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from routewise_vllm.router.policy.kv_view import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, token_prefix_blocks

CHARS_PER_TOKEN = 4
# the hashes the emulator publishes are not the router's own: a subscriber must map them, as with vLLM's
PUBLISHED_SALT = 0x2545_F491_4F6C_DD1D
REPLAY_BUFFER = 10_000


def token_ids(text: str) -> list[int]:
    """One id per 4 characters: a polynomial of the chunk's code points, below 2^31."""
    if not text:
        return []
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.uint64)
    pad = (-len(cps)) % CHARS_PER_TOKEN
    if pad:
        cps = np.concatenate([cps, np.zeros(pad, dtype=np.uint64)])
    c = cps.reshape(-1, CHARS_PER_TOKEN)
    mod = np.uint64(2**31 - 1)
    ids = np.zeros(len(c), dtype=np.uint64)
    for j in range(CHARS_PER_TOKEN):
        ids = (ids * np.uint64(1_114_111) + c[:, j]) % mod
    return ids.astype(np.int64).tolist()


def prefix_keys(ids: list[int], block_size: int) -> tuple[int, ...]:
    """The cache keys of a prompt's full KV blocks."""
    return token_prefix_blocks(ids, block_size, max_blocks=len(ids) // block_size + 1)


def published(key: int) -> int:
    return key ^ PUBLISHED_SALT


class _ObservedCache(dict):
    """The replica's prefix cache, telling the publisher what was added and evicted (the replica sets and deletes
    entries by key; nothing else changes it)."""

    def __init__(self, publisher: "KVPublisher") -> None:
        super().__init__()
        self.publisher = publisher

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.publisher.stored(key)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self.publisher.removed(key)


class KVPublisher:
    def __init__(self, endpoint: str, block_size: int, topic: str = "kv", replay_endpoint: str | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.block_size = block_size
        self.meta: OrderedDict[int, tuple[int | None, tuple[int, ...]]] = OrderedDict()  # key -> (parent, tokens)
        self.max_meta = 1 << 20
        self.pending: list[tuple[str, int]] = []
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        self.ctx = zmq.asyncio.Context()  # the replay socket's
        self.sync_ctx = zmq.Context()  # the PUB socket's: a send never waits (at the high-water mark it drops)
        self.pub = self.sync_ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay_sock = None
        if replay_endpoint is not None:
            self.replay_sock = self.ctx.socket(zmq.ROUTER)
            self.replay_sock.setsockopt(zmq.LINGER, 0)
            self.replay_sock.bind(replay_endpoint)
        self._replay_task: asyncio.Task | None = None

    def config(self) -> dict:
        """vLLM's /kv_event_sources entry of this engine."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "buffer_steps": REPLAY_BUFFER, "hwm": 100_000,
                "max_queue_size": 100_000, "topic": self.topic.decode()}

    def observe(self, replica) -> None:
        """Watch the replica model's prefix cache (after any resize, which replaces it)."""
        replica.cache = _ObservedCache(self)

    def register(self, keys: tuple[int, ...], ids: list[int]) -> None:
        """A request's blocks: what a BlockStored of each will carry."""
        bs = self.block_size
        parent = None
        for j, key in enumerate(keys):
            if key not in self.meta:
                self.meta[key] = (parent, tuple(ids[j * bs : (j + 1) * bs]))
            else:
                self.meta.move_to_end(key)
            parent = key
        while len(self.meta) > self.max_meta:
            self.meta.popitem(last=False)

    def stored(self, key: int) -> None:
        self.pending.append(("s", key))

    def removed(self, key: int) -> None:
        self.pending.append(("r", key))

    def flush(self) -> None:
        """Send what the last iteration changed as one batch."""
        if not self.pending:
            return
        events: list = []
        run: list[int] = []  # consecutive stored keys of one chain

        def close_run() -> None:
            if run:
                parent = self.meta.get(run[0], (None, ()))[0]
                tokens = [t for k in run for t in self.meta.get(k, (None, ()))[1]]
                events.append(BlockStored(tuple(published(k) for k in run),
                                          None if parent is None else published(parent), tuple(tokens),
                                          self.block_size, None, None, "GPU"))
                run.clear()

        for kind, key in self.pending:
            if kind == "s":
                if key not in self.meta:
                    continue  # not a block of a prompt it was told of (cannot happen in the emulator)
                if run and self.meta[key][0] != run[-1]:
                    close_run()
                run.append(key)
            else:
                close_run()
                if events and isinstance(events[-1], BlockRemoved):
                    events[-1] = BlockRemoved(events[-1].block_hashes + (published(key),), "GPU")
                else:
                    events.append(BlockRemoved((published(key),), "GPU"))
        close_run()
        self.pending.clear()
        if not events:
            return
        payload = encode_batch(events)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart(frames(self.topic, seq, payload), flags=zmq.NOBLOCK)

    def start(self) -> None:
        if self.replay_sock is not None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replays(), name="kv-replay")

    async def _serve_replays(self) -> None:
        """vLLM's replay protocol: [client, b"", start seq] -> every buffered batch from there, then seq -1."""
        sock = self.replay_sock
        while True:
            msg = await sock.recv_multipart()
            if len(msg) != 3:
                continue
            client, _, start = msg
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await sock.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await sock.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self.ctx.destroy(linger=0)
        self.sync_ctx.destroy(linger=0)


_encoder = msgspec.msgpack.Encoder()


def encode_event(ev: KVEvent) -> dict:
    """As vLLM 0.32 encodes it (vllm/distributed/kv_events.py): a map tagged by `type`."""
    if isinstance(ev, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(ev.block_hashes), "parent_block_hash": ev.parent_block_hash,
                "token_ids": list(ev.token_ids), "block_size": ev.block_size, "lora_id": ev.lora_id,
                "medium": ev.medium, "lora_name": ev.lora_name}
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {ev!r}")


def encode_batch(events: Sequence[KVEvent], ts: float | None = None, dp_rank: int = 0) -> bytes:
    """A KVEventBatch, array-like: [ts, events, data_parallel_rank]."""
    return _encoder.encode([time.time() if ts is None else ts, [encode_event(e) for e in events], dp_rank])


def frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big", signed=True), payload]


def endpoint_of(value: str) -> str:
    """`--kv-events PORT_OR_ENDPOINT`: a port binds tcp://*:PORT."""
    return f"tcp://*:{int(value)}" if value.isdigit() else value
