"""CPU demo of the main job: an emulated heterogeneous vLLM fleet, the router in A/B mode, a real trace.

    fleet demo [--duration 75] [--trace azure-conv] [--replica URL ...]

1. Starts emulated vLLM replicas (`fleet emulate`, each in its own process group on a free loopback
   port) with a heterogeneous mix: 2 x Llama-3-8B on A100, 1 x on H100, 1 x on A100 slowed 3x (a degraded
   node). `--replica URL` (repeatable) uses real vLLM servers instead and starts no emulator.
2. Starts the router (`router serve`) in front of them: control arm least-outstanding (the
   fallback), treatment arm the router's default policy (`gated`: the shipped model behind its gate), traffic split
   50/50 by a stable hash of the request
   (`--ab-treatment/--ab-share`). A router without those flags gets `--policy <treatment>` alone, and a
   checkout without a shipped learned model gets a stated stand-in treatment.
3. Waits until every replica is routable, then replays a train-window slice of the Azure conversation
   trace sped up to load the fleet (`fleet loadgen` in process, with live progress).
4. Prints TTFT and E2E percentiles per arm side by side, and which replicas each arm used.
Stops everything it started, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit
from dataclasses import dataclass
from pathlib import Path

from routewise_vllm.simulator.commands import positive, share
from routewise_vllm.fleet.fidelity_report import interval95, p99_bootstrap
from routewise_vllm.fleet.loadgen import (
    TRACE_CHOICES,
    ClientSpec,
    PlanSpec,
    RequestResult,
    build_plan,
    format_side_by_side,
    run_load,
    summarize,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
ARM_ORDER = ("control", "treatment", "main", "all")


@dataclass(frozen=True)
class EmulatedReplica:
    profile: str
    slowdown: float = 1.0

    def label(self) -> str:
        return self.profile + (f" x{self.slowdown:g} slower" if self.slowdown != 1 else "")


# Heterogeneous on purpose: a least-outstanding router treats all four alike. The last one is `--slowdown` times
# slower than an A100 (default SLOWDOWN).
SLOWDOWN = 3.0


def demo_fleet(slowdown: float = SLOWDOWN) -> tuple[EmulatedReplica, ...]:
    return (EmulatedReplica("llama3-8b-a100"), EmulatedReplica("llama3-8b-a100"), EmulatedReplica("llama3-8b-h100"),
            EmulatedReplica("llama3-8b-a100", slowdown=slowdown))


DEFAULT_FLEET = demo_fleet()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Child processes, each in its own process group; `stop()` ends every group it started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO_ROOT, env=env)  # fmt: skip
        log.close()
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}; its log ends:\n{tail}")

    def stop(self, grace_s: float = 10.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for _, proc in self.procs:  # children of a child (none expected) share its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.procs.clear()


def _get_json(url: str, timeout: float = 1.0) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, None


def wait_ready(procs: Processes, urls: list[str], router: str, timeout_s: float) -> None:
    """Every replica answers /health, then the router's /ready counts all of them routable."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while True:
        procs.check_alive()
        still = []
        for url in pending:
            try:
                status, _ = _get_json(url + "/health")
            except (OSError, ValueError):
                status = 0
            if status != 200:
                still.append(url)
        pending = still
        if not pending:
            try:
                status, body = _get_json(router + "/ready")
            except (OSError, ValueError):
                status, body = 0, None
            if status == 200 and isinstance(body, dict) and body.get("healthy_replicas") == len(urls):
                return
        if time.monotonic() > deadline:
            what = f"replicas {pending}" if pending else f"router {router}/ready"
            raise TimeoutError(f"not ready after {timeout_s:.0f} s: {what} (logs in {procs.log_dir})")
        time.sleep(0.2)


def router_flags(python: str) -> set[str]:
    """The flags `router serve --help` lists (A/B support is detected, not assumed)."""
    out = subprocess.run([python, "-m", "routewise_vllm.router", "serve", "--help"], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"`router serve --help` failed:\n{out.stderr[-2000:]}")
    return {tok.rstrip(",") for tok in out.stdout.split() if tok.startswith("--")}


def default_policy() -> str:
    """The policy `router serve` serves when given none: the demo's treatment."""
    from routewise_vllm.router.policy.registry import DEFAULT_POLICY

    return DEFAULT_POLICY


def learned_available() -> bool:
    from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH

    return DEFAULT_MODEL_PATH.is_file()


def router_argv(python: str, port: int, replicas: list[str], control: str, treatment: str, share: float,
                flags: set[str], late_max_num_seqs: int | None = None) -> tuple[list[str], bool]:  # fmt: skip
    """`late_max_num_seqs`: None = late binding at the batch limits the router infers from the replicas' /metrics
    (the default configuration), N = at N in flight per replica, 0 = off."""
    argv = [python, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for url in replicas:
        argv += ["--replica", url]
    if late_max_num_seqs is None:
        argv += ["--late-binding"]
    elif late_max_num_seqs > 0:
        argv += ["--late-binding", "--late-binding-max-num-seqs", str(late_max_num_seqs)]
    elif "--no-late-binding" in flags:
        argv += ["--no-late-binding"]
    ab = "--ab-treatment" in flags and "--ab-share" in flags
    if ab:
        argv += ["--policy", control, "--ab-treatment", treatment, "--ab-share", str(share)]
    else:
        argv += ["--policy", treatment]
    return argv, ab


def _replica_mix(summary: dict, arms: list[str], names: dict[str, str]) -> list[str]:
    lines = []
    for arm in arms:
        counts = summary[arm]["replicas"]
        if not counts:
            continue
        total = sum(counts.values())
        labelled = sorted((names.get(r, r), n) for r, n in counts.items())
        parts = [f"{label} {100 * n / total:.0f}%" for label, n in labelled]
        lines.append(f"  {arm:<10} " + ", ".join(parts))
    return lines


def p99_intervals(results: list[RequestResult], arms: list[str]) -> dict[str, list[float] | None]:
    """Each arm's TTFT p99 95 % bootstrap interval over its requests (seconds; None without samples)."""
    boot = p99_bootstrap([[r.ttft_s for r in results if r.group == arm and r.ok] for arm in arms])
    return {arm: interval95(boot[i]) for i, arm in enumerate(arms)}


def _plot(results: list[RequestResult], arms: list[str], intervals: dict[str, list[float] | None], title: str,
          path: Path) -> str | None:
    """The result drawn beside the table: a line naming the file, or why there is none."""
    try:
        from routewise_vllm.fleet.demo_plot import plot_demo

        ttfts = {arm: [r.ttft_s for r in results if r.group == arm and r.ok and math.isfinite(r.ttft_s)] for arm in arms}
        return f"plot: {plot_demo(ttfts, intervals, title, path)}"
    except ImportError:
        return "plot: none (matplotlib is not installed: pip install 'routewise-vllm[sim]')"
    except OSError as exc:
        return f"plot: none ({path}: {exc.strerror or exc})"


def p99_verdict(intervals: dict[str, list[float] | None]) -> str | None:
    """One line: both arms' TTFT p99 intervals and whether this run can rank the arms at all."""
    c, t = intervals.get("control"), intervals.get("treatment")
    if c is None or t is None:
        return None
    line = (f"TTFT p99, 95 % interval over requests (bootstrap; a lower bound on the noise): control "
            f"[{c[0] * 1e3:.0f}, {c[1] * 1e3:.0f}] ms, treatment [{t[0] * 1e3:.0f}, {t[1] * 1e3:.0f}] ms: ")
    if t[1] < c[0]:
        return line + "treatment lower, outside the noise"
    if c[1] < t[0]:
        return line + "treatment higher, outside the noise"
    return line + "they overlap, so this run does not rank the arms (a longer --duration narrows them)"


def decision_summary(metrics_text: str) -> dict[str, dict]:
    """Per arm, from the router's /metrics text: decisions, fallback share by reason, and the decision
    latency p50/p99 as the upper bound of their histogram bucket (seconds). For the demo and the e2e tests."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, dict[float, float]] = {}
    fallbacks: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            arm = s.labels.get("arm")
            if s.name == "llm_router_decision_latency_seconds_bucket":
                le = float(s.labels["le"])
                per = buckets.setdefault(arm, {})
                per[le] = per.get(le, 0.0) + s.value
            elif s.name == "llm_router_fallbacks_total" and s.value:
                per = fallbacks.setdefault(arm, {})
                per[s.labels["reason"]] = per.get(s.labels["reason"], 0.0) + s.value
    out: dict[str, dict] = {}
    for arm, per in buckets.items():
        les = sorted(per)
        total = per[les[-1]] if les else 0.0

        def quantile(q: float) -> float:
            return next((le for le in les if per[le] >= q * total), math.inf) if total else math.nan

        reasons = fallbacks.get(arm, {})
        out[arm] = {
            "decisions": int(total),
            "fallback_share": sum(reasons.values()) / total if total else 0.0,
            "fallbacks": {k: int(v) for k, v in reasons.items()},
            "decision_p50_s": quantile(0.5),
            "decision_p99_s": quantile(0.99),
        }
    return out


def late_binding_summary(metrics_text: str) -> tuple[dict[str, int], int]:
    """From the router's /metrics text: the requests late binding let go, by reason (llm_router_late_dispatches_total;
    "room" after a hold or at once, "idle", "full", "timeout", ...), and how many it held in its queue
    (llm_router_hold_duration_seconds_count); ({}, 0) when late binding is off."""
    from prometheus_client.parser import text_string_to_metric_families

    reasons: dict[str, int] = {}
    held = 0.0
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "llm_router_late_dispatches_total" and s.value:
                reasons[s.labels["reason"]] = reasons.get(s.labels["reason"], 0) + int(s.value)
            elif s.name == "llm_router_hold_duration_seconds_count":
                held += s.value
    return reasons, int(held)


def batch_limits(metrics_text: str) -> dict[str, list]:
    """From the router's /metrics text: each replica's batch limit and its source (operator, or inferred from the
    replica's own /metrics), llm_router_replica_batch_limit; {} before any is known."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["replica"]: [int(s.value), s.labels["source"]] for fam in text_string_to_metric_families(metrics_text)
            for s in fam.samples if s.name == "llm_router_replica_batch_limit"}


def router_stats(router: str) -> tuple[dict[str, dict], dict[str, int], int, dict[str, list]]:
    """From the router's /metrics: per-arm decision counts, fallback shares and decision latency; late binding's
    dispatches by reason; requests it held; the replicas' batch limits ({}, {}, 0, {} if unreadable)."""
    from urllib.request import urlopen

    try:
        with urlopen(f"{router}/metrics", timeout=2.0) as resp:
            text = resp.read().decode()
    except OSError:
        return {}, {}, 0, {}
    return decision_summary(text), *late_binding_summary(text), batch_limits(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="use this (real vLLM) server instead of emulated ones (repeatable)")  # fmt: skip
    p.add_argument("--duration", type=positive(), default=75.0, help="seconds of trace replay (default 75)")
    p.add_argument("--trace", default="azure-conv", choices=TRACE_CHOICES, help="trace to replay (train window)")
    p.add_argument("--start", type=float, default=600.0, help="offset into the train window, trace seconds")
    p.add_argument("--time-scale", type=positive(), default=3.0, help="trace speed-up (default 3x: ~15 req/s)")
    p.add_argument("--token-scale", type=positive(), default=0.5, help="prompt/output length multiplier (default 0.5)")
    p.add_argument("--max-tokens-cap", type=positive(int), default=48, help="cap on max_tokens (default 48)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="clip prompts (e.g. 900 for real tiny vLLM servers with --max-model-len 1024)")
    p.add_argument("--max-num-seqs", type=positive(int), default=8, help="emulated replicas: batch slots (default 8)")
    p.add_argument("--late-binding-max-num-seqs", type=int, default=None, metavar="N",
                   help="router-side late binding: hold a request while every replica has N in flight, then send it to "
                   "the first with room (default: at each replica's batch limit, which the router infers from its "
                   "/metrics, as `router serve` does by default; 0 = off)")
    p.add_argument("--slowdown", type=positive(), default=SLOWDOWN,
                   help=f"emulated fleet: how many times slower than an A100 its slowest replica is (default {SLOWDOWN:g})")
    p.add_argument("--speed", type=positive(), default=0.5,
                   help="emulated replicas: emulated seconds per wall second (default 0.5: half-speed GPUs, so a "
                        "2-core machine can stream the tokens of a loaded fleet)")
    p.add_argument("--control", default="least-outstanding", help="control arm policy (default least-outstanding)")
    default = default_policy()
    p.add_argument("--treatment", default=default, help=f"treatment arm policy (default {default}, the router's)")
    p.add_argument("--ab-share", type=share, default=0.5, help="share of traffic in the treatment arm")
    p.add_argument("--model", default="tiny", help="served model name (for --replica servers)")
    p.add_argument("--timeout", type=positive(), default=60.0, help="per-request timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the per-arm summary here")
    p.add_argument("--logs", type=Path, default=None, help="keep the child processes' logs in this folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="draw the result here (default: demo.png in the logs folder; needs matplotlib)")


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt


def _stop_on_ctrl_c_and_sigterm() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so the demo always stops the fleet it started.

    SIGINT is set explicitly because it can arrive ignored: a shell without job control (a script, CI) starts
    `cmd &` with SIGINT ignored, exec keeps that, and Python then installs no Ctrl-C handler and `asyncio.run`
    none either, so the demo would ignore Ctrl-C and replay the whole trace.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)  # asyncio.run cancels the load on it
    signal.signal(signal.SIGTERM, _on_sigterm)


def unreachable(urls: list[str], timeout_s: float = 3.0) -> str | None:
    """The first of `urls` whose /health does not answer 200 within `timeout_s`, with why; None if all do."""
    for url in urls:
        try:
            status, _ = _get_json(url.rstrip("/") + "/health", timeout=timeout_s)
        except (OSError, ValueError) as exc:
            return f"--replica {url}: not reachable ({getattr(exc, 'reason', None) or exc})"
        if status != 200:
            return f"--replica {url}: /health answered {status}"
    return None


def main(args: argparse.Namespace) -> int:
    if args.late_binding_max_num_seqs is not None and args.late_binding_max_num_seqs < 0:
        print(f"fleet demo: error: --late-binding-max-num-seqs {args.late_binding_max_num_seqs}: must be 0 (off) or "
              "more", file=sys.stderr)
        return 2
    down = unreachable(args.replica)
    if down is not None:
        print(f"fleet demo: error: {down}", file=sys.stderr)
        return 2
    started = time.monotonic()
    python = sys.executable
    _stop_on_ctrl_c_and_sigterm()
    log_root = args.logs or Path(tempfile.mkdtemp(prefix="routewise-demo-"))
    log_root.mkdir(parents=True, exist_ok=True)
    procs = Processes(log_root)
    treatment = args.treatment
    note = ""
    from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH, model_path

    if model_path(treatment) == DEFAULT_MODEL_PATH and not learned_available():  # `learned`, `gated`: the shipped model
        treatment, note = "speed-aware", "no shipped learned model (router/policy/models/): treatment = speed-aware"
    plan, info = build_plan(PlanSpec(
        trace=args.trace, window="train", start_s=args.start, time_scale=args.time_scale, duration_s=args.duration,
        token_scale=args.token_scale, max_tokens_cap=args.max_tokens_cap,
        max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
    ))  # fmt: skip
    try:
        names: dict[str, str] = {}
        if args.replica:
            urls = [u.rstrip("/") for u in args.replica]
            names = {u: u for u in urls}
            model = args.model
        else:
            urls = []
            for i, rep in enumerate(demo_fleet(args.slowdown)):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                procs.start(f"emulator-{i}", [
                    python, "-m", "routewise_vllm.fleet", "emulate", "--port", str(port), "--profile", rep.profile,
                    "--slowdown", str(rep.slowdown), "--max-num-seqs", str(args.max_num_seqs), "--speed", str(args.speed),
                ])  # fmt: skip
                urls.append(url)
                names[url] = f"{i}:{rep.label()}"
            model = "tiny"
        router_port = free_port()
        late = args.late_binding_max_num_seqs  # None: at the batch limits the router infers
        flags = router_flags(python)
        if late != 0 and "--late-binding-max-num-seqs" not in flags:
            note = (note + "; " if note else "") + "router has no --late-binding-max-num-seqs: late binding off"
            late = 0
        argv, ab = router_argv(python, router_port, urls, args.control, treatment, args.ab_share, flags, late)
        if not ab:
            note = (note + "; " if note else "") + f"router has no --ab-treatment: single policy {treatment}"
        procs.start("router", argv)
        router = f"http://127.0.0.1:{router_port}"
        print("routewise demo", file=sys.stderr)
        for url in urls:
            print(f"  replica  {names[url]:<32} {url}", file=sys.stderr)
        arms = f"control={args.control} / treatment={treatment} ({args.ab_share:.0%})" if ab else f"policy={treatment}"
        print(f"  router   {arms:<32} {router}", file=sys.stderr)
        print("  late     " + ("off" if late == 0 else f"held in the router while every replica has {late} requests in flight"
                                 if late else "held in the router while every replica is at its batch limit (inferred "
                                 "from its /metrics)"), file=sys.stderr)
        if note:
            print(f"  note     {note}", file=sys.stderr)
        wait_ready(procs, urls, router, timeout_s=60.0)
        # The router names replicas by URL, host:port or index: map each to the fleet's labels.
        names.update({str(i): names[u] for i, u in enumerate(urls)})
        names.update({urlsplit(u).netloc: names[u] for u in urls})
        print(
            f"  load     {info['requests']} requests of {info['trace']} (train window from {args.start:.0f} s) over "
            f"{args.duration:.0f} s: time scale {info['time_scale']:g}x, token scale {args.token_scale:g}, "
            f"max_tokens cap {args.max_tokens_cap}, ~{info['offered_rate_per_s']:.1f} req/s "
            f"(mean prompt {info['mean_prompt_tokens']:.0f}, mean output {info['mean_max_tokens']:.0f} tokens)",
            file=sys.stderr,
        )
        spec = ClientSpec(url=router, model=model, timeout_s=args.timeout)
        results, wall = asyncio.run(run_load(plan, spec, progress=not args.no_progress))
        procs.check_alive()
        decisions, late_reasons, held, limits = router_stats(router)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the demo's processes", file=sys.stderr)
        return 130
    except (TimeoutError, RuntimeError) as exc:  # a process that died or never became ready: its log is named
        print(f"fleet demo: error: {' '.join(str(exc).split())[:400]}", file=sys.stderr)
        return 1
    finally:
        procs.stop()
    summary = summarize(results)
    arms_seen = [a for a in ARM_ORDER if a in summary] + [a for a in summary if a not in ARM_ORDER]
    print()
    title = f"TTFT and E2E per arm ({info['trace']} train window, {len(results)} requests, {wall:.0f} s)"
    if ab:
        title += f": control = {args.control}, treatment = {treatment}"
    print(title)
    print(format_side_by_side(summary, arms_seen))
    intervals = p99_intervals(results, arms_seen)
    verdict = p99_verdict(intervals)
    if verdict:
        print(verdict)
    if decisions:
        print("routing decisions per arm (router /metrics): who decided, and how long it took")
        for arm, d in decisions.items():
            why = ", ".join(f"{k} {v}" for k, v in sorted(d["fallbacks"].items())) or "none"
            print(f"  {arm:<10} {d['decisions']} decisions, fell back to least-outstanding {d['fallback_share']:.1%} "
                  f"({why}); decision latency p50 <= {d['decision_p50_s'] * 1e6:.0f} us, p99 <= {d['decision_p99_s'] * 1e6:.0f} us")
    if late != 0:
        why = ", ".join(f"{k} {v}" for k, v in sorted(late_reasons.items())) or "none"
        at = f"{late} in flight per replica" if late else "the batch limits the router inferred: " + (", ".join(
            f"{names.get(r, r)} {n}" for r, (n, _) in sorted(limits.items())) or "none yet")
        print(f"late binding (at {at}): {held} of {len(results)} requests held in the router "
              f"(dispatches by reason: {why})")
    plot = _plot(results, arms_seen, intervals, title, args.plot or log_root / "demo.png")
    if plot:
        print(plot)
    mix = _replica_mix(summary, arms_seen, names)
    if mix:
        print("replica share per arm:")
        print("\n".join(mix))
    print(f"(demo took {time.monotonic() - started:.0f} s; logs in {log_root})")
    if args.json:
        args.json.write_text(json.dumps({"plan": info, "summary": summary, "ab": ab, "treatment": treatment, "decisions": decisions,
                                         "late_binding": late != 0, "late_binding_max_num_seqs": late,
                                         "batch_limits": limits, "held": held, "late_dispatches": late_reasons,
                                         "ttft_p99_interval_s": intervals}, indent=1))
    errors = sum(s["errors"] for s in summary.values())
    return 0 if errors == 0 else 1
