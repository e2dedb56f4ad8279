"""A replica's batch limit (vLLM's --max-num-seqs), for late binding's room: the operator's where given, otherwise
inferred from the replica's own /metrics, which do not export it.

vLLM never runs more than max_num_seqs requests at once, and leaves the rest waiting once that many run (or once
its KV cache is full, whichever comes first). So the running count it plateaus at while requests wait is its
limit, capped by what its KV cache holds. A single scrape with requests waiting is not yet a plateau: in a burst,
one scheduler step's token budget admits a few prompts and leaves the others waiting at a running count below
the limit. The same running count with requests waiting on PLATEAU_SCRAPES scrapes in a row is. Once inferred,
any larger running count raises it (no server runs more than its cap); it never falls.

A plateau can also be a step below the limit (two scrapes in a row where the scheduler's token budget, not the
cap, left a request waiting). Late binding then holds the replica at that count, and a count it never reaches cannot
raise the limit. So once the replica has run exactly its inferred limit with nothing waiting for PROBE_SCRAPES
scrapes in a row (the router, not the replica, holding the rest back), the router may send it one more (`cap`):
where the limit is higher it runs, and the running count raises the limit; where it is the limit, the extra request
waits at the replica (as it would without late binding) and that plateau ends the probe until the next such run.

Until a replica's limit is inferred, the router does not hold requests for it on a count (only its KV-derived
limit applies, as late binding always had): nothing waits in the router on a guess, the replica's own queue takes
the excess as it does without late binding, and that queueing is what reveals the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

PLATEAU_SCRAPES = 2
PROBE_SCRAPES = 3
UNKNOWN_LIMIT = 1 << 30  # no count limit: only the KV-derived one (router.policy.late_binding.replica_limit)
#: Where a replica's batch limit comes from (the llm_router_replica_batch_limit label).
SOURCES = ("operator", "inferred")


@dataclass(slots=True)
class BatchLimitInference:
    limit: int | None = None  # inferred; None until a plateau was seen
    probing: bool = False  # late binding may send one more than `limit` (the module's docstring)
    _candidate: int | None = None
    _streak: int = 0
    _full: int = 0  # scrapes in a row at exactly `limit` running with nothing waiting

    @property
    def cap(self) -> int | None:
        """The count late binding holds the replica to: the limit, one more while probing."""
        return None if self.limit is None else self.limit + self.probing

    def observe(self, running: int | None, waiting: int | None) -> int | None:
        """One scrape's vllm:num_requests_running and vllm:num_requests_waiting; returns the limit inferred so far."""
        if running is None or waiting is None:
            return self.limit
        before = self.limit
        if self.limit is not None and running > self.limit:
            self.limit, self.probing = running, False
        if waiting > 0 and running > 0:
            if running == self._candidate:
                self._streak += 1
            else:
                self._candidate, self._streak = running, 1
            if self._streak >= PLATEAU_SCRAPES and (self.limit is None or running > self.limit):
                self.limit = running
            if running == self.limit:
                self.probing = False  # the probe's request waited: the limit holds
        else:
            self._candidate, self._streak = None, 0
        full = self.limit is not None and self.limit == before and running == self.limit and waiting == 0
        self._full = self._full + 1 if full else 0  # a new limit starts a new run
        if self._full >= PROBE_SCRAPES:
            self.probing = True
        return self.limit
