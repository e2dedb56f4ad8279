"""The shared fleet view's logic without Redis: the others' sums folded into a router's trackers (and the host's
with --workers), what each batch publishes, the merge of the other routers' hashes, failure episodes, backoff and
the view's age on a fake clock."""

from __future__ import annotations

import pytest

from routewise_vllm.router.scale.fleet_view import (HEARTBEAT_FIELD, MAX_BACKOFF_S, FleetSharedClusterTracker, FleetState, decode, encode,
                               load_source)
from routewise_vllm.router.policy.remote_load import ZERO, RemoteLoad
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import RequestInfo
from routewise_vllm.router.scale.shared import SharedLoad


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _req(rid: str, prompt: int = 100, decode_: int = 50) -> RequestInfo:
    return RequestInfo(rid, prompt_tokens_est=prompt, max_tokens=decode_)


def _fields(snap) -> tuple[int, ...]:
    return (snap.outstanding, snap.outstanding_prompt_tokens, snap.outstanding_decode_tokens,
            snap.awaiting_first_token, snap.awaiting_prompt_tokens)


def test_the_others_sums_are_folded_into_views_while_this_routers_own_counts_stay_its_own():
    cluster = ClusterTracker(["a:1", "b:1"])
    remote = RemoteLoad(cluster)
    cluster.dispatch(0, _req("q1"))
    assert remote.apply({"a:1": (2, 300, 80, 1, 200), "zz:9": (5, 5, 5, 5, 5)})  # zz:9: a replica it does not know
    view = cluster.view(0.0, _req("q", 1))
    assert _fields(view.replicas[0]) == (3, 400, 130, 2, 300)
    assert _fields(view.replicas[1]) == ZERO
    assert remote.own() == {"a:1": (1, 100, 50, 1, 100), "b:1": ZERO}
    # this router's hooks run on top of the folded sums
    cluster.trackers[0].on_first_token("q1", 0.1)
    cluster.dispatch(1, _req("q2", 10, 5))
    assert remote.own() == {"a:1": (1, 100, 50, 0, 0), "b:1": (1, 10, 5, 1, 10)}
    assert not remote.apply({"a:1": (2, 300, 80, 1, 200)})  # same sums: nothing changes
    assert remote.apply({"b:1": (1, 1, 1, 1, 1)})  # a:1's others left, b:1 gained one
    view = cluster.view(0.0, _req("q", 1))
    assert _fields(view.replicas[0]) == (1, 100, 50, 0, 0)
    assert _fields(view.replicas[1]) == (2, 11, 6, 2, 11)
    cluster.trackers[0].on_complete("q1")
    assert remote.apply({})  # the local view: own counts only
    assert [_fields(s) for s in cluster.view(0.0, _req("q", 1)).replicas] == [ZERO, (1, 10, 5, 1, 10)]


def test_a_replica_removed_and_discovered_again_starts_with_nothing_folded_in():
    cluster = ClusterTracker(["a:1"])
    remote = RemoteLoad(cluster)
    remote.apply({"a:1": (4, 4, 4, 4, 4)})
    cluster.remove("a:1")
    cluster.add("a:1")
    assert remote.own() == {"a:1": ZERO}
    remote.apply({"a:1": (1, 1, 1, 1, 1)})
    assert _fields(cluster.view(0.0, _req("q", 1)).replicas[0]) == (1, 1, 1, 1, 1)


def test_each_batch_writes_only_what_changed_plus_the_heartbeat_and_everything_after_redis_lost_it():
    clock = Clock()
    st = FleetState("me", 0.01, clock, heartbeat_s=0.5)
    own = {"a:1": (1, 100, 50, 1, 100), "b:1": ZERO}
    fields, gone, new = st.batch(own)
    assert set(fields) == {"a:1", "b:1", HEARTBEAT_FIELD} and gone == [] and new == 3
    assert decode(fields["a:1"]) == (1, 100, 50, 1, 100)
    st.wrote(own, added=3, expected_new=new)
    clock.t += 0.49
    assert st.batch(own) is None  # nothing changed, the heartbeat not due: no write at all
    clock.t += 0.01
    fields, gone, new = st.batch(own)
    assert set(fields) == {HEARTBEAT_FIELD} and new == 0  # the heartbeat alone, renewing the TTL
    st.wrote(own, added=0, expected_new=new)
    own2 = {"a:1": (2, 200, 100, 2, 200)}
    fields, gone, new = st.batch(own2)
    assert set(fields) == {"a:1", HEARTBEAT_FIELD} and gone == ["b:1"] and new == 0
    # the hash had expired (a pause longer than the TTL) or Redis restarted empty: every field came back new
    st.wrote(own2, added=2, expected_new=new)
    fields, _, new = st.batch(own2)
    assert set(fields) == {"a:1", HEARTBEAT_FIELD} and new == 2
    st.wrote(own2, added=2, expected_new=new)
    assert st.batch(own2) is None
    st.failed()  # after a failure nobody knows what Redis holds: a full batch
    assert set(st.batch(own2)[0]) == {"a:1", HEARTBEAT_FIELD}


def test_merge_sums_the_other_routers_hashes_and_skips_what_it_cannot_read():
    hashes = [
        [HEARTBEAT_FIELD, "1.0", "a:1", encode((1, 10, 5, 1, 10)), "b:1", encode((2, 20, 10, 0, 0))],
        [HEARTBEAT_FIELD, "1.0", "a:1", encode((3, 30, 15, 3, 30)), "c:1", "garbage", "d:1", "1 2 3"],
    ]
    assert FleetState.merge(hashes) == {"a:1": (4, 40, 20, 4, 40), "b:1": (2, 20, 10, 0, 0)}
    assert FleetState.merge([]) == {}


def test_a_failure_episode_is_logged_once_backs_off_and_ages_the_view():
    clock = Clock()
    st = FleetState("me", 0.01, clock)
    clock.t += 0.5
    assert st.age() == pytest.approx(0.5)  # never synced: as old as the router
    st.succeeded()
    assert st.next_delay(clock.t - 0.004) == pytest.approx(0.006)  # the interval from the tick's start
    clock.t += 0.003
    assert st.age() == pytest.approx(0.003)
    assert st.failed() is True
    assert [st.failed() for _ in range(3)] == [False, False, False]
    assert st.next_delay(clock.t) == pytest.approx(0.01 * 2**4)
    for _ in range(10):
        st.failed()
    assert st.next_delay(clock.t) == MAX_BACKOFF_S
    clock.t += 2.0
    assert st.age() == pytest.approx(2.003)
    assert st.succeeded() == pytest.approx(2.0)  # the episode's length, for its one recovery line
    assert st.succeeded() is None and st.age() == 0.0
    assert st.failed() is True  # a new episode


def test_with_workers_the_view_is_the_hosts_sums_plus_the_other_hosts_and_worker_0_publishes_the_host():
    load = SharedLoad(2)
    try:
        w0, w1 = FleetSharedClusterTracker(load, 0), FleetSharedClusterTracker(load, 1)
        for c in (w0, w1):
            c.add("a:1")
            c.add("b:1")
        assert load_source(w0) is w0 and isinstance(load_source(ClusterTracker([])), RemoteLoad)
        w0.dispatch(0, _req("q1"))
        w1.dispatch(0, _req("q2", 10, 5))
        assert w0.own() == {"a:1": (2, 110, 55, 2, 110), "b:1": ZERO}  # the host's counts, both workers'
        for c in (w0, w1):
            assert c.apply({"a:1": (3, 3, 3, 3, 3)})
        assert _fields(w1.view(0.0, _req("q", 1)).replicas[0]) == (5, 113, 58, 5, 113)
        assert w1.trackers[0].outstanding == 5  # metrics and the admin API read the same
        assert w0.own()["a:1"] == (2, 110, 55, 2, 110)  # what it publishes leaves the other hosts out
        w1.trackers[0].on_complete("q2")  # the hooks still count this worker's own requests
        assert _fields(w0.view(0.0, _req("q", 1)).replicas[0]) == (4, 103, 53, 4, 103)
        assert w0.apply({})
        assert _fields(w0.view(0.0, _req("q", 1)).replicas[0]) == (1, 100, 50, 1, 100)
        w0.trackers[0].on_complete("q1")
        assert load.counters[..., :5].sum() == 0  # the other hosts' counts never reached the shared memory
    finally:
        load.close()
