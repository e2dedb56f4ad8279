"""Golden digests: simulated outcomes and router inputs for fixed scenarios must not change.

The digests were computed on the engine before the speed work (commit dcf3f69), on workloads
whose requests fit the profiles' max_model_len (so the admission rule added later, which rejects
or truncates longer requests, does not apply to them). Any change to
event order, scheduling, timing arithmetic, tracker state, snapshots or features changes a
digest. If a change is meant to alter behaviour, recompute them (run this file as a script)
and say why in the commit message.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from router.policy.features import build_features
from router.policy.registry import make_policy
from simulator.bench import azure_conv_like_lengths
from simulator.cluster import ClusterSim
from simulator.config import ClusterConfig, FaultConfig, ReplicaGroup, ScrapeConfig
from simulator.gym_env import RoutingEnv
from simulator.types import SimRequest

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


def _run_digest(config: ClusterConfig, reqs: list[SimRequest], policy_name: str, seed: int, closed_form: bool) -> str:
    """Digest of every decision's view and of the final records."""
    h = hashlib.sha256()
    sim = ClusterSim(config, reqs, seed=seed, closed_form=closed_form)
    policy = make_policy(policy_name, seed=seed)
    while (d := sim.next_decision()) is not None:
        view, info = d
        h.update(_exact(sim.now_s).encode())
        h.update(repr((info.request_id, info.prompt_tokens_est, info.max_tokens, info.prefix_blocks)).encode())
        for r in view.replicas:
            h.update("|".join(_exact(getattr(r, f)) for f in SNAPSHOT_FIELDS).encode())
        a = policy.choose(view, info)
        h.update(str(a).encode())
        sim.dispatch(a)
    for rec in sim.finish():
        h.update("|".join(_exact(getattr(rec, f)) for f in RECORD_FIELDS).encode())
    return h.hexdigest()[:24]


def _bench_digest() -> str:
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
    return _run_digest(config, reqs, "least-outstanding", 7, True)


def _env_digest() -> str:
    """Observations (features), masks and rewards of a RoutingEnv episode under a fixed action sequence."""
    env = RoutingEnv(lambda rng: (_faulty_config(), _workload(300, 14.0, int(rng.integers(1000)))), max_replicas=6)
    h = hashlib.sha256()
    obs, info = env.reset(seed=11)
    rng = np.random.default_rng(5)
    done = False
    while True:
        h.update(obs.tobytes())
        h.update(info["action_mask"].tobytes())
        if done:
            break
        obs, reward, done, _, info = env.step(int(rng.integers(6)))
        h.update(struct.pack("<d", reward))
    h.update(info["episode_ttft"].tobytes())
    return h.hexdigest()[:24]


def _features_digest() -> str:
    """build_features on the views of a faulty run (pads, unhealthy rows, missing stats)."""
    sim = ClusterSim(_faulty_config(), _workload(200, 14.0, 3), seed=4)
    policy = make_policy("prefix-aware", seed=4)
    h = hashlib.sha256()
    while (d := sim.next_decision()) is not None:
        view, info = d
        h.update(build_features(view, info).tobytes())
        h.update(build_features(view, info, pad_to=8).tobytes())
        sim.dispatch(policy.choose(view, info))
    return h.hexdigest()[:24]


CASES = {
    "bench-1500-lor": _bench_digest,
    "faulty-prefix-aware": lambda: _run_digest(_faulty_config(), _workload(500, 14.0, 1), "prefix-aware", 1, True),
    "faulty-kv-aware": lambda: _run_digest(_faulty_config(), _workload(500, 14.0, 2), "kv-aware", 2, True),
    "faulty-weighted-scorer-reference": lambda: _run_digest(
        _faulty_config(), _workload(300, 14.0, 3), "weighted-scorer", 3, False
    ),
    "faulty-power-of-two": lambda: _run_digest(_faulty_config(), _workload(400, 14.0, 4), "power-of-two", 4, True),
    "faulty-speed-aware": lambda: _run_digest(_faulty_config(), _workload(400, 14.0, 5), "speed-aware", 5, True),
    "faulty-least-token-load": lambda: _run_digest(_faulty_config(), _workload(400, 14.0, 6), "least-token-load", 6, True),
    "faulty-round-robin": lambda: _run_digest(_faulty_config(), _workload(400, 14.0, 7), "round-robin", 7, True),
    "faulty-random": lambda: _run_digest(_faulty_config(), _workload(400, 14.0, 8), "random", 8, True),
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_outcomes_match_the_pinned_digest(case: str):
    assert CASES[case]() == GOLDEN[case], f"{case}: simulated behaviour changed (see the module docstring)"


if __name__ == "__main__":
    for name in sorted(CASES):
        print(f"    {name!r}: {CASES[name]()!r},")
