"""Sim-to-real fidelity: one trace segment through the live router to a real vLLM fleet, and the same arrivals and
lengths through the simulator on profiles calibrated from that fleet (`fleet fidelity`).

One long module because one run owns its fleet, router process, calibrations and simulated replay from start to
stop, in that order; what needs none of them is apart (fidelity_report.py: the comparison; fidelity_plot.py).

    fleet fidelity --duration 40 --load 0.7            # launches the heterogeneous CPU fleet (fleet/vllm.py)
    fleet fidelity --server URL --server URL --json    # an already running fleet

Per policy: start the router on the fleet, replay the segment open loop (time-scaled to `--load` of the fleet's
calibrated capacity), record each request's TTFT/TPOT/E2E client-side; tokenise every prompt on the server so the
simulation gets the true prompt lengths; simulate exactly those arrivals and lengths with the same policy on a
cluster built from the calibrated profiles (their KV sizes, block size, max_num_seqs, request overhead; the router's
chars/4 estimate as a bias against the measured chars per token). Report real vs simulated p50/p90/p99 with relative
errors, the ranking by p99 TTFT, and the learned policy's gain over least-outstanding real vs predicted, the p99s
and the gain with 95 % bootstrap intervals (`--plot FILE.png` draws them: fleet/fidelity_plot.py). The same requests
are also simulated on the servers the real router chose ("real routing"): the error of the server model alone, so
that a policy's error splits into the servers' and what the simulated router's different choices add; and with
each engine's speed fitted to the replay's own inter-token latency ("tracked speed"): what is left once the drift
of engine speed between the warm-up and the replay is taken out (diagnostics, not predictions).

This module runs it: the fleet, calibration, the live replays and their simulations, in named steps (`_main`);
the report's statistics and text are fleet/fidelity_report.py (pure, tested in tests/fleet/test_fidelity_report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from routewise_vllm.fleet.fidelity_report import (
    BASELINE,
    LEARNED,
    Replay,
    Runs,
    Served,
    extra_overhead,
    mean_itl,
    mean_of,
    report_lines,
    rotated,
)
from routewise_vllm.router.policy.base import Policy
from routewise_vllm.simulator.late_binding import split_late

DEFAULT_POLICIES = ("least-outstanding", "expected-wait", "learned")
LOAD_MATCH_ROUNDS = 12  # steps of the warm-up's rate toward the evaluated segment's offered load
SPEED_FIT_ROUNDS = 3  # simulate-and-correct rounds of the in-fleet engine speed factors (fit_in_fleet)
ROUTER_ESTIMATE_CHARS_PER_TOKEN = 4.0  # router.policy.estimate.DEFAULT_CHARS_PER_TOKEN


class FidelityError(Exception):
    pass


@dataclass(frozen=True)
class LateBinding:
    """How a `<policy>+late` run holds requests, live and simulated alike: each server's batch cap (its calibrated
    max_num_seqs, by host:port) and the KV tokens one request is assumed to hold (the plan's mean prompt + output)."""

    caps: dict[str, int]
    tokens_per_request: int

    def router_env(self) -> dict[str, str]:
        return {"ROUTEWISE_LATE_BINDING": "1", "ROUTEWISE_LATE_BINDING_REPLICA_MAX_NUM_SEQS": json.dumps(self.caps),
                "ROUTEWISE_LATE_BINDING_TOKENS_PER_REQUEST": str(self.tokens_per_request)}


# ---------------------------------------------------------------- the fleet side


def _tokenize(url: str, model: str, prompts: list[str]) -> list[int]:
    """The server's own prompt lengths (vLLM's /tokenize), so the simulation gets the tokens really prefilled."""
    out = []
    for text in prompts:
        req = urllib.request.Request(
            url.rstrip("/") + "/tokenize", data=json.dumps({"model": model, "prompt": text}).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                out.append(int(json.loads(resp.read())["count"]))
        except (OSError, ValueError, KeyError) as e:
            raise FidelityError(f"{url}/tokenize: probe 'tokenize': {e}") from None
    return out


def _wait_idle(urls: list[str], timeout_s: float = 60.0) -> None:
    from routewise_vllm.fleet.calibrate import _total, parse_metrics

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for u in urls:
            with urllib.request.urlopen(u.rstrip("/") + "/metrics", timeout=5) as resp:
                s = parse_metrics(resp.read().decode())
            busy += _total(s, "vllm:num_requests_running") + _total(s, "vllm:num_requests_waiting")
        if busy == 0:
            return
        time.sleep(0.5)
    raise FidelityError(f"fleet {urls} still busy {timeout_s:g} s after the replay")


ENGINE_HISTOGRAMS = ("vllm:inter_token_latency_seconds", "vllm:time_to_first_token_seconds")


def _engine_sums(urls: list[str]) -> list[list[tuple[float, float]]]:
    """Per server, (sum, count) of each of ENGINE_HISTOGRAMS."""
    from routewise_vllm.fleet.calibrate import _total, parse_metrics

    out = []
    for u in urls:
        with urllib.request.urlopen(u.rstrip("/") + "/metrics", timeout=5) as resp:
            s = parse_metrics(resp.read().decode())
        out.append([(_total(s, f"{h}_sum"), _total(s, f"{h}_count")) for h in ENGINE_HISTOGRAMS])
    return out


def replay_real(urls: list[str], policy: str, plan, model: str, work: Path, scrape_interval_s: float,
                progress: bool, late: LateBinding | None = None) -> Replay:
    """The plan through a fresh router with `policy`: what each request saw, in plan order, the engines' own
    inter-token latency and TTFT over the replay and the router's TTFT (server- and router-side, to tell engine
    speed from HTTP and queueing, and where a first token's time goes), and the share of the router's decisions
    its fallback made (a learned policy over its time budget decides as least-outstanding: the simulator must know
    how often that happened live) with the count per reason. `<policy>+late` runs the router with late binding as
    `late` says."""
    from routewise_vllm.fleet.router_process import start_router
    from routewise_vllm.fleet.loadgen import ClientSpec, run_load

    _wait_idle(urls)
    before = _engine_sums(urls)
    # the router names the serving replica in a response header: which server each request saw
    base, held = split_late(policy)
    if held and late is None:
        raise FidelityError(f"policy {policy}: late binding needs the servers' batch caps")
    router = start_router(urls, base, work / "router", scrape_interval_s=scrape_interval_s,
                          env={"ROUTEWISE_REPLICA_HEADER": "true", **(late.router_env() if held else {})})
    try:
        results, _ = asyncio.run(run_load(plan, ClientSpec(url=router.base_url, model=model, timeout_s=120.0), progress))
        page = router.metrics()
    finally:
        router.stop()
    after = _engine_sums(urls)
    # per server and histogram, (sum, count) over the replay
    itl, ttft = ([(b[k][0] - a[k][0], b[k][1] - a[k][1]) for a, b in zip(before, after)] for k in (0, 1))
    tokens = _tokenize(urls[0], model, [r.prompt for r in plan])
    index = {urlsplit(u).netloc: i for i, u in enumerate(urls)}  # the header names a replica by host:port
    served = []
    for req, res, n in zip(plan, results, tokens):
        if not res.ok:
            raise FidelityError(f"policy {policy}: request sent at {req.send_s:.2f} s failed on the real fleet: {res.error}")
        served.append(Served(req.send_s, n, res.output_tokens, res.ttft_s, res.tpot_s, res.e2e_s,
                             index.get(res.replica, -1)))
    decisions = len(plan) + page.retries
    share = sum(page.fallbacks.values()) / decisions if decisions else 0.0
    return Replay(served, itl, ttft, (sum(page.ttft_sums.values()), sum(page.ttft_counts.values())), share,
                  {k: int(v) for k, v in page.fallbacks.items() if v})


# ---------------------------------------------------------------- the simulator side


def cluster_from_profiles(profile_paths: list[Path], scrape_interval_s: float, max_num_batched_tokens: int):
    """A ClusterConfig of one replica per calibrated profile, with the server settings the profile measured."""
    import yaml

    from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup, ScrapeConfig

    groups = []
    for path in profile_paths:
        srv = yaml.safe_load(path.read_text())["server"]
        seqs = srv.get("max_num_seqs") or 256  # never saw a request wait: vLLM's default
        groups.append(ReplicaGroup(
            profile=str(path), count=1, max_num_seqs=seqs, block_size=int(srv["block_size"]),
            max_num_batched_tokens=max(max_num_batched_tokens, seqs), enable_prefix_caching=bool(srv["enable_prefix_caching"]),
        ))
    return ClusterConfig(replicas=groups, scrape=ScrapeConfig(interval_s=scrape_interval_s, jitter_s=0.0),
                         estimator_sigma=0.0)


def simulate_same(served: list[Served], cluster, policy: str, estimate_scale: float,
                  seed: int = 0, late: LateBinding | None = None) -> tuple[list[Served], float]:
    """The same arrivals and lengths on the simulated fleet: what each request saw, and the fallback share.
    `<policy>+late` runs behind the simulator's late binding (the live rule) with `late`'s tokens per request; the
    simulated replicas' own max_num_seqs are the caps."""
    from routewise_vllm.router.policy.late_binding import LateBindingConfig
    from routewise_vllm.router.policy.served import served_policy
    from routewise_vllm.simulator.cluster import simulate
    from routewise_vllm.simulator.late_binding import simulate_late
    from routewise_vllm.simulator.types import SimRequest

    reqs = [SimRequest(i, s.arrival_s, s.prompt_tokens, s.output_tokens, max_tokens=s.output_tokens)
            for i, s in enumerate(served)]
    cfg = cluster.model_copy(update={"estimator_scale": estimate_scale})
    base, held = split_late(policy)
    served_as = served_policy(base, seed=seed)
    if held:
        if late is None:
            raise FidelityError(f"policy {policy}: late binding needs the tokens per request")
        records, _ = simulate_late(cfg, reqs, served_as, seed=seed, late=LateBindingConfig(tokens_per_request=late.tokens_per_request))
    else:
        records = simulate(cfg, reqs, served_as, seed=seed)
    return served_from(records), served_as.fallback_share


def served_from(records) -> list[Served]:
    """Simulated request records as Served, each with the index of its replica (ids `r<i>-<profile>`)."""
    return [Served(r.arrival_s, r.prompt_tokens, r.output_tokens, r.ttft_s, r.tpot_s, r.e2e_s,
                   int(r.replica_id[1:].split("-", 1)[0])) for r in records]


class RealChoices(Policy):
    """Sends each simulated request (ids 0..n-1) to the server that served it live."""

    name = "real-routing"

    def __init__(self, replicas: list[int]) -> None:
        super().__init__()
        self.replicas = replicas

    def choose(self, view, request) -> int:
        return self.replicas[int(request.request_id)]


def simulate_routed(served: list[Served], cluster, estimate_scale: float) -> list[Served]:
    """The same requests on the simulated fleet, each sent where the real router sent it, on arrival: the error of
    the server model alone. Against `simulate_same` (the simulated router decides), it splits a policy's error into
    what the simulated servers get wrong and what the simulated router's different choices add. Not for late
    binding (live holding times are not recorded)."""
    from routewise_vllm.simulator.cluster import simulate
    from routewise_vllm.simulator.types import SimRequest

    if any(s.replica < 0 for s in served):
        raise FidelityError("simulate_routed: a request without the server that served it")
    policy = RealChoices([s.replica for s in served])
    reqs = [SimRequest(i, s.arrival_s, s.prompt_tokens, s.output_tokens, max_tokens=s.output_tokens)
            for i, s in enumerate(served)]
    return served_from(simulate(cluster.model_copy(update={"estimator_scale": estimate_scale}), reqs, policy, seed=0))


# ---------------------------------------------------------------- capacity and the command


def capacity_rps(profile_paths: list[Path], mean_prompt: float, mean_output: float) -> float:
    """Requests/s the fleet sustains at full batches (from the calibrated cost model): the time scale's target."""
    import yaml

    from routewise_vllm.simulator.costmodel import load_profile

    total = 0.0
    for path in profile_paths:
        prof = load_profile(str(path))
        srv = yaml.safe_load(path.read_text())["server"]
        seqs = min(srv.get("max_num_seqs") or 16, max(1, int(prof.kv_cache_tokens or 1e9) // int(mean_prompt + mean_output)))
        step = prof.iteration_time(0, seqs, int(seqs * (mean_prompt + mean_output / 2)))
        # decode shares an iteration with the batch; a prefill's tokens are the request's own work
        prefill = prof.coefficients().iteration_time(int(mean_prompt), 0, int(mean_prompt), prefill_seqs=1) - prof.overhead_s
        per_req = mean_output * step / seqs + prefill
        total += 1.0 / per_req
    return total


def offered_load(plan, duration_s: float, profile_paths: list[Path]) -> float:
    """A plan's requests per second over what the fleet sustains at the plan's own mean lengths."""
    if not plan:
        return 0.0
    cap = capacity_rps(profile_paths, float(np.mean([r.prompt_tokens for r in plan])),
                       float(np.mean([r.max_tokens for r in plan])))
    return len(plan) / duration_s / cap


def plan_at_load(spec, load: float, profile_paths: list[Path]):
    """The plan of `spec`, time-scaled so that its offered load is `load` (within 2 %, else the closest found): a
    rate picks the time scale from a window's first requests, so another window at the same rate can offer far more
    work (the warm-up's train segment at the evaluated rate ran at 40.5 req/s with 64 output tokens, the evaluated
    one at 32.1 with 48: the engines were saturated while the speed factors were measured). Offered load rises with
    the rate but not in proportion (a sparse window start at 5.2 req/s gave 0.16 of capacity, at 10 req/s 0.73), so
    rescaling by the ratio oscillates; the rate is bracketed and bisected on its logarithm."""
    from routewise_vllm.fleet.loadplan import PlanSpec, build_plan

    def at(rate: float):
        plan, _ = build_plan(PlanSpec(**{**spec.__dict__, "rate": rate}))
        return plan, offered_load(plan, spec.duration_s, profile_paths)

    rate = spec.rate
    plan, now = at(rate)
    if not now or load <= 0:
        return plan
    best = (abs(now / load - 1), plan)
    lo = hi = None  # rates known to offer too little / too much
    for _ in range(LOAD_MATCH_ROUNDS):
        if abs(now / load - 1) < 0.02:
            break
        if now < load:
            lo = rate
            rate = math.sqrt(lo * hi) if hi else rate * load / now
        else:
            hi = rate
            rate = math.sqrt(lo * hi) if lo else rate * load / now
        plan, now = at(rate)
        best = min(best, (abs(now / load - 1), plan), key=lambda b: b[0])
    return best[1]


def fit_speed(cluster, itl: list[tuple[float, float]], simulate_fn) -> tuple[object, list[float]]:
    """Each replica's speed_factor at which the simulated engine runs as fast as the real one did (`itl`: each
    server's engine inter-token latency (sum, count) over the replay; `simulate_fn(cluster)` simulates the replay's
    requests). A slower replica gets fewer requests in a simulation that routes, so smaller batches and a shorter
    inter-token latency: one ratio of real to simulated latency overshoots (by 10-30 % on the CPU fleet);
    simulating, correcting and simulating again converges."""
    factors = [1.0] * len(cluster.replicas)
    for _ in range(SPEED_FIT_ROUNDS):
        sim = simulate_fn(cluster)
        for i, delta in enumerate(itl):
            real_itl, sim_itl = mean_of([delta]), mean_itl(sim, i)
            if real_itl > 0 and sim_itl > 0:
                factors[i] = float(min(10.0, max(0.5, factors[i] * real_itl / sim_itl)))
        groups = [g.model_copy(update={"speed_factor": f}) for g, f in zip(cluster.replicas, factors)]
        cluster = cluster.model_copy(update={"replicas": groups})
    return cluster, factors


def fit_in_fleet(args, base, rate: float, estimate_scale: float, urls: list[str], model: str, work: Path,
                 cluster, log):
    """How much slower each engine runs inside the loaded fleet than alone during calibration (CPU contention with
    the other server, the router and the load generator, other tenants of the machine): replay a segment of the
    trace's TRAIN window (never the evaluated one) through the router, and set each replica's `speed_factor` to its
    engine's real mean inter-token latency over the simulated one. Returns the cluster, the factors, the extra
    request overhead and the warm-up engines' mean inter-token latency."""
    from routewise_vllm.fleet.loadplan import PlanSpec, PromptSynth, build_plan

    profiles = [Path(g.profile) for g in cluster.replicas]
    evaluated, _ = build_plan(PlanSpec(**{**base.__dict__, "rate": rate}))
    load = offered_load(evaluated, base.duration_s, profiles)
    plan = plan_at_load(PlanSpec(**{**base.__dict__, "window": "train", "duration_s": args.warmup, "rate": rate}),
                        load, profiles)
    synth = PromptSynth(seed=999)
    plan = [type(r)(r.send_s, synth.prompt(max(1, round(r.prompt_tokens * estimate_scale))), r.prompt_tokens,
                    r.max_tokens) for r in plan]
    warm = offered_load(plan, args.warmup, profiles)
    log(f"fidelity: warm-up: {len(plan)} requests of the train window ({len(plan) / args.warmup:.1f} req/s: "
        f"{warm:.2f} of capacity, {'as' if load and abs(warm / load - 1) < 0.05 else 'the closest found to'} the evaluated "
        f"segment's {load:.2f}) to measure each engine's speed under load")
    replay = replay_real(urls, BASELINE, plan, model, work, args.scrape_interval, not args.quiet)
    served = replay.served
    cluster, factors = fit_speed(cluster, replay.engine_itl, lambda c: simulate_same(served, c, BASELINE, estimate_scale)[0])
    # What the loaded path adds before a first token beyond the calibrated request overhead (the router's hop, the
    # client and the servers' API processes sharing the cores), added to each profile's request_overhead_s (in-fleet
    # copies of the profiles).
    sim, _ = simulate_same(served, cluster, BASELINE, estimate_scale)
    extra = extra_overhead([r.ttft_s for r in served], [x.ttft_s for x in sim])
    if args.out:
        (work / "warmup.json").write_text(json.dumps({"real": [x.__dict__ for x in served], "sim": [x.__dict__ for x in sim]}))
    import yaml

    groups = []
    for i, g in enumerate(cluster.replicas):
        doc = yaml.safe_load(Path(g.profile).read_text())
        doc["request_overhead_s"] = round(float(doc.get("request_overhead_s", 0.0)) + extra, 6)
        doc["in_fleet"] = {"speed_factor": factors[i], "extra_request_overhead_s": round(extra, 6),
                           "measured_on": f"{args.trace} train window, {args.warmup:g} s, {BASELINE}"}
        path = work / f"profile-{i}-in-fleet.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        groups.append(g.model_copy(update={"profile": str(path)}))
    log(f"fidelity: engine speed factors under load: {', '.join(f'{f:.2f}' for f in factors)}; "
        f"extra request overhead {extra * 1e3:.1f} ms")
    warmup_itl = mean_of(replay.engine_itl)
    return cluster.model_copy(update={"replicas": groups}), factors, extra, None if math.isnan(warmup_itl) else warmup_itl


def check_fits(plan, profile_paths: list[Path], urls: list[str]) -> None:
    """Every request of the segment must fit every server's max_model_len (vLLM would refuse it: HTTP 400)."""
    import yaml

    for path, url in zip(profile_paths, urls):
        limit = int(yaml.safe_load(path.read_text())["model"]["max_model_len"])
        for i, r in enumerate(plan):
            if r.prompt_tokens + r.max_tokens > limit:
                raise FidelityError(
                    f"{url}: trace segment request {i} (sent at {r.send_s:.2f} s) needs {r.prompt_tokens} prompt + "
                    f"{r.max_tokens} output tokens, over the server's max_model_len {limit} (lower --max-prompt-tokens "
                    f"or --max-tokens-cap)"
                )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="append", default=[], help="base URL of a running vLLM server (repeat); "
                   "none: launch the heterogeneous CPU fleet of fleet/vllm.py (needs .venv-vllm)")
    p.add_argument("--servers", type=int, default=2, choices=(1, 2), help="servers to launch without --server (default 2)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma list (default: %(default)s); "
                   "NAME+late runs NAME behind the router's late binding at each server's calibrated max_num_seqs, "
                   "live and simulated")
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--window", default="eval", help="trace window (default eval: held out from training)")
    p.add_argument("--start", type=float, default=0.0, help="offset into the window, trace seconds")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of replay per policy (default 40)")
    p.add_argument("--load", type=float, default=0.7, help="offered load as a fraction of calibrated capacity")
    p.add_argument("--rate", type=float, help="offered requests/s instead of --load (runs comparable across calibrations)")
    p.add_argument("--token-scale", type=float, default=0.25, help="shrink trace lengths for CPU servers")
    p.add_argument("--max-tokens-cap", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=600, help="clip prompts (real tokens; fleet max_model_len 1024)")
    p.add_argument("--scrape-interval", type=float, default=0.2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the servers' (vLLM CPU default 2048)")
    p.add_argument("--calibrate-budget", type=float, default=90.0, help="seconds one calibration sweep may take")
    p.add_argument("--calibrations", type=int, default=3,
                   help="calibration sweeps per server after a first one that only warms the engine; the profile "
                        "with the median capacity is kept (default 3)")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of a TRAIN-window segment replayed first to "
                   "measure each engine's slow-down under load (replica speed_factor); 0 = none")
    p.add_argument("--profiles", nargs="*", help="calibrated profiles to reuse (one per server) instead of calibrating")
    p.add_argument("--out", help="directory for profiles and raw results (default: a temporary one, removed)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the TTFT tails and the p99s with their intervals, "
                   "real vs simulated per policy (needs matplotlib: the [sim] extra)")
    p.add_argument("--repeats", type=int, default=1,
                   help="replay every policy this many times, in a rotated order (drift lands on none of them); "
                        "the report pools the repeats and lists each one's ranking and gain (default 1)")
    p.add_argument("--client-cpus", metavar="LIST",
                   help="run this command, its router and its load generator on these CPUs only (taskset list, e.g. 1 "
                        "or 2-3) and start the servers on the other CPUs, one each, so that no server shares a core "
                        "with them (a real fleet's servers have their own machines); default: the servers take the "
                        "first CPUs and the rest runs anywhere")
    p.add_argument("--quiet", action="store_true")


def _split_cpus(client: str | None, n_servers: int) -> tuple[list[int] | None, list[int] | None]:
    """--client-cpus as (client CPUs, CPUs left for the servers); (None, None) without it."""
    if not client:
        return None, None
    from routewise_vllm.fleet.vllm import cpu_ids, parse_cpu_list

    try:
        wanted = parse_cpu_list(client)
    except ValueError as e:
        raise FidelityError(f"--client-cpus: {e}") from None
    available = cpu_ids()
    if not hasattr(os, "sched_setaffinity"):
        raise FidelityError("--client-cpus: this platform cannot confine a process to CPUs")
    missing = [c for c in wanted if c not in available]
    if missing:
        raise FidelityError(f"--client-cpus {client}: CPUs {missing} are not available here (this process may use "
                            f"{available})")
    rest = [c for c in available if c not in wanted]
    if len(rest) < n_servers:
        raise FidelityError(f"--client-cpus {client}: {n_servers} servers need a CPU each besides those, and "
                            f"{len(rest)} are left ({rest}); use --servers {len(rest)} or fewer client CPUs"
                            if rest else f"--client-cpus {client}: no CPU left for the servers (this process may use "
                            f"{available})")
    return wanted, rest


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except FidelityError as e:
        print(f"fleet fidelity: error: {e}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    """One run: the fleet (launched or given), its calibrated profiles and the simulated cluster, every policy's
    replays and simulations, the report."""
    policies, client_cpus, server_cpus = _checked(args)
    affinity_before = os.sched_getaffinity(0) if client_cpus else None
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="routewise-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    log = (lambda m: None) if args.quiet and args.json else (lambda m: print(m, file=sys.stderr))
    servers: list = []
    t_start = time.monotonic()
    try:
        urls, known_seqs, servers = _fleet(args, work, server_cpus, log)
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)  # the router started later inherits it
            log(f"fidelity: this command, the router and the load generator on CPUs {client_cpus}"
                + (f", the servers on {server_cpus[:len(servers)]}" if servers else ""))
        setup = _setup(args, urls, known_seqs, work, log)
        runs = _replay_all(args, policies, setup, work, log)
        report = runs.report([g.max_num_seqs for g in setup.cluster.replicas])
        report.update(
            speed_factors=setup.factors, extra_request_overhead_s=setup.extra, warmup_engine_itl_s=setup.warmup_itl,
            mean_tokens={"prompt": setup.mean_prompt, "output": setup.mean_output}, warmup_s=args.warmup,
            repeats=args.repeats, trace=args.trace, window=args.window, duration_s=args.duration,
            offered_rps=setup.rate, capacity_rps=setup.capacity, servers=urls,
            profiles=[str(p) for p in setup.profiles], load_average=os.getloadavg(), client_cpus=client_cpus,
            wall_s=time.monotonic() - t_start,
        )
        _write_results(args, work, runs, report, log)
        print(json.dumps(report, indent=2) if args.json else "\n".join(report_lines(report)))
        return 0
    finally:
        if affinity_before is not None:
            os.sched_setaffinity(0, affinity_before)
        if servers:
            from routewise_vllm.fleet import vllm

            vllm.stop_servers(servers)
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


def _checked(args: argparse.Namespace) -> tuple[list[str], list[int] | None, list[int] | None]:
    """(--policies as a list, the client's CPUs, the servers' CPUs), the arguments checked before minutes of
    measurement rather than after."""
    from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.calibrations < 0:
        raise FidelityError(f"--calibrations {args.calibrations}: must be 0 or more")
    if args.repeats < 1:
        raise FidelityError(f"--repeats {args.repeats}: must be 1 or more")
    client_cpus, server_cpus = _split_cpus(args.client_cpus, 0 if args.server else args.servers)
    if LEARNED in {split_late(p)[0] for p in policies} and not DEFAULT_MODEL_PATH.is_file():
        raise FidelityError(f"policy 'learned': no model at {DEFAULT_MODEL_PATH}")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise FidelityError(f"--plot {args.plot}: needs matplotlib (pip install 'routewise-vllm[sim]')")
    return policies, client_cpus, server_cpus


def _fleet(args: argparse.Namespace, work: Path, server_cpus: list[int] | None, log) -> tuple[list[str], list, list]:
    """(the servers' URLs, each one's max_num_seqs where this command set it, the servers it launched): --server's,
    or the heterogeneous CPU fleet of fleet/vllm.py, started here."""
    urls = list(args.server)
    if urls:
        return urls, [None] * len(urls), []
    from routewise_vllm.fleet import vllm

    python = vllm.vllm_python()
    if python is None:
        raise FidelityError(f"no vLLM interpreter: set {vllm.VLLM_PYTHON_ENV} or run scripts/install-vllm.sh")
    model_dir = vllm.ensure_tiny_model(work / "model", python)
    fleet_args = vllm.FLEET_ARGS[: args.servers]
    log(f"fidelity: starting {len(fleet_args)} vLLM CPU servers: {fleet_args}")
    servers = vllm.start_servers(len(fleet_args), model_dir, python, work / "fleet", extra_args=fleet_args,
                                 cores=server_cpus)
    return [s.base_url for s in servers], [int(a[a.index("--max-num-seqs") + 1]) for a in fleet_args], servers


@dataclass
class _Setup:
    """What every replay and simulation of a run shares."""

    urls: list[str]
    model: str
    base: Any  # fleet.loadplan.PlanSpec of the evaluated segment at rate 1
    mean_prompt: float
    mean_output: float
    profiles: list[Path]
    estimate_scale: float  # the servers' chars per token over the router's estimate's
    capacity: float
    rate: float
    cluster: Any  # simulator.config.ClusterConfig, in-fleet after a warm-up
    factors: list[float]
    extra: float
    warmup_itl: float | None
    late: LateBinding


def _setup(args: argparse.Namespace, urls: list[str], known_seqs: list, work: Path, log) -> _Setup:
    """The segment's plan and mean lengths, the calibrated profiles, the offered rate, and the simulated cluster
    (fitted to the loaded fleet by the warm-up)."""
    import yaml

    from routewise_vllm.fleet.loadplan import PlanSpec, build_plan

    model = vllm_model(urls[0])
    base = PlanSpec(trace=args.trace, window=args.window, start_s=args.start, duration_s=args.duration,
                    token_scale=args.token_scale, max_tokens_cap=args.max_tokens_cap,
                    max_prompt_tokens=args.max_prompt_tokens, rate=1.0)
    probe_plan, _ = build_plan(base)
    mean_p = float(np.mean([r.prompt_tokens for r in probe_plan]))
    mean_o = float(np.mean([r.max_tokens for r in probe_plan]))
    profiles = _given_profiles(args, urls) if args.profiles else _calibrate(args, urls, known_seqs, model, work,
                                                                           mean_p, mean_o, log)
    cpt = float(np.mean([yaml.safe_load(p.read_text())["server"]["chars_per_token"] for p in profiles]))
    estimate_scale = cpt / ROUTER_ESTIMATE_CHARS_PER_TOKEN
    cap = capacity_rps(profiles, mean_p, mean_o)
    rate = args.rate if args.rate else args.load * cap
    log(f"fidelity: capacity {cap:.2f} req/s (mean prompt {mean_p:.0f}, output {mean_o:.0f} tokens); "
        f"replaying {args.trace} at {rate:.2f} req/s for {args.duration:g} s per policy")
    check_fits(probe_plan, profiles, urls)
    cluster = cluster_from_profiles(profiles, args.scrape_interval, args.max_num_batched_tokens)
    factors, extra, warmup_itl = [1.0] * len(urls), 0.0, None
    if args.warmup > 0:
        cluster, factors, extra, warmup_itl = fit_in_fleet(args, base, rate, estimate_scale, urls, model, work,
                                                           cluster, log)
    late = LateBinding({urlsplit(u).netloc: g.max_num_seqs for u, g in zip(urls, cluster.replicas)},
                       max(1, int(mean_p + mean_o)))
    return _Setup(urls, model, base, mean_p, mean_o, profiles, estimate_scale, cap, rate, cluster, factors, extra,
                  warmup_itl, late)


def _given_profiles(args: argparse.Namespace, urls: list[str]) -> list[Path]:
    """--profiles, one measured profile per server, checked."""
    if len(args.profiles) != len(urls):
        raise FidelityError(f"--profiles: {len(args.profiles)} files for {len(urls)} servers")
    profiles = [Path(p) for p in args.profiles]
    for path in profiles:
        try:
            doc = yaml_load(path)
            srv = doc["server"]
            srv["block_size"], srv["chars_per_token"], doc["model"]["max_model_len"]  # noqa: B018
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise FidelityError(f"--profiles {path}: not a measured profile of `fleet calibrate --server` "
                                f"({type(e).__name__}: {e})") from None
    return profiles


def _calibrate(args: argparse.Namespace, urls: list[str], known_seqs: list, model: str, work: Path, mean_p: float,
               mean_o: float, log) -> list[Path]:
    """A calibrated profile per server: the median-capacity one of --calibrations sweeps after a warming one."""
    import yaml

    from routewise_vllm.fleet.calibrate import CalibrationError, SweepSpec, calibrate, profile_document, write_atomically

    profiles = []
    for i, url in enumerate(urls):
        t0 = time.monotonic()
        # A fresh CPU engine runs slower for its first minute (its first calibration of 12 in a row measured
        # 55 req/s, the others 60-77, median 67), and one sweep varies by about 10 %: the first sweep only
        # warms the engine, then the median-capacity profile of `--calibrations` sweeps is kept.
        log(f"fidelity: {args.calibrations + 1} calibration sweeps of {url} (the first warms the engine), "
            "each the load announced below")
        runs = []
        for k in range(args.calibrations + 1):
            try:
                spec = SweepSpec(budget_s=args.calibrate_budget, max_num_seqs=known_seqs[i])
                res = calibrate(url, model, spec, announce=log if k == 0 else (lambda m: None),
                                progress=not args.quiet)
            except CalibrationError as e:
                raise FidelityError(str(e)) from None
            path = work / f"profile-{i}-sweep-{k}.yaml"
            write_atomically(path, yaml.safe_dump(profile_document(res, f"fleet-{i}", known_seqs[i]), sort_keys=False))
            runs.append((capacity_rps([path], mean_p, mean_o), path, res))
        settled = sorted(runs[1:] or runs, key=lambda r: r[0])
        cap_i, chosen, res = settled[len(settled) // 2]
        path = work / f"profile-{i}.yaml"
        shutil.copyfile(chosen, path)
        log(f"fidelity: calibrated {url} in {time.monotonic() - t0:.0f} s -> {path} (residual "
            f"{res.residuals['linear']:.3f}; capacity per sweep {', '.join(f'{r[0]:.1f}' for r in runs)} req/s, "
            f"the first warming the engine; kept the median, {cap_i:.1f})")
        profiles.append(path)
    return profiles


def _replay_all(args: argparse.Namespace, policies: list[str], setup: _Setup, work: Path, log) -> Runs:
    """Every policy through the live router, `--repeats` times in rotated order, and each replay simulated: by the
    simulated router, on the real routing, and at the speed the engines ran in it."""
    from routewise_vllm.fleet.loadplan import PlanSpec, PromptSynth, build_plan

    runs = Runs(policies)
    for rep in range(args.repeats):
        runs.new_repeat()
        for policy in rotated(policies, rep):
            k = policies.index(policy)
            plan, info = build_plan(PlanSpec(**{**setup.base.__dict__, "rate": setup.rate}))
            # Fresh prompt text per policy and repeat (same lengths and arrivals) so no run hits another's
            # prefix cache. The synthesiser writes 4 characters per token, the router's rule; the server's
            # tokenizer packs chars_per_token: write the text that the server counts as the trace's length.
            synth = PromptSynth(seed=1000 + k + 100 * rep)
            plan = [type(r)(r.send_s, synth.prompt(max(1, round(r.prompt_tokens * setup.estimate_scale))),
                            r.prompt_tokens, r.max_tokens) for r in plan]
            log(f"fidelity: {policy}: {len(plan)} requests through the router"
                + (f" (repeat {rep + 1} of {args.repeats})" if args.repeats > 1 else ""))
            replay = replay_real(setup.urls, policy, plan, setup.model, work, args.scrape_interval, not args.quiet,
                                 setup.late)
            _simulate_replay(runs, rep, policy, replay, setup)
    return runs


def _simulate_replay(runs: Runs, rep: int, policy: str, replay: Replay, setup: _Setup) -> None:
    """One replay and its simulations into `runs`."""
    served, cluster, scale = replay.served, setup.cluster, setup.estimate_scale
    runs.replays[policy].append(replay)
    runs.real[rep][policy] = served
    runs.sim[rep][policy], fallback_sim = simulate_same(served, cluster, policy, scale, late=setup.late)
    if not split_late(policy)[1]:
        runs.routed[rep][policy] = simulate_routed(served, cluster, scale)
    # a diagnostic, not a prediction: the engines at the speed they ran in this very replay
    same = lambda c: simulate_same(served, c, policy, scale, late=setup.late)[0]  # noqa: E731
    tracked, f = fit_speed(cluster, replay.engine_itl, same)
    runs.tracked[rep][policy] = same(tracked)
    runs.tracked_factors[policy].append(f)
    runs.itls[policy] += replay.engine_itl
    runs.shares[policy]["real"].append(replay.fallback_share)
    runs.shares[policy]["sim"].append(fallback_sim)
    for reason, n in replay.fallback_reasons.items():
        runs.reasons[policy][reason] = runs.reasons[policy].get(reason, 0) + n


def _write_results(args: argparse.Namespace, work: Path, runs: Runs, report: dict, log) -> None:
    """--out's raw.json and --plot's figure."""
    real, sim = runs.pooled()
    if args.out:
        (work / "raw.json").write_text(json.dumps(
            {p: {"real": [s.__dict__ for s in real[p]], "sim": [s.__dict__ for s in sim[p]]} for p in real}))
    if args.plot:
        from routewise_vllm.fleet.fidelity_plot import plot_fidelity

        log(f"fidelity: wrote {plot_fidelity(real, sim, report, args.plot)}")


def yaml_load(path: Path) -> dict:
    import yaml

    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError("not a mapping")
    return doc


def vllm_model(url: str) -> str:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise FidelityError(f"{url}/v1/models: probe 'models': {e}") from None
