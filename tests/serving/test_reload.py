"""Hot reload at the policy level: good files swap in, bad files are refused, traffic never fails."""

from __future__ import annotations

import asyncio
import os
import shutil

from prometheus_client import CollectorRegistry

from routewise_vllm.router.policy.onnx_policy import OnnxPolicy
from routewise_vllm.router.serving.metrics import ServingMetrics
from routewise_vllm.router.serving.reload import PolicyFileWatcher, PolicyReloader

from .helpers import guarded, make_request, make_view
from .onnx_models import corrupt_file, fixed_width_model, linear_model, nan_model, prefer_replica_model

VIEW = make_view([3, 3, 3, 3, 3])


def setup(tmp_path, first):
    live = tmp_path / "live.onnx"
    shutil.copy(first, live)
    fb = guarded(OnnxPolicy(live), budget_s=0.05)
    reg = CollectorRegistry()
    reloader = PolicyReloader(str(live), lambda p: setattr(fb, "primary", p), metrics=ServingMetrics(reg),
                              current=lambda: fb.primary.describe())
    return live, fb, reloader, reg


def replace_atomically(src, dst):
    tmp = dst.with_suffix(".tmp")
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


async def test_reload_swaps_good_and_refuses_bad(tmp_path):
    a = prefer_replica_model(tmp_path / "a.onnx", 0, version="a")
    b = prefer_replica_model(tmp_path / "b.onnx", 2, version="b")
    live, fb, reloader, reg = setup(tmp_path, a)
    assert fb.decide(VIEW, make_request()).index == 0
    res = await reloader.reload(b)
    assert res.ok and res.result == "ok" and res.policy["version"] == "b"
    assert fb.decide(VIEW, make_request()).index == 2
    bad = {
        "unavailable": corrupt_file(tmp_path / "corrupt.onnx"),
        "spec_mismatch": linear_model(tmp_path / "other.onnx", spec_hash="feedfacefeedface"),
        "nan": nan_model(tmp_path / "nan.onnx"),
        "exception": fixed_width_model(tmp_path / "fixed.onnx", replicas=4),
    }
    for reason, path in bad.items():
        res = await reloader.reload(path)
        assert not res.ok and res.result == reason, res
        assert res.policy["version"] == "b"  # the old policy still serves
        d = fb.decide(VIEW, make_request())
        assert d.index == 2 and d.fallback_reason is None
        assert reg.get_sample_value("llm_router_policy_reload_total", {"result": reason}) == 1
    assert reg.get_sample_value("llm_router_policy_reload_total", {"result": "ok"}) == 1
    assert reloader.path == b  # a refused path does not become the watched one
    res = await reloader.reload(tmp_path / "missing.onnx")
    assert not res.ok and res.result == "unavailable" and "not found" in res.message


async def test_file_watch_reloads_on_change(tmp_path):
    a = prefer_replica_model(tmp_path / "a.onnx", 0, version="a")
    b = prefer_replica_model(tmp_path / "b.onnx", 4, version="b")
    live, fb, reloader, reg = setup(tmp_path, a)
    watcher = PolicyFileWatcher(reloader, interval_s=0.01)
    assert await watcher.check_once() is None  # unchanged
    replace_atomically(corrupt_file(tmp_path / "c.onnx"), live)
    res = await watcher.check_once()
    assert not res.ok and res.result == "unavailable"
    assert await watcher.check_once() is None  # a refused file is not retried until it changes again
    assert fb.decide(VIEW, make_request()).index == 0
    replace_atomically(b, live)
    res = await watcher.check_once()
    assert res.ok and fb.decide(VIEW, make_request()).index == 4


async def test_reload_mid_traffic_never_fails_a_decision(tmp_path):
    a = prefer_replica_model(tmp_path / "a.onnx", 0, version="a")
    b = prefer_replica_model(tmp_path / "b.onnx", 2, version="b")
    broken = [corrupt_file(tmp_path / "c.onnx"), nan_model(tmp_path / "n.onnx")]
    live, fb, reloader, reg = setup(tmp_path, a)
    decisions, stop = [], asyncio.Event()

    async def traffic():
        i = 0
        while not stop.is_set():
            d = fb.decide(VIEW, make_request(i))  # raises only if serving broke
            decisions.append((fb.primary.describe()["version"], d))
            i += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(traffic())
    for k in range(6):
        await asyncio.sleep(0.01)
        res = await reloader.reload(b if k % 2 == 0 else a)
        assert res.ok
        assert not (await reloader.reload(broken[k % 2])).ok
    await asyncio.sleep(0.01)
    stop.set()
    await task
    assert len(decisions) > 100
    want = {"a": 0, "b": 2}
    assert all(d.fallback_reason is None and d.index == want[version] for version, d in decisions)
    assert {v for v, _ in decisions} == {"a", "b"}


async def test_baseline_policy_is_not_reloadable(tmp_path):
    reloader = PolicyReloader("least-outstanding", lambda p: None)
    res = await reloader.reload()
    assert not res.ok and res.result == "not_reloadable"


async def test_watch_picks_up_a_model_that_appears_later(tmp_path):
    # `--policy learned` before the trainer shipped suite-fleet.onnx: LOR serves, then the file arrives
    live = tmp_path / "suite-fleet.onnx"
    fb = guarded(OnnxPolicy(live), budget_s=0.05)
    assert fb.decide(VIEW, make_request()).fallback_reason == "unavailable"
    reloader = PolicyReloader(str(live), lambda p: setattr(fb, "primary", p))
    watcher = PolicyFileWatcher(reloader, interval_s=0.01)
    assert await watcher.check_once() is None
    replace_atomically(prefer_replica_model(tmp_path / "a.onnx", 3), live)
    res = await watcher.check_once()
    assert res.ok and fb.decide(VIEW, make_request()).index == 3


async def test_a_gated_router_stays_gated_across_a_reload(tmp_path):
    """`--policy gated`: the reloaded file is the model behind the gate, not a bare model in the gate's place."""
    from routewise_vllm.router.policy.gated import GatedPolicy
    from routewise_vllm.router.policy.registry import make_policy

    b = prefer_replica_model(tmp_path / "b.onnx", 2, version="b")
    fb = guarded(make_policy("gated"), budget_s=0.05)
    assert isinstance(fb.primary, GatedPolicy)
    reloader = PolicyReloader("gated", lambda p: setattr(fb, "primary", p), current=lambda: fb.primary.describe())
    res = await reloader.reload(b)
    assert res.ok, res
    assert isinstance(fb.primary, GatedPolicy) and res.policy["name"] == "gated", res.policy
    assert res.policy["learned"]["version"] == "b"
    assert fb.decide(VIEW, make_request()).index == 2  # no cache share: the gate serves its model, the new one
