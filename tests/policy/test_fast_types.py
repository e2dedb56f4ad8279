"""The hot-path constructors and the one-pass least-outstanding give what the plain code gives."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from routewise_vllm.router.policy.base import argmin_random_ties, healthy_or_raise
from routewise_vllm.router.policy.baselines import LeastOutstanding
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import (
    ClusterView,
    NoHealthyReplica,
    ReplicaSnapshot,
    RequestInfo,
    make_request_info,
    make_snapshot,
    make_view,
    unhealthy,
)
from tests.ci import require_compiled_views

SNAP_ARGS = ("r1", True, 3, 300, 256, 2, 5, 0.25, 4096, 0.5, 1, 2, 0.12, 0.03, 1, 120, 0.011)


def test_fast_snapshot_is_a_real_frozen_snapshot():
    fast, slow = make_snapshot(*SNAP_ARGS), ReplicaSnapshot(*SNAP_ARGS)
    assert type(fast) is ReplicaSnapshot
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert fast.has_stats
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.outstanding = 0  # type: ignore[misc]
    assert dataclasses.replace(fast, healthy=False).healthy is False
    assert pickle.loads(pickle.dumps(fast)) == slow


def test_fast_view_and_request_info():
    snap = make_snapshot(*SNAP_ARGS)
    assert make_view((snap,)) == ClusterView((ReplicaSnapshot(*SNAP_ARGS),))
    assert type(make_view(())) is ClusterView
    info = make_request_info("q", 12, None, (1, 2), "user")
    assert info == RequestInfo("q", 12, None, (1, 2), "user") and type(info) is RequestInfo
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.request_id = "x"  # type: ignore[misc]


def test_unhealthy_copy_is_dataclasses_replace():
    snap = make_snapshot(*SNAP_ARGS)
    fast, slow = unhealthy(snap), dataclasses.replace(snap, healthy=False)
    assert type(fast) is ReplicaSnapshot and fast == slow and hash(fast) == hash(slow)
    assert snap.healthy and fast is not snap
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.healthy = True  # type: ignore[misc]


def test_tracker_snapshot_age_is_clamped_and_infinite_before_any_scrape():
    ct = ClusterTracker(["a", "b"])
    ct.trackers[0].on_scrape(10.0, 1, 2, 0.5, 1000)
    view = ct.view(9.0, RequestInfo("q", 5))  # a clock behind the scrape: age 0, never negative
    assert view.replicas[0].stats_age_s == 0.0 and view.replicas[1].stats_age_s == float("inf")
    assert ct.view(10.25, RequestInfo("q", 5)).replicas[0].stats_age_s == 0.25


def _reference_lor(view: ClusterView, rng: np.random.Generator) -> int:
    healthy = healthy_or_raise(view)
    return argmin_random_ties([view.replicas[i].outstanding for i in healthy], healthy, rng)


def test_one_pass_least_outstanding_matches_argmin_random_ties_and_rng_use():
    draw = np.random.default_rng(0)
    policy = LeastOutstanding(seed=3)
    ref_rng = np.random.default_rng(3)
    for _ in range(2000):
        n = int(draw.integers(1, 7))
        reps = tuple(
            ReplicaSnapshot(f"r{i}", bool(draw.random() < 0.8), int(draw.integers(0, 4)), 0) for i in range(n)
        )
        view = ClusterView(reps)
        if not any(r.healthy for r in reps):
            with pytest.raises(NoHealthyReplica):
                policy.choose(view, RequestInfo("q", 1))
            continue
        assert policy.choose(view, RequestInfo("q", 1)) == _reference_lor(view, ref_rng)
    assert policy.rng.random() == ref_rng.random()  # same number of draws on ties


def test_cluster_view_equals_each_trackers_snapshot_with_and_without_prefix():
    ct = ClusterTracker(["a", "b", "c"], prefix_block_tokens=64)
    ct.trackers[0].on_scrape(1.0, 2, 3, 0.4, 64 * 100)
    ct.trackers[1].on_first_token("none", 0.2)
    ct.trackers[1].on_complete("none", 0.01)
    ct.trackers[2].healthy = False
    ct.dispatch(0, RequestInfo("p", 100, 50, prefix_blocks=(11, 12, 13)))
    ct.dispatch(1, RequestInfo("q", 80))
    for req in (RequestInfo("x", 10), RequestInfo("y", 10, prefix_blocks=(11, 12, 99))):
        view = ct.view(2.5, req)
        expect = tuple(
            t.snapshot(2.5, ct.prefix_index.match(t.replica_id, req.prefix_blocks) if req.prefix_blocks else 0)
            for t in ct.trackers
        )
        assert view == ClusterView(expect)
    assert ct.view(2.5, RequestInfo("y", 10, prefix_blocks=(11, 12, 99))).replicas[0].prefix_match_blocks == 2


def test_prefix_match_many_equals_match_per_replica():
    rng = np.random.default_rng(3)
    ct = ClusterTracker([f"r{i}" for i in range(12)], prefix_block_tokens=16)
    for k in range(200):
        blocks = tuple(int(x) for x in rng.integers(0, 6, int(rng.integers(1, 6))))
        ct.dispatch(int(rng.integers(0, 12)), RequestInfo(f"q{k}", 10, 10, prefix_blocks=blocks))
    ids = [t.replica_id for t in ct.trackers] + ["unknown"]
    matched = 0
    for _ in range(200):
        blocks = tuple(int(x) for x in rng.integers(0, 6, int(rng.integers(0, 6))))
        want = [ct.prefix_index.match(r, blocks) for r in ids]
        assert ct.prefix_index.match_many(ids, blocks) == want
        assert [s.prefix_match_blocks for s in ct.view(1.0, RequestInfo("v", 1, prefix_blocks=blocks)).replicas] == want[:-1]
        matched += sum(want)
    assert matched > 0  # the index does match something


def test_compiled_views_equal_python_views_field_for_field_and_type_for_type(monkeypatch):
    """ClusterTracker.view builds snapshots in C where the extension is built; the Python comprehension is the
    reference: same values and the same Python types in every field (an int stays an int, None stays None)."""
    from routewise_vllm.router.policy import tracking

    compiled = require_compiled_views()
    rng = np.random.default_rng(4)
    ct = ClusterTracker([f"r{i}" for i in range(12)], prefix_block_tokens=16)
    for step in range(400):
        now = step * 0.05
        req = RequestInfo(f"q{step}", int(rng.integers(1, 900)), None if step % 4 == 0 else int(rng.integers(1, 64)),
                          tuple(int(x) for x in rng.integers(0, 6, int(rng.integers(0, 4)))))
        got = ct.view(now, req)
        monkeypatch.setattr(tracking, "_compiled", None)
        want = ct.view(now, req)
        monkeypatch.setattr(tracking, "_compiled", compiled)
        assert type(got) is ClusterView and type(got.replicas) is tuple
        for g, w in zip(got.replicas, want.replicas, strict=True):
            assert type(g) is ReplicaSnapshot
            for f in dataclasses.fields(ReplicaSnapshot):
                a, b = getattr(g, f.name), getattr(w, f.name)
                assert (a, type(a)) == (b, type(b)), (step, f.name)
        i = int(rng.integers(0, 12))
        ct.dispatch(i, req)
        t = ct.trackers[int(rng.integers(0, 12))]
        if step % 5 == 0:
            t.on_scrape(now, int(rng.integers(0, 5)), None if step % 3 else 2, 0.3 if step % 2 else None, 4096)
        if step % 3 == 0:
            ct.trackers[i].on_first_token(req.request_id, float(rng.uniform(0.01, 0.3)))
        if step % 7 == 0 or step > 200:  # late on, enough completions that trackers publish a TPOT floor
            ct.trackers[i].on_complete(req.request_id, float(rng.uniform(0.005, 0.05)))
        if step % 11 == 0:
            t.healthy = not t.healthy
    assert any(t.tpot_floor_s is not None for t in ct.trackers)


def test_compiled_view_reads_a_tracker_subclass_through_its_properties():
    """A subclass whose fields are properties (router/scale/shared.py's SharedReplicaTracker) is read with getattr."""
    from routewise_vllm.router.policy import tracking

    require_compiled_views()

    class Doubled(tracking.ReplicaTracker):
        @property
        def outstanding(self):
            return 2 * self._n

        @outstanding.setter
        def outstanding(self, value):
            self._n = value

    ct = ClusterTracker(["a"])
    ct.trackers[0] = Doubled("a")
    ct.trackers[0].outstanding = 3
    assert ct.view(1.0, RequestInfo("q", 10)).replicas[0].outstanding == 6
    assert tracking.bind_compiled(tracking._compiled, tracker_cls=object) is not None  # no slots: stays as was
    assert ct.view(1.0, RequestInfo("q", 10)).replicas[0].outstanding == 6


def test_the_compiled_views_are_bound_wherever_the_extension_is_built():
    """Built means bound: the import binds the view table or fails (it never falls back to Python silently)."""
    from routewise_vllm.router.policy import tracking

    require_compiled_views()
    assert tracking.bind_compiled(tracking._compiled) is None


def test_classes_the_view_table_cannot_read_by_slot_are_named_and_leave_the_binding(monkeypatch):
    """Planted drift: a snapshot class without slots, and a tracker class missing an attribute the table copies.
    Binding either fails with a reason naming the attribute, and the working binding stays."""
    from routewise_vllm.router.policy import tracking

    compiled = require_compiled_views()
    names = [f.name for f in dataclasses.fields(ReplicaSnapshot)]  # names only: a Field given here would be changed
    Unslotted = dataclasses.make_dataclass("Unslotted", names, frozen=True)
    DriftedTracker = type("DriftedTracker", (), {"__slots__": tuple(n for n in tracking.ReplicaTracker.__slots__
                                                                    if n != "awaiting_prompt_tokens")})
    snap_reason = tracking.bind_compiled(compiled, snapshot_cls=Unslotted)
    assert snap_reason is not None and "Unslotted.replica_id is not a plain slot" in snap_reason
    tracker_reason = tracking.bind_compiled(compiled, tracker_cls=DriftedTracker)
    assert tracker_reason is not None and "DriftedTracker.awaiting_prompt_tokens is not a plain slot" in tracker_reason
    # the real types are still the bound ones: views come out of C as ReplicaSnapshots with every field
    view = ClusterTracker(["a"]).view(1.0, RequestInfo("q", 10))
    assert type(view.replicas[0]) is ReplicaSnapshot and view.replicas[0].tpot_floor_s is None
    assert tracking.bind_compiled(compiled) is None


STALE_EXTENSION = """
import sys, types
for name, path in {packages!r}:  # the packages without their __init__, so that only {module} binds
    sys.modules[name] = package = types.ModuleType(name)
    package.__path__ = [path]
sys.modules["routewise_vllm.router.policy._fastnet"] = types.ModuleType("routewise_vllm.router.policy._fastnet")  # built from other sources
try:
    import {module}
except ImportError as exc:
    print(exc)
else:
    print("imported")
"""


@pytest.mark.parametrize("module,what", [("routewise_vllm.router.policy.tracking", "the views"),
                                         ("routewise_vllm.router.policy.features", "the feature rows")])
def test_an_extension_that_cannot_follow_the_tables_stops_the_import(module, what):
    """An extension built from other sources (here: one without bind_view / bind_rows) fails the import of the
    module that binds it, naming the fix, instead of building every view or row in Python unnoticed."""
    import subprocess
    import sys

    import routewise_vllm
    import routewise_vllm.router.policy
    from routewise_vllm import router

    require_compiled_views()
    packages = [("routewise_vllm", routewise_vllm.__path__[0]), ("routewise_vllm.router", router.__path__[0]),
                ("routewise_vllm.router.policy", router.policy.__path__[0])]
    code = STALE_EXTENSION.format(packages=packages, module=module)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"cannot build {what}" in out and "rebuild it (pip install -e .)" in out, out
