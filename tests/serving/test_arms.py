"""A/B split by a stable hash, and the rollback guard."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from routewise_vllm.router.serving.arms import ABSplit, GuardConfig, RollbackGuard, routing_key, stable_fraction


def test_stable_fraction_is_stable_across_processes():
    keys = ["alice", "bob", "session-42", "ü-ñ"]
    code = "from routewise_vllm.router.serving.arms import stable_fraction as f; print([f(k) for k in %r])" % keys
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."}).stdout
        for seed in ("1", "2")
    }
    assert outs == {f"{[stable_fraction(k) for k in keys]}\n"}


# Pinned: a change to the hash would move every A/B user to a new arm between releases (and mix a running
# experiment's arms), so it must show here
PINNED = {"alice": 0.3043658763184171, "bob": 0.4568354589222517, "session-42": 0.1591381125001984,
          "ü-ñ": 0.026770742380396124, "": 0.8931675160897388}


def test_stable_fraction_is_pinned():
    assert {k: stable_fraction(k) for k in PINNED} == PINNED


def test_split_share_and_stickiness():
    split = ABSplit(0.3)
    keys = [f"user-{i}" for i in range(20000)]
    arms = [split.assign(k) for k in keys]
    share = arms.count("treatment") / len(arms)
    assert 0.28 < share < 0.32
    assert arms == [split.assign(k) for k in keys]  # the same key always lands in the same arm
    assert {ABSplit(0.0).assign(k) for k in keys[:500]} == {"control"}
    assert {ABSplit(1.0).assign(k) for k in keys[:500]} == {"treatment"}


def test_share_out_of_range_is_refused():
    with pytest.raises(ValueError, match="ab_share=1.5"):
        ABSplit(1.5)


def test_routing_key_precedence():
    assert routing_key({"x-routewise-key": "k", "x-user-id": "u"}, "body-user", "r1") == "k"
    assert routing_key({"x-user-id": "u", "x-session-id": "s"}, "body-user", "r1") == "u"
    assert routing_key({"x-session-id": "s"}, "body-user", "r1") == "s"
    assert routing_key({}, "body-user", "r1") == "body-user"
    assert routing_key({}, None, "r1") == "r1"


def feed(guard, rng, n, control_ms=100.0, treatment_ms=100.0, control_err=0.0, treatment_err=0.0, t0=0.0):
    tripped = []
    for i in range(n):
        for arm, ms, err in (("control", control_ms, control_err), ("treatment", treatment_ms, treatment_err)):
            ok = rng.random() >= err
            ttfb = rng.lognormal(np.log(ms / 1000.0), 0.4)
            if guard.record(arm, t0 + i * 0.01, ttfb if ok else None, ok):
                tripped.append(i)
    return tripped


CFG = GuardConfig()  # the defaults: 1000-request windows, 500 samples per arm before a verdict


def test_guard_stays_off_when_arms_are_equal():
    for seed in range(5):
        guard = RollbackGuard(CFG)
        assert feed(guard, np.random.default_rng(seed), 3000) == []
        assert not guard.active and guard.last_stats["treatment"]["requests"] == CFG.window_requests


def test_guard_trips_on_slower_treatment():
    guard = RollbackGuard(CFG)
    tripped = feed(guard, np.random.default_rng(0), 1000, treatment_ms=200.0)
    assert guard.active and guard.cause == "p99" and "p99" in guard.reason
    assert tripped and CFG.min_samples <= tripped[0] < 2 * CFG.min_samples
    split = ABSplit(0.5, guard)
    assert split.effective_share == 0.0 and {split.assign(f"k{i}") for i in range(200)} == {"control"}
    guard.reset()
    assert not guard.active and split.effective_share == 0.5


def test_guard_waits_for_min_samples():
    guard = RollbackGuard(CFG)
    assert feed(guard, np.random.default_rng(0), CFG.min_samples - 1, treatment_ms=1000.0) == []
    assert not guard.active


def test_guard_trips_on_errors():
    guard = RollbackGuard(CFG)
    feed(guard, np.random.default_rng(1), 1000, treatment_err=0.05)
    assert guard.active and guard.cause == "errors"


def test_guard_window_forgets_old_outcomes():
    cfg = GuardConfig(window_requests=500, window_s=10.0, min_samples=100, check_every=1)
    guard = RollbackGuard(cfg)
    rng = np.random.default_rng(2)
    feed(guard, rng, 150, treatment_ms=1000.0, t0=-1000.0)  # all long ago...
    guard.reset()
    guard.active = False
    feed(guard, rng, 80, t0=-1000.0)  # ...and below min_samples within any window
    assert feed(guard, rng, 150, t0=0.0) == []  # the old slow outcomes have expired
    assert guard.last_stats["treatment"]["requests"] == 150


def test_guard_config_is_checked():
    with pytest.raises(ValueError, match="min_samples"):
        GuardConfig(window_requests=50, min_samples=100)
