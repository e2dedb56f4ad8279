"""The request's token blocks (router.kv.prompt_tokens): a prefix not tokenized yet never costs the request."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from routewise_vllm.router.kv.prompt_tokens import MIN_PREFIX_CHARS, LocalTokenizer, PromptBlocks
from routewise_vllm.router.policy.kv_view import token_prefix_blocks

pytestmark = pytest.mark.timeout(60)

SYSTEM = " ".join(f"w{i % 97}" for i in range(600))  # ~2,300 characters: cut at 2,048, 1,024 and 512


class SlowTokenizer:
    """One token per word. A text longer than the shortest prefix takes `delay_s` (and waits for `release`); the
    threads such texts were tokenized on are noted."""

    def __init__(self, delay_s: float = 0.2) -> None:
        self.delay_s = delay_s
        self.threads: list[int] = []
        self.release = threading.Event()
        self.release.set()

    def completion_ids(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if len(prompt) > MIN_PREFIX_CHARS:
            self.threads.append(threading.get_ident())
            self.release.wait(10)
            time.sleep(self.delay_s)
        return [1 + (hash(w) % 1000) for w in prompt.split(" ")]

    completion_ids_nogil = completion_ids


def test_a_miss_decides_on_its_head_and_tokenizes_the_prefix_in_the_background():
    tok = SlowTokenizer()
    pb = PromptBlocks(lambda: 16, tok)  # type: ignore[arg-type]
    body = {"prompt": SYSTEM + " question one?"}
    t0 = time.perf_counter()
    head = pb.of(body, chat=False)  # nothing cached yet: the first 512 characters' blocks
    assert time.perf_counter() - t0 < tok.delay_s / 2  # it did not wait for the long prefix
    words = SYSTEM[:MIN_PREFIX_CHARS + 1].count(" ")  # the words before the cut, the last one dropped
    assert head and len(head) == words // 16
    assert pb.sources["head"] == 1
    pb.drain()
    assert tok.threads and threading.get_ident() not in tok.threads
    blocks = pb.of({"prompt": SYSTEM + " question two?"}, chat=False)  # the same system prompt: precise now
    assert blocks and len(blocks) >= 2000 // 16 // 4
    assert pb.sources["cached"] == 1


def test_without_a_tokenizer_a_miss_decides_on_the_estimate():
    pb = PromptBlocks(lambda: 16, None, fetch=None)
    assert pb.of({"prompt": SYSTEM}, chat=False) is None
    assert pb.sources["estimate"] == 1


def test_a_shorter_cached_prefix_is_used_while_the_longer_one_is_tokenized():
    tok = SlowTokenizer(delay_s=0.0)
    pb = PromptBlocks(lambda: 16, tok)  # type: ignore[arg-type]
    pb.of({"prompt": SYSTEM[:1100]}, chat=False)  # learns the 1,024-character cut (and 512)
    pb.drain()
    tok.release.clear()  # the next tokenization waits
    blocks = pb.of({"prompt": SYSTEM + " question?"}, chat=False)
    assert blocks and pb.sources["prefix"] == 1
    short = len(blocks)
    tok.release.set()
    pb.drain()
    longer = pb.of({"prompt": SYSTEM + " another question?"}, chat=False)
    assert longer and len(longer) > short and pb.sources["cached"] == 1


def test_the_background_queue_is_bounded():
    tok = SlowTokenizer(delay_s=0.0)
    tok.release.clear()
    pb = PromptBlocks(lambda: 16, tok, max_queued=3)  # type: ignore[arg-type]
    for i in range(10):
        assert pb.of({"prompt": f"{i} " + SYSTEM}, chat=False)  # each its head
    assert len(pb.queued) == 3  # the other misses are asked again by a later request
    tok.release.set()
    pb.drain()
    assert not pb.queued and len(pb.cache.d) == 10 + 3  # 10 heads, 3 long prefixes


def test_the_background_tokenization_gives_the_callers_ids(tmp_path: Path):
    """encode_batch on the background thread (the GIL released) tokenizes as encode does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([SYSTEM] * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    local = LocalTokenizer(tmp_path)
    prompt = SYSTEM + " question?"
    assert local.completion_ids_nogil(prompt) == local.completion_ids(prompt)
    pb = PromptBlocks(lambda: 16, local)
    head = SYSTEM.rfind(" ", 0, MIN_PREFIX_CHARS + 1)
    assert pb.of({"prompt": prompt}, chat=False) == token_prefix_blocks(local.completion_ids(SYSTEM[:head])[:-1], 16)
    pb.drain()
    blocks = pb.of({"prompt": prompt}, chat=False)
    cut = SYSTEM.rfind(" ", 0, 2049)
    assert blocks == token_prefix_blocks(local.completion_ids(SYSTEM[:cut])[:-1], 16)
