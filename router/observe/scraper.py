"""Scrape every replica's vLLM /metrics concurrently and push the numbers into the tracker.

A failed scrape (timeout, HTTP error, unparsable page) is counted and leaves the tracker
untouched, so the replica's stats age keeps growing. A page that parses but lacks a metric is
counted as `missing_metric` and that value is None (never zero); a page with none of the
required metrics counts as failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from routewise_vllm.router.logsafe import safe
from routewise_vllm.router.replicas import Replica, ReplicaSet
from routewise_vllm.router.telemetry import RouterMetrics
from routewise_vllm.router.observe.vllm_metrics import REQUIRED, MetricsParseError, VllmStats, parse_vllm_metrics

log = logging.getLogger("router.scraper")


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """The settings of the same names (RouterSettings.scrape_config builds it)."""

    scrape_interval_s: float
    scrape_timeout_s: float  # at most scrape_interval_s


class Scraper:
    def __init__(
        self, config: ScrapeConfig, replicas: ReplicaSet, session_getter: Callable[[], aiohttp.ClientSession],
        metrics: RouterMetrics,
    ) -> None:
        self.replicas = replicas
        self._session = session_getter
        self.metrics = metrics
        self.interval_s = config.scrape_interval_s
        self.timeout_s = config.scrape_timeout_s

    def _fail(self, rep: Replica, kind: str, detail: str) -> None:
        self.metrics.scrape_errors.labels(rep.id, kind).inc()
        rep.scrape_error = f"{kind}: {detail}"
        log.debug("scrape of %s failed: %s: %s", rep.id, kind, safe(detail))

    async def scrape(self, rep: Replica) -> VllmStats | None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._session().get(rep.url / "metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    await resp.read()
                    self._fail(rep, "http", f"HTTP {resp.status}")
                    return None
                text = await resp.text(errors="replace")
        except asyncio.TimeoutError:
            self._fail(rep, "timeout", f"no answer within {self.timeout_s}s")
            return None
        except (aiohttp.ClientError, OSError) as exc:
            self._fail(rep, "connect", f"{type(exc).__name__}: {exc}")
            return None
        try:
            stats = parse_vllm_metrics(text)
        except MetricsParseError as exc:
            self._fail(rep, "parse", str(exc))
            return None
        missing = stats.missing()
        if missing:
            self._fail(rep, "missing_metric", ", ".join(missing))
            if len(missing) == len(REQUIRED):
                return None
        else:
            rep.scrape_error = None
        # clock read after the answer: the values are as fresh as this moment
        rep.tracker.on_scrape(
            self.replicas.clock(), stats.waiting, stats.running, stats.kv_cache_usage, stats.kv_capacity_tokens,
            stats.lora,
        )
        before = rep.batch.limit
        if rep.batch.observe(stats.running, stats.waiting) != before:
            log.debug("replica %s: batch limit %d inferred from its /metrics (running while requests wait)", rep.id,
                     rep.batch.limit)
        prev = rep.scrape.generation_tokens if isinstance(rep.scrape, VllmStats) else None
        if prev is not None and stats.generation_tokens is not None and stats.generation_tokens > prev:
            rep.outlier.last_progress = time.perf_counter()  # generating: a long non-streamed answer is not a stall
        rep.scrape = stats
        return stats

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(r) for r in list(self.replicas.ordered)))
        self.replicas.notify()

    async def run(self) -> None:
        """Scrape every interval (the first scrape is the caller's, at startup)."""
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at = max(next_at + self.interval_s, loop.time())
            await self.scrape_all()
