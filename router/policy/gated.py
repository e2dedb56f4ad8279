"""The gated policy: the learned policy, except on a uniform pool where the cache decides, where a heuristic routes.

The learned policy pays where a fleet's replicas run at different speeds, and loses to the cache-aware heuristics on
pools of one GPU kind whose traffic shares prefixes (many tenants' system prompts, multi-turn chat, shared documents:
docs/peers.md, "Uniform pools"). On the suite's uniform scenarios without shared prefixes (crash, kv-pressure,
adversarial) it beats every heuristic. So the gate asks two questions of what the router already sees, live and
simulated alike; no configuration of the fleet is read:

- Does the cache decide? The cache share: a running mean, over the last ~`cache_window` decisions, of the largest
  fraction of the request's prefix blocks any replica holds (`prefix_match_blocks`, 0 for a request without
  blocks). It is on at >= 0.3 and off again below 0.2 (the uniform pools measure 0.39-0.90; the suite's scenarios
  0-0.18).
- Do the replicas' speeds differ? The speed spread: the slowest replica's TPOT floor over the fastest's
  (`tpot_floor_s`, a low percentile of its measured time per output token, router.policy.tracking), known once at
  least `min_measured` replicas, and at least `min_measured_share` of the view's, have one. Evidence: +1 for each
  spread >= `mixed_min_spread` (2.0), -1 for each below, between 0 and `evidence` (50). Evidence at 50 latches
  `learned` for `dwell` decisions (this one included), renewed while it stays at 50. A spread the load explains is
  no evidence either way: where the slowest replica has at least `max_load_ratio` (3) times the fastest's requests
  in flight (each plus one), its floor measures its batch, not its GPU.

The heuristic decides when the cache share is on and no latch runs; otherwise the learned policy.

Why evidence and a latch rather than a threshold both ways: floors also move with load. The learned policy loads fast
replicas more than slow ones, which brings their floors together (an H100 + A100 fleet measures 1.1-1.5x under the
learned policy, 1.2-2.9x under the heuristic, which spreads prefill work evenly), and a uniform pool's floors touch
2.0 now and then (for a few decisions). So the spread is judged while the heuristic decides, over 50 decisions'
worth of evidence, and the learned policy then keeps the fleet for `dwell` decisions before the gate looks again.
Why the load ratio: the heuristic's cache affinity piles a hot prefix's requests onto a few replicas of a uniform
pool, whose floors then reach 3.6-4.3x the others' (uniform-rag-16 under llm-d: 170-220 running where the fastest
floor's replica runs 6-9); a mixed fleet's slow replicas carry about what its fast ones do (1.1-1.6x under llm-d:
heterogeneous, shape-conv-mix2x, the random fleets with shared prefixes; docs/peers.md, "The gate").

Each request applies the rule once, to the view of the first time the gate is asked about it, and is decided in the
resulting mode. Behind late binding that is the room stage's question (`binds_late`), before the request can be held
or handed to the only replica with room without a pick: so every request counts in the rule, and one that arrives
once the cache decides goes at once to the heuristic's pick. (Judged at the pick only, an overloaded pool whose
requests late binding held and handed out without a pick kept the gate in the mode it had before they came:
uniform-tenants-2 held 12 % of its requests while the heuristic made nearly every pick.) The gate serves behind
FallbackPolicy, which asks a primary for `best`, then `scores` (the learned policy scores the whole fleet behind
late binding), and for `choose` on the view late binding restricted when both say None (router.policy.base.Policy).
So in `learned` mode the gate answers `best` and `scores` with the learned policy's; in `heuristic` mode both say
None and `choose` is the heuristic's, on the same restricted view it gets when it is served on its own.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Literal

import numpy as np

from routewise_vllm.router.policy.base import Policy, best_of
from routewise_vllm.router.policy.types import ClusterView, Outcome, ReplicaSnapshot, RequestInfo

Mode = Literal["learned", "heuristic"]
MODES: tuple[str, ...] = ("learned", "heuristic")

# The heuristic the gate serves on uniform pools where the cache decides: the best single heuristic behind late
# binding (how the gate is served) on the uniform suite (docs/peers.md).
GATE_HEURISTIC = "llm-d"
# Under the heuristic the TPOT floors of one GPU kind stay below 2.0x of each other but for a few decisions; an H100 +
# A100 mix passes it on most decisions, an H100 + L4 mix on all (docs/peers.md, "The gate").
MIXED_MIN_SPREAD = 2.0
MIXED_EVIDENCE = 50
MAX_LOAD_RATIO = 3.0
DWELL_DECISIONS = 10_000
MIN_MEASURED = 2
MIN_MEASURED_SHARE = 0.5
CACHE_ON = 0.3
CACHE_OFF = 0.2
CACHE_WINDOW = 200
# Requests judged by the room stage whose pick has not come yet (held ones wait in the router's queue); a request
# handed to its only replica with room is never picked, so the oldest are forgotten past this many.
JUDGED_MEMORY = 4096


def floor_extremes(view: ClusterView) -> tuple[int, ReplicaSnapshot | None, ReplicaSnapshot | None]:
    """How many replicas have a TPOT floor (healthy or not: a replica late binding marked full still has its speed),
    and the ones with the slowest and the fastest (None without any)."""
    n = 0
    slow = fast = None
    for r in view.replicas:
        f = r.tpot_floor_s
        if f is not None and f > 0:
            n += 1
            if slow is None or f > slow.tpot_floor_s:
                slow = r
            if fast is None or f < fast.tpot_floor_s:
                fast = r
    return n, slow, fast


def speed_spread(view: ClusterView, min_measured: int = MIN_MEASURED, min_measured_share: float = MIN_MEASURED_SHARE,
                 extremes: tuple[int, ReplicaSnapshot | None, ReplicaSnapshot | None] | None = None) -> float | None:
    """The slowest replica's TPOT floor over the fastest one's, among replicas with a floor; None while fewer than
    `min_measured` replicas, or fewer than `min_measured_share` of the view's, have one. `extremes`: the view's
    `floor_extremes`, when already known."""
    n, slow, fast = extremes or floor_extremes(view)
    if slow is None or fast is None or n < min_measured or n < min_measured_share * len(view.replicas):
        return None
    return slow.tpot_floor_s / fast.tpot_floor_s


def load_ratio(view: ClusterView,
               extremes: tuple[int, ReplicaSnapshot | None, ReplicaSnapshot | None] | None = None) -> float | None:
    """Requests in flight at the replica with the slowest TPOT floor over those at the fastest's, each plus one
    (None while fewer than two replicas have a floor). `extremes`: the view's `floor_extremes`, when already known."""
    _, slow, fast = extremes or floor_extremes(view)
    if slow is None or fast is None or slow is fast:
        return None
    return (slow.outstanding + 1) / (fast.outstanding + 1)


def next_state(latch: int, evidence: int, spread: float | None, mixed_min_spread: float = MIXED_MIN_SPREAD,
               max_evidence: int = MIXED_EVIDENCE, dwell: int = DWELL_DECISIONS) -> tuple[int, int]:
    """The speed rule: (latch, evidence) after a decision whose view has this `spread` (None: not measured).
    `latch`: learned decisions left before the gate looks again; `evidence`: see the module's docstring."""
    if spread is not None:
        evidence = min(max_evidence, evidence + 1) if spread >= mixed_min_spread else max(0, evidence - 1)
    if evidence >= max_evidence:
        return dwell, evidence
    return max(0, latch - 1), evidence


def cached_fraction(view: ClusterView, request: RequestInfo) -> float:
    """The largest fraction of the request's prefix blocks one replica holds (0 without blocks)."""
    n = len(request.prefix_blocks)
    if not n:
        return 0.0
    return min(1.0, max(r.prefix_match_blocks for r in view.replicas) / n) if view.replicas else 0.0


def next_cache(share: float, on: bool, seen: int, fraction: float, window: int = CACHE_WINDOW,
               cache_on: float = CACHE_ON, cache_off: float = CACHE_OFF) -> tuple[float, bool]:
    """The cache rule: (share, on) after the `seen`-th decision (1 for the first) whose request has this cached
    `fraction`. The share is the mean of the fractions so far, then (past `window` decisions) an exponential average
    with weight 1 / `window`; `on` turns on at >= `cache_on` and off below `cache_off`."""
    share += (fraction - share) / min(seen, window)
    return share, (share >= cache_off) if on else (share >= cache_on)


class GatedPolicy(Policy):
    """`heuristic` on a uniform pool where the cache decides, `learned` everywhere else (the module's docstring has
    the rule)."""

    name = "gated"

    def __init__(self, learned: Policy, heuristic: Policy, seed: int | None = None, *,
                 mixed_min_spread: float = MIXED_MIN_SPREAD, evidence: int = MIXED_EVIDENCE,
                 dwell: int = DWELL_DECISIONS, cache_on: float = CACHE_ON, cache_off: float = CACHE_OFF,
                 cache_window: int = CACHE_WINDOW, min_measured: int = MIN_MEASURED,
                 min_measured_share: float = MIN_MEASURED_SHARE, max_load_ratio: float = MAX_LOAD_RATIO) -> None:
        super().__init__(seed)
        if not mixed_min_spread >= 1.0:
            raise ValueError(f"mixed_min_spread must be >= 1 (a ratio of speeds), got {mixed_min_spread}")
        if dwell < 1 or evidence < 1:
            raise ValueError(f"dwell and evidence must be >= 1 decision, got {dwell} and {evidence}")
        if not 0.0 <= cache_off <= cache_on <= 1.0 or cache_window < 1:
            raise ValueError(f"need 0 <= cache_off <= cache_on <= 1 and cache_window >= 1, got {cache_off}, {cache_on} "
                             f"and {cache_window}")
        if not max_load_ratio > 1.0:
            raise ValueError(f"max_load_ratio must be > 1 (a ratio of loads), got {max_load_ratio}")
        if min_measured < 1 or not 0.0 <= min_measured_share <= 1.0:
            raise ValueError(f"need min_measured >= 1 and min_measured_share in [0, 1], got {min_measured} and "
                             f"{min_measured_share}")
        self.learned = learned
        self.heuristic = heuristic
        self.mixed_min_spread = mixed_min_spread
        self.dwell = dwell
        self.max_evidence = evidence
        self.cache_on = cache_on
        self.cache_off = cache_off
        self.cache_window = cache_window
        self.min_measured = min_measured
        self.min_measured_share = min_measured_share
        self.max_load_ratio = max_load_ratio
        self._start()

    def _start(self) -> None:
        self.latch = 0  # learned decisions left before the gate looks at the speeds again
        self.evidence = 0
        self.cache_share = 0.0
        self.cache_heavy = False
        self.seen = 0  # decisions the rule has judged
        self.mode: Mode = "learned"
        self.spread: float | None = None  # the last one known
        self.spread_range = (math.inf, 0.0)  # the least and the most measured so far
        self.switches = 0
        self.decisions = {m: 0 for m in MODES}
        self._judged: OrderedDict[str, Mode] = OrderedDict()  # judged requests' modes by id (JUDGED_MEMORY)

    def _update(self, view: ClusterView, request: RequestInfo) -> Mode:
        """The request's mode: the rule applied once per request, on the view of the first question about it (the
        room stage's `binds_late`, or the pick's; FallbackPolicy may ask `best`, `scores` and `choose` for one
        decision, on the view or on the late-binding context, which carry the same floors)."""
        mode = self._judged.get(request.request_id)
        if mode is None:
            mode = self._judge(view, request)
            self._judged[request.request_id] = mode
            if len(self._judged) > JUDGED_MEMORY:
                self._judged.popitem(last=False)
        return mode

    def _judge(self, view: ClusterView, request: RequestInfo) -> Mode:
        extremes = floor_extremes(view)
        spread = speed_spread(view, self.min_measured, self.min_measured_share, extremes)
        if spread is not None:
            self.spread = spread
            lo, hi = self.spread_range
            self.spread_range = (min(lo, spread), max(hi, spread))
            if spread >= self.mixed_min_spread and (load_ratio(view, extremes) or 1.0) >= self.max_load_ratio:
                spread = None  # the load explains it (the module's docstring)
        self.latch, self.evidence = next_state(self.latch, self.evidence, spread, self.mixed_min_spread,
                                               self.max_evidence, self.dwell)
        self.seen += 1
        self.cache_share, self.cache_heavy = next_cache(self.cache_share, self.cache_heavy, self.seen,
                                                        cached_fraction(view, request), self.cache_window,
                                                        self.cache_on, self.cache_off)
        mode: Mode = "heuristic" if self.cache_heavy and self.latch == 0 else "learned"
        if mode != self.mode:
            self.mode = mode
            self.switches += 1
        return mode

    # FallbackPolicy asks `best` (no late-binding context), else `scores`, and `choose` when both say None:
    # the learned policy answers the first two in `learned` mode, the heuristic the third in `heuristic` mode.
    def best(self, view: ClusterView, request: RequestInfo) -> tuple[int, bool] | None:
        if self._update(view, request) != "learned":
            return None
        self.decisions["learned"] += 1
        best = self.learned.best(view, request)
        if best is not None:
            return best
        return best_of(np.asarray(self.learned.scores(view, request), dtype=np.float64),
                       [r.healthy for r in view.replicas])

    def scores(self, view: ClusterView, request: RequestInfo) -> np.ndarray | None:
        if self._update(view, request) != "learned":
            return None
        self.decisions["learned"] += 1
        return self.learned.scores(view, request)

    @property
    def last_input(self):
        """The learned policy's last model input (the decision log reuses it when its view is the decision's)."""
        return getattr(self.learned, "last_input", None)

    def binds_late(self, view: ClusterView, request: RequestInfo) -> bool:
        """Not while the heuristic routes: behind late binding a held request goes to whichever replica frees first,
        which undoes what a cache-aware pick wins (docs/peers.md, "The gate"). The room stage asks before a request
        can be held, so the rule judges the request here (the module's docstring)."""
        return self._update(view, request) != "heuristic"

    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        mode = self._update(view, request)
        self.decisions[mode] += 1
        return (self.learned if mode == "learned" else self.heuristic).choose(view, request)

    def on_complete(self, replica_id: str, request: RequestInfo, outcome: Outcome) -> None:
        self.learned.on_complete(replica_id, request, outcome)
        self.heuristic.on_complete(replica_id, request, outcome)

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self.learned.reset(seed)
        self.heuristic.reset(seed)
        self._start()

    def describe(self) -> dict:
        learned = self.learned.describe()
        # the learned model's version, feature hash and load state: what the router's policy info reports
        return {**{k: v for k, v in learned.items() if k != "name"}, "name": self.name, "mode": self.mode,
                "speed_spread": self.spread, "switches": self.switches, "decisions": dict(self.decisions),
                "mixed_min_spread": self.mixed_min_spread, "max_load_ratio": self.max_load_ratio, "dwell": self.dwell,
                "latch": self.latch, "evidence": self.evidence, "cache_share": self.cache_share,
                "cache_heavy": self.cache_heavy,
                "learned": learned, "heuristic": self.heuristic.describe()}
