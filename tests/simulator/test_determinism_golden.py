"""Golden digests: simulated outcomes and router inputs for fixed scenarios must not change.

The digests were computed on the engine before the speed work (commit dcf3f69), on workloads
whose requests fit the profiles' max_model_len (so the admission rule added later, which rejects
or truncates longer requests, does not apply to them). Any change to
event order, scheduling, timing arithmetic, tracker state, snapshots or features changes a
digest. If a change is meant to alter behaviour, recompute them (run this file as a script: it rewrites
the digests' trails too) and say why in the commit message.

Each digest is over a sequence of records (one per decision: time, request, view, choice; one per finished
request; one per env step or feature matrix). tests/data/golden_trails.json keeps a short hash of every record,
so a failure names the first record that differs and prints what it is now.
The `env-random-actions` and `features` digests were re-recorded when the feature contract changed (v2); the
tests at the end hold those two runs to checks that do not come from the code under test: the features to the
frozen per-replica reference implementation, the env's return to its closed form over the finished requests.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from routewise_vllm.router.policy.features import build_features
from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.simulator.bench import azure_conv_like_lengths
from routewise_vllm.simulator.cluster import ClusterSim
from routewise_vllm.simulator.config import ClusterConfig, FaultConfig, ReplicaGroup, ScrapeConfig
from routewise_vllm.simulator.gym_env import RoutingEnv
from routewise_vllm.simulator.types import SimRequest

RECORD_FIELDS = (
    "request_id", "replica_id", "arrival_s", "prompt_tokens", "output_tokens", "first_token_s",
    "finish_s", "queue_delay_s", "preemptions", "prefix_hit_tokens", "tenant",
)  # fmt: skip
SNAPSHOT_FIELDS = (
    "replica_id", "healthy", "outstanding", "outstanding_prompt_tokens", "outstanding_decode_tokens", "waiting",
    "running", "kv_cache_usage", "kv_capacity_tokens", "stats_age_s", "dispatched_since_scrape",
    "prefix_match_blocks", "ttft_ema_s", "tpot_ema_s",
)  # fmt: skip


MAX_MODEL_LEN = 8192  # of the profiles used: no request here is rejected or truncated


def _exact(v: object) -> str:
    return v.hex() if isinstance(v, float) else repr(v)  # floats bit-exact


def _workload(n: int, rate: float, seed: int) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1.0 / rate, n))
    prompt = np.clip(rng.lognormal(6.8, 1.0, n), 8, 6000).astype(int)  # prompt + output within max_model_len
    output = np.clip(rng.lognormal(5.0, 0.9, n), 1, 2000).astype(int)
    return [
        SimRequest(
            i, float(arr[i]), int(prompt[i]), int(output[i]),
            block_ids=tuple(int(b) for b in rng.integers(0, 3, size=int(rng.integers(0, 4)))) + (10_000 + i,),
            block_tokens=64, max_tokens=int(output[i]) + 50 if i % 3 else None, tenant=f"t{i % 2}",
        )
        for i in range(n)
    ]  # fmt: skip


def _faulty_config() -> ClusterConfig:
    return ClusterConfig(
        replicas=[
            ReplicaGroup(profile="llama3-8b-a100", count=2, max_num_seqs=48, max_num_batched_tokens=2048),
            ReplicaGroup(profile="llama3-8b-l4", count=2, max_num_seqs=32),
        ],
        scrape=ScrapeConfig(interval_s=0.4, jitter_s=0.05, lag_s=0.1, failure_prob=0.2),
        faults=[
            FaultConfig(kind="crash", replica=1, at_s=6.0, duration_s=5.0),
            FaultConfig(kind="crash", replica=3, at_s=15.0),
            FaultConfig(kind="slowdown", replica=0, at_s=3.0, duration_s=8.0, factor=2.5),
            FaultConfig(kind="slowdown", replica=2, at_s=10.0, factor=1.7),
        ],
        health_check_delay_s=1.0,
    )


TRAILS = Path(__file__).resolve().parents[1] / "data" / "golden_trails.json"
Records = list[bytes]  # the digest is sha256 over their concatenation


def _run_records(config: ClusterConfig, reqs: list[SimRequest], policy_name: str, seed: int,
                 closed_form: bool) -> Records:
    """Every decision's view and choice, then the final records."""
    out = []
    sim = ClusterSim(config, reqs, seed=seed, closed_form=closed_form)
    policy = make_policy(policy_name, seed=seed)
    while (d := sim.next_decision()) is not None:
        view, info = d
        rec = [_exact(sim.now_s).encode(),
               repr((info.request_id, info.prompt_tokens_est, info.max_tokens, info.prefix_blocks)).encode()]
        rec += ["|".join(_exact(getattr(r, f)) for f in SNAPSHOT_FIELDS).encode() for r in view.replicas]
        a = policy.choose(view, info)
        out.append(b"".join(rec) + str(a).encode())
        sim.dispatch(a)
    out += ["|".join(_exact(getattr(rec, f)) for f in RECORD_FIELDS).encode() for rec in sim.finish()]
    return out


def _digest(records: Records) -> str:
    return hashlib.sha256(b"".join(records)).hexdigest()[:24]


def _trail(records: Records) -> list[str]:
    return [hashlib.sha256(r).hexdigest()[:8] for r in records]


def _bench_digest() -> Records:
    """The bench's lengths and cluster at its arrival rate (fixed here: the bench measures it)."""
    rng = np.random.default_rng(7)
    prompt, output = azure_conv_like_lengths(1500, rng)
    arrivals = np.cumsum(rng.exponential(1.0 / 25.6, 1500))
    reqs = [
        SimRequest(i, float(a), int(p), int(o))
        for i, (a, p, o) in enumerate(zip(arrivals, prompt, output))
        if p + o <= MAX_MODEL_LEN  # none truncated
    ]
    config = ClusterConfig(replicas=[ReplicaGroup(profile="llama3-8b-a100", count=4)])
    return _run_records(config, reqs, "least-outstanding", 7, True)


def _env_episode() -> tuple[Records, list[float], dict]:
    """Observations (features), masks and rewards of a RoutingEnv episode under a fixed action sequence, with its
    rewards and last info."""
    env = RoutingEnv(lambda rng: (_faulty_config(), _workload(300, 14.0, int(rng.integers(1000)))), max_replicas=6)
    out, rewards = [], []
    obs, info = env.reset(seed=11)
    rng = np.random.default_rng(5)
    done = False
    while True:
        step = obs.tobytes() + info["action_mask"].tobytes()
        if done:
            out.append(step)
            break
        obs, reward, done, _, info = env.step(int(rng.integers(6)))
        rewards.append(reward)
        out.append(step + struct.pack("<d", reward))
    out.append(info["episode_ttft"].tobytes())
    return out, rewards, info


def _env_digest() -> Records:
    return _env_episode()[0]


def _features_views():
    """The views and requests of a faulty run (pads, unhealthy rows, missing stats)."""
    sim = ClusterSim(_faulty_config(), _workload(200, 14.0, 3), seed=4)
    policy = make_policy("prefix-aware", seed=4)
    while (d := sim.next_decision()) is not None:
        view, info = d
        yield view, info
        sim.dispatch(policy.choose(view, info))


def _features_digest() -> Records:
    """build_features on the views of a faulty run, unpadded and padded to 8."""
    return [build_features(view, info).tobytes() + build_features(view, info, pad_to=8).tobytes()
            for view, info in _features_views()]


CASES = {
    "bench-1500-lor": _bench_digest,
    "faulty-prefix-aware": lambda: _run_records(_faulty_config(), _workload(500, 14.0, 1), "prefix-aware", 1, True),
    "faulty-kv-aware": lambda: _run_records(_faulty_config(), _workload(500, 14.0, 2), "kv-aware", 2, True),
    "faulty-weighted-scorer-reference": lambda: _run_records(
        _faulty_config(), _workload(300, 14.0, 3), "weighted-scorer", 3, False
    ),
    "faulty-power-of-two": lambda: _run_records(_faulty_config(), _workload(400, 14.0, 4), "power-of-two", 4, True),
    "faulty-speed-aware": lambda: _run_records(_faulty_config(), _workload(400, 14.0, 5), "speed-aware", 5, True),
    "faulty-least-token-load": lambda: _run_records(_faulty_config(), _workload(400, 14.0, 6), "least-token-load", 6, True),
    "faulty-round-robin": lambda: _run_records(_faulty_config(), _workload(400, 14.0, 7), "round-robin", 7, True),
    "faulty-random": lambda: _run_records(_faulty_config(), _workload(400, 14.0, 8), "random", 8, True),
    "env-random-actions": _env_digest,
    "features": _features_digest,
}

GOLDEN = {
    "bench-1500-lor": "f814ee9231e3266ccff76fe5",
    "env-random-actions": "ab32c6ed3d3d7bbe3e62b334",
    "faulty-kv-aware": "a0c4a15f9b290c71e5cf2e9e",
    "faulty-least-token-load": "4fd28e7ef98028926bd282a1",
    "faulty-power-of-two": "b0120912a606e3eeca3e89ac",
    "faulty-prefix-aware": "f60dbd6c431692eb29ad8a99",
    "faulty-random": "45c325be20694ededaa6c291",
    "faulty-round-robin": "2884c0aa2b83329e6f904836",
    "faulty-speed-aware": "fb73e04a10bb26cd637f19d1",
    "faulty-weighted-scorer-reference": "a24e2f687f1ca86be03fa62c",
    "features": "4bd6877f5baeca50ac63cd87",
}


def first_difference(records: Records, trail: list[str]) -> str:
    """Where a run's records first differ from the recorded trail, and that record as it is now."""
    now = _trail(records)
    i = next((i for i, (a, b) in enumerate(zip(now, trail)) if a != b), min(len(now), len(trail)))
    if i == len(now) or i == len(trail):
        return f"the same {i} first records, then {len(now)} records now against {len(trail)} recorded"
    return f"first difference at record {i} of {len(trail)}: now {records[i][:600]!r}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_outcomes_match_the_pinned_digest(case: str):
    records = CASES[case]()
    trail = json.loads(TRAILS.read_text())[case].split()
    if _digest(records) != GOLDEN[case]:
        pytest.fail(f"{case}: simulated behaviour changed (see the module docstring); "
                    f"{first_difference(records, trail)}", pytrace=False)
    # the records that give the pinned digest give the recorded trail, record for record: a trail that does not
    # belong to its digest would point a future difference at the wrong record
    assert _trail(records) == trail, f"{case}: the trail is not the pinned digest's: {first_difference(records, trail)}"


def test_a_difference_is_located_at_its_record():
    records = [b"a", b"b", b"c"]
    trail = _trail(records)
    assert first_difference([b"a", b"B", b"c"], trail) == "first difference at record 1 of 3: now b'B'"
    assert "then 2 records now against 3" in first_difference(records[:2], trail)


def test_every_digest_has_a_trail():
    """Keys and lengths; each trail's records are checked against its digest in test_outcomes_match_the_pinned_digest."""
    trails = json.loads(TRAILS.read_text())
    assert set(trails) == set(GOLDEN)
    assert all(len(trails[c].split()) > 100 for c in trails)


def test_re_recorded_features_golden_equals_the_frozen_reference():
    """Beside the re-recorded `features` digest: the same views through the frozen per-replica implementation
    (tests/policy/test_features_fast.py) give the same bytes."""
    from tests.policy.test_features_fast import reference_build_features

    n = 0
    for view, info in _features_views():
        assert build_features(view, info).tobytes() == reference_build_features(view, info).tobytes()
        assert build_features(view, info, pad_to=8).tobytes() == reference_build_features(view, info, 8).tobytes()
        n += 1
    assert n >= 200  # every request decided, some again after a crash


def test_re_recorded_env_golden_returns_its_closed_form():
    """Beside the re-recorded `env-random-actions` digest: the episode's undiscounted return is minus the sum of
    TTFT plus the TTFT beyond the 2 s SLO (slo_penalty 1, reward_scale 1), from the finished requests alone."""
    _, rewards, info = _env_episode()
    ttft = info["episode_ttft"]
    assert len(ttft) == 300
    assert sum(rewards) == pytest.approx(-(ttft.sum() + np.maximum(ttft - 2.0, 0).sum()), rel=1e-9)


if __name__ == "__main__":
    runs = {name: CASES[name]() for name in sorted(CASES)}
    for name, records in runs.items():
        print(f"    {name!r}: {_digest(records)!r},")
    TRAILS.write_text(json.dumps({name: " ".join(_trail(r)) for name, r in runs.items()}, indent=0) + "\n")
    print(f"trails written to {TRAILS}")
