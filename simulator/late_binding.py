"""Heuristic late binding in the simulator: `simulate_late` drives `ClusterSim.hold()` with the rule of
router/policy/late_binding.py (the same `decide` the live router's hold queue calls), wrapping any
per-request policy: the policy still picks the replica, but only among those with room.
"""

from __future__ import annotations

from collections import Counter

from routewise_vllm.router.policy.fallback import FallbackPolicy
from routewise_vllm.router.policy.late_binding import LateBindingConfig, ReplicaLimit, decide, replica_limit, restrict


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


def next_choice(sim, limits: list[ReplicaLimit], late: LateBindingConfig, reasons: Counter[str] | None = None):
    """Runs `sim` up to its next decision with a choice behind late binding: requests the rule holds are held, one
    it lets go to a single replica is dispatched there. Returns (view, request, the replicas the rule allows), or
    None when the run is over; counts each decision's reason in `reasons`."""
    while (d := sim.next_decision()) is not None:
        view, info = d
        idx = sim._pending[0]
        dec = decide(view, limits, sim.held_besides(idx), sim.is_offered(idx), sim.now_s - sim.requests[idx].arrival_s,
                     late)
        if reasons is not None:
            reasons[dec.reason] += 1
        if dec.reason == "hold":
            sim.hold()
        elif len(dec.candidates) == 1:
            sim.dispatch(dec.candidates[0])
        else:
            return view, info, dec.candidates
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
    while (d := next_choice(sim, limits, late, reasons)) is not None:
        view, info, candidates = d
        if isinstance(policy, FallbackPolicy):  # as the router: a learned primary scores the whole fleet
            sim.dispatch(policy.decide(restrict(view, candidates), info, view).index)
        else:
            sim.dispatch(policy.choose(restrict(view, candidates), info))
    records = sim.finish()
    reasons["held_requests"] = sim.n_holds
    return records, reasons
