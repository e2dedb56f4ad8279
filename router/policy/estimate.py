"""Prompt-token estimation and prefix-block hashing, shared by the live router and the simulator.

The live router sees text; the simulator sees the trace's true token counts. Both go through
`TokenEstimator` so the policy gets the same kind of (imperfect) number in both worlds.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

try:  # a prompt's chain in one C call (router/policy/fastnet_c/prefix.c); chain_hash stays the definition
    from routewise_vllm.router.policy._fastnet import chain_blocks
except ImportError:  # built without a C compiler, or from older sources
    chain_blocks = None

DEFAULT_CHARS_PER_TOKEN = 4.0
# Router-side prefix blocks are this many (estimated) tokens; Mooncake traces use 512.
DEFAULT_PREFIX_BLOCK_TOKENS = 64


@dataclass(frozen=True, slots=True)
class TokenEstimator:
    """Characters-per-token rule live; a log-normal error model of that rule in the simulator.

    `rel_error_sigma` is the standard deviation of log(estimate / true); 0.15 matches a
    4-chars-per-token rule on English chat text within the usual spread.
    """

    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    rel_error_sigma: float = 0.15

    def from_text(self, text: str) -> int:
        return max(1, math.ceil(len(text) / self.chars_per_token))

    def from_true_tokens(self, true_tokens: int, rng: np.random.Generator) -> int:
        if self.rel_error_sigma <= 0:
            return max(1, int(true_tokens))
        # sigma * standard_normal() is bit-identical to rng.normal(0.0, sigma), and cheaper to call
        return max(1, int(round(true_tokens * math.exp(self.rel_error_sigma * rng.standard_normal()))))


def chain_hash(parent: int, payload: bytes) -> int:
    """64-bit chained block hash: identical leading blocks give identical hashes."""
    h = hashlib.blake2b(payload, digest_size=8, key=parent.to_bytes(8, "little", signed=False))
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


def text_prefix_blocks(
    text: str,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
    block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
    max_blocks: int = 256,
) -> tuple[int, ...]:
    """Chained hashes of the prompt's full fixed-size blocks (partial tail block excluded)."""
    block_chars = max(1, int(block_tokens * chars_per_token))
    data = text.encode("utf-8", "surrogatepass")
    n_full = min(len(data) // block_chars, max_blocks)
    if chain_blocks is not None:
        return chain_blocks(data, block_chars, n_full)
    out: list[int] = []
    parent = 0
    for i in range(n_full):
        parent = chain_hash(parent, data[i * block_chars : (i + 1) * block_chars])
        out.append(parent)
    return tuple(out)


def id_prefix_blocks(block_ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Chained hashes of a trace's block ids (Mooncake `hash_ids`), same contract as text."""
    out: list[int] = []
    parent = 0
    for b in block_ids:
        parent = chain_hash(parent, int(b).to_bytes(8, "little", signed=True))
        out.append(parent)
    return tuple(out)


class PrefixIndex:
    """The router's approximate view of which prefix blocks each replica has cached.

    Per replica, an LRU of chained block hashes bounded by the replica's estimated cache
    capacity (in blocks). Inserting at dispatch mirrors SGLang's approximate radix tree. Each block keeps the time
    it was last sent (`extend_recent`: what was sent lately, not yet in a replica's KV events).
    """

    def __init__(self, capacity_blocks: int = 4096) -> None:
        self.capacity_blocks = capacity_blocks
        self._lru: dict[str, OrderedDict[int, float]] = {}

    def match(self, replica_id: str, blocks: tuple[int, ...]) -> int:
        lru = self._lru.get(replica_id)
        if not lru or not blocks:
            return 0
        n = 0
        for b in blocks:  # chained hashes: the first miss ends the shared prefix
            if b not in lru:
                break
            n += 1
        return n

    def match_many(self, replica_ids: list[str], blocks: tuple[int, ...]) -> list[int]:
        """[match(r, blocks) for r in replica_ids], in one call (the router's view asks for every replica)."""
        if not blocks:
            return [0] * len(replica_ids)
        get = self._lru.get
        first = blocks[0]
        out = []
        for rid in replica_ids:
            lru = get(rid)
            if not lru or first not in lru:  # most replicas share no prefix with the request
                out.append(0)
                continue
            n = 0
            for b in blocks:
                if b not in lru:
                    break
                n += 1
            out.append(n)
        return out

    def extend_recent(self, replica_ids: list[str], blocks: tuple[int, ...], matched: list[int], since_s: float) -> list[int]:
        """Per replica, `matched` (leading blocks known cached there) extended over the following blocks sent to it
        at or after `since_s`. A block's time is never older than a later block's of the same chain (a prompt sends
        its whole prefix), so this is the larger of `matched` and the recently sent prefix, found with one lookup per
        replica once the events have caught up."""
        n_blocks = len(blocks)
        get = self._lru.get
        out = []
        for rid, n in zip(replica_ids, matched):
            lru = get(rid)
            if lru:
                at = lru.get
                while n < n_blocks and at(blocks[n], -math.inf) >= since_s:
                    n += 1
            out.append(n)
        return out

    def insert(self, replica_id: str, blocks: tuple[int, ...], capacity_blocks: int | None = None,
               now_s: float = -math.inf) -> None:
        """`now_s`: when the blocks were sent (-inf, unknown: never counted by `extend_recent`)."""
        if not blocks:
            return
        lru = self._lru.setdefault(replica_id, OrderedDict())
        for b in blocks:
            lru[b] = now_s
            lru.move_to_end(b)
        cap = capacity_blocks if capacity_blocks is not None else self.capacity_blocks
        while len(lru) > cap:
            lru.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        self._lru.pop(replica_id, None)

    def size(self, replica_id: str) -> int:
        return len(self._lru.get(replica_id, ()))
