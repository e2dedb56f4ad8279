"""What each replica's prefix cache holds, as the replica itself reports it (vLLM's KV-cache events).

Pure: the events arrive already decoded (router/kv/events.py decodes vLLM's wire format, the simulator may build them
directly) and every time is passed in. The interface:

    view = KVView(max_blocks=..., stale_hold_s=...)
    view.attach(replica_id, now_s, replay=False)        # a subscription exists: its (empty) view is fresh
    view.apply(replica_id, seq, events, now_s)          # one batch; returns a sequence to replay from, or None
    view.apply(replica_id, seq, events, now_s, replay=True) ... view.replay_done(replica_id, now_s, complete)
    view.clear(replica_id, now_s, stale=...)            # restarted or lost: nothing is known to be cached
    view.reject(replica_id, now_s, reason)              # bad input: ignored, counted, the view stale for a while
    view.fresh(replica_id, now_s) -> bool
    view.match_many(replica_ids, blocks, lora=None) -> list[int]   # as PrefixIndex.match_many
    view.stats(replica_id) -> ReplicaKV                 # counters and sizes, read by the metrics

The simulator's replicas key their cache by the router's chain hashes already: they report `KeyedBlocksStored`
(keys, no token ids), and `BlockRemoved` by those keys.

Block identity without vLLM's hash function: vLLM names a block by its own hash (sha256 bytes or an int), which the
router cannot recompute. The view maps each reported hash to the router's chain hash of the block's token ids:
`own = chain_hash(own(parent), token_bytes(block's token ids))` from 0 at the root, the same chain
`token_prefix_blocks` computes over a request's token ids. A request's blocks then match a replica's by set lookup.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Sequence, Union

from routewise_vllm.router.policy.estimate import chain_blocks, chain_hash

# vLLM's ExternalBlockHash: sha256 bytes by default, an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
BlockHash = Union[bytes, int]
EVENT_KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# Ignored-input reasons (decode-level reasons come from router/kv/events.py and go through `reject`)
IGNORED_REASONS = ("garbage", "unknown_kind", "huge_batch", "bad_tokens", "unknown_lora", "unknown_topic",
                   "orphan", "medium", "replay_overflow")
DEFAULT_MAX_BLOCKS = 1 << 20  # per replica: 2^20 blocks of 16 tokens = 16M tokens, ~100 MB of view
DEFAULT_STALE_HOLD_S = 30.0
# A block sent to a replica counts as cached there for this long before its KV events can report it (the request
# waits and prefills first): without it a burst on one document sees the document cached nowhere and spreads
# (uniform-rag-16 behind the precise view, docs/kv-events.md). llm-d's precise scorer adds speculative entries alike.
DEFAULT_INFLIGHT_S = 2.0
MAX_PENDING_BATCHES = 4096  # live batches held while a replay runs
_CACHED_MEDIA = (None, "GPU")  # offloaded copies (CPU, STORAGE) are not prefix-cache hits of the engine


# ---------------------------------------------------------------- decoded events


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]  # every stored block's tokens, concatenated: len(block_hashes) * block_size
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class KeyedBlocksStored:
    """Blocks already named by the router's own chain hashes (each the hash of its whole prefix, as a request's
    prefix blocks are, so no parent is needed): what the simulator's replicas report, since they key their cache so.
    Each key is its own block hash too (a later `BlockRemoved` names it by the key)."""

    keys: tuple[int, ...]
    lora_name: str | None = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared, KeyedBlocksStored]


# ---------------------------------------------------------------- the router's block hashes


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian unsigned integers: what the chain hash reads. Raises ValueError (or
    OverflowError) on an id outside 0..2^32-1."""
    a = array("I", token_ids)
    if a.itemsize != 4:  # pragma: no cover - every platform we build on has a 4-byte unsigned int
        a = array("L", token_ids)
    if array("I").itemsize == 4 and not _little_endian():  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def _little_endian() -> bool:
    import sys

    return sys.byteorder == "little"


class TokenBlocks(tuple):
    """A request's prefix blocks hashed from its token ids (not the character estimate), in blocks of
    `block_tokens` tokens: the only blocks a KV view can match. Still a plain tuple to every policy."""

    block_tokens: int

    def __new__(cls, hashes: Sequence[int], block_tokens: int) -> "TokenBlocks":
        self = super().__new__(cls, hashes)
        self.block_tokens = block_tokens
        return self

    def __reduce__(self):  # pickles (decision records, process pools) as what it is
        return (TokenBlocks, (tuple(self), self.block_tokens))


def token_prefix_blocks(token_ids: Sequence[int], block_tokens: int, max_blocks: int = 1024) -> TokenBlocks:
    """Chained hashes of the full `block_tokens`-token blocks of a prompt's token ids (the partial tail excluded, as
    vLLM caches full blocks only), at most `max_blocks`."""
    n = min(len(token_ids) // block_tokens, max_blocks)
    data = token_bytes(token_ids[: n * block_tokens])
    width = 4 * block_tokens
    if chain_blocks is not None:
        return TokenBlocks(chain_blocks(data, width, n), block_tokens)
    out, parent = [], 0
    for i in range(n):
        parent = chain_hash(parent, data[i * width : (i + 1) * width])
        out.append(parent)
    return TokenBlocks(out, block_tokens)


# ---------------------------------------------------------------- one replica's view


@dataclass(slots=True)
class ReplicaKV:
    """One replica's blocks and counters. `blocks` maps vLLM's hash to (own hash, LoRA key), oldest first."""

    attached: bool = False
    replay: bool = False  # the replica has a replay endpoint
    last_seq: int | None = None
    last_event_s: float | None = None  # when the last batch was applied
    stale_until: float = 0.0  # fresh from this time on (inf: until a replay ends)
    replaying: bool = False
    replay_from: int = 0  # the first sequence number the running replay must bring
    replay_ok: bool = True  # so far it brought every batch from replay_from on
    pending: list = field(default_factory=list)  # (seq, events) that arrived live during a replay
    blocks: OrderedDict = field(default_factory=OrderedDict)
    own: dict = field(default_factory=dict)  # LoRA key -> {own hash: vLLM hashes mapped to it}
    block_size: int | None = None
    adapters: frozenset[str] | None = None  # the LoRA adapters it serves (None: not checked)
    events: Counter = field(default_factory=Counter)  # by kind
    ignored: Counter = field(default_factory=Counter)  # by reason
    gaps: int = 0
    replays: Counter = field(default_factory=Counter)  # complete / incomplete
    dropped: int = 0  # blocks forgotten for the cap, oldest first
    clears: int = 0


class KVView:
    """Per replica and per LoRA adapter, the router's chain hashes of the blocks the replica reported cached."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, stale_hold_s: float = DEFAULT_STALE_HOLD_S,
                 inflight_s: float = DEFAULT_INFLIGHT_S) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        if not inflight_s >= 0:
            raise ValueError(f"inflight_s must be >= 0, got {inflight_s}")
        self.max_blocks = max_blocks
        self.stale_hold_s = stale_hold_s
        self.inflight_s = inflight_s  # read by router.policy.tracking: what was sent lately counts as cached
        self.replicas: dict[str, ReplicaKV] = {}

    # ---- lifecycle
    def attach(self, replica_id: str, now_s: float, replay: bool = False, adapters: frozenset[str] | None = None) -> None:
        """A subscription to the replica exists. Its view starts empty and fresh (what was cached before the router
        subscribed is unknown: a replay endpoint, when there is one, is asked for its whole buffer)."""
        r = self.replicas.setdefault(replica_id, ReplicaKV())
        r.attached, r.replay, r.adapters = True, replay, adapters

    def follow_from(self, replica_id: str, seq: int) -> None:
        """Expect the replica's next batch to be `seq` (0 with a replay endpoint: a first batch later than that asks
        for everything still in the publisher's buffer)."""
        r = self.replicas.get(replica_id)
        if r is not None and r.last_seq is None:
            r.last_seq = seq - 1

    def detach(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def clear(self, replica_id: str, now_s: float, stale: bool = False) -> None:
        """Nothing is known cached on the replica (it restarted, cleared its cache, or went away). `stale`: and the
        view is not trusted for a while (the replica was lost, its next events may not follow on)."""
        r = self.replicas.get(replica_id)
        if r is None:
            return
        r.blocks.clear()
        r.own.clear()
        r.clears += 1
        r.last_seq = None
        r.replaying, r.pending = False, []
        if stale:
            r.stale_until = max(r.stale_until if r.stale_until != math.inf else 0.0, now_s + self.stale_hold_s)
        else:
            r.stale_until = 0.0

    def reject(self, replica_id: str, now_s: float, reason: str, n: int = 1) -> None:
        """Input from the replica that was ignored: counted, and the view stale for stale_hold_s."""
        r = self.replicas.get(replica_id)
        if r is None:
            return
        r.ignored[reason] += n
        if r.stale_until != math.inf:
            r.stale_until = max(r.stale_until, now_s + self.stale_hold_s)

    # ---- events
    def apply(self, replica_id: str, seq: int, events: Sequence[KVEvent], now_s: float, replay: bool = False) -> int | None:
        """Apply one batch. Returns the sequence number to replay from when a gap needs the replay endpoint.

        Live batches follow on (seq = last + 1); a lower or equal seq is the publisher restarted (its counter starts
        at 0): the view is cleared first. A gap marks the view stale: until a replay fills it, or for stale_hold_s
        without a replay endpoint (the batch is applied either way). Replayed batches (`replay=True`) fill in;
        `replay_done` ends the replay and applies what arrived live meanwhile."""
        r = self.replicas.get(replica_id)
        if r is None or not r.attached:
            return None
        if replay:
            if not r.replaying or (r.last_seq is not None and seq <= r.last_seq):
                return None  # not asked for, or already applied
            if seq > (r.replay_from if r.last_seq is None else r.last_seq + 1):
                r.replay_ok = False  # the publisher's buffer no longer reaches back: the gap stays
            self._apply(r, events, now_s)
            r.last_seq = seq
            return None
        if r.replaying:
            if len(r.pending) >= MAX_PENDING_BATCHES:
                r.ignored["replay_overflow"] += 1
                self._give_up_replay(r, now_s)
            else:
                r.pending.append((seq, events))
                return None
        last = r.last_seq
        want = None
        if last is not None and seq <= last:  # the publisher's counter restarted: so did its cache
            self.clear(replica_id, now_s)
            last = None
            if seq > 0:
                want = self._gap(r, -1, now_s)
        elif last is not None and seq > last + 1:
            want = self._gap(r, last, now_s)
        if want is not None:
            r.pending.append((seq, events))
            return want
        self._apply(r, events, now_s)
        r.last_seq = seq
        return None

    def replay_done(self, replica_id: str, now_s: float, complete: bool = True) -> None:
        """The replay asked for by `apply` ended (`complete`: its first batch followed on from what was applied)."""
        r = self.replicas.get(replica_id)
        if r is None or not r.replaying:
            return
        r.replaying = False
        ok = complete and r.replay_ok
        r.replays["complete" if ok else "incomplete"] += 1
        r.stale_until = 0.0 if ok else now_s + self.stale_hold_s
        pending, r.pending = r.pending, []
        for seq, events in pending:
            if r.last_seq is not None and seq <= r.last_seq:
                continue  # the replay had it
            if r.last_seq is not None and seq > r.last_seq + 1:
                r.gaps += 1
                r.stale_until = max(r.stale_until, now_s + self.stale_hold_s)
            self._apply(r, events, now_s)
            r.last_seq = seq

    def _gap(self, r: ReplicaKV, last: int, now_s: float) -> int | None:
        r.gaps += 1
        if r.replay:
            r.replaying, r.replay_from, r.replay_ok = True, last + 1, True
            r.stale_until = math.inf
            return last + 1
        r.stale_until = max(r.stale_until, now_s + self.stale_hold_s)
        return None

    def _give_up_replay(self, r: ReplicaKV, now_s: float) -> None:
        r.replaying = False
        r.replays["incomplete"] += 1
        r.stale_until = now_s + self.stale_hold_s
        pending, r.pending = r.pending, []
        for seq, events in pending:
            self._apply(r, events, now_s)
            r.last_seq = seq

    def _apply(self, r: ReplicaKV, events: Sequence[KVEvent], now_s: float) -> None:
        r.last_event_s = now_s
        for ev in events:
            kind = type(ev)
            if kind is BlockStored:
                self._store(r, ev, now_s)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                r.events["BlockRemoved"] += 1
                if ev.medium not in _CACHED_MEDIA:  # type: ignore[union-attr]
                    continue
                for h in ev.block_hashes:  # type: ignore[union-attr]
                    self._forget(r, h)
            elif kind is AllBlocksCleared:
                r.events["AllBlocksCleared"] += 1
                r.blocks.clear()
                r.own.clear()
                r.clears += 1
            elif kind is KeyedBlocksStored:
                self._store_keyed(r, ev, now_s)  # type: ignore[arg-type]
            else:
                self._bad(r, "unknown_kind", now_s)

    def _store(self, r: ReplicaKV, ev: BlockStored, now_s: float) -> None:
        r.events["BlockStored"] += 1
        if ev.medium not in _CACHED_MEDIA:
            r.ignored["medium"] += 1
            return
        bs, hashes, tokens = ev.block_size, ev.block_hashes, ev.token_ids
        if not isinstance(bs, int) or bs < 1 or len(tokens) != len(hashes) * bs:
            self._bad(r, "bad_tokens", now_s)  # a block's tokens longer (or shorter) than its block size
            return
        lora = ev.lora_name if ev.lora_name is not None else (None if ev.lora_id is None else str(ev.lora_id))
        if lora is not None and r.adapters is not None and lora not in r.adapters:
            self._bad(r, "unknown_lora", now_s)  # events for a model it does not serve
            return
        if ev.parent_block_hash is None:
            parent = 0
        else:
            entry = r.blocks.get(ev.parent_block_hash)
            if entry is None:  # stored before the router subscribed, or already forgotten: unreachable anyway
                r.ignored["orphan"] += 1
                return
            parent = entry[0]
        try:
            data = token_bytes(tokens)
        except (OverflowError, TypeError, ValueError):
            self._bad(r, "bad_tokens", now_s)
            return
        r.block_size = bs
        own = r.own.get(lora)
        if own is None:
            own = r.own[lora] = {}
        width = 4 * bs
        blocks = r.blocks
        for i, h in enumerate(hashes):
            parent = chain_hash(parent, data[i * width : (i + 1) * width])
            if h in blocks:
                continue  # reported twice: keep the first
            blocks[h] = (parent, lora)
            own[parent] = own.get(parent, 0) + 1
        self._drop_oldest(r)

    def _store_keyed(self, r: ReplicaKV, ev: KeyedBlocksStored, now_s: float) -> None:
        r.events["BlockStored"] += 1
        lora = ev.lora_name
        if lora is not None and r.adapters is not None and lora not in r.adapters:
            self._bad(r, "unknown_lora", now_s)
            return
        own = r.own.get(lora)
        if own is None:
            own = r.own[lora] = {}
        blocks = r.blocks
        for key in ev.keys:
            if key in blocks:
                continue  # reported twice: keep the first
            blocks[key] = (key, lora)
            own[key] = own.get(key, 0) + 1
        self._drop_oldest(r)

    def _drop_oldest(self, r: ReplicaKV) -> None:
        """Forget the oldest blocks past `max_blocks`, counted as dropped."""
        blocks = r.blocks
        while len(blocks) > self.max_blocks:
            self._forget(r, next(iter(blocks)))
            r.dropped += 1

    def _bad(self, r: ReplicaKV, reason: str, now_s: float) -> None:
        r.ignored[reason] += 1
        if r.stale_until != math.inf:
            r.stale_until = max(r.stale_until, now_s + self.stale_hold_s)

    @staticmethod
    def _forget(r: ReplicaKV, h: Hashable) -> None:
        entry = r.blocks.pop(h, None)
        if entry is None:
            return
        own_hash, lora = entry
        own = r.own.get(lora)
        if own is None:
            return
        n = own.get(own_hash, 0) - 1
        if n > 0:
            own[own_hash] = n
        else:
            own.pop(own_hash, None)

    # ---- reads (the request path)
    def fresh(self, replica_id: str, now_s: float) -> bool:
        r = self.replicas.get(replica_id)
        return r is not None and r.attached and now_s >= r.stale_until

    def fresh_many(self, replica_ids: Sequence[str], now_s: float) -> list[bool]:
        get = self.replicas.get
        return [(r := get(rid)) is not None and r.attached and now_s >= r.stale_until for rid in replica_ids]

    def match_many(self, replica_ids: Sequence[str], blocks: Sequence[int], lora: str | None = None) -> list[int]:
        """Leading `blocks` (token chain hashes) each replica holds for the adapter `lora` (None: the base model)."""
        if not blocks:
            return [0] * len(replica_ids)
        get = self.replicas.get
        first = blocks[0]
        out = []
        for rid in replica_ids:
            r = get(rid)
            own = None if r is None else r.own.get(lora)
            if not own or first not in own:
                out.append(0)
                continue
            n = 0
            for b in blocks:
                if b not in own:
                    break
                n += 1
            out.append(n)
        return out

    def block_size(self) -> int | None:
        """The block size the replicas report (the first one seen; vLLM fleets behind one router share it)."""
        for r in self.replicas.values():
            if r.block_size is not None:
                return r.block_size
        return None

    def stats(self, replica_id: str) -> ReplicaKV | None:
        return self.replicas.get(replica_id)
