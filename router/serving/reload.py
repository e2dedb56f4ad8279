"""Hot reload of a learned policy file, on request (admin API) or when the file changes.

A candidate is built and checked off the event loop (onnxruntime session creation takes tens
of milliseconds): it must load, match the feature spec, and give finite scores of the right
shape on probe views. Only then is it installed, by swapping one reference on the event-loop
thread: decisions already made keep their replica, every later decision uses the new policy,
no request waits or fails. A bad file leaves the old policy serving and says why (result,
`llm_router_policy_reload_total{result}`, a log line).
Replace files atomically (write elsewhere, then rename): a half-written file is refused and
retried when it changes again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from routewise_vllm.router.policy.base import Policy, PolicyUnavailable
from routewise_vllm.router.policy.registry import is_learned, model_policy
from routewise_vllm.router.policy.registry import model_path as registry_model_path
from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo

log = logging.getLogger("router.reload")


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    result: str  # "ok" or why the file was refused (a bounded label)
    message: str
    path: str | None
    at_unix_s: float
    policy: dict | None = None  # describe() of the policy serving after the attempt

    def as_dict(self) -> dict:
        return asdict(self)


def is_reloadable(spec: str) -> bool:
    return is_learned(spec)


def model_path(spec: str) -> Path:
    path = registry_model_path(spec)
    assert path is not None, spec
    return path


def probe_views() -> list[tuple[ClusterView, RequestInfo]]:
    """Small synthetic situations every usable policy must score with finite numbers."""
    out = []
    for n in (1, 3, 8):
        reps = tuple(
            ReplicaSnapshot(
                f"probe-{i}", healthy=(i != 1 or n == 1), outstanding=i * 3, outstanding_prompt_tokens=i * 900,
                outstanding_decode_tokens=i * 200, waiting=i, running=2 * i, kv_cache_usage=0.1 * i,
                kv_capacity_tokens=65536, stats_age_s=0.5, dispatched_since_scrape=i, prefix_match_blocks=i % 2,
                ttft_ema_s=0.05 * (i + 1), tpot_ema_s=0.02,
            )
            for i in range(n)
        )
        out.append((ClusterView(reps), RequestInfo(f"probe-{n}", 700, 128, (1, 2, 3))))
    return out


def check_policy(policy: Policy) -> tuple[str, str] | None:
    """None if `policy` can serve, else (reason, message)."""
    err = getattr(policy, "load_error", None)
    if err is not None:
        return getattr(err, "reason", "unavailable"), str(err)
    for view, request in probe_views():
        try:
            raw = policy.scores(view, request)
            if raw is None:  # not a scoring policy (router.policy.base.Policy.scores)
                policy.choose(view, request)
                continue
            s = np.asarray(raw, dtype=np.float64)
        except PolicyUnavailable as exc:
            return exc.reason, str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure refuses the file
            return "exception", f"probe with {len(view)} replicas raised {type(exc).__name__}: {exc}"
        healthy = np.array([r.healthy for r in view.replicas])
        if s.shape != (len(view),) or not np.all(np.isfinite(s[healthy])):
            return "nan", f"probe with {len(view)} replicas: scores {s.tolist()} are not finite or not of shape ({len(view)},)"
    return None


class PolicyReloader:
    """Reloads one learned policy (`spec`: `learned`, `gated`, a shipped model's name or a path) from a model file and
    hands it to `install`, built as `spec` builds it (registry.model_policy)."""

    def __init__(
        self,
        spec: str,
        install: Callable[[Policy], None],
        *,
        seed: int | None = None,
        metrics=None,  # router.serving.metrics.ServingMetrics or None
        label: str = "main",
        current: Callable[[], dict] | None = None,  # describe() of the serving policy
    ) -> None:
        self.spec = spec
        self.path: Path | None = model_path(spec) if is_reloadable(spec) else None
        self.install = install
        self.seed = seed
        self.metrics = metrics
        self.label = label
        self.current = current
        self.history: deque[ReloadResult] = deque(maxlen=20)
        self._lock = asyncio.Lock()

    def build(self, path: Path) -> tuple[Policy | None, str, str]:
        """(policy or None, result, message). Blocking: run it off the event loop."""
        try:
            policy = model_policy(self.spec, path, seed=self.seed)  # `gated` stays gated
        except Exception as exc:  # noqa: BLE001
            return None, "exception", f"{path}: {type(exc).__name__}: {exc}"
        problem = check_policy(policy)
        if problem is not None:
            return None, problem[0], problem[1]
        return policy, "ok", f"{path}: loaded {policy.describe().get('version', '')}".rstrip()

    async def reload(self, path: str | Path | None = None) -> ReloadResult:
        """Build `path` (default: the current file) in a thread, install it if it is usable."""
        async with self._lock:
            target = Path(path) if path is not None else self.path
            if target is None:
                return self._finish(None, "not_reloadable", f"policy {self.spec!r} is not a model file; give a path", None)
            if target.suffix != ".onnx":
                return self._finish(None, "not_reloadable", f"{target}: not an .onnx file", str(target))
            policy, result, message = await asyncio.to_thread(self.build, target)
            if policy is not None:
                self.install(policy)  # one reference swap on the event-loop thread
                self.path = target
            return self._finish(policy, result, message, str(target))

    def _finish(self, policy: Policy | None, result: str, message: str, path: str | None) -> ReloadResult:
        ok = policy is not None
        serving = self.current() if self.current is not None else (policy.describe() if policy is not None else None)
        res = ReloadResult(ok, result, message, path, time.time(), serving)
        self.history.append(res)
        if self.metrics is not None:
            self.metrics.policy_reloads.labels(result).inc()
        if ok:
            log.info("policy reload (%s): %s", self.label, message)
        else:
            log.warning("policy reload (%s) refused, keeping the current policy: %s", self.label, message)
        return res

    def describe(self) -> dict:
        return {
            "spec": self.spec,
            "path": None if self.path is None else str(self.path),
            "last": self.history[-1].as_dict() if self.history else None,
            "history": [r.as_dict() for r in self.history],
        }


def file_signature(path: Path) -> tuple[int, int, int] | None:
    """(mtime_ns, size, inode), or None if the file does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class PolicyFileWatcher:
    """Polls the reloader's file every `interval_s` and reloads when it changed."""

    def __init__(self, reloader: PolicyReloader, interval_s: float = 5.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"policy_watch_interval_s={interval_s}: must be > 0")
        self.reloader = reloader
        self.interval_s = interval_s
        self._path = reloader.path
        self._sig = file_signature(reloader.path) if reloader.path else None

    async def check_once(self) -> ReloadResult | None:
        """Reload if the watched file changed since the last look (the reloader's current path;
        an admin reload to another path moves the watch there)."""
        path = self.reloader.path
        if path is None:
            return None
        sig = file_signature(path)
        if path != self._path:
            self._path, self._sig = path, sig
            return None
        if sig == self._sig:
            return None
        self._sig = sig  # a refused file is retried only when it changes again
        if sig is None:
            log.warning("policy file %s disappeared; the policy in memory keeps serving", path)
            return None
        return await self.reloader.reload(path)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - the watcher must outlive any single failure
                log.exception("policy file watch")
