import math

import numpy as np
import pytest

from routewise_vllm.simulator.metrics import Slo, aggregate, load_imbalance, mean_ci95, request_table, summarize, t_quantile_975
from routewise_vllm.simulator.types import RequestRecord


def _rec(i, ttft, tpot=0.01, out=11, replica="r0", tenant="", finished=True, arrival=None, preempt=0, hit=0):
    arrival = float(i) if arrival is None else arrival
    first = arrival + ttft
    finish = first + tpot * (out - 1) if finished else math.nan
    return RequestRecord(
        request_id=i, replica_id=replica, arrival_s=arrival, prompt_tokens=100, output_tokens=out,
        first_token_s=first if finished else math.nan, finish_s=finish, queue_delay_s=ttft / 2,
        preemptions=preempt, prefix_hit_tokens=hit, tenant=tenant,
    )


def test_percentiles_use_linear_interpolation():
    records = [_rec(i, ttft=float(i + 1)) for i in range(100)]  # TTFT 1..100
    m = summarize(records, Slo(ttft_s=1000, tpot_s=1))
    assert m["ttft_p50_s"] == pytest.approx(50.5)
    assert m["ttft_p90_s"] == pytest.approx(90.1)
    assert m["ttft_p99_s"] == pytest.approx(99.01)
    assert m["ttft_p999_s"] == pytest.approx(99.901)
    assert m["queue_delay_p50_s"] == pytest.approx(25.25)
    assert m["tpot_p99_s"] == pytest.approx(0.01)


def test_goodput_needs_both_slos_and_counts_unfinished_as_misses():
    records = [
        _rec(0, ttft=0.5, tpot=0.05),  # ok
        _rec(1, ttft=2.0, tpot=0.05),  # TTFT miss
        _rec(2, ttft=0.5, tpot=0.50),  # TPOT miss
        _rec(3, ttft=0.5, tpot=0.05, finished=False),  # lost
    ]
    m = summarize(records, Slo(ttft_s=1.0, tpot_s=0.1))
    assert m["goodput"] == pytest.approx(0.25)
    assert m["unfinished"] == 1 and m["completed_fraction"] == pytest.approx(0.75)
    span = (2 + 0.5 + 0.5 * 10) - 0.0  # first arrival 0, last finish: request 2
    assert m["goodput_rps"] == pytest.approx(1 / span)
    assert m["throughput_rps"] == pytest.approx(3 / span)
    assert m["output_tokens_per_s"] == pytest.approx(33 / span)


def test_warmup_records_are_not_scored():
    records = [_rec(0, ttft=100.0, tenant="warmup"), _rec(1, ttft=0.2), _rec(2, ttft=0.4)]
    m = summarize(records, Slo(ttft_s=1.0, tpot_s=0.1))
    assert m["requests"] == 2
    assert m["ttft_p50_s"] == pytest.approx(0.3)
    assert m["goodput"] == 1.0
    with pytest.raises(ValueError, match="no scored requests"):
        summarize([_rec(0, ttft=1.0, tenant="warmup")], Slo(1, 1))


def test_single_token_outputs_have_zero_tpot_and_prefix_hits_add_up():
    records = [_rec(0, ttft=0.1, out=1, hit=50), _rec(1, ttft=0.1, out=1, preempt=2)]
    m = summarize(records, Slo(ttft_s=1, tpot_s=1e-9))
    assert m["tpot_p99_s"] == 0.0 and m["goodput"] == 1.0
    assert m["prefix_hit_fraction"] == pytest.approx(50 / 200)
    assert m["preemptions_total"] == 2


def test_load_imbalance_counts_idle_replicas():
    reps = ["a"] * 6 + ["b"] * 2
    balanced = load_imbalance(["a", "b", "c", "d"], ["a", "b", "c", "d"])
    assert balanced == {"load_cov": 0.0, "load_max_over_mean": 1.0}
    m = load_imbalance(reps, ["a", "b", "c"])  # c got nothing: counts 6, 2, 0
    per = np.array([6, 2, 0])
    assert m["load_cov"] == pytest.approx(per.std() / per.mean())
    assert m["load_max_over_mean"] == pytest.approx(6 / (8 / 3))
    assert load_imbalance(reps)["load_max_over_mean"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="not in replica_ids"):
        load_imbalance(["x"], ["a"])


def test_request_table_columns():
    t = request_table([_rec(0, ttft=0.5, tpot=0.02), _rec(1, ttft=0.1, finished=False)])
    assert t["ttft_s"][0] == pytest.approx(0.5)
    assert t["e2e_s"][0] == pytest.approx(0.5 + 0.2)
    assert math.isnan(t["tpot_s"][1]) and math.isnan(t["e2e_s"][1])


def test_t_quantiles_match_scipy():
    from scipy import stats

    for df in [1, 2, 5, 10, 29, 30, 31, 45, 100, 1000]:
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), rel=2e-4), df


def test_mean_ci95_and_aggregate():
    m, h = mean_ci95([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.3027 * 1.0 / math.sqrt(3))
    m1, h1 = mean_ci95([5.0])
    assert m1 == 5.0 and math.isnan(h1)
    agg = aggregate([{"x": 1.0}, {"x": 3.0}])
    assert agg["x"] == 2.0 and agg["x_ci95"] == pytest.approx(12.7062 * math.sqrt(2) / math.sqrt(2))
    with pytest.raises(ValueError):
        aggregate([])
