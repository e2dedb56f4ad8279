"""EVAL workloads differ between seeds where the window allows; a seed still fixes them."""

from __future__ import annotations

import numpy as np

from routewise_vllm.simulator.scenario import load_scenario


def _rows(name: str, seed: int, split: str = "eval") -> list[tuple]:
    _, reqs = load_scenario(name, split=split).build(np.random.default_rng(seed))
    return [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.block_ids) for r in reqs if r.tenant != "warmup"]


def test_two_seeds_of_bursty_code_replay_different_requests():
    a, b = _rows("bursty-code", 0), _rows("bursty-code", 1)
    lengths_a = {row[1:] for row in a}
    lengths_b = {row[1:] for row in b}
    # the EVAL window holds 1,328 requests: before the shorter eval segment both seeds replayed all of them
    assert len(a) <= 500 and len(b) <= 500
    assert lengths_a != lengths_b
    assert len(lengths_a & lengths_b) < 0.9 * len(lengths_a)


def test_the_same_seed_gives_the_same_eval_requests():
    assert _rows("bursty-code", 3) == _rows("bursty-code", 3)
    assert _rows("steady-chat", 2) == _rows("steady-chat", 2)


def test_training_keeps_the_long_segments():
    assert len(_rows("bursty-code", 0, split="train")) > 500  # eval_max_requests applies to the eval split only
