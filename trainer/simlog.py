"""A decision log written by a simulated fleet, in the live router's format and with its encoder
(router.serving.decision_log.decision_record): the fine-tuning path can be exercised and tested
on fleets whose true profiles differ from what the shipped policy was trained on.

Each decision is routed by `behaviour` (a baseline name, or an .onnx model) with a uniformly random
healthy replica with probability `epsilon` (the treatment arm's exploration share, see finetune.py).
Simulated seconds are mapped to wall time from `t0_unix_s`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.router.policy.types import ClusterView, RequestInfo
from routewise_vllm.router.policy.decision_record import PendingRecord, decision_record
from routewise_vllm.simulator.scenario import load_scenario
from routewise_vllm.trainer.config import TrainConfig
from routewise_vllm.trainer.instances import InstanceBuilder, InstanceSpec
from routewise_vllm.trainer.rollout import SpecEnv


def _env(scenario: str, max_requests: int) -> SpecEnv:
    width = max(16, load_scenario(scenario, split="train").cluster.replica_count())  # the live router has no padding limit
    cfg = TrainConfig.model_validate(
        {"env": {"scenarios": [scenario], "max_requests": max_requests, "randomise": False, "max_replicas": width}}
    )
    return SpecEnv(cfg, InstanceBuilder(cfg.env))


def simulate_log(
    scenario: str, out_dir: str | Path, *, behaviour: str = "least-outstanding", epsilon: float = 0.1,
    episodes: int = 2, max_requests: int = 600, seed: int = 0, t0_unix_s: float = 1.7e9, load: float = 1.0,
) -> Path:
    """Write `decisions-000001.jsonl` into `out_dir` (episodes one after another in time); returns the file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "decisions-000001.jsonl"
    env = _env(scenario, max_requests)
    policy = make_policy(behaviour, seed=seed)
    rng = np.random.default_rng([seed, 0x106])
    t_base = t0_unix_s
    with open(path, "a", encoding="utf-8") as fh:
        for ep in range(episodes):
            spec = InstanceSpec(scenario, seed * 1000 + ep, load, False, max_requests)
            _, mask, _ = env.reset_to(spec)
            pending: list[tuple[float, ClusterView, RequestInfo, int, int | None]] = []
            done = False
            while not done:
                view, request = env.decision()
                healthy = np.flatnonzero([r.healthy for r in view.replicas])
                explored = rng.random() < epsilon and len(healthy) > 0
                action = int(rng.choice(healthy)) if explored else int(policy.choose(view, request))
                pending.append((env.now_s, view, request, action, None if explored else action))
                _, mask, _, done, _ = env.step(action)
            records = {str(r.request_id): r for r in env.records()}
            final = {str(req.request_id): i for i, (_, _, req, _, _) in enumerate(pending)}  # a crash re-decides
            attempts: dict[str, int] = {}
            last = 0.0
            for i, (now, view, request, action, primary) in enumerate(pending):
                rid = str(request.request_id)
                attempt = attempts[rid] = attempts.get(rid, -1) + 1
                r = records.get(rid)
                # Only a request's last attempt can have served it, and only if its first token came after that
                # decision (the simulator re-decides a crashed replica's requests, even those already streaming).
                ok = (final[rid] == i and r is not None and not r.error and r.first_token_s is not None
                      and r.first_token_s >= now)
                p = PendingRecord(
                    time_s=t_base + now, request=request, view=view, arm="main", policy=behaviour, index=action,
                    primary_index=primary, fallback_reason=None, decision_s=None, attempt=attempt, stream=True,
                    status=200 if ok else 503, ok=ok, ttft_s=(r.first_token_s - now) if ok else None, prefix_block_tokens=64,
                )
                fh.write(json.dumps(decision_record(p), separators=(",", ":")) + "\n")
                last = now
            t_base += last + 1.0
    return path
