"""The replicas' KV-cache events as each router's KV view receives them (`ClusterConfig.kv_view`, mode precise).

Each replica's prefix cache (`Replica.cache`, keyed by the requests' chained prefix-block hashes, the router's own)
is observed as the emulator observes it: an entry added is a stored block, an entry evicted a removed one. All the
changes of one replica at one simulated time are one batch with the next sequence number of that replica's
publisher, delivered to every router `lag_s` later through the simulator's event heap (so runs stay deterministic),
each router losing it with probability `loss` (drawn from the feed's own generator: the scrapes' draws are the
same as without the feed). A lost batch is a sequence gap in the view (router.policy.kv_view): with `replay`, the
router asks for the missed batches and gets them one `lag_s` later from the publisher's buffer; without, the view
is stale for `stale_hold_s` and decisions use the guess there. A crash restarts the publisher (sequence 0, empty
buffer); the cluster clears every router's view of a replica when it sees the replica fail, as the live router does.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from routewise_vllm.router.policy.kv_view import BlockRemoved, KeyedBlocksStored, KVEvent, KVView
from routewise_vllm.simulator.config import KVViewConfig

if TYPE_CHECKING:
    from routewise_vllm.simulator.cluster import ClusterSim

REPLAY_BUFFER = 10_000  # batches a publisher keeps for replays (vLLM's buffer_steps default)
_SALT = 0x4B56_5649_4557  # the feed's generator, apart from the cluster's


class ObservedCache(dict):
    """A replica's prefix cache that tells the feed what was stored and evicted (the replica sets and deletes entries
    by key; nothing else changes it)."""

    __slots__ = ("feed", "i")

    def __setitem__(self, key: Any, value: Any) -> None:
        dict.__setitem__(self, key, value)
        self.feed.changed(self.i, key, True)

    def __delitem__(self, key: Any) -> None:
        dict.__delitem__(self, key)
        self.feed.changed(self.i, key, False)


def batch_events(ops: list[tuple[bool, int]]) -> list[KVEvent]:
    """(stored?, key) changes in order as events: each run of stores one KeyedBlocksStored, of evictions one
    BlockRemoved."""
    events: list[KVEvent] = []
    run: list[int] = []
    stored = None
    for s, key in ops:
        if s is not stored and run:
            events.append(KeyedBlocksStored(tuple(run)) if stored else BlockRemoved(tuple(run)))
            run = []
        stored = s
        run.append(key)
    if run:
        events.append(KeyedBlocksStored(tuple(run)) if stored else BlockRemoved(tuple(run)))
    return events


class KVFeed:
    def __init__(self, sim: ClusterSim, config: KVViewConfig, seed: int | None, push) -> None:
        self.sim = sim
        self.config = config
        self.push = push  # push(t, kind, x, y): an event on the cluster's heap
        self.rng = np.random.default_rng(None if seed is None else [seed, _SALT])
        self.views: list[KVView] = []
        for router in sim.routers:
            view = KVView(max_blocks=config.max_blocks, stale_hold_s=config.stale_hold_s, inflight_s=config.inflight_s)
            for rid in sim.replica_ids:
                view.attach(rid, 0.0, replay=config.replay)
                view.follow_from(rid, 0)  # a lost first batch is a gap too
            router.kv_view = view
            self.views.append(view)
        n = len(sim.replicas)
        self.seq = [0] * n  # each publisher's next sequence number
        self.open: list[tuple[float, list] | None] = [None] * n  # (time, changes) of the batch being filled
        self.buffer: list[deque] = [deque(maxlen=REPLAY_BUFFER) for _ in range(n)]  # (seq, changes)
        self.lost = 0  # batches a router never received
        for i in range(n):
            self.observe(i)

    def observe(self, i: int) -> None:
        """Watch replica i's cache (after anything that replaced it: a crash, a recovery)."""
        rep = self.sim.replicas[i]
        cache = ObservedCache(rep.cache)
        cache.feed, cache.i = self, i
        rep.cache = cache

    def restart(self, i: int) -> None:
        """Replica i crashed: its publisher starts over (sequence 0, nothing to replay)."""
        self.seq[i] = 0
        self.open[i] = None
        self.buffer[i].clear()
        self.observe(i)

    def changed(self, i: int, key: int, stored: bool) -> None:
        now = self.sim.now_s
        b = self.open[i]
        if b is None or b[0] != now:
            ops: list = []
            seq = self.seq[i]
            self.seq[i] = seq + 1
            self.open[i] = (now, ops)
            self.buffer[i].append((seq, ops))
            self.push(now + self.config.lag_s, i, (seq, ops), False)
        else:
            ops = b[1]
        ops.append((stored, key))

    def deliver(self, i: int, seq: int, ops: list, t: float) -> None:
        """One batch reaches the routers (those that do not lose it)."""
        events = batch_events(ops)
        rid = self.sim.replica_ids[i]
        loss = self.config.loss
        for k, view in enumerate(self.views):
            if loss and self.rng.random() < loss:
                self.lost += 1
                continue
            want = view.apply(rid, seq, events, t)
            if want is not None:  # a gap, and the replica has a replay endpoint: ask for what was missed
                self.push(t + self.config.lag_s, i, (k, want), True)

    def replay(self, i: int, k: int, want: int, t: float) -> None:
        """Router k's replay of replica i's batches from `want` on: the buffered ones up to the last it saw live."""
        view = self.views[k]
        rid = self.sim.replica_ids[i]
        r = view.replicas.get(rid)
        if r is None or not r.replaying:
            return
        upto = r.pending[-1][0] if r.pending else want
        buf = self.buffer[i]
        complete = bool(buf) and buf[0][0] <= want
        for seq, ops in buf:
            if want <= seq < upto:
                view.apply(rid, seq, batch_events(ops), t, replay=True)
        view.replay_done(rid, t, complete)

    def replica_failed(self, i: int, t: float) -> None:
        """The routers saw replica i fail its health checks: what it held is unknown."""
        rid = self.sim.replica_ids[i]
        for view in self.views:
            view.clear(rid, t, stale=True)
