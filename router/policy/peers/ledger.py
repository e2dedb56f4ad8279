"""What a peer router tracks per request and the view sums over: the cached part of each in-flight request.

llm-d and Dynamo count, per replica, the *uncached* prompt tokens of requests still in prefill (each request's prompt
minus the prefix the replica had cached when it was routed) and Dynamo the distinct KV blocks of active requests. The
router's snapshot has the exact totals of in-flight prompt tokens (`awaiting_prompt_tokens` before the first token,
`outstanding_prompt_tokens` until completion) but not their cached part, so a peer keeps a ledger of what it sent
where, and scales the exact totals by the ledger's fractions:

- in prefill: the replica's last `awaiting_first_token` requests (vLLM prefills in arrival order, so the requests
  still waiting for a first token are the most recent ones sent there);
- active: its requests not yet completed (`on_complete` removes them; the oldest beyond `outstanding` are dropped,
  so a request whose completion never reaches the policy does not stay forever).

Counts always come from the snapshot; the ledger only supplies fractions, so a missed record (a request routed by
another policy, a probe decision never dispatched) skews a fraction, never a count.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from routewise_vllm.router.policy.types import ReplicaSnapshot, RequestInfo


def uncached_tokens(request: RequestInfo, match_blocks: int) -> float:
    """The request's prompt tokens a replica holding `match_blocks` of its prefix blocks must still compute."""
    n = len(request.prefix_blocks)
    return request.prompt_tokens_est * (1.0 - min(match_blocks, n) / n) if n else float(request.prompt_tokens_est)


class _Replica:
    __slots__ = ("prefill", "prefill_prompt", "prefill_uncached", "active", "blocks", "active_blocks")

    def __init__(self) -> None:
        self.prefill: OrderedDict[str, tuple[int, float]] = OrderedDict()  # request id -> (prompt, uncached)
        self.prefill_prompt = 0
        self.prefill_uncached = 0.0
        self.active: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # request id -> prefix blocks
        self.blocks: Counter[int] = Counter()  # distinct blocks of the active requests, with their counts
        self.active_blocks = 0  # sum of len(prefix blocks) over the active requests

    def drop_prefill(self, request_id: str) -> None:
        entry = self.prefill.pop(request_id, None)
        if entry is not None:
            self.prefill_prompt -= entry[0]
            self.prefill_uncached -= entry[1]

    def drop_active(self, request_id: str) -> None:
        blocks = self.active.pop(request_id, None)
        if blocks is None:
            return
        self.active_blocks -= len(blocks)
        counts = self.blocks
        for b in blocks:
            c = counts[b] - 1
            if c:
                counts[b] = c
            else:
                del counts[b]


class InflightLedger:
    """Per replica id, the requests this policy routed there that are still in prefill or in flight."""

    def __init__(self, track_blocks: bool = False) -> None:
        self.track_blocks = track_blocks
        self._reps: dict[str, _Replica] = {}

    def clear(self) -> None:
        self._reps.clear()

    def _rep(self, replica_id: str) -> _Replica:
        rep = self._reps.get(replica_id)
        if rep is None:
            rep = self._reps[replica_id] = _Replica()
        return rep

    def sync(self, r: ReplicaSnapshot) -> None:
        """Keep no more records than the snapshot counts: the most recent ones."""
        rep = self._reps.get(r.replica_id)
        if rep is None:
            return
        while len(rep.prefill) > r.awaiting_first_token:
            rep.drop_prefill(next(iter(rep.prefill)))
        if self.track_blocks:
            while len(rep.active) > r.outstanding:
                rep.drop_active(next(iter(rep.active)))

    def record(self, replica_id: str, request: RequestInfo, uncached: float) -> None:
        rep = self._rep(replica_id)
        rid = request.request_id
        rep.drop_prefill(rid)  # a retried id replaces its earlier record
        rep.prefill[rid] = (request.prompt_tokens_est, uncached)
        rep.prefill_prompt += request.prompt_tokens_est
        rep.prefill_uncached += uncached
        if self.track_blocks:
            rep.drop_active(rid)
            blocks = request.prefix_blocks
            rep.active[rid] = blocks
            rep.active_blocks += len(blocks)
            rep.blocks.update(blocks)

    def forget(self, replica_id: str, request_id: str) -> None:
        rep = self._reps.get(replica_id)
        if rep is not None:
            rep.drop_prefill(request_id)
            rep.drop_active(request_id)

    def uncached_in_prefill(self, r: ReplicaSnapshot) -> float:
        """Uncached prompt tokens of the replica's requests without a first token: the snapshot's exact prompt total,
        scaled by the uncached fraction of the ledger's records (all of it when there are none)."""
        total = r.awaiting_prompt_tokens
        rep = self._reps.get(r.replica_id)
        if rep is None or rep.prefill_prompt <= 0 or total <= 0:
            return float(max(total, 0))
        return total * min(1.0, max(0.0, rep.prefill_uncached / rep.prefill_prompt))

    def distinct_active_tokens(self, r: ReplicaSnapshot) -> float:
        """Prompt tokens of the replica's in-flight requests with shared prefix blocks counted once: the snapshot's
        exact total scaled by the distinct fraction of the ledger's blocks."""
        total = r.outstanding_prompt_tokens
        rep = self._reps.get(r.replica_id)
        if rep is None or rep.active_blocks <= 0 or total <= 0:
            return float(max(total, 0))
        return total * len(rep.blocks) / rep.active_blocks

    def active_shared_blocks(self, replica_id: str, blocks: tuple[int, ...]) -> int:
        """How many of `blocks` (a chained prefix) the replica's in-flight requests already hold."""
        rep = self._reps.get(replica_id)
        if rep is None or not rep.blocks:
            return 0
        n = 0
        for b in blocks:
            if b not in rep.blocks:
                break
            n += 1
        return n
