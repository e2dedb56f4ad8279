"""Late binding's held requests of one model: the one queue the live router (router/hold_queue.py) and the simulator
(simulator/cluster.py) both keep, so the order the simulator replays is the order the router serves.

Two orders over the same requests: arrival (the hold timeout goes by the oldest) and deadline (room goes to the
earliest TTFT deadline; a request without one has an infinite deadline, so it goes after every one with, in arrival
order). `head(now_s, timeout_s)` is the request to offer when room may have appeared: the oldest once it has waited
the timeout, else the earliest deadline. A request taken out (dispatched, or its client gone) leaves both orders
lazily, when it reaches the front of each. Pure: no clock, no I/O; the caller keys each request by a sequence
number unique within the queue (arrival order, the deadline's tie-break) and keeps what the item is.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class HeldQueue(Generic[T]):
    __slots__ = ("_fifo", "_edf", "_held")

    def __init__(self) -> None:
        self._fifo: deque[tuple[int, float, T]] = deque()  # (seq, arrived_s, item) in arrival order
        self._edf: list[tuple[float, int, T]] = []  # heap of (deadline_s, seq, item): seq breaks ties, never item
        self._held: set[int] = set()  # the seqs held now; an entry of either order whose seq is not here has left

    def __len__(self) -> int:
        return len(self._held)

    def push(self, seq: int, item: T, arrived_s: float, deadline_s: float) -> None:
        self._fifo.append((seq, arrived_s, item))
        heapq.heappush(self._edf, (deadline_s, seq, item))
        self._held.add(seq)

    def take(self, seq: int) -> bool:
        """Takes request `seq` out of the queue; False if it is not held here (already taken, or never pushed)."""
        held = self._held
        if seq not in held:
            return False
        held.remove(seq)
        if not held:  # nothing held: the left entries of both orders can go at once
            self._fifo.clear()
            self._edf.clear()
        return True

    def oldest(self) -> tuple[T, float] | None:
        """The oldest request still held and its arrival time, or None."""
        fifo, held = self._fifo, self._held
        while fifo and fifo[0][0] not in held:
            fifo.popleft()
        if not fifo:
            return None
        _, arrived_s, item = fifo[0]
        return item, arrived_s

    def earliest(self) -> T | None:
        """The held request with the earliest deadline (the oldest among equal ones), or None."""
        edf, held = self._edf, self._held
        while edf and edf[0][1] not in held:
            heapq.heappop(edf)
        return edf[0][2] if edf else None

    def head(self, now_s: float, timeout_s: float) -> T | None:
        """The request to offer: the oldest once it has waited `timeout_s`, else the earliest deadline; None if empty."""
        oldest = self.oldest()
        if oldest is None:
            return None
        item, arrived_s = oldest
        if now_s - arrived_s >= timeout_s:
            return item
        return self.earliest()
