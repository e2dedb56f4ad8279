"""The pure KV view on hand-made event sequences: store, remove, clear, gaps and replays, the cap, bad input."""

from __future__ import annotations

import math

from routewise_vllm.router.policy.kv_view import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVView, TokenBlocks, token_prefix_blocks,
)
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import RequestInfo

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4


def stored(hashes, parent, first_block: int, lora: str | None = None) -> BlockStored:
    n = len(hashes)
    return BlockStored(tuple(hashes), parent, tuple(TOKENS[first_block * BS:(first_block + n) * BS]), BS, None, lora, "GPU")


def view_with(*batches, replay: bool = False, **kw) -> KVView:
    v = KVView(**kw)
    v.attach("a", 0.0, replay=replay)
    for seq, events in enumerate(batches):
        v.apply("a", seq, events, 1.0)
    return v


REQ = token_prefix_blocks(TOKENS, BS)  # the prompt's own 6 blocks


def test_vllm_hashes_map_to_the_token_chain():
    # vLLM's hashes are its own (here b"h0".., made up): the view matches by the tokens, across events of a chain
    v = view_with([stored([b"h0", b"h1"], None, 0)], [stored([b"h2"], b"h1", 2)])
    assert len(REQ) == 6 and isinstance(REQ, TokenBlocks) and REQ.block_tokens == BS
    assert v.match_many(["a", "b"], REQ) == [3, 0]
    assert v.match_many(["a"], token_prefix_blocks([1] + TOKENS[1:], BS)) == [0]  # another first token: no match


def test_removal_cuts_the_chain_and_a_clear_empties_it():
    v = view_with([stored([b"h0", b"h1", b"h2"], None, 0)], [BlockRemoved((b"h1",), "GPU")])
    assert v.match_many(["a"], REQ) == [1]
    v.apply("a", 2, [AllBlocksCleared()], 2.0)
    assert v.match_many(["a"], REQ) == [0] and not v.stats("a").blocks
    assert v.fresh("a", 2.0)


def test_lora_blocks_match_only_their_adapter():
    v = view_with([stored([b"l0"], None, 0, lora="sql")])
    assert v.match_many(["a"], REQ) == [0]
    assert v.match_many(["a"], REQ, lora="sql") == [1]


def test_a_gap_without_replay_makes_the_view_stale_for_a_while():
    v = view_with([stored([b"h0"], None, 0)], stale_hold_s=5.0)
    assert v.apply("a", 3, [stored([b"h1"], b"h0", 1)], 10.0) is None  # 1 and 2 missed
    assert not v.fresh("a", 10.0) and v.fresh("a", 15.0)
    assert v.stats("a").gaps == 1
    assert v.match_many(["a"], REQ) == [2]  # applied all the same


def test_a_gap_with_replay_is_filled_in_order():
    v = view_with([stored([b"h0"], None, 0)], replay=True)
    assert v.apply("a", 3, [BlockRemoved((b"h1",), "GPU")], 2.0) == 1  # replay from 1
    assert not v.fresh("a", 100.0)
    v.apply("a", 4, [stored([b"h1"], b"h0", 1)], 2.1)  # live, during the replay: held
    v.apply("a", 1, [stored([b"h1"], b"h0", 1)], 2.2, replay=True)
    v.apply("a", 2, [stored([b"h2"], b"h1", 2)], 2.2, replay=True)
    v.apply("a", 3, [BlockRemoved((b"h1",), "GPU")], 2.2, replay=True)
    v.replay_done("a", 2.3, complete=True)
    assert v.fresh("a", 2.3) and v.stats("a").replays["complete"] == 1
    assert v.stats("a").last_seq == 4
    assert v.match_many(["a"], REQ) == [3]  # removed at 3, stored again at 4: in order (out of order: 1)


def test_a_replay_that_cannot_reach_back_leaves_the_view_stale():
    v = view_with([stored([b"h0"], None, 0)], replay=True, stale_hold_s=5.0)
    assert v.apply("a", 5, [], 2.0) == 1
    v.apply("a", 3, [], 2.1, replay=True)  # the buffer starts at 3: 1 and 2 are lost
    v.replay_done("a", 2.2, complete=True)
    assert not v.fresh("a", 2.2) and v.fresh("a", 7.3)
    assert v.stats("a").replays["incomplete"] == 1


def test_a_sequence_reset_is_a_restart_and_clears_the_view():
    v = view_with([stored([b"h0"], None, 0)], [stored([b"h1"], b"h0", 1)])
    v.apply("a", 0, [stored([b"x0"], None, 0)], 3.0)
    assert v.stats("a").clears == 1 and set(v.stats("a").blocks) == {b"x0"}
    assert v.fresh("a", 3.0)


def test_the_cap_drops_the_oldest_blocks_and_counts_them():
    v = view_with([stored([b"h0", b"h1", b"h2"], None, 0)], [stored([b"h3", b"h4"], b"h2", 3)], max_blocks=4)
    r = v.stats("a")
    assert len(r.blocks) == 4 and r.dropped == 1 and b"h0" not in r.blocks
    assert v.match_many(["a"], REQ) == [0]  # its first block forgotten: the chain is cut at the root


def test_bad_input_is_ignored_counted_and_marks_the_view_stale():
    v = view_with([stored([b"h0"], None, 0)], stale_hold_s=5.0)
    too_long = BlockStored((b"h1",), b"h0", tuple(range(BS + 1)), BS, None, None, "GPU")  # 5 tokens in a 4-block
    v.apply("a", 1, [too_long], 2.0)
    assert v.stats("a").ignored["bad_tokens"] == 1 and not v.fresh("a", 2.0) and v.fresh("a", 7.0)
    assert v.match_many(["a"], REQ) == [1]
    v.attach("a", 8.0, adapters=frozenset({"sql"}))
    v.apply("a", 2, [stored([b"z0"], None, 0, lora="chat")], 8.0)  # an adapter it does not serve
    assert v.stats("a").ignored["unknown_lora"] == 1 and not v.fresh("a", 8.0)
    v.apply("a", 3, [stored([b"q1"], b"unknown-parent", 1)], 20.0)  # stored before we subscribed
    assert v.stats("a").ignored["orphan"] == 1 and v.fresh("a", 20.0)
    v.apply("a", 4, [BlockStored((b"c0",), None, tuple(TOKENS[:BS]), BS, None, None, "CPU")], 21.0)
    assert v.stats("a").ignored["medium"] == 1 and b"c0" not in v.stats("a").blocks


def test_a_view_only_for_attached_replicas_and_a_lost_one_cleared_stale():
    v = KVView(stale_hold_s=5.0)
    v.apply("a", 0, [stored([b"h0"], None, 0)], 0.0)
    assert not v.fresh("a", 0.0) and v.stats("a") is None
    v.attach("a", 0.0)
    v.apply("a", 0, [stored([b"h0"], None, 0)], 0.0)
    v.clear("a", 1.0, stale=True)
    assert not v.fresh("a", 1.0) and v.fresh("a", 6.0) and v.match_many(["a"], REQ) == [0]


def _request(blocks) -> RequestInfo:
    return RequestInfo("r1", 100, 8, blocks)


def test_the_tracker_takes_fresh_views_and_guesses_for_stale_ones():
    cluster = ClusterTracker(["a", "b"])
    v = view_with([stored([b"h0", b"h1"], None, 0)], stale_hold_s=5.0)
    v.attach("b", 0.0)
    cluster.prefix_index.insert("b", REQ[:5])  # the guess says b holds 5 blocks (b never reported them)
    before = [r.prefix_match_blocks for r in cluster.view(1.0, _request(REQ)).replicas]
    assert before == [0, 5]  # no view yet: the guess
    cluster.kv_view = v
    assert [r.prefix_match_blocks for r in cluster.view(1.0, _request(REQ)).replicas] == [2, 0]
    assert cluster.match_sources == [1, 1, 0]
    v.reject("b", 1.0, "garbage")  # b stale: its guess, a's view
    assert [r.prefix_match_blocks for r in cluster.view(2.0, _request(REQ)).replicas] == [2, 5]
    assert cluster.match_sources == [1, 1, 1]
    # the character estimate's blocks are not the view's: the guess for every replica
    assert [r.prefix_match_blocks for r in cluster.view(10.0, _request(tuple(REQ))).replicas] == [0, 5]
    assert cluster.match_sources == [1, 2, 1]
    assert math.isfinite(v.stats("a").last_event_s)


def test_a_request_just_sent_counts_as_cached_until_its_events_could_say_so():
    """A dispatch's blocks count on its replica for the view's inflight_s (the replica has not prefilled them, so no
    event reports them yet); after that only the events do, and with inflight_s 0 they never count. The view's own
    matches are never lowered, and a stale view still takes the guess."""
    for inflight, at_1s, at_3s in ((2.0, [2, 6], [2, 0]), (0.0, [2, 0], [2, 0])):
        cluster = ClusterTracker(["a", "b"])
        v = view_with([stored([b"h0", b"h1"], None, 0)], stale_hold_s=5.0)
        v.inflight_s = inflight
        v.attach("b", 0.0)
        cluster.kv_view = v
        cluster.dispatch(1, _request(REQ), now_s=0.5)  # sent to b at 0.5 s
        cluster.dispatch(0, _request(REQ[:1]), now_s=0.5)  # and one block to a, below what a reported
        assert [r.prefix_match_blocks for r in cluster.view(1.0, _request(REQ)).replicas] == at_1s
        assert [r.prefix_match_blocks for r in cluster.view(3.0, _request(REQ)).replicas] == at_3s
    v.reject("b", 3.0, "garbage")
    assert [r.prefix_match_blocks for r in cluster.view(3.0, _request(REQ)).replicas] == [2, 6]  # the guess



def test_inflight_s_is_checked():
    import pytest

    with pytest.raises(ValueError, match="inflight_s must be >= 0, got -1"):
        KVView(inflight_s=-1)
