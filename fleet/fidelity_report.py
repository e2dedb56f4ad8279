"""The statistics and the text of the sim-to-real fidelity report (`fleet fidelity`, fleet/fidelity.py runs it):
percentiles and relative errors, rankings with bootstrap intervals, the learned policy's gain, repeats, TTFT against
load, where a first token's time goes. Pure: results in, numbers and lines out (tests/fleet/test_fidelity_report.py;
fleet/demo.py uses the intervals too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft_s", "tpot_s", "e2e_s")
LEARNED, BASELINE = "learned", "least-outstanding"
SPEED_DRIFT_WARNING = 0.2  # the report says so when a replay's engines ran this much off the warm-up's speed
EXTRA_OVERHEAD_QUANTILE = 10  # percentile of TTFT at which the warm-up's real and simulated runs are matched
BOOTSTRAP_RESAMPLES = 1000  # resamplings behind the p99 intervals of the report
MIN_BIN = 5  # requests an in-flight count needs to count in the TTFT-vs-load line (ttft_line)
REPEAT_OFFSET_S = 1e6  # pooled repeats are laid end to end on the time axis, never overlapping


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


@dataclass
class Replay:
    """One replay through the live router (replay_real)."""

    served: list[Served]  # in plan order
    engine_itl: list[tuple[float, float]]  # per server, (sum, count) of its engine's inter-token latency
    engine_ttft: list[tuple[float, float]]  # per server, (sum, count) of its own TTFT (from its HTTP arrival)
    router_ttft: tuple[float, float]  # (sum, count) of the router's TTFT (from the request's arrival there)
    fallback_share: float
    fallback_reasons: dict[str, int]


def pcts(values: list[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(vals, PERCENTILES))}


def rel_err(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


def mean_itl(served: list[Served], replica: int | None = None) -> float:
    """Token-weighted mean time between output tokens (what the engines' ITL histogram averages)."""
    if replica is not None:
        served = [s for s in served if s.replica == replica]
    gaps = sum(s.tpot_s * (s.output_tokens - 1) for s in served if s.output_tokens > 1)
    n = sum(s.output_tokens - 1 for s in served if s.output_tokens > 1)
    return gaps / n if n else math.nan


def mean_of(deltas: list[tuple[float, float]]) -> float:
    """The mean behind (sum, count) pairs: their sums over their counts (NaN without any count)."""
    total, count = sum(d[0] for d in deltas), sum(d[1] for d in deltas)
    return total / count if count else math.nan


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


# ---------------------------------------------------------------- where the time goes


def ttft_by_hop(replays: list[Replay], sim: list[Served]) -> dict[str, float]:
    """Mean TTFT where each hop measures it, over a policy's replays: client, router, servers; and simulated. The
    differences say where a first token's time goes that the simulator does not see (the client's and the
    router's own delays on the cores they share with the servers, HTTP between them)."""
    client = [s.ttft_s for r in replays for s in r.served]
    hops = {
        "client_s": float(np.mean(client)) if client else math.nan,
        "router_s": mean_of([r.router_ttft for r in replays]),
        "servers_s": mean_of([d for r in replays for d in r.engine_ttft]),
        "sim_s": float(np.mean([s.ttft_s for s in sim])) if sim else math.nan,
    }
    return {k: (None if math.isnan(v) else v) for k, v in hops.items()}


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


# ---------------------------------------------------------------- the whole run's report


@dataclass
class Runs:
    """Every replay of a run, per repeat (lists) and policy: what the real fleet served, the simulation of the same
    requests, the simulation on the real routing and at the speed the engines ran in the replay itself (with those
    speed factors), and per policy its replays, engine inter-token latencies, fallback shares and reasons."""

    policies: list[str]
    real: list[dict[str, list[Served]]] = field(default_factory=list)
    sim: list[dict[str, list[Served]]] = field(default_factory=list)
    routed: list[dict[str, list[Served]]] = field(default_factory=list)
    tracked: list[dict[str, list[Served]]] = field(default_factory=list)
    tracked_factors: dict[str, list[list[float]]] = field(default_factory=dict)
    replays: dict[str, list[Replay]] = field(default_factory=dict)
    itls: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    shares: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    reasons: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for p in self.policies:
            self.tracked_factors.setdefault(p, [])
            self.replays.setdefault(p, [])
            self.itls.setdefault(p, [])
            self.shares.setdefault(p, {"real": [], "sim": []})
            self.reasons.setdefault(p, {})

    def new_repeat(self) -> None:
        for runs in (self.real, self.sim, self.routed, self.tracked):
            runs.append({})

    def pooled(self) -> tuple[dict[str, list[Served]], dict[str, list[Served]]]:
        """(real, simulated) per policy over all repeats, in the order the policies were asked for."""
        real, sim = pool_repeats(self.real), pool_repeats(self.sim)
        return {p: real[p] for p in self.policies}, {p: sim[p] for p in self.policies}

    def report(self, slots: list[int]) -> dict[str, Any]:
        """compare() of the pooled runs, then each repeat's own (with more than one), TTFT against load on each
        server (`slots`: their max_num_seqs), the engines' inter-token latency, the fallback shares, the errors on
        the real routing and at tracked speed, and the mean TTFT by hop."""
        policies = self.policies
        real, sim = self.pooled()
        engine = {p: {"real_server_side_s": mean_of(self.itls[p]), "sim_s": mean_itl(sim[p]),
                      "real_client_side_s": mean_itl(real[p])} for p in policies}
        fallbacks = {p: {"real": float(np.mean(self.shares[p]["real"])), "sim": float(np.mean(self.shares[p]["sim"])),
                         "real_reasons": self.reasons[p]} for p in policies}
        report = compare(real, sim)
        if len(self.real) > 1:  # the pooled figures above; each repeat's own ranking and gain here
            report["per_repeat"] = per_repeat(self.real, self.sim, policies)
        # where the error comes from: how each server's median TTFT grows with its load, real and simulated
        report["ttft_vs_in_flight"] = {p: [{"real": ttft_line(real[p], slots, i), "sim": ttft_line(sim[p], slots, i)}
                                           for i in range(len(slots))] for p in real}
        report["mean_inter_token_latency"] = engine
        report["fallback_share"] = fallbacks
        report["real_routing"] = pct_errors(real, pool_repeats(self.routed))
        report["mean_ttft_by_hop"] = {p: ttft_by_hop(self.replays[p], sim[p]) for p in policies}
        report["tracked_speed"] = {p: {"speed_factors": self.tracked_factors[p], "errors": e}
                                   for p, e in pct_errors(real, pool_repeats(self.tracked)).items()}
        return report


def report_lines(report: dict) -> list[str]:
    """The printed report: format_report's table, each repeat, then per policy the engines' speed and fallbacks,
    TTFT against load, the real-routing errors, the engine speed drift, TTFT by hop and the tracked-speed errors,
    and the offered load."""
    engine, fallbacks = report["mean_inter_token_latency"], report["fallback_share"]
    lines = [format_report(report), *repeat_lines(report.get("per_repeat", []))]
    for p, e in engine.items():
        lines.append(f"{p}: mean inter-token latency real {e['real_server_side_s'] * 1e3:.1f} ms in the engines "
                     f"({e['real_client_side_s'] * 1e3:.1f} ms at the client), simulated {e['sim_s'] * 1e3:.1f} ms; "
                     f"fallback decisions real {fallbacks[p]['real']:.1%} "
                     f"({', '.join(f'{k} {v}' for k, v in fallbacks[p]['real_reasons'].items()) or 'none'}), "
                     f"simulated {fallbacks[p]['sim']:.1%}")
    for p, per_server in report["ttft_vs_in_flight"].items():
        lines.append(f"{p}: median TTFT (ms) vs requests in flight on the server at arrival, requests with a free "
                     "batch slot: " + "; ".join(f"server {i} real {ln['real'][0] * 1e3:.1f} + {ln['real'][1] * 1e3:.2f}/req, "
                                           f"sim {ln['sim'][0] * 1e3:.1f} + {ln['sim'][1] * 1e3:.2f}/req"
                                           for i, ln in enumerate(per_server)))
    for p, errs in report["real_routing"].items():
        lines.append(f"{p}: with the real routing (each request simulated on the server that served it: the server "
                     "model alone), p50 / p99 error: " + ", ".join(
                         f"{m[:-2].upper()} {_pct(e['p50'])} / {_pct(e['p99'])}" for m, e in errs.items()))
    warmup_itl = report["warmup_engine_itl_s"]
    replays = [r for e in engine.values() if (r := e["real_server_side_s"]) == r]  # NaN: no tokens
    if warmup_itl and replays:
        drift = max(abs(r / warmup_itl - 1) for r in replays)
        lines.append(f"engine speed: {warmup_itl * 1e3:.1f} ms per token in the warm-up, "
                     f"{min(replays) * 1e3:.1f}-{max(replays) * 1e3:.1f} in the replays"
                     + (f" (up to {drift:.0%} apart: the speed factors were fitted at another operating point or "
                        "the machine drifted; the tracked-speed lines below take that out)"
                        if drift > SPEED_DRIFT_WARNING else ""))
    for p, hop in report["mean_ttft_by_hop"].items():
        lines.append(f"{p}: mean TTFT (ms) as the client saw it {_ms(hop['client_s'])}, the router (from arrival "
                     f"there) {_ms(hop['router_s'])}, the servers (from arrival at their HTTP front) "
                     f"{_ms(hop['servers_s'])}; simulated {_ms(hop['sim_s'])}")
    for p, tr in report["tracked_speed"].items():
        lines.append(f"{p}: with each engine's speed fitted to this replay's own inter-token latency (factors "
                     f"{'; '.join(', '.join(f'{x:.2f}' for x in f) for f in tr['speed_factors'])}: the speed drift "
                     "between warm-up and replay taken out; a diagnostic, fitted on the run it checks), p50 / p99 "
                     "error: " + ", ".join(f"{m[:-2].upper()} {_pct(e['p50'])} / {_pct(e['p99'])}"
                                            for m, e in tr["errors"].items()))
    la, rate, cap = report["load_average"], report["offered_rps"], report["capacity_rps"]
    lines.append(f"offered {rate:.2f} req/s ({rate / cap:.2f} of calibrated capacity {cap:.2f}); load average "
                 f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f}; {report['wall_s']:.0f} s")
    return lines
