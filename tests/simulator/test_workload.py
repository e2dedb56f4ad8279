import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from routewise_vllm.simulator.traces import KNOWN_TRACES, WARMUP_TENANT, TraceLibrary
from routewise_vllm.simulator.workload import (
    AdversarialWorkload,
    SyntheticWorkload,
    TraceWorkload,
    diurnal_arrivals,
    gamma_arrivals,
    onoff_arrivals,
    poisson_arrivals,
)

DATA = Path(__file__).resolve().parent.parent / "data"


def _cv(x: np.ndarray) -> float:
    gaps = np.diff(np.concatenate([[0.0], x]))
    return float(gaps.std() / gaps.mean())


def test_poisson_rate_and_cv():
    t = poisson_arrivals(np.random.default_rng(1), rate=5.0, n=40000)
    assert len(t) / t[-1] == pytest.approx(5.0, rel=0.03)
    assert _cv(t) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_renewal_hits_rate_and_burst_cv(cv):
    t = gamma_arrivals(np.random.default_rng(2), rate=10.0, cv=cv, n=100000)
    assert len(t) / t[-1] == pytest.approx(10.0, rel=0.05)
    assert _cv(t) == pytest.approx(cv, rel=0.08)


def test_diurnal_mean_rate_and_peak_to_trough_ratio():
    rate, amp, period = 20.0, 0.5, 100.0
    t = diurnal_arrivals(np.random.default_rng(3), rate, amp, period, n=100000)
    assert len(t) / t[-1] == pytest.approx(rate, rel=0.03)
    phase = (t % period) / period
    rising = np.sum(phase < 0.5)  # sin > 0 half: mean factor 1 + 2a/pi
    falling = np.sum(phase >= 0.5)
    assert rising / falling == pytest.approx((1 + 2 * amp / math.pi) / (1 - 2 * amp / math.pi), rel=0.05)


def test_onoff_mmpp_mean_rate_and_burstiness():
    t = onoff_arrivals(np.random.default_rng(4), rate=50.0, mean_on_s=1.0, mean_off_s=3.0, off_rate_fraction=0.0, n=200000)
    assert len(t) / t[-1] == pytest.approx(50.0, rel=0.06)
    assert _cv(t) > 2.0  # silent off periods: far burstier than Poisson
    per_second = np.bincount(t.astype(int))
    assert np.mean(per_second == 0) > 0.4  # most seconds in an off period are empty


def _synthetic(**kw) -> SyntheticWorkload:
    base = {"kind": "synthetic", "n_requests": 2000, "rate_rps": 4.0, "lengths": {"dist": "fixed", "prompt": 100, "output": 10}}
    return SyntheticWorkload.model_validate(base | kw)


LIB = TraceLibrary(DATA)  # only the synthetic specs use it here, none of which read a trace


def test_synthetic_build_is_deterministic_and_time_scale_multiplies_rate():
    spec = _synthetic(arrivals={"process": "gamma", "cv": 2.0})
    a = spec.build(np.random.default_rng(9), "train", LIB, 1.0)
    b = spec.build(np.random.default_rng(9), "train", LIB, 1.0)
    c = spec.build(np.random.default_rng(10), "train", LIB, 1.0)
    assert a == b and a != c
    fast = spec.build(np.random.default_rng(9), "train", LIB, 4.0)
    assert fast[-1].arrival_s == pytest.approx(a[-1].arrival_s / 4.0, rel=1e-9)
    assert [r.request_id for r in a] == list(range(2000))
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))


def test_lognormal_lengths_median_and_clip():
    spec = _synthetic(
        n_requests=20000,
        lengths={"dist": "lognormal", "prompt_median": 800, "prompt_sigma": 1.0, "output_median": 100,
                 "output_sigma": 0.5, "max_prompt": 4000},
    )
    reqs = spec.build(np.random.default_rng(0), "eval", LIB, 1.0)
    prompts = np.array([r.prompt_tokens for r in reqs])
    assert np.median(prompts) == pytest.approx(800, rel=0.05)
    assert prompts.max() == 4000 and prompts.min() >= 1
    assert all(len(r.block_ids) == math.ceil(r.prompt_tokens / 512) for r in reqs)
    assert len({b for r in reqs for b in r.block_ids}) == sum(len(r.block_ids) for r in reqs)  # nothing shared


def test_prefix_groups_share_leading_blocks():
    spec = _synthetic(prefix={"kind": "groups", "groups": 3, "prefix_tokens": 1024, "zipf_s": 0.0}, block_tokens=256)
    reqs = spec.build(np.random.default_rng(5), "train", LIB, 1.0)
    heads = {r.block_ids[:4] for r in reqs}
    assert len(heads) == 3
    assert all(r.prompt_tokens == 1124 for r in reqs)
    assert all(len(r.block_ids) == math.ceil(1124 / 256) for r in reqs)
    tails = [r.block_ids[4:] for r in reqs]
    assert len(set(tails)) == len(tails)  # own tokens are never shared


def test_prefix_groups_zipf_popularity_skews_to_the_first_group():
    spec = _synthetic(n_requests=5000, prefix={"kind": "groups", "groups": 10, "prefix_tokens": 512, "zipf_s": 1.5})
    reqs = spec.build(np.random.default_rng(5), "train", LIB, 1.0)
    counts = sorted(np.unique([r.block_ids[0] for r in reqs], return_counts=True)[1], reverse=True)
    assert counts[0] > 3 * counts[4]


def test_sessions_grow_prompts_and_keep_the_history_blocks():
    spec = _synthetic(
        n_requests=300,
        lengths={"dist": "fixed", "prompt": 300, "output": 100},
        prefix={"kind": "sessions", "sessions": 5, "mean_turns": 6},
        block_tokens=128,
    )
    reqs = spec.build(np.random.default_rng(6), "train", LIB, 1.0)
    by_first: dict[int, list] = {}
    for r in reqs:
        by_first.setdefault(r.block_ids[0], []).append(r)
    multi = [turns for turns in by_first.values() if len(turns) > 1]
    assert multi, "some session must have more than one turn"
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt_tokens == prev.prompt_tokens + 100 + 300  # history + answer + new message
            full = prev.prompt_tokens // 128
            assert nxt.block_ids[:full] == prev.block_ids[:full]
    assert max(len(t) for t in by_first.values()) > 3


def test_adversarial_mega_prompts_come_in_bursts_from_one_tenant():
    spec = AdversarialWorkload.model_validate({
        "kind": "adversarial", "n_requests": 3000, "rate_rps": 10.0, "period_s": 60.0,
        "lengths": {"dist": "fixed", "prompt": 200, "output": 20},
        "mega_bursts_per_min": 6.0, "burst_size": 5, "burst_spread_s": 0.5, "mega_prompt_tokens": 30000,
    })
    reqs = spec.build(np.random.default_rng(11), "eval", LIB, 1.0)
    mega = [r for r in reqs if r.tenant == "mega"]
    assert mega and len(mega) % 5 == 0
    assert all(r.prompt_tokens == 30000 for r in mega)
    assert {r.tenant for r in reqs if r.tenant != "mega"} <= {f"tenant-{i}" for i in range(4)}
    horizon = reqs[-1].arrival_s
    # ~6 bursts a minute over the horizon, within Poisson noise
    assert len(mega) / 5 == pytest.approx(6.0 * horizon / 60.0, rel=0.5)
    times = np.sort([r.arrival_s for r in mega])
    assert np.median(np.diff(times)) < 0.5  # bursts, not a spread-out trickle


def _fake_root(tmp_path: Path) -> Path:
    """Tiny trace folder with the known layout: the Azure good file and a Mooncake file around 2400 s."""
    for name, src in [("azure-conv", "azure_good.csv")]:
        dst = tmp_path / KNOWN_TRACES[name].relative_path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DATA / src, dst)
    rows = []
    for i, t in enumerate([0, 0, 1800, 1800, 2397, 2397, 2400, 2400, 2403, 2403, 2406]):
        rows.append(f'{{"timestamp": {t * 1000}, "input_length": 600, "output_length": 5, "hash_ids": [0, {i + 1}]}}')
    dst = tmp_path / KNOWN_TRACES["mooncake-conversation"].relative_path
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n".join(rows) + "\n")
    return tmp_path


def test_trace_replay_time_scale_window_and_cap(tmp_path):
    lib = TraceLibrary(_fake_root(tmp_path))
    spec = TraceWorkload(kind="trace", trace="azure-conv", windows={"train": (0.5, 10.0)}, segment="first", max_requests=2)
    reqs = spec.build(np.random.default_rng(0), "train", lib, 2.0)
    assert [r.prompt_tokens for r in reqs] == [200, 300]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, (1.6 - 0.5000001) / 2.0])
    assert all(r.tenant == "" for r in reqs)


def test_trace_replay_random_segment_depends_on_seed(tmp_path):
    lib = TraceLibrary(_fake_root(tmp_path))
    spec = TraceWorkload(kind="trace", trace="azure-conv", max_requests=1)
    firsts = {spec.build(np.random.default_rng(s), "train", lib, 1.0)[0].prompt_tokens for s in range(30)}
    assert firsts == {100, 200, 300, 400}


def test_mooncake_eval_replays_warmup_before_the_window(tmp_path):
    lib = TraceLibrary(_fake_root(tmp_path))
    spec = TraceWorkload(kind="trace", trace="mooncake-conversation", segment="first")
    reqs = spec.build(np.random.default_rng(0), "eval", lib, 1.0)
    warm = [r for r in reqs if r.tenant == WARMUP_TENANT]
    scored = [r for r in reqs if r.tenant != WARMUP_TENANT]
    assert len(warm) == 4  # the requests at 1800 s and 2397 s: within 600 s before 2400 s
    assert len(scored) == 5
    assert max(r.arrival_s for r in warm) < min(r.arrival_s for r in scored)
    # arrivals spread inside 3 s buckets, relative to the first replayed request (bucket 1800 s)
    first_scored = min(r.arrival_s for r in scored)
    assert 600 - 3 <= first_scored < 603
    assert all(r.block_ids[0] == 0 and r.block_tokens == 512 for r in reqs)
    train = spec.build(np.random.default_rng(0), "train", lib, 1.0)
    assert all(r.tenant == "" for r in train[:2])  # nothing before the first train request
    assert sum(r.tenant != WARMUP_TENANT for r in train) == 6


def test_trace_windows_must_stay_inside_the_split():
    with pytest.raises(ValidationError, match=r"windows.train = \[2000.0, 2500.0\) must lie inside"):
        TraceWorkload(kind="trace", trace="azure-conv", windows={"train": (2000, 2500)})
    with pytest.raises(ValidationError, match="unknown trace 'azure'"):
        TraceWorkload(kind="trace", trace="azure")


def test_max_prompt_tokens_clips_prompts_and_blocks(tmp_path):
    lib = TraceLibrary(_fake_root(tmp_path))
    spec = TraceWorkload(kind="trace", trace="mooncake-conversation", max_prompt_tokens=500, warmup=False)
    reqs = spec.build(np.random.default_rng(0), "train", lib, 1.0)
    assert all(r.prompt_tokens == 500 and len(r.block_ids) == 1 for r in reqs)


def test_target_rps_normalises_each_segment_to_the_same_mean_rate(tmp_path):
    lib = TraceLibrary(_fake_root(tmp_path))
    spec = TraceWorkload(kind="trace", trace="azure-conv", target_rps=10.0, segment="first")
    reqs = spec.build(np.random.default_rng(0), "train", lib, 1.0)
    assert (len(reqs) - 1) / reqs[-1].arrival_s == pytest.approx(10.0)
    doubled = spec.build(np.random.default_rng(0), "train", lib, 2.0)
    assert (len(doubled) - 1) / doubled[-1].arrival_s == pytest.approx(20.0)
    warm = TraceWorkload(kind="trace", trace="mooncake-conversation", target_rps=2.0, segment="first")
    reqs = warm.build(np.random.default_rng(0), "eval", lib, 1.0)
    scored = [r.arrival_s for r in reqs if r.tenant != WARMUP_TENANT]
    # the scored span is set by the rate; spreading inside 3 s buckets moves its ends a little
    assert (len(scored) - 1) / (scored[-1] - scored[0]) == pytest.approx(2.0, rel=0.5)
