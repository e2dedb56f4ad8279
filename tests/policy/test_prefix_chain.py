"""The chained prefix-block hashes: estimate.chain_hash (BLAKE2b through hashlib) defines them, and the C chain
(`_fastnet.chain_blocks`, router/policy/fastnet_c/prefix.c) that text_prefix_blocks calls gives the same
hashes on the same bytes: block sizes across BLAKE2b's 128-byte blocks, every kind of text, the block cap."""

from __future__ import annotations

import hashlib
import random

import pytest

from routewise_vllm.router.policy import estimate
from routewise_vllm.router.policy.estimate import chain_hash, text_prefix_blocks
from tests.ci import skip_or_fail


def _compiled():
    if estimate.chain_blocks is None:
        skip_or_fail("the C extension router.policy._fastnet is not built (no C compiler at install)")
    return estimate.chain_blocks


def _python_chain(data: bytes, block: int, n: int) -> tuple[int, ...]:
    out, parent = [], 0
    for i in range(n):
        parent = chain_hash(parent, data[i * block:(i + 1) * block])
        out.append(parent)
    return tuple(out)


def test_chain_hash_is_keyed_blake2b_of_8_bytes() -> None:
    digest = hashlib.blake2b(b"abc", digest_size=8, key=(5).to_bytes(8, "little")).digest()
    assert chain_hash(5, b"abc") == int.from_bytes(digest, "little") & (2**63 - 1)


@pytest.mark.parametrize("block", [1, 7, 127, 128, 129, 255, 256, 257, 384, 1000])
def test_the_c_chain_matches_hashlib_across_blake2b_block_boundaries(block: int) -> None:
    chain_blocks = _compiled()
    rng = random.Random(block)
    data = rng.randbytes(block * 9 + rng.randrange(block))
    for n in (0, 1, 2, 9):
        assert chain_blocks(data, block, n) == _python_chain(data, block, n)


def test_text_prefix_blocks_is_the_same_with_and_without_the_c_chain(monkeypatch) -> None:
    chain_blocks = _compiled()
    rng = random.Random(3)
    alphabets = ["abc ", "héllo wörld ", "日本語テキスト", "\U0001f600x", "a\udc80b"]  # a lone surrogate: surrogatepass
    for _ in range(300):
        text = "".join(rng.choice(rng.choice(alphabets)) for _ in range(rng.choice((0, 10, 255, 256, 3000, 20000))))
        args = (text, rng.choice((4.0, 3.5, 1.0)), rng.choice((64, 16, 1)), rng.choice((256, 5)))
        monkeypatch.setattr(estimate, "chain_blocks", chain_blocks)
        fast = text_prefix_blocks(*args)
        monkeypatch.setattr(estimate, "chain_blocks", None)
        assert fast == text_prefix_blocks(*args)


def test_the_c_chain_refuses_blocks_beyond_its_data() -> None:
    chain_blocks = _compiled()
    with pytest.raises(ValueError):
        chain_blocks(b"abcd", 2, 3)
    with pytest.raises(ValueError):
        chain_blocks(b"abcd", 0, 1)
    assert chain_blocks(b"", 1, 0) == ()
