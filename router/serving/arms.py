"""A/B rollout: a stable hash split of request keys between a control and a treatment policy,
and a guard that rolls the treatment back when it serves worse than control.

The split hashes a request key with blake2b (stable across processes, restarts and Python
versions, unlike `hash()`), so one user or session always lands in the same arm. The guard
keeps, per arm, a sliding window of outcomes (the last `window_requests`, none older than
`window_s`) and trips when, with at least `min_samples` outcomes in each arm, the treatment's
p99 time to first byte exceeds control's by more than `max_p99_ratio`, or its error rate
exceeds control's by more than `max_error_rate_delta`, in `confirm_checks` consecutive checks, and significantly (the treatment's
p99 lower bound above control's upper bound; a two-proportion z-test on errors). A tripped guard latches: all traffic
goes to control until an operator resets it (`POST /admin/ab/reset`).
Times are passed in by the caller; nothing here reads a clock.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

ARMS = ("control", "treatment")
# Request headers that carry a stable routing key, in order of preference.
KEY_HEADERS = ("x-routewise-key", "x-user-id", "x-session-id")


def routing_key(headers: Mapping[str, str], body_user: str | None, request_id: str) -> str:
    """The key a request is split by: a routing header, else the OpenAI `user` field, else the
    request id (then each request is split independently)."""
    for name in KEY_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return body_user if body_user else request_id


def stable_fraction(key: str) -> float:
    """A uniform number in [0, 1) fixed by `key` (first 8 bytes of blake2b)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass(frozen=True, slots=True)
class GuardConfig:
    window_requests: int = 1000  # per arm
    window_s: float = 300.0
    min_samples: int = 500  # per arm, before the guard may trip (a p99 needs hundreds of samples)
    max_p99_ratio: float = 1.2  # treatment p99 / control p99
    max_error_rate_delta: float = 0.01  # treatment error rate - control error rate
    check_every: int = 20  # evaluate after this many recorded outcomes (p99 over a window is not free)
    # trip only when this many consecutive evaluations breach: a p99 over a few hundred samples is
    # noisy (two equal arms differ by >1.2x now and then), a real regression breaches every time
    confirm_checks: int = 3
    # and only when the difference is significant: one-sided z of the distribution-free p99
    # bounds (order statistics) and of the two-proportion test on error rates
    z: float = 1.645

    def __post_init__(self) -> None:
        for name in ("window_requests", "min_samples", "check_every", "confirm_checks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.min_samples > self.window_requests:
            raise ValueError(f"min_samples={self.min_samples}: must not exceed window_requests={self.window_requests}")
        if not self.window_s > 0 or not self.max_p99_ratio > 0 or self.max_error_rate_delta < 0 or self.z < 0:
            raise ValueError(f"window_s, max_p99_ratio must be > 0 and max_error_rate_delta >= 0, got {self}")


@dataclass(slots=True)
class ArmWindow:
    """(time, ttfb or None, ok) of the arm's latest outcomes."""

    maxlen: int
    entries: deque = field(init=False)

    def __post_init__(self) -> None:
        self.entries = deque(maxlen=self.maxlen)

    def add(self, now_s: float, ttfb_s: float | None, ok: bool) -> None:
        self.entries.append((now_s, ttfb_s, ok))

    def expire(self, oldest_s: float) -> None:
        e = self.entries
        while e and e[0][0] < oldest_s:
            e.popleft()

    def stats(self, z: float = 1.645) -> dict:
        n = len(self.entries)
        ttfb = np.sort(np.array([t for _, t, ok in self.entries if ok and t is not None], dtype=np.float64))
        errors = sum(1 for _, _, ok in self.entries if not ok)
        out = {"requests": n, "errors": errors, "error_rate": errors / n if n else None, "latency_samples": int(ttfb.size)}
        if ttfb.size:
            # distribution-free bounds of the p99: order statistics around rank 0.99 n (normal approx. of the binomial)
            m, sd = ttfb.size * 0.99, np.sqrt(ttfb.size * 0.99 * 0.01)
            lo = int(np.clip(np.floor(m - z * sd) - 1, 0, ttfb.size - 1))
            hi = int(np.clip(np.ceil(m + z * sd) - 1, 0, ttfb.size - 1))
            out |= {"ttfb_p50_s": float(np.percentile(ttfb, 50)), "ttfb_p99_s": float(np.percentile(ttfb, 99)),
                    "ttfb_p99_low_s": float(ttfb[lo]), "ttfb_p99_high_s": float(ttfb[hi])}
        else:
            out |= {"ttfb_p50_s": None, "ttfb_p99_s": None, "ttfb_p99_low_s": None, "ttfb_p99_high_s": None}
        return out


class RollbackGuard:
    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.windows = {arm: ArmWindow(config.window_requests) for arm in ARMS}
        self.active = False
        self.cause: str | None = None  # "p99" or "errors"
        self.reason: str | None = None  # a sentence for the admin API and the log
        self.tripped_at_s: float | None = None
        self.trips = 0
        self.last_stats: dict[str, dict] = {arm: self.windows[arm].stats() for arm in ARMS}
        self._since_check = 0
        self._breaches = 0

    def record(self, arm: str, now_s: float, ttfb_s: float | None, ok: bool) -> bool:
        """Record one finished request of `arm`; returns True when this call tripped the guard."""
        w = self.windows.get(arm)
        if w is None:
            return False
        w.add(now_s, ttfb_s, ok)
        self._since_check += 1
        if self._since_check < self.config.check_every:
            return False
        self._since_check = 0
        return self.evaluate(now_s)

    def evaluate(self, now_s: float) -> bool:
        """Refresh the window stats; trip if the treatment is worse. Returns True if it tripped now."""
        cfg = self.config
        for w in self.windows.values():
            w.expire(now_s - cfg.window_s)
        c, t = (self.windows[a].stats(cfg.z) for a in ARMS)
        self.last_stats = {"control": c, "treatment": t}
        if self.active:
            return False
        cause = reason = None
        if c["requests"] >= cfg.min_samples and t["requests"] >= cfg.min_samples:
            diff = t["error_rate"] - c["error_rate"]
            pooled = (t["errors"] + c["errors"]) / (t["requests"] + c["requests"])
            se = np.sqrt(pooled * (1 - pooled) * (1 / t["requests"] + 1 / c["requests"]))
            if diff > cfg.max_error_rate_delta and se > 0 and diff / se > cfg.z:
                cause = "errors"
                reason = (f"treatment error rate {t['error_rate']:.2%} exceeds control's {c['error_rate']:.2%} "
                          f"by more than {cfg.max_error_rate_delta:.2%}")
        if cause is None and c["latency_samples"] >= cfg.min_samples and t["latency_samples"] >= cfg.min_samples:
            ratio = t["ttfb_p99_s"] / max(c["ttfb_p99_s"], 1e-9)
            if ratio > cfg.max_p99_ratio and t["ttfb_p99_low_s"] > c["ttfb_p99_high_s"]:
                cause = "p99"
                reason = (f"treatment p99 time to first byte {t['ttfb_p99_s'] * 1e3:.1f} ms is {ratio:.2f}x "
                          f"control's {c['ttfb_p99_s'] * 1e3:.1f} ms (limit {cfg.max_p99_ratio:.2f}x)")
        if cause is None:
            self._breaches = 0
            return False
        self._breaches += 1
        if self._breaches < cfg.confirm_checks:
            return False
        self.active, self.cause, self.reason, self.tripped_at_s = True, cause, reason, now_s
        self.trips += 1
        return True

    def reset(self) -> None:
        """Re-enable the treatment with empty windows (it must prove itself again)."""
        for w in self.windows.values():
            w.entries.clear()
        self.active, self.cause, self.reason, self.tripped_at_s = False, None, None, None
        self._since_check = 0
        self._breaches = 0
        self.last_stats = {arm: self.windows[arm].stats() for arm in ARMS}

    def describe(self) -> dict:
        cfg = self.config
        return {
            "rollback_active": self.active,
            "cause": self.cause,
            "reason": self.reason,
            "tripped_at_s": self.tripped_at_s,
            "trips": self.trips,
            "config": {
                "window_requests": cfg.window_requests, "window_s": cfg.window_s, "min_samples": cfg.min_samples,
                "max_p99_ratio": cfg.max_p99_ratio, "max_error_rate_delta": cfg.max_error_rate_delta,
                "confirm_checks": cfg.confirm_checks, "z": cfg.z,
            },
            "window": self.last_stats,
        }


class ABSplit:
    """Which arm routes a request: treatment for keys whose stable fraction is below `share`,
    unless the guard has rolled the treatment back."""

    def __init__(self, share: float, guard: RollbackGuard | None = None) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"ab_share={share}: must be within [0, 1]")
        self.share = share
        self.guard = guard

    @property
    def effective_share(self) -> float:
        return 0.0 if self.guard is not None and self.guard.active else self.share

    def assign(self, key: str) -> str:
        share = self.effective_share
        if share <= 0.0:
            return "control"
        return "treatment" if stable_fraction(key) < share else "control"
