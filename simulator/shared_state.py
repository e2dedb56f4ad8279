"""Several routers sharing a fleet view (`ClusterConfig.shared_state_lag_s`), as the live router's
`--shared-state` does (router.scale.fleet_view): before each decision, router k's trackers count its own requests
plus the other routers' as they were `lag_s` ago, folded in by the live router's code
(router.policy.remote_load.RemoteLoad).

Every router's own counts are sampled at each decision (they change only at events, and decisions come
milliseconds apart), and router k sees the latest sample at least `lag_s` old; before the first such
sample it sees nobody else's. Lag 0 is an instant shared view of the counts; the prefix index, the TTFT and
TPOT estimates and `dispatched_since_scrape` stay each router's own, as live.
"""

from __future__ import annotations

from collections import deque

from routewise_vllm.router.policy.remote_load import Counts, RemoteLoad, own_counts
from routewise_vllm.router.policy.tracking import ClusterTracker


class LaggedFleetView:
    def __init__(self, routers: list[ClusterTracker], lag_s: float) -> None:
        self.loads = [RemoteLoad(r) for r in routers]
        self.lag_s = lag_s
        self._history: deque[tuple[float, list[list[Counts]]]] = deque()

    def _sample(self) -> list[list[Counts]]:
        return [[own_counts(t, load.applied(t.replica_id)) for t in load.cluster.trackers] for load in self.loads]

    def own_in_flight(self) -> bool:
        """Any router has a request of its own in flight (the folded counts may be stale)."""
        return any(c[0] for row in self._sample() for c in row)

    def before_view(self, k: int, t: float) -> None:
        """Folds the others' counts as of t - lag into router k's trackers."""
        owns: list[list[Counts]] | None = self._sample()
        if self.lag_s > 0:
            h = self._history
            h.append((t, owns))  # type: ignore[arg-type]
            cutoff = t - self.lag_s
            while len(h) > 1 and h[1][0] <= cutoff:
                h.popleft()
            owns = h[0][1] if h[0][0] <= cutoff else None
        load = self.loads[k]
        if owns is None:
            load.apply({})
            return
        sums: dict[str, Counts] = {}
        for i, tr in enumerate(load.cluster.trackers):
            acc = [0, 0, 0, 0, 0]
            for j, row in enumerate(owns):
                if j != k:
                    c = row[i]
                    if c[0] or c[1] or c[2]:
                        acc[0] += c[0]
                        acc[1] += c[1]
                        acc[2] += c[2]
                        acc[3] += c[3]
                        acc[4] += c[4]
            if acc[0] or acc[1] or acc[2]:
                sums[tr.replica_id] = tuple(acc)  # type: ignore[assignment]
        load.apply(sums)
