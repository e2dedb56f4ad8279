"""Sim-to-real fidelity: one trace segment through the live router to a real vLLM fleet, and the same arrivals and
lengths through the simulator on profiles calibrated from that fleet (`fleet fidelity`).

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

Over 400 lines on purpose: one run (fleet, calibration, live replay, simulation, report) whose steps pass the
same plan and results along; the report arithmetic is separately tested (tests/fleet/test_fidelity_report.py).
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
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from router.policy.base import Policy
from simulator.late_binding import split_late

PERCENTILES = (50, 90, 99)
METRICS = ("ttft_s", "tpot_s", "e2e_s")
LEARNED, BASELINE = "learned", "least-outstanding"
DEFAULT_POLICIES = ("least-outstanding", "expected-wait", "learned")
LOAD_MATCH_ROUNDS = 4  # rescalings of the warm-up's rate toward the evaluated segment's offered load
SPEED_DRIFT_WARNING = 0.2  # the report says so when a replay's engines ran this much off the warm-up's speed
SPEED_FIT_ROUNDS = 3  # simulate-and-correct rounds of the in-fleet engine speed factors (fit_in_fleet)
EXTRA_OVERHEAD_QUANTILE = 10  # percentile of TTFT at which the warm-up's real and simulated runs are matched
BOOTSTRAP_RESAMPLES = 1000  # resamplings behind the p99 intervals of the report
MIN_BIN = 5  # requests an in-flight count needs to count in the TTFT-vs-load line (ttft_line)
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


@dataclass
class Served:
    """One request as the real fleet served it (times from the start of the replay)."""

    arrival_s: float
    prompt_tokens: int  # the server's tokenisation of the prompt sent
    output_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    replica: int = -1  # index of the server that served it (-1: not known)


def pcts(values: list[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(vals, PERCENTILES))}


def rel_err(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


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
    from fleet.calibrate import _total, parse_metrics

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
    from fleet.calibrate import _total, parse_metrics

    out = []
    for u in urls:
        with urllib.request.urlopen(u.rstrip("/") + "/metrics", timeout=5) as resp:
            s = parse_metrics(resp.read().decode())
        out.append([(_total(s, f"{h}_sum"), _total(s, f"{h}_count")) for h in ENGINE_HISTOGRAMS])
    return out


@dataclass
class Replay:
    """One replay through the live router (replay_real)."""

    served: list[Served]  # in plan order
    engine_itl: list[tuple[float, float]]  # per server, (sum, count) of its engine's inter-token latency
    engine_ttft: list[tuple[float, float]]  # per server, (sum, count) of its own TTFT (from its HTTP arrival)
    router_ttft: tuple[float, float]  # (sum, count) of the router's TTFT (from the request's arrival there)
    fallback_share: float
    fallback_reasons: dict[str, int]


def replay_real(urls: list[str], policy: str, plan, model: str, work: Path, scrape_interval_s: float,
                progress: bool, late: LateBinding | None = None) -> Replay:
    """The plan through a fresh router with `policy`: what each request saw, in plan order, the engines' own
    inter-token latency and TTFT over the replay and the router's TTFT (server- and router-side, to tell engine
    speed from HTTP and queueing, and where a first token's time goes), and the share of the router's decisions
    its fallback made (a learned policy over its time budget decides as least-outstanding: the simulator must know
    how often that happened live) with the count per reason. `<policy>+late` runs the router with late binding as
    `late` says."""
    from fleet.router_process import start_router
    from fleet.loadgen import ClientSpec, run_load

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


def mean_itl(served: list[Served], replica: int | None = None) -> float:
    """Token-weighted mean time between output tokens (what the engines' ITL histogram averages)."""
    if replica is not None:
        served = [s for s in served if s.replica == replica]
    gaps = sum(s.tpot_s * (s.output_tokens - 1) for s in served if s.output_tokens > 1)
    n = sum(s.output_tokens - 1 for s in served if s.output_tokens > 1)
    return gaps / n if n else math.nan


# ---------------------------------------------------------------- the simulator side


def cluster_from_profiles(profile_paths: list[Path], scrape_interval_s: float, max_num_batched_tokens: int):
    """A ClusterConfig of one replica per calibrated profile, with the server settings the profile measured."""
    import yaml

    from simulator.config import ClusterConfig, ReplicaGroup, ScrapeConfig

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
    from router.policy.late_binding import LateBindingConfig
    from router.policy.served import served_policy
    from simulator.cluster import simulate
    from simulator.late_binding import simulate_late
    from simulator.types import SimRequest

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
    from simulator.cluster import simulate
    from simulator.types import SimRequest

    if any(s.replica < 0 for s in served):
        raise FidelityError("simulate_routed: a request without the server that served it")
    policy = RealChoices([s.replica for s in served])
    reqs = [SimRequest(i, s.arrival_s, s.prompt_tokens, s.output_tokens, max_tokens=s.output_tokens)
            for i, s in enumerate(served)]
    return served_from(simulate(cluster.model_copy(update={"estimator_scale": estimate_scale}), reqs, policy, seed=0))


def metric_cells(real: list[Served], sim: list[Served], metric: str) -> dict[str, dict]:
    """Per percentile of `metric`: real, simulated and the relative error."""
    r, s = pcts([getattr(x, metric) for x in real]), pcts([getattr(x, metric) for x in sim])
    return {k: {"real": r[k], "sim": s[k], "rel_err": rel_err(s[k], r[k])} for k in r}


def pct_errors(real: dict[str, list[Served]], sims: dict[str, list[Served]]) -> dict:
    """Per policy (of `sims`) and metric, the p50 / p99 relative errors of a simulation against the real runs."""
    return {p: {m: {k: c["rel_err"] for k, c in metric_cells(real[p], sim, m).items() if k in ("p50", "p99")}
                for m in METRICS} for p, sim in sims.items()}


# ---------------------------------------------------------------- the report


def p99_bootstrap(ttft_s: list[list[float]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> np.ndarray:
    """p99 of each list's values over `resamples` resamplings of it (with replacement): [len(ttft_s), resamples].
    A lower bound on a p99's run-to-run noise: requests that queue together are not independent."""
    rng = np.random.default_rng(seed)
    out = np.full((len(ttft_s), resamples), np.nan)
    for i, vals in enumerate(ttft_s):
        v = np.array([x for x in vals if x is not None and not math.isnan(x)])
        if len(v):
            out[i] = np.percentile(v[rng.integers(0, len(v), (resamples, len(v)))], 99, axis=1)
    return out


def interval95(boot: np.ndarray) -> list[float] | None:
    """The central 95 % of bootstrap values (p99_bootstrap's rows); None if any is undefined."""
    return None if np.isnan(boot).any() else [float(x) for x in np.percentile(boot, [2.5, 97.5])]


REPEAT_OFFSET_S = 1e6  # pooled repeats are laid end to end on the time axis, never overlapping


def rotated(policies: list[str], repeat: int) -> list[str]:
    """The replay order of repeat `repeat`: each policy goes first, second, ... in turn, so that a drift of the
    machine over the run does not land on one policy."""
    k = repeat % len(policies) if policies else 0
    return policies[k:] + policies[:k]


def pool_repeats(runs: list[dict[str, list[Served]]]) -> dict[str, list[Served]]:
    """Each policy's requests over all repeats, repeat r shifted by r x REPEAT_OFFSET_S so that in-flight counts
    (in_flight_at_arrival) never mix two repeats."""
    out: dict[str, list[Served]] = {}
    for r, run in enumerate(runs):
        for p, rows in run.items():
            out.setdefault(p, []).extend(replace(x, arrival_s=x.arrival_s + r * REPEAT_OFFSET_S) for x in rows)
    return out


def per_repeat(runs_real: list[dict[str, list[Served]]], runs_sim: list[dict[str, list[Served]]],
               policies: list[str]) -> list[dict]:
    """Each repeat's replay order, its ranking by p99 TTFT, the learned gain, real and simulated, and its own p50 / p99
    errors per policy: a server that drifts during a run shows as repeats that disagree (the same arrivals are
    simulated the same way every repeat)."""
    out = []
    for rep, (rr, ss) in enumerate(zip(runs_real, runs_sim)):
        real, sim = {p: rr[p] for p in policies}, {p: ss[p] for p in policies}
        one = compare(real, sim)
        out.append({"order": rotated(policies, rep), "ranking_by_ttft_p99": one["ranking_by_ttft_p99"],
                    "learned_gain_ttft_p99": one.get("learned_gain_ttft_p99"), "errors": pct_errors(real, sim)})
    return out


def repeat_lines(repeats: list[dict]) -> list[str]:
    """One printed line per repeat of `per_repeat`: its order, rankings, learned gain and TTFT errors."""
    lines = []
    for rep, one in enumerate(repeats):
        rk, g = one["ranking_by_ttft_p99"], one["learned_gain_ttft_p99"]
        lines.append(
            f"repeat {rep + 1} (replayed {', '.join(one['order'])}): real {' < '.join(rk['real'])}, "
            f"sim {' < '.join(rk['sim'])}"
            + (f"; learned gain real {_pct(g['real'])}, predicted {_pct(g['predicted'])}" if g else "")
            + "; TTFT p50 / p99 error "
            + ", ".join(f"{p} {_pct(e['ttft_s']['p50'])} / {_pct(e['ttft_s']['p99'])}" for p, e in one["errors"].items()))
    return lines


def compare(real: dict[str, list[Served]], sim: dict[str, list[Served]]) -> dict:
    policies = list(real)
    rows = {}
    for p in policies:
        row = {}
        for m in METRICS:
            row[m] = metric_cells(real[p], sim[p], m)
        row["requests"] = len(real[p])
        rows[p] = row
    rank = {src: sorted(policies, key=lambda p: rows[p]["ttft_s"]["p99"][src]) for src in ("real", "sim")}
    boot = {src: dict(zip(policies, p99_bootstrap([[x.ttft_s for x in runs[p]] for p in policies])))
            for src, runs in (("real", real), ("sim", sim))}
    for p in policies:
        rows[p]["ttft_s"]["p99"]["ci95"] = {src: interval95(boot[src][p]) for src in ("real", "sim")}

    def separated(src: str) -> bool:  # each policy's interval below the next one's in the ranking
        ci = [rows[p]["ttft_s"]["p99"]["ci95"][src] for p in rank[src]]
        return all(a is not None and b is not None and a[1] < b[0] for a, b in zip(ci, ci[1:]))

    report: dict = {"policies": rows, "ranking_by_ttft_p99": {
        **rank, "same": rank["real"] == rank["sim"], "separated": {src: separated(src) for src in ("real", "sim")}}}
    if LEARNED in rows and BASELINE in rows:
        gain, gain_ci = {}, {}
        for src in ("real", "sim"):
            base, learned = rows[BASELINE]["ttft_s"]["p99"][src], rows[LEARNED]["ttft_s"]["p99"][src]
            gain[src] = 1.0 - learned / base if base else None
            with np.errstate(divide="ignore", invalid="ignore"):
                gain_ci[src] = interval95(1.0 - boot[src][LEARNED] / boot[src][BASELINE])
        ratio = gain["real"] / gain["sim"] if gain["real"] is not None and gain["sim"] else None
        report["learned_gain_ttft_p99"] = {"real": gain["real"], "predicted": gain["sim"], "ratio": ratio,
                                           "real_ci95": gain_ci["real"], "predicted_ci95": gain_ci["sim"]}
    errs = [abs(v["rel_err"]) for p in rows.values() for m in ("ttft_s", "e2e_s") for k, v in p[m].items()
            if v["rel_err"] is not None]
    report["max_abs_rel_err_ttft_e2e"] = max(errs) if errs else None
    return report


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def format_report(report: dict) -> str:
    lines = [f"{'policy':18s} {'metric':6s} {'pct':>4s} {'real ms':>9s} {'sim ms':>9s} {'error':>8s}"]
    for p, row in report["policies"].items():
        for m in METRICS:
            for k, v in row[m].items():
                lines.append(f"{p:18s} {m[:-2].upper():6s} {k:>4s} {_ms(v['real']):>9s} {_ms(v['sim']):>9s} "
                             f"{_pct(v['rel_err']):>8s}")
    rk = report["ranking_by_ttft_p99"]
    lines.append(f"ranking by p99 TTFT: real {' < '.join(rk['real'])}; sim {' < '.join(rk['sim'])} "
                 f"({'same' if rk['same'] else 'DIFFERENT'})")
    ci = lambda c: "-" if c is None else f"[{c[0] * 1e3:.0f}, {c[1] * 1e3:.0f}]"  # noqa: E731
    cis = {p: row["ttft_s"]["p99"]["ci95"] for p, row in report["policies"].items()}
    lines.append("p99 TTFT 95 % bootstrap intervals, ms (requests resampled: a lower bound on the noise): "
                 + "; ".join(f"{p} real {ci(c['real'])} sim {ci(c['sim'])}" for p, c in cis.items()))
    sep = rk["separated"]
    where = lambda ok: "outside that noise (each interval below the next one's)" if ok else \
        "inside that noise (neighbours' intervals overlap)"  # noqa: E731
    lines.append(f"  the real ranking is {where(sep['real'])}; the simulated one {where(sep['sim'])}")
    g = report.get("learned_gain_ttft_p99")
    if g:
        pc = lambda c: "-" if c is None else f"[{c[0] * 100:+.0f}%, {c[1] * 100:+.0f}%]"  # noqa: E731
        lines.append(f"learned gain over least-outstanding (p99 TTFT): real {_pct(g['real'])} {pc(g['real_ci95'])}, "
                     f"predicted {_pct(g['predicted'])} {pc(g['predicted_ci95'])}, "
                     f"ratio {'-' if g['ratio'] is None else format(g['ratio'], '.2f')}")
    return "\n".join(lines)


# ---------------------------------------------------------------- capacity and the command


def capacity_rps(profile_paths: list[Path], mean_prompt: float, mean_output: float) -> float:
    """Requests/s the fleet sustains at full batches (from the calibrated cost model): the time scale's target."""
    import yaml

    from simulator.costmodel import load_profile

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
    """The plan of `spec`, time-scaled so that its offered load is `load`: a rate picks the time scale from a window's
    first requests, so another window at the same rate can offer far more work (the warm-up's train segment at the
    evaluated rate ran at 40.5 req/s with 64 output tokens, the evaluated one at 32.1 with 48: the engines were
    saturated while the speed factors were measured, and the factors overshot at the evaluated load)."""
    from fleet.loadplan import PlanSpec, build_plan

    rate = spec.rate
    for _ in range(LOAD_MATCH_ROUNDS):
        plan, _ = build_plan(spec)
        now = offered_load(plan, spec.duration_s, profile_paths)
        if not now or load <= 0 or abs(now / load - 1) < 0.02:
            break
        rate *= load / now
        spec = PlanSpec(**{**spec.__dict__, "rate": rate})
    return plan


def ttft_by_hop(replays: list[Replay], sim: list[Served]) -> dict[str, float]:
    """Mean TTFT where each hop measures it, over a policy's replays: client, router, servers; and simulated. The
    differences say where a first token's time goes that the simulator does not see (the client's and the
    router's own delays on the cores they share with the servers, HTTP between them)."""
    client = [s.ttft_s for r in replays for s in r.served]
    hops = {
        "client_s": float(np.mean(client)) if client else math.nan,
        "router_s": _mean([r.router_ttft for r in replays]),
        "servers_s": _mean([d for r in replays for d in r.engine_ttft]),
        "sim_s": float(np.mean([s.ttft_s for s in sim])) if sim else math.nan,
    }
    return {k: (None if math.isnan(v) else v) for k, v in hops.items()}


def _mean(deltas: list[tuple[float, float]]) -> float:
    total, count = sum(d[0] for d in deltas), sum(d[1] for d in deltas)
    return total / count if count else math.nan


def in_flight_at_arrival(served: list[Served]) -> np.ndarray:
    """Per request: how many requests of the same server had arrived and not finished when it arrived."""
    out = np.zeros(len(served), dtype=int)
    by_replica: dict[int, list[int]] = {}
    for i, s in enumerate(served):
        by_replica.setdefault(s.replica, []).append(i)
    for idx in by_replica.values():
        start = np.array([served[i].arrival_s for i in idx])
        end = start + np.array([served[i].e2e_s for i in idx])
        for k, i in enumerate(idx):
            out[i] = int(np.count_nonzero((start < start[k]) & (end > start[k])))
    return out


def ttft_line(served: list[Served], slots: list[int] | None = None, replica: int | None = None) -> tuple[float, float]:
    """(a, b): the median TTFT as a + b x requests in flight on the same server at arrival, a least-squares
    line through the median TTFT at each in-flight count seen at least MIN_BIN times, weighted by that count.
    With `slots` (each server's max_num_seqs) only requests that found a free batch slot count: beyond it TTFT
    is queueing, which the simulator models itself, and which would otherwise hide the per-request delay.
    With `replica`, that server's requests only."""
    n = in_flight_at_arrival(served)
    ttft = np.array([s.ttft_s for s in served])
    keep = np.array([(replica is None or s.replica == replica) and (slots is None or s.replica < 0 or k < slots[s.replica])
                     for s, k in zip(served, n)], dtype=bool)
    n, ttft = n[keep], ttft[keep]
    xs, ys, ws = [], [], []
    for k in np.unique(n):
        sel = n == k
        if sel.sum() >= MIN_BIN:
            xs.append(float(k))
            ys.append(float(np.median(ttft[sel])))
            ws.append(float(sel.sum()))
    if len(xs) < 2:
        return (float(np.median(ttft)) if len(ttft) else 0.0), 0.0
    b, a = np.polyfit(xs, ys, 1, w=np.sqrt(ws))
    return float(a), float(b)


def extra_overhead(real_ttft_s: list[float], sim_ttft_s: list[float]) -> float:
    """Seconds a real fleet adds to every request's TTFT beyond the simulated one: the gap of the two TTFT
    distributions at their EXTRA_OVERHEAD_QUANTILE-th percentile, where requests queue least (never negative). A
    constant overhead shifts every request; a queueing mismatch moves the upper part only, and the median gap took
    it for overhead (a warm-up whose real fleet queued more than the simulated one fitted 121 ms of "overhead",
    which then put the simulated median TTFT 3-5x over the real one on the evaluated segment)."""
    q = EXTRA_OVERHEAD_QUANTILE
    return max(0.0, float(np.percentile(real_ttft_s, q) - np.percentile(sim_ttft_s, q)))


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
            real_itl, sim_itl = _mean([delta]), mean_itl(sim, i)
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
    from fleet.loadplan import PlanSpec, PromptSynth, build_plan

    profiles = [Path(g.profile) for g in cluster.replicas]
    evaluated, _ = build_plan(PlanSpec(**{**base.__dict__, "rate": rate}))
    load = offered_load(evaluated, base.duration_s, profiles)
    plan = plan_at_load(PlanSpec(**{**base.__dict__, "window": "train", "duration_s": args.warmup, "rate": rate}),
                        load, profiles)
    synth = PromptSynth(seed=999)
    plan = [type(r)(r.send_s, synth.prompt(max(1, round(r.prompt_tokens * estimate_scale))), r.prompt_tokens,
                    r.max_tokens) for r in plan]
    log(f"fidelity: warm-up: {len(plan)} requests of the train window ({len(plan) / args.warmup:.1f} req/s: "
        f"{offered_load(plan, args.warmup, profiles):.2f} of capacity, as the evaluated segment's {load:.2f}) to "
        "measure each engine's speed under load")
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
    warmup_itl = _mean(replay.engine_itl)
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
    from fleet.vllm import cpu_ids, parse_cpu_list

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
    from router.policy.registry import DEFAULT_MODEL_PATH
    from fleet.calibrate import CalibrationError, SweepSpec, calibrate, profile_document, write_atomically
    from fleet.loadplan import PlanSpec, PromptSynth, build_plan

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.calibrations < 0:
        raise FidelityError(f"--calibrations {args.calibrations}: must be 0 or more")
    if args.repeats < 1:
        raise FidelityError(f"--repeats {args.repeats}: must be 1 or more")
    client_cpus, server_cpus = _split_cpus(args.client_cpus, 0 if args.server else args.servers)
    affinity_before = os.sched_getaffinity(0) if client_cpus else None
    if LEARNED in {split_late(p)[0] for p in policies} and not DEFAULT_MODEL_PATH.is_file():
        raise FidelityError(f"policy 'learned': no model at {DEFAULT_MODEL_PATH}")
    if args.plot:  # before minutes of measurement, not after
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise FidelityError(f"--plot {args.plot}: needs matplotlib (pip install 'routewise[sim]')")
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="routewise-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    log = (lambda m: None) if args.quiet and args.json else (lambda m: print(m, file=sys.stderr))
    servers = []
    t_start = time.monotonic()
    try:
        urls = list(args.server)
        known_seqs: list[int | None] = [None] * len(urls)
        if not urls:
            from fleet import vllm

            python = vllm.vllm_python()
            if python is None:
                raise FidelityError(f"no vLLM interpreter: set {vllm.VLLM_PYTHON_ENV} or run scripts/install-vllm.sh")
            model_dir = vllm.ensure_tiny_model(work / "model", python)
            fleet_args = vllm.FLEET_ARGS[: args.servers]
            log(f"fidelity: starting {len(fleet_args)} vLLM CPU servers: {fleet_args}")
            servers = vllm.start_servers(len(fleet_args), model_dir, python, work / "fleet", extra_args=fleet_args,
                                         cores=server_cpus)
            urls = [s.base_url for s in servers]
            known_seqs = [int(a[a.index("--max-num-seqs") + 1]) for a in fleet_args]
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)  # the router started later inherits it
            log(f"fidelity: this command, the router and the load generator on CPUs {client_cpus}"
                + (f", the servers on {server_cpus[:len(servers)]}" if servers else ""))
        model = vllm_model(urls[0])
        base = PlanSpec(trace=args.trace, window=args.window, start_s=args.start, duration_s=args.duration,
                        token_scale=args.token_scale, max_tokens_cap=args.max_tokens_cap,
                        max_prompt_tokens=args.max_prompt_tokens, rate=1.0)
        probe_plan, _ = build_plan(base)
        mean_p = float(np.mean([r.prompt_tokens for r in probe_plan]))
        mean_o = float(np.mean([r.max_tokens for r in probe_plan]))
        if args.profiles:
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
        else:
            import yaml

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
        import yaml

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
        runs_real: list[dict[str, list[Served]]] = []
        runs_sim: list[dict[str, list[Served]]] = []
        runs_routed: list[dict[str, list[Served]]] = []
        runs_tracked: list[dict[str, list[Served]]] = []
        tracked_factors: dict[str, list[list[float]]] = {p: [] for p in policies}
        hops: dict[str, list[Replay]] = {p: [] for p in policies}
        itls: dict[str, list[tuple[float, float]]] = {p: [] for p in policies}
        shares: dict[str, dict[str, list[float]]] = {p: {"real": [], "sim": []} for p in policies}
        reasons_all: dict[str, dict[str, int]] = {p: {} for p in policies}
        for rep in range(args.repeats):
            runs_real.append({})
            runs_sim.append({})
            runs_routed.append({})
            runs_tracked.append({})
            for policy in rotated(policies, rep):
                k = policies.index(policy)
                plan, info = build_plan(PlanSpec(**{**base.__dict__, "rate": rate}))
                # Fresh prompt text per policy and repeat (same lengths and arrivals) so no run hits another's
                # prefix cache. The synthesiser writes 4 characters per token, the router's rule; the server's
                # tokenizer packs chars_per_token: write the text that the server counts as the trace's length.
                synth = PromptSynth(seed=1000 + k + 100 * rep)
                plan = [type(r)(r.send_s, synth.prompt(max(1, round(r.prompt_tokens * estimate_scale))), r.prompt_tokens,
                                r.max_tokens) for r in plan]
                log(f"fidelity: {policy}: {len(plan)} requests through the router"
                    + (f" (repeat {rep + 1} of {args.repeats})" if args.repeats > 1 else ""))
                replay = replay_real(urls, policy, plan, model, work, args.scrape_interval, not args.quiet, late)
                served, itl, fallback_real, reasons = replay.served, replay.engine_itl, replay.fallback_share, \
                    replay.fallback_reasons
                hops[policy].append(replay)
                runs_real[rep][policy] = served
                runs_sim[rep][policy], fallback_sim = simulate_same(served, cluster, policy, estimate_scale, late=late)
                if not split_late(policy)[1]:
                    runs_routed[rep][policy] = simulate_routed(served, cluster, estimate_scale)
                # a diagnostic, not a prediction: the engines at the speed they ran in this very replay
                same = lambda c: simulate_same(served, c, policy, estimate_scale, late=late)[0]  # noqa: E731
                tracked, f = fit_speed(cluster, itl, same)
                runs_tracked[rep][policy] = same(tracked)
                tracked_factors[policy].append(f)
                itls[policy] += itl
                shares[policy]["real"].append(fallback_real)
                shares[policy]["sim"].append(fallback_sim)
                for reason, n in reasons.items():
                    reasons_all[policy][reason] = reasons_all[policy].get(reason, 0) + n
        real, sim = pool_repeats(runs_real), pool_repeats(runs_sim)
        real = {p: real[p] for p in policies}  # the report lists the policies in the order asked for
        sim = {p: sim[p] for p in policies}
        engine = {p: {"real_server_side_s": _mean(itls[p]), "sim_s": mean_itl(sim[p]), "real_client_side_s": mean_itl(real[p])}
                  for p in policies}
        fallbacks = {p: {"real": float(np.mean(shares[p]["real"])), "sim": float(np.mean(shares[p]["sim"])),
                         "real_reasons": reasons_all[p]} for p in policies}
        report = compare(real, sim)
        if args.repeats > 1:  # the pooled figures above; each repeat's own ranking and gain here
            report["per_repeat"] = per_repeat(runs_real, runs_sim, policies)
        # where the error comes from: how each server's median TTFT grows with its load, real and simulated
        slots = [g.max_num_seqs for g in cluster.replicas]
        report["ttft_vs_in_flight"] = {p: [{"real": ttft_line(real[p], slots, i), "sim": ttft_line(sim[p], slots, i)}
                                           for i in range(len(slots))] for p in real}
        report["mean_inter_token_latency"] = engine
        report["fallback_share"] = fallbacks
        report["real_routing"] = pct_errors(real, pool_repeats(runs_routed))
        report["mean_ttft_by_hop"] = {p: ttft_by_hop(hops[p], sim[p]) for p in policies}
        report["tracked_speed"] = {p: {"speed_factors": tracked_factors[p], "errors": e}
                                   for p, e in pct_errors(real, pool_repeats(runs_tracked)).items()}
        report.update(
            speed_factors=factors, extra_request_overhead_s=extra, warmup_engine_itl_s=warmup_itl, mean_tokens={"prompt": mean_p, "output": mean_o}, warmup_s=args.warmup, repeats=args.repeats, trace=args.trace, window=args.window, duration_s=args.duration, offered_rps=rate, capacity_rps=cap,
            servers=urls, profiles=[str(p) for p in profiles], load_average=os.getloadavg(), client_cpus=client_cpus,
            wall_s=time.monotonic() - t_start,
        )
        if args.out:
            (work / "raw.json").write_text(json.dumps(
                {p: {"real": [s.__dict__ for s in real[p]], "sim": [s.__dict__ for s in sim[p]]} for p in real}))
        if args.plot:
            from fleet.fidelity_plot import plot_fidelity

            log(f"fidelity: wrote {plot_fidelity(real, sim, report, args.plot)}")
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(format_report(report))
            for line in repeat_lines(report.get("per_repeat", [])):
                print(line)
            for p, e in engine.items():
                print(f"{p}: mean inter-token latency real {e['real_server_side_s'] * 1e3:.1f} ms in the engines "
                      f"({e['real_client_side_s'] * 1e3:.1f} ms at the client), simulated {e['sim_s'] * 1e3:.1f} ms; "
                      f"fallback decisions real {fallbacks[p]['real']:.1%} "
                      f"({', '.join(f'{k} {v}' for k, v in fallbacks[p]['real_reasons'].items()) or 'none'}), "
                      f"simulated {fallbacks[p]['sim']:.1%}")
            for p, lines in report["ttft_vs_in_flight"].items():
                print(f"{p}: median TTFT (ms) vs requests in flight on the server at arrival, requests with a free batch "
                      "slot: " + "; ".join(f"server {i} real {ln['real'][0] * 1e3:.1f} + {ln['real'][1] * 1e3:.2f}/req, "
                                            f"sim {ln['sim'][0] * 1e3:.1f} + {ln['sim'][1] * 1e3:.2f}/req"
                                            for i, ln in enumerate(lines)))
            for p, errs in report["real_routing"].items():
                print(f"{p}: with the real routing (each request simulated on the server that served it: the server "
                      "model alone), p50 / p99 error: " + ", ".join(
                          f"{m[:-2].upper()} {_pct(e['p50'])} / {_pct(e['p99'])}" for m, e in errs.items()))
            replays = [r for e in engine.values() if (r := e["real_server_side_s"]) == r]  # NaN: no tokens
            if warmup_itl and replays:
                drift = max(abs(r / warmup_itl - 1) for r in replays)
                print(f"engine speed: {warmup_itl * 1e3:.1f} ms per token in the warm-up, "
                      f"{min(replays) * 1e3:.1f}-{max(replays) * 1e3:.1f} in the replays"
                      + (f" (up to {drift:.0%} apart: the speed factors were fitted at another operating point or "
                         "the machine drifted; the tracked-speed lines below take that out)"
                         if drift > SPEED_DRIFT_WARNING else ""))
            for p, hop in report["mean_ttft_by_hop"].items():
                print(f"{p}: mean TTFT (ms) as the client saw it {_ms(hop['client_s'])}, the router (from arrival "
                      f"there) {_ms(hop['router_s'])}, the servers (from arrival at their HTTP front) "
                      f"{_ms(hop['servers_s'])}; simulated {_ms(hop['sim_s'])}")
            for p, tr in report["tracked_speed"].items():
                print(f"{p}: with each engine's speed fitted to this replay's own inter-token latency (factors "
                      f"{'; '.join(', '.join(f'{x:.2f}' for x in f) for f in tr['speed_factors'])}: the speed drift "
                      "between warm-up and replay taken out; a diagnostic, fitted on the run it checks), p50 / p99 "
                      "error: " + ", ".join(f"{m[:-2].upper()} {_pct(e['p50'])} / {_pct(e['p99'])}"
                                             for m, e in tr["errors"].items()))
            la = report["load_average"]
            print(f"offered {rate:.2f} req/s ({rate / cap:.2f} of calibrated capacity {cap:.2f}); load average "
                  f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f}; {report['wall_s']:.0f} s")
        return 0
    finally:
        if affinity_before is not None:
            os.sched_setaffinity(0, affinity_before)
        if servers:
            from fleet import vllm

            vllm.stop_servers(servers)
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


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
