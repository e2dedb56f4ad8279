"""Heuristic late binding in the simulator: `simulate_late` drives `ClusterSim.hold()` with the room stage of the
decision pipeline (router.policy.pipeline, late binding's rule: the same stages the live router's hold queue runs),
wrapping any per-request policy: the policy still picks the replica, but only among those with room.
"""

from __future__ import annotations

from collections import Counter

from routewise_vllm.router.policy.late_binding import LateBindingConfig, ReplicaLimit, replica_limit
from routewise_vllm.router.policy.pipeline import Choice, Held, Room
from routewise_vllm.router.policy.types import RequestInfo


#: `<policy>+late`: the policy behind late binding (simulator compare rows, fleet fidelity and router_bench targets)
LATE_SUFFIX = "+late"


def split_late(policy: str) -> tuple[str, bool]:
    """("expected-wait", True) for "expected-wait+late"; (name, False) for a name without the suffix."""
    return (policy[: -len(LATE_SUFFIX)], True) if policy.endswith(LATE_SUFFIX) else (policy, False)


def sim_limits(sim, config: LateBindingConfig) -> list[ReplicaLimit]:
    """Each simulated replica's limits, from its profile's max_num_seqs, KV capacity and token budget."""
    return [
        replica_limit(rep.max_seqs, rep.kv_capacity_tokens, rep.budget, config.tokens_per_request)
        for rep in sim.replicas
    ]


def next_choice(sim, limits: list[ReplicaLimit], late: LateBindingConfig,
                reasons: Counter[str] | None = None, policy=None) -> tuple[Choice, RequestInfo] | None:
    """Runs `sim` up to its next decision with a choice behind late binding, through its pipeline's health and room
    stages (router.policy.pipeline): requests the rule holds are held, one it lets go to a single replica is
    dispatched there. Returns the policy's Choice (its view restricted to the replicas the rule allows, the whole
    fleet as context) and the request, or None when the run is over; counts each decision's reason in `reasons`.
    `policy`: asked whether the rule applies to each request (the pipeline's room stage, as live)."""
    narrow = sim.pipeline.narrow
    while (d := sim.next_decision()) is not None:
        view, info = d
        idx = sim._pending[0]
        out = narrow(view, info, Room(limits, sim.held_besides(idx), sim.is_offered(idx),
                                      sim.now_s - sim.requests[idx].arrival_s, late), policy)
        if type(out) is Held:
            if reasons is not None:
                reasons["hold"] += 1
            sim.hold()
            continue
        if reasons is not None:
            reasons[out.late] += 1  # type: ignore[union-attr]
        if type(out) is Choice:
            return out, info  # type: ignore[return-value]
        sim.dispatch(out.index)  # type: ignore[union-attr]  # Routed: the lone candidate
    return None


def simulate_late(config, requests, policy, seed: int | None = None, late: LateBindingConfig | None = None,
                  hold_order: str = "deadline"):
    """`simulator.cluster.simulate` with late binding; returns (records, Counter of decision reasons). `hold_order`:
    which held request a freed slot offers first, the earliest TTFT deadline (the live router's) or the oldest
    ("fifo"); the same without targets.
    `reasons["hold"]` counts hold decisions (a head offered and held again counts again); `sim.n_holds`
    (in `reasons["held_requests"]`) counts requests that entered the queue."""
    from routewise_vllm.simulator.cluster import ClusterSim, Policy

    late = late or LateBindingConfig()
    sim = ClusterSim(config, requests, seed=seed)
    sim.hold_order, sim.hold_timeout_s = hold_order, late.timeout_s
    policy.reset(seed)
    if type(policy).on_complete is not Policy.on_complete:
        sim.on_complete_hook = policy.on_complete
    limits = sim_limits(sim, late)
    reasons: Counter[str] = Counter()
    pick = sim.pipeline.pick
    while (d := next_choice(sim, limits, late, reasons, policy)) is not None:
        sim.dispatch(pick(d[0], d[1], policy).index)
    records = sim.finish()
    reasons["held_requests"] = sim.n_holds
    return records, reasons
