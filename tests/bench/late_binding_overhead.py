"""What live late binding adds to a request that is not held: `HoldQueue.route` (router/hold_queue.py: its view,
per-replica limits, the rule, metrics) around the same view + decision `Router.route` makes without it.

    .venv/bin/python tests/bench/late_binding_overhead.py [--iters 2000] [--replicas 16 128]

Prints p50/p99 microseconds of view + least-outstanding decision, without and with the hold queue in front
(nothing held: the fleet has room), on decision_latency.py's cluster fixture.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.router.hold_queue import HoldQueue, late_binding_config  # noqa: E402
from routewise_vllm.router.policy.pipeline import Pipeline, Routed  # noqa: E402
from routewise_vllm.router.policy import FallbackPolicy, LeastOutstanding  # noqa: E402
from routewise_vllm.router.replicas import ReplicaSet  # noqa: E402
from routewise_vllm.router.settings import RouterSettings  # noqa: E402
from routewise_vllm.router.telemetry import RouterMetrics  # noqa: E402
from tests.bench.decision_latency import cluster, requests  # noqa: E402


class _Route:
    def __init__(self, late: str | None) -> None:
        self.late = late


def run_now(coro):
    """Runs a coroutine that finishes without waiting (a request that is not held)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the request was held")


def bench(n: int, iters: int) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(0)
    ct = cluster(n, rng)
    settings = RouterSettings(replicas=["http://127.0.0.1:9"], policy="least-outstanding", late_binding=True)
    replicas = ReplicaSet(settings.replica_config(), lambda: None)
    replicas.cluster = ct
    pol = FallbackPolicy(LeastOutstanding(seed=0), LeastOutstanding(seed=1), budget_s=None, clock=time.perf_counter)

    pipeline = Pipeline()

    class _Router:  # Router.decide's view + pipeline, without the dispatch
        def decide(self, info, *, view=None, room=None, started=None, held_s=None):
            out = pipeline.decide(ct.view(1.0, info) if view is None else view, info, pol, room=room)
            return _Route(out.late) if type(out) is Routed else out

        def release(self, route) -> None:
            return None

    route = _Router().decide
    q = HoldQueue(late_binding_config(settings), replicas, RouterMetrics(), lambda: 1.0, _Router())
    reqs = requests(rng)
    plain, late = [], []
    for i in range(iters + 200):
        req = reqs[i % len(reqs)]
        t0 = time.perf_counter()
        route(req)
        t1 = time.perf_counter()
        run_now(q.route(req))
        t2 = time.perf_counter()
        if i >= 200:
            plain.append(t1 - t0)
            late.append(t2 - t1)
    return plain, late


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--replicas", type=int, nargs="+", default=[16, 128])
    args = ap.parse_args()

    def p(xs: list[float], q: int) -> float:
        return statistics.quantiles(xs, n=100)[q - 1] * 1e6

    print(f"{'replicas':>8} {'route p50 us':>13} {'p99 us':>8} {'late binding + route p50 us':>28} {'p99 us':>8}")
    for n in args.replicas:
        plain, late = bench(n, args.iters)
        print(f"{n:>8} {p(plain, 50):>13.1f} {p(plain, 99):>8.1f} {p(late, 50):>28.1f} {p(late, 99):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
