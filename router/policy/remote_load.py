"""The other routers' in-flight load, folded into one router's trackers (the live router's shared fleet view,
router.scale.fleet_view, and the simulator's `shared_state_lag_s` run this same code).

A tracker's shared counters (SHARED_FIELDS) become its own counts plus the others' latest sums: the fold is
done when new sums arrive (every sync interval), not at every decision, so views, the C view builder, the
late-binding rule, metrics and the admin API read fleet-wide counts at no cost per decision. The hooks keep
adding and subtracting this router's own requests on top, so its own counts are always `field - applied`.
"""

from __future__ import annotations

from collections.abc import Mapping

from routewise_vllm.router.policy.tracking import ClusterTracker, ReplicaTracker

# What one router contributes to a replica's load in the others' views: requests in flight, their prompt and
# expected decode tokens, those awaiting a first token and their prompt tokens. Not dispatched_since_scrape
# (each router counts its own since its own scrape) nor anything measured (EMAs, scraped stats).
SHARED_FIELDS = ("outstanding", "outstanding_prompt_tokens", "outstanding_decode_tokens", "awaiting_first_token",
                 "awaiting_prompt_tokens")
Counts = tuple[int, int, int, int, int]
ZERO: Counts = (0, 0, 0, 0, 0)


def own_counts(t: ReplicaTracker, applied: Counts = ZERO) -> Counts:
    return (t.outstanding - applied[0], t.outstanding_prompt_tokens - applied[1],
            t.outstanding_decode_tokens - applied[2], t.awaiting_first_token - applied[3],
            t.awaiting_prompt_tokens - applied[4])


class RemoteLoad:
    """Others' sums folded into `cluster`'s trackers. A tracker replaced under the same replica id (removed, then
    discovered again) starts with nothing folded in."""

    def __init__(self, cluster: ClusterTracker) -> None:
        self.cluster = cluster
        self._applied: dict[str, tuple[ReplicaTracker, Counts]] = {}

    def applied(self, replica_id: str) -> Counts:
        t = self.cluster.by_id.get(replica_id)
        entry = self._applied.get(replica_id)
        return entry[1] if entry is not None and t is not None and entry[0] is t else ZERO

    def own(self) -> dict[str, Counts]:
        """This router's own counts per replica (the fleet view publishes them)."""
        return {t.replica_id: own_counts(t, self.applied(t.replica_id)) for t in self.cluster.trackers}

    def apply(self, sums: Mapping[str, Counts]) -> bool:
        """Makes every tracker count its own requests plus `sums` (the others', by replica id; absent = none).
        True if any tracker's counts changed."""
        changed = False
        applied = self._applied
        for t in self.cluster.trackers:
            rid = t.replica_id
            new = sums.get(rid, ZERO)
            entry = applied.get(rid)
            old = entry[1] if entry is not None and entry[0] is t else ZERO
            if new == old:
                if entry is not None and entry[0] is not t:
                    del applied[rid]
                continue
            changed = True
            t.outstanding += new[0] - old[0]
            t.outstanding_prompt_tokens += new[1] - old[1]
            t.outstanding_decode_tokens += new[2] - old[2]
            t.awaiting_first_token += new[3] - old[3]
            t.awaiting_prompt_tokens += new[4] - old[4]
            if new == ZERO:
                applied.pop(rid, None)
            else:
                applied[rid] = (t, new)
        for rid in [r for r in applied if r not in self.cluster.by_id]:
            del applied[rid]  # removed: a re-added replica gets a new tracker
        return changed
