"""Per-request metric observations applied in batches, off the requests' path.

A prometheus_client observation takes a lock per value (a histogram: its sum and one bucket, found by a Python loop
over the bounds), about 1-2 us each, and a request makes several (decision latency, E2E, its code class, its model's
decision count; a stream its TTFT and inter-token gaps). Here a request appends to a list or adds to a number; the
batch applies them every `interval_s`, a histogram's sum once and each bucket hit once. Nothing is lost or late for a
reader: a `FlushingRegistry` applies the batch before it is collected (/metrics, get_sample_value). With several
workers (prometheus_client's multiprocess mode) another worker's /metrics reads this worker's files, so there the
batch is applied after each turn of the event loop instead.

Histograms are updated through prometheus_client's child internals (`_sum`, `_buckets`, `_upper_bounds`): the
library has no batch API. tests/router/test_metric_batch.py holds the result to `Histogram.observe`'s, sample for
sample.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import Counter as Hits
from typing import Any

from prometheus_client import CollectorRegistry, values


class Tally:
    """A histogram child's observations waiting for the batch: `observe` as the child's."""

    __slots__ = ("_batch", "_child", "values")

    def __init__(self, batch: Batch, child: Any) -> None:
        self._batch = batch
        self._child = child
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)
        if len(self.values) == 1:
            self._batch.pending(self)

    def apply(self) -> None:
        vals, self.values = self.values, []
        child = self._child
        child._sum.inc(sum(vals))
        bounds, buckets = child._upper_bounds, child._buckets  # each value counts in the first bucket >= it
        if len(vals) == 1:
            buckets[bisect_left(bounds, vals[0])].inc(1)
        else:
            for i, n in Hits(bisect_left(bounds, v) for v in vals).items():
                buckets[i].inc(n)


class Count:
    """A counter child's increments waiting for the batch: `inc` as the child's."""

    __slots__ = ("_batch", "_child", "n")

    def __init__(self, batch: Batch, child: Any) -> None:
        self._batch = batch
        self._child = child
        self.n = 0

    def inc(self, amount: int = 1) -> None:
        self.n += amount
        if self.n == amount:
            self._batch.pending(self)

    def apply(self) -> None:
        n, self.n = self.n, 0
        self._child.inc(n)


class Batch:
    """The observations waiting, applied every `interval_s` (None: after each turn of the event loop; with several
    workers' metrics in shared files) and before every collection."""

    __slots__ = ("interval_s", "_pending", "_handle")

    def __init__(self, interval_s: float | None = 0.01) -> None:
        if interval_s is not None and getattr(values.ValueClass, "_multiprocess", False):
            interval_s = None  # another worker's /metrics reads this one's values: no waiting for a timer
        self.interval_s = interval_s
        self._pending: list[Tally | Count] = []
        self._handle: asyncio.Handle | None = None

    def tally(self, child: Any) -> Tally:
        return Tally(self, child)

    def count(self, child: Any) -> Count:
        return Count(self, child)

    def pending(self, item: Tally | Count) -> None:
        self._pending.append(item)
        if self._handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a synchronous caller (no event loop): applied at once
                self.flush()
                return
            self._handle = (loop.call_soon(self.flush) if self.interval_s is None
                            else loop.call_later(self.interval_s, self.flush))

    def flush(self) -> None:
        """Applies every observation waiting."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        pending, self._pending = self._pending, []
        for item in pending:
            item.apply()


class FlushingRegistry(CollectorRegistry):
    """A registry that applies its batch before each collection."""

    def __init__(self, batch: Batch, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batch = batch

    def collect(self):  # type: ignore[override]
        self.batch.flush()
        yield from super().collect()
