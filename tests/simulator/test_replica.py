"""The vLLM V1 replica model: budgets, preemption, prefix caching, closed-form decode jumps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator.cluster import ClusterSim, simulate
from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup
from routewise_vllm.simulator.costmodel import load_profile
from routewise_vllm.simulator.replica import COMPLETE, DONE, FIRST, ReqState, Replica
from routewise_vllm.simulator.types import SimRequest

A100 = load_profile("llama3-8b-a100")


class RecordingReplica(Replica):
    """Records every iteration's scheduled tokens and running count."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.iterations: list[tuple[int, int, int]] = []  # (decode seqs, prefill tokens, running)

    def _start_iteration(self, now: float) -> None:
        super()._start_iteration(now)
        if self.mode == 1:  # ITER
            self.iterations.append((self.n_dec, sum(n for _, n in self._plan), len(self.running)))


def drive(replica: Replica, requests: list[SimRequest]) -> dict[int, ReqState]:
    """Run one replica alone: arrivals go straight to it, events in time order (replica first)."""
    states: dict[int, ReqState] = {}
    pending = sorted(requests, key=lambda r: r.arrival_s)
    i = 0
    done = 0
    while done < len(requests):
        t_ev = replica.event_s
        if i < len(pending) and (t_ev is None or pending[i].arrival_s < t_ev):
            r = pending[i]
            st = ReqState(r, r.request_id, r.arrival_s)
            states[r.request_id] = st
            replica.add(st, r.arrival_s)
            i += 1
            continue
        assert t_ev is not None, "replica idle with requests outstanding"
        replica.on_event(t_ev)
        done += sum(1 for kind, _, _ in replica.outputs if kind == COMPLETE)
        replica.outputs.clear()
    return states


def test_chunked_prefill_respects_token_budget_and_max_num_seqs():
    group = ReplicaGroup(profile="llama3-8b-a100", max_num_batched_tokens=512, max_num_seqs=4)
    rep = RecordingReplica("r0", group, A100)
    reqs = [SimRequest(i, 0.001 * i, 1500, 40) for i in range(10)]
    states = drive(rep, reqs)
    assert all(st.g == st.output for st in states.values())
    assert max(d + p for d, p, _ in rep.iterations) == 512  # the budget is used to the full ...
    assert all(d + p <= 512 for d, p, _ in rep.iterations)  # ... and never exceeded
    assert max(r for _, _, r in rep.iterations) == 4
    assert all(r <= 4 for _, _, r in rep.iterations)
    # a 1500-token prompt alone needs ceil(1500/512) = 3 chunks: first token after >= 3 iterations
    first = states[0]
    assert first.first_token_s - first.req.arrival_s >= 3 * A100.iteration_time(0, 0, 0) - 1e-12


def test_preemption_when_kv_blocks_run_out_and_everything_completes():
    # a small cache: ~ 6k tokens of KV for 20 requests that grow to ~1.4k tokens each
    group = ReplicaGroup(profile="llama3-8b-a100", gpu_memory_utilization=0.2212, max_num_seqs=64)
    rep = Replica("r0", group, A100)
    assert rep.kv_capacity_tokens < 8000
    reqs = [SimRequest(i, 0.0, 400, 1000) for i in range(20)]
    states = drive(rep, reqs)
    assert rep.n_preemptions > 0
    assert sum(st.preemptions for st in states.values()) == rep.n_preemptions
    assert all(st.g == st.output and not math.isnan(st.finish_s) for st in states.values())
    assert rep.num_free + rep.evictable == rep.num_blocks  # every block came back


def test_prefix_cache_hit_counts_tokens_and_lowers_ttft():
    group = ReplicaGroup(profile="llama3-8b-a100")
    rep = Replica("r0", group, A100)
    shared = (11, 12, 13, 14)  # 4 x 512 tokens
    reqs = [
        SimRequest(0, 0.0, 2100, 5, block_ids=shared + (100,)),
        SimRequest(1, 10.0, 2100, 5, block_ids=shared + (200,)),  # same 2048-token prefix
        SimRequest(2, 20.0, 2100, 5, block_ids=(31, 32, 33, 34, 300)),  # nothing shared
    ]
    states = drive(rep, reqs)
    assert states[0].prefix_hit_tokens == 0
    assert states[1].prefix_hit_tokens == 2048
    assert states[2].prefix_hit_tokens == 0
    ttft = {i: st.first_token_s - st.req.arrival_s for i, st in states.items()}
    assert ttft[1] < 0.5 * ttft[0]
    assert ttft[2] == pytest.approx(ttft[0], rel=1e-9)


def test_prefix_cache_disabled_gives_no_hits():
    group = ReplicaGroup(profile="llama3-8b-a100", enable_prefix_caching=False)
    rep = Replica("r0", group, A100)
    reqs = [SimRequest(i, 10.0 * i, 2100, 5, block_ids=(1, 2, 3, 4)) for i in range(2)]
    assert all(st.prefix_hit_tokens == 0 for st in drive(rep, reqs).values())


def test_lru_evicts_least_recently_used_prefix():
    # room for ~3 cached prefixes of 2048 tokens next to one running request
    group = ReplicaGroup(profile="llama3-8b-a100", gpu_memory_utilization=0.2227)
    rep = Replica("r0", group, A100)
    cap = rep.kv_capacity_tokens  # 3 cached prefixes + 2 blocks fit, a 4th prefix does not
    assert 386 * 16 <= cap < 514 * 16, cap

    def req(i: int, t: float, prefix: int) -> SimRequest:
        return SimRequest(i, t, 2048 + 16, 2, block_ids=tuple(prefix * 10 + j for j in range(4)) + (1000 + i,))

    reqs = [
        req(0, 0.0, 1),  # prefix X
        req(1, 10.0, 2),  # prefix Y
        req(2, 20.0, 1),  # X again: hit, X becomes the most recently used
        req(3, 30.0, 3),  # Z: fills the cache
        req(4, 40.0, 4),  # W: needs an eviction -> Y (least recently used) goes
        req(5, 50.0, 1),  # X: still cached
        req(6, 60.0, 2),  # Y: evicted, no hit
    ]
    states = drive(rep, reqs)
    hits = [states[i].prefix_hit_tokens for i in range(7)]
    assert hits[2] == 2048
    assert hits[5] == 2048
    assert hits[6] == 0


def _scenario(n: int, seed: int, prefix: bool) -> tuple[ClusterConfig, list[SimRequest]]:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(0.08, n))
    reqs = []
    for i in range(n):
        ids = (int(rng.integers(3)), int(rng.integers(3)), 500 + i) if prefix else ()
        reqs.append(
            SimRequest(i, float(arr[i]), int(rng.integers(20, 1800)), int(rng.integers(1, 400)), block_ids=ids, block_tokens=512)
        )
    group = ReplicaGroup(profile="llama3-8b-a100", count=2, gpu_memory_utilization=0.2315, max_num_batched_tokens=1024)
    return ClusterConfig(replicas=[group]), reqs


@pytest.mark.parametrize("prefix", [False, True])
def test_closed_form_jumps_match_one_iteration_at_a_time(prefix: bool):
    config, reqs = _scenario(300, seed=5, prefix=prefix)
    results = {}
    for closed in (True, False):
        sim = ClusterSim(config, reqs, seed=1, closed_form=closed)
        policy = make_policy("least-outstanding", seed=2)
        while (d := sim.next_decision()) is not None:
            sim.dispatch(policy.choose(*d))
        records = sim.finish()
        reps = sim.replicas
        results[closed] = (records, sum(r.n_iterations for r in reps), sum(r.n_preemptions for r in reps), sum(r.n_jumps for r in reps))
    fast, slow = results[True][0], results[False][0]
    assert results[False][3] == 0 and results[True][3] > 50  # the fast path really jumped
    assert results[True][2] > 0  # and the case includes preemptions
    assert results[True][1] == results[False][1]  # the same number of engine iterations
    assert results[True][2] == results[False][2]
    for a, b in zip(fast, slow):
        assert a.replica_id == b.replica_id
        assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-9, abs=1e-9)
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9, abs=1e-9)
        assert a.preemptions == b.preemptions and a.prefix_hit_tokens == b.prefix_hit_tokens


def test_outputs_are_in_time_order_and_first_precedes_completion():
    config, reqs = _scenario(200, seed=9, prefix=True)
    records = simulate(config, reqs, make_policy("round-robin"), seed=0)
    for r in records:
        assert r.arrival_s <= r.arrival_s + r.queue_delay_s <= r.first_token_s <= r.finish_s
    assert FIRST != COMPLETE


def test_request_larger_than_the_cache_is_rejected():
    group = ReplicaGroup(profile="llama3-8b-a100", gpu_memory_utilization=0.2265)
    rep = Replica("r0", group, A100)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        rep.add(ReqState(SimRequest(0, 0.0, rep.kv_capacity_tokens, 10), 0, 0.0), 0.0)


# ---- cost model ----------------------------------------------------------------------------------


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ValueError, match="llama3-8b-a100") as exc:
        load_profile("llama3-8b-tpu")
    assert "llama3-8b-h100" in str(exc.value) and "llama3-70b-h100-tp4" in str(exc.value)


def test_profile_derived_quantities():
    assert A100.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per token for Llama-3-8B
    blocks = A100.num_kv_blocks(16, 0.9)
    free = 80 * 2**30 * 0.9 - 8.03e9 * 2 - 2 * 2**30
    assert blocks == int(free // (16 * A100.kv_bytes_per_token))
    # decode is memory-bound, a long prefill compute-bound
    co = A100.coefficients()
    assert A100.iteration_time(0, 8, 8000) == pytest.approx(
        co.overhead_s + (co.weight_bytes + co.kv_bytes_per_token * 8000) * co.s_per_byte
    )
    assert A100.iteration_time(8000, 0, 8000) == pytest.approx(co.overhead_s + co.flops_per_token * 8000 * co.s_per_flop)
    h100 = load_profile("llama3-8b-h100")
    assert h100.iteration_time(0, 32, 32000) < A100.iteration_time(0, 32, 32000)


def test_fit_recovers_overhead_and_efficiencies():
    import dataclasses

    from routewise_vllm.simulator.costmodel import fit

    truth = dataclasses.replace(A100, overhead_s=0.004, prefill_mfu=0.42, decode_bw_util=0.66)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(200):  # like `simulator calibrate` data: decode-only batches and prefill-heavy iterations
        if i % 2:
            p, d, c = 0, int(rng.integers(1, 256)), int(rng.integers(0, 400_000))
        else:
            p, d, c = int(rng.integers(16, 8192)), int(rng.integers(0, 8)), int(rng.integers(0, 10_000))
        rows.append((p, d, c, truth.iteration_time(p, d, c) * (1 + rng.normal(0, 0.01))))
    fitted = fit(A100, rows)
    assert fitted.overhead_s == pytest.approx(0.004, rel=0.15)
    assert fitted.prefill_mfu == pytest.approx(0.42, rel=0.03)
    assert fitted.decode_bw_util == pytest.approx(0.66, rel=0.03)
    with pytest.raises(ValueError, match="at least 3"):
        fit(A100, rows[:2])


@pytest.mark.parametrize("seed", [0, 9, 10])
def test_closed_form_matches_reference_under_memory_pressure_faults_and_stale_scrapes(seed: int):
    """Randomised: tight budgets and caches, shared prefixes, a crash and a slow-down."""
    from routewise_vllm.simulator.config import FaultConfig, ScrapeConfig

    rng = np.random.default_rng(seed)
    n = 250
    arr = np.cumsum(rng.exponential(1 / float(rng.uniform(5, 60)), n))
    reqs = [
        SimRequest(
            i, float(arr[i]), int(rng.integers(1, 3000)), int(rng.integers(1, 500)),
            block_ids=tuple(int(x) for x in rng.integers(0, 3, size=int(rng.integers(0, 6)))), block_tokens=256,
        )
        for i in range(n)
    ]  # fmt: skip
    faults = [
        FaultConfig(kind="crash", replica=0, at_s=float(arr[50]), duration_s=float(rng.uniform(0.5, 5)) if seed % 2 else None),
        FaultConfig(kind="slowdown", replica=1, at_s=float(arr[20]), duration_s=3.0, factor=4.0),
    ]
    tight = ReplicaGroup(
        profile="llama3-8b-a100", count=2, gpu_memory_utilization=0.2235,
        max_num_seqs=int(rng.integers(1, 64)), max_num_batched_tokens=int(rng.integers(64, 4096)),
    )  # fmt: skip
    cfg = ClusterConfig(
        replicas=[tight, ReplicaGroup(profile="llama3-8b-l4")],
        faults=faults,
        scrape=ScrapeConfig(lag_s=float(rng.uniform(0, 2)), failure_prob=0.3),
        health_check_delay_s=float(rng.uniform(0, 3)),
    )
    out = {}
    for closed in (True, False):
        sim = ClusterSim(cfg, reqs, seed=seed, closed_form=closed)
        policy = make_policy("random", seed=seed)
        while (d := sim.next_decision()) is not None:
            sim.dispatch(policy.choose(*d))
        out[closed] = sim.finish()
        for rep in sim.replicas:
            assert rep.num_free + rep.evictable == rep.num_blocks  # all blocks back once idle
    assert sum(r.preemptions for r in out[True]) > 0
    for a, b in zip(out[True], out[False]):
        assert (a.replica_id, a.preemptions, a.prefix_hit_tokens) == (b.replica_id, b.preemptions, b.prefix_hit_tokens)
        assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-9)
        assert a.finish_s == pytest.approx(b.finish_s, abs=1e-9)


def test_wall_clock_interface_aborts_free_every_block_and_count_tokens():
    """The public interface the emulator drives: advance one iteration at a time, abort, tokens generated."""
    rep = Replica("r0", ReplicaGroup(profile="llama3-8b-a100", max_num_seqs=2), A100, closed_form=False)
    rep.resize_kv(64)
    assert (rep.num_blocks, rep.num_free) == (64, 64)
    a, b, c = (ReqState(SimRequest(i, 0.0, 100, 50), i, 0.0) for i in range(3))
    for st in (a, b, c):
        rep.add(st, 0.0)
    assert len(rep.waiting) == 2  # one iteration is planned for `a` alone
    rep.abort(c)  # a waiting request may leave mid-iteration
    with pytest.raises(RuntimeError, match="during an iteration"):
        rep.abort(a)
    firsts, steps_after_a = [], 0
    while len(firsts) < 2:
        rep.advance(rep.event_s)
        steps_after_a += bool(firsts)
        firsts += [st for kind, st, _ in rep.take_outputs() if kind == FIRST]
    assert firsts == [a, b] and rep.take_outputs() == []
    for _ in range(3):
        rep.advance(rep.event_s)
    assert rep.tokens_generated(a) == 1 + steps_after_a + 3 and rep.tokens_generated(b) == 1 + 3
    rep.advance(rep.event_s, aborts=[a, b])
    assert (a.phase, b.phase, c.phase) == (DONE, DONE, DONE)
    assert rep.num_free + rep.evictable == 64 and rep.event_s is None and not rep.running
