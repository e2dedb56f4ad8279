"""The held queue that the live router and the simulator share (router.policy.held_queue)."""

from __future__ import annotations

import math

import numpy as np

from routewise_vllm.router.policy.held_queue import HeldQueue


def test_room_goes_to_the_earliest_deadline_and_the_timeout_to_the_oldest():
    q: HeldQueue[str] = HeldQueue()
    q.push(0, "no-target", 0.0, math.inf)
    q.push(1, "late", 1.0, 9.0)
    q.push(2, "soon", 2.0, 5.0)
    q.push(3, "soon-too", 3.0, 5.0)  # the same deadline: arrival order breaks the tie
    assert q.head(now_s=1.5, timeout_s=2.0) == "soon"
    assert q.head(now_s=2.0, timeout_s=2.0) == "no-target"  # the oldest has waited the timeout: it goes first
    assert q.take(2) and not q.take(2)
    assert q.head(now_s=1.5, timeout_s=2.0) == "soon-too"
    assert q.take(3) and q.take(1)
    assert q.head(now_s=1.5, timeout_s=2.0) == "no-target" and len(q) == 1
    assert q.take(0) and q.head(0.0, 2.0) is None and q.oldest() is None and q.earliest() is None


def test_without_deadlines_it_is_first_in_first_out():
    q: HeldQueue[int] = HeldQueue()
    for i in range(5):
        q.push(i, i, float(i), math.inf)
    order = []
    while (head := q.head(now_s=0.0, timeout_s=10.0)) is not None:
        order.append(head)
        q.take(head)
    assert order == [0, 1, 2, 3, 4]


def test_a_long_lived_queue_forgets_what_left_both_orders():
    """The live router keeps one queue per model for its lifetime: taken requests must not pile up inside."""
    q: HeldQueue[int] = HeldQueue()
    rng = np.random.default_rng(0)
    seq = 0
    for _ in range(2000):
        for _ in range(int(rng.integers(1, 4))):
            q.push(seq, seq, float(seq), float(rng.choice([math.inf, seq + rng.uniform(0, 50)])))
            seq += 1
        while len(q) > 3:
            q.take(q.head(now_s=float(seq), timeout_s=20.0))
        assert len(q._fifo) + len(q._edf) < 400  # what left one order waits only until it reaches its front
    while (head := q.head(0.0, 20.0)) is not None:
        q.take(head)
    assert len(q) == 0 and not q._fifo and not q._edf
    assert not q.take(0) and not q.take(10**9)  # taken before, never pushed: neither counts
