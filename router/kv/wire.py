"""vLLM's KV-cache events on the wire: decoding what a replica publishes (the emulator encodes them on its own,
fleet/emulator/kv_publish.py).

A ZMQ message is multipart `[topic, sequence (8 bytes, big-endian), payload]`; the payload is a msgpack
`KVEventBatch`, array-like `[ts, events, data_parallel_rank?]` (vllm/distributed/kv_events.py). Each event is a
msgpack map tagged by `type` (vLLM 0.32: `{"type": "BlockStored", "block_hashes": [...], ...}`, defaults omitted);
older vLLMs sent array-like events `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium]`, read too. Block hashes are ints or bytes. A replay answer ends with the sequence -1 and an empty payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from routewise_vllm.router.policy.kv_view import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

END_SEQ = -1  # a replay's last message
DEFAULT_MAX_EVENTS = 10_000  # per batch: vLLM publishes one batch per engine step
DEFAULT_MAX_PAYLOAD_BYTES = 8 << 20
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_decoder = msgspec.msgpack.Decoder()


class BadBatch(ValueError):
    """A message that is not a KV event batch; `reason` is one of kv_view.IGNORED_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Decoded:
    topic: bytes
    seq: int
    events: list[KVEvent]
    bad: dict[str, int]  # events left out, by reason (the rest of the batch is good)


def decode_frames(frames: Sequence[bytes], max_events: int = DEFAULT_MAX_EVENTS,
                  max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Decoded:
    """One ZMQ message. Raises BadBatch when the message as a whole is unreadable (its sequence, when readable, is
    in `.seq` of the exception's `partial`)."""
    if len(frames) != 3:
        raise BadBatch("garbage", f"{len(frames)} frames, not [topic, sequence, payload]")
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise BadBatch("garbage", f"a sequence of {len(seq_bytes)} bytes, not 8")
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    events, bad = decode_payload(payload, max_events, max_bytes)
    return Decoded(bytes(topic), seq, events, bad)


def decode_payload(payload: bytes, max_events: int = DEFAULT_MAX_EVENTS,
                   max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[list[KVEvent], dict[str, int]]:
    if len(payload) > max_bytes:
        raise BadBatch("huge_batch", f"{len(payload)} bytes (at most {max_bytes})")
    try:
        obj = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise BadBatch("garbage", f"not msgpack ({e})") from None
    if isinstance(obj, dict):
        raw = obj.get("events")
    elif isinstance(obj, list) and len(obj) >= 2:
        raw = obj[1]
    else:
        raise BadBatch("garbage", "not a KVEventBatch [ts, events, ...]")
    if not isinstance(raw, list):
        raise BadBatch("garbage", "the batch's events are not a list")
    if len(raw) > max_events:
        raise BadBatch("huge_batch", f"{len(raw)} events (at most {max_events})")
    events: list[KVEvent] = []
    bad: dict[str, int] = {}
    for item in raw:
        try:
            events.append(decode_event(item))
        except BadBatch as e:
            bad[e.reason] = bad.get(e.reason, 0) + 1
    return events, bad


def _hashes(v: Any, what: str) -> tuple:
    if not isinstance(v, list) or not all(isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in v):
        raise BadBatch("garbage", f"{what} is not a list of ints or bytes")
    return tuple(v)


def decode_event(item: Any) -> KVEvent:
    if isinstance(item, dict):
        kind = item.get("type")
        get = item.get
    elif isinstance(item, list) and item and isinstance(item[0], str):
        kind = item[0]
        fields = dict(zip(_STORED_FIELDS if kind == "BlockStored" else ("block_hashes", "medium"), item[1:]))
        get = fields.get
    else:
        raise BadBatch("garbage", "an event is neither a tagged map nor a tagged array")
    if kind == "BlockStored":
        parent = get("parent_block_hash")
        tokens = get("token_ids")
        bs = get("block_size")
        lora_id, lora_name, medium = get("lora_id"), get("lora_name"), get("medium")
        if parent is not None and (not isinstance(parent, (int, bytes)) or isinstance(parent, bool)):
            raise BadBatch("garbage", "parent_block_hash is not an int, bytes or null")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise BadBatch("garbage", "token_ids is not a list of ints")
        if type(bs) is not int or bs < 1:
            raise BadBatch("garbage", "block_size is not a positive int")
        if lora_id is not None and type(lora_id) is not int:
            raise BadBatch("garbage", "lora_id is not an int or null")
        if lora_name is not None and not isinstance(lora_name, str):
            raise BadBatch("garbage", "lora_name is not a string or null")
        if medium is not None and not isinstance(medium, str):
            raise BadBatch("garbage", "medium is not a string or null")
        return BlockStored(_hashes(get("block_hashes"), "block_hashes"), parent, tuple(tokens), bs, lora_id,
                           lora_name, medium)
    if kind == "BlockRemoved":
        medium = get("medium")
        if medium is not None and not isinstance(medium, str):
            raise BadBatch("garbage", "medium is not a string or null")
        return BlockRemoved(_hashes(get("block_hashes"), "block_hashes"), medium)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise BadBatch("unknown_kind", f"event type {str(kind)[:40]!r}")
