"""Outlier detection on real request outcomes: per-replica windows of failures and time to first byte,
and the attempts in flight (so a stalled replica's unanswered requests can be aborted and retried).

Only failures blamed on the replica enter a window (see Proxy._forward: a 5xx or reset the same request
also gets from another replica is the request's fault, not the replica's).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

EJECTION_REASONS = ("consecutive_failures", "request_failures", "stream_failures", "slow_first_byte", "stalled")


@dataclass(frozen=True, slots=True)
class EjectionConfig:
    """When a replica is taken out of rotation for its request outcomes (the breaker and outlier detection);
    the settings of the same names (RouterSettings.replica_config builds it)."""

    breaker_failure_threshold: int
    breaker_cooldown_s: float
    max_ejected_ratio: float
    outlier_window: int
    outlier_min_requests: int
    outlier_failure_ratio: float
    outlier_ttfb_ratio: float
    outlier_ttfb_min_s: float
    stall_timeout_s: float


class Inflight:
    """One attempt on a replica; `abort()` ends it. Before its first byte: a streamed attempt's first-byte
    timeout fires now, a non-streamed attempt's task is cancelled (the proxy turns either into a retryable
    failure); afterwards the upstream response is closed (the client gets an SSE error event)."""

    __slots__ = ("started", "last", "timeout", "task", "response", "aborted")

    def __init__(self, timeout: asyncio.Timeout | None, task: asyncio.Task | None) -> None:
        self.started = self.last = time.perf_counter()  # last: the last byte of a stream
        self.timeout = timeout
        self.task = task
        self.response = None
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        if self.response is not None:  # closing alone would not wake a pending read: fail it first
            self.response.content.set_exception(aiohttp.ClientPayloadError("replica stalled: stream aborted"))
            self.response.close()
        elif self.timeout is not None and not self.timeout.expired():
            with contextlib.suppress(RuntimeError):  # its block already ended: nothing left to abort
                self.timeout.reschedule(asyncio.get_running_loop().time())
        elif self.task is not None:
            self.task.cancel("replica stalled")


@dataclass(slots=True)
class OutlierState:
    window: int
    requests: deque[bool] = field(init=False)  # True = failed (non-streamed)
    streams: deque[bool] = field(init=False)
    ttfb: deque[float] = field(init=False)
    inflight: set[Inflight] = field(default_factory=set)
    last_progress: float = field(default_factory=time.perf_counter)  # last byte from the replica
    ejections: dict[str, int] = field(default_factory=dict)  # by reason

    def __post_init__(self) -> None:
        self.requests = deque(maxlen=self.window)
        self.streams = deque(maxlen=self.window)
        self.ttfb = deque(maxlen=self.window)

    def record(self, stream: bool, failed: bool, ttfb_s: float | None = None) -> None:
        (self.streams if stream else self.requests).append(failed)
        if ttfb_s is not None:
            self.ttfb.append(ttfb_s)

    def failure_reason(self, min_requests: int, ratio: float) -> str | None:
        for reason, w in (("stream_failures", self.streams), ("request_failures", self.requests)):
            if len(w) >= min_requests and sum(w) >= ratio * len(w):
                return reason
        return None

    def clear_windows(self) -> None:
        self.requests.clear()
        self.streams.clear()
        self.ttfb.clear()

    def stalled_for(self, now: float) -> float:
        """Seconds since the replica last sent a byte while at least one attempt waited on it (0 if none)."""
        if not self.inflight:
            return 0.0
        oldest = min(a.started for a in self.inflight)
        return now - max(self.last_progress, oldest)


def stalled_streams(state: OutlierState, now: float, timeout_s: float) -> list[Inflight]:
    """Streams of one replica silent for `timeout_s` since their last chunk (vLLM streams tokens steadily)."""
    return [a for a in state.inflight if a.response is not None and now - a.last >= timeout_s]


def ttfb_outliers(states: dict[str, OutlierState], min_samples: int, ratio: float, min_s: float) -> list[str]:
    """Replicas whose median time to first byte is `ratio` x the median of all their peers' samples and > min_s."""
    medians = {rid: statistics.median(s.ttfb) for rid, s in states.items() if len(s.ttfb) >= min_samples}
    out = []
    for rid, m in medians.items():
        peers = [x for pid, s in states.items() if pid != rid for x in s.ttfb]
        if len(peers) >= min_samples and m > min_s and m > ratio * statistics.median(peers):
            out.append(rid)
    return out


def stalled(states: dict[str, OutlierState], now: float, timeout_s: float,
            routable: Callable[[str], bool]) -> list[str]:
    """Replicas silent for `timeout_s` with attempts waiting on them, while some routable peer is not (it sent
    bytes meanwhile, or has nothing to do). When every replica is silent (say, all busy with long non-streamed
    generations) none is judged stalled."""
    out = []
    for rid, s in states.items():
        if s.stalled_for(now) >= timeout_s and any(
            pid != rid and routable(pid) and p.stalled_for(now) < timeout_s for pid, p in states.items()
        ):
            out.append(rid)
    return out
