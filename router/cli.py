"""`router serve`: run the live router (also `python -m routewise_vllm.router serve`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from importlib import metadata

from aiohttp import web
from pydantic import ValidationError

from routewise_vllm.router.policy.registry import policy_names
from routewise_vllm.router.serving.decision_log import DecisionLogError, check_directory
from routewise_vllm.router.settings import RouterSettings, build_settings, fleet_problem, redacted

# Fields with a flag of their own name below; every other field gets --<field-name> (ALL_FLAGS)
DISTRIBUTION = "routewise-vllm"  # the name on the package index (a test holds it to pyproject.toml)
_OPTIONAL_NONE = "none"  # a flag's value that sets an optional field to None (unset), as ROUTEWISE_<FIELD>=none


def format_validation_error(exc: ValidationError) -> str:
    """One line: every invalid field with why and the value given."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        parts.append(f"{field}: {' '.join(err['msg'].removeprefix('Value error, ').split())}{shown}")
    return "invalid router settings: " + "; ".join(parts)


def _field_flags(group: argparse._ArgumentGroup, taken: set[str]) -> None:
    """--<field-name> for every RouterSettings field no hand-written flag sets: each setting has a flag, an
    environment variable (ROUTEWISE_<FIELD>) and a config-file key."""
    for name, field in RouterSettings.model_fields.items():
        if name in taken:
            continue
        flag = "--" + name.replace("_", "-")
        kind = str(field.annotation)
        env = f"ROUTEWISE_{name.upper()}"
        doc = " ".join((field.description or "").split())
        if field.default is not None and "default" not in doc.lower():
            default = field.default.get_secret_value() if hasattr(field.default, "get_secret_value") else field.default
            doc += f" (default {default if isinstance(default, (int, float, str)) else json.dumps(default, default=str)})"
        if field.annotation in (bool, bool | None):
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{doc} (env {env})".replace("%", "%%"))
        else:
            none = f"; {_OPTIONAL_NONE!r} unsets it" if "None" in kind else ""
            group.add_argument(flag, dest=name, metavar="VALUE", help=f"{doc} (env {env}{none})".replace("%", "%%"))


def _version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="router", description="routewise: a learned request router for vLLM replicas.")
    p.add_argument("--version", action="version", version=f"%(prog)s ({DISTRIBUTION}) {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve", help="serve the OpenAI API in front of vLLM replicas",
        description="Serve the OpenAI API in front of vLLM replicas. Every setting can also come from a "
        "ROUTEWISE_<FIELD> environment variable or a YAML/JSON --config file (flags win, then the "
        "environment, then the file). docs/settings.md describes every field; deploy/examples/router.yaml is an "
        "example file.",
    )
    s.add_argument("--config", help="YAML or JSON file of settings (field names as in RouterSettings)")
    s.add_argument("--print-config", action="store_true", default=None,
                   help="print the effective settings (flags over environment over --config file over defaults) as "
                   "JSON, the admin token redacted, and exit")
    s.add_argument("--host", help="listen address (default 0.0.0.0; 127.0.0.1 keeps it local)")
    s.add_argument("--port", type=int, help="listen port (default 8000)")
    s.add_argument("--replica", action="append", dest="replicas", metavar="URL",
                   help="vLLM base URL, e.g. http://10.0.0.5:8000 (repeatable)")
    s.add_argument("--discover", metavar="HOST:PORT", help="resolve HOST's A records periodically (headless service)")
    s.add_argument("--policy", help=f"one of {', '.join(policy_names())}, gated:MODEL (the gate around another "
                   "model), or a path to an .onnx file (default gated: the recommended shipped model, any-fleet, "
                   "behind the gate and late binding)")
    s.add_argument("--shadow-policy", help="a second policy (name or .onnx path) that decides on every request "
                   "without acting; agreement is exported as llm_router_shadow_decisions_total")
    s.add_argument("--ab-treatment", help="A/B: the treatment policy (name or .onnx path); control is --policy")
    s.add_argument("--ab-share", type=float, help="A/B: share of request keys (x-routewise-key, x-user-id, "
                   "x-session-id, the OpenAI 'user' field, else the request) routed by the treatment, 0..1")
    s.add_argument("--decision-log", dest="decision_log_dir", metavar="DIR",
                   help="write one JSON line per routing decision to rotating files in DIR (see router/serving/DECISION_LOG.md)")
    s.add_argument("--admin-token", help="bearer token of /admin/* (admin API disabled without one); visible in ps: "
                   "prefer ROUTEWISE_ADMIN_TOKEN or --admin-token-file")
    s.add_argument("--admin-token-file", metavar="PATH", help="read the admin bearer token from PATH")
    s.add_argument("--ops-port", type=int, help="serve /metrics and /admin/* on this port only, not on --port")
    s.add_argument("--ops-host", help="listen address of --ops-port (default: --host)")
    s.add_argument("--scrape-interval-s", "--scrape-interval", type=float, dest="scrape_interval_s", metavar="S",
                   help="seconds between /metrics scrapes of each replica (default 1)")
    s.add_argument("--late-binding", action=argparse.BooleanOptionalAction, default=None,
                   help="hold requests in a router-side queue while every replica is at its limit and dispatch each "
                   "to the first replica with room (router/hold_queue.py; default: on for a learned policy, off "
                   "for a baseline)")
    s.add_argument("--late-binding-timeout-s", "--late-binding-timeout", type=float, dest="late_binding_timeout_s", metavar="S",
                   help="longest a request is held before the policy sends it to any healthy replica, room or not (default 2)")
    s.add_argument("--late-binding-max-num-seqs", type=int, dest="late_binding_max_num_seqs", metavar="N",
                   help="a replica has room below N requests in flight: your vLLM servers' --max-num-seqs (default: "
                   "inferred per replica from its /metrics; lowered per replica to what its KV cache holds)")
    s.add_argument("--replica-max-num-seqs", action="append", dest="late_binding_replica_max_num_seqs",
                   metavar="HOST:PORT=N", help="late binding's limit for one replica whose --max-num-seqs differs from "
                   "--late-binding-max-num-seqs (repeatable)")
    s.add_argument("--workers", type=int, help="worker processes sharing the port and one view of the in-flight "
                   "load (default 1; on a dedicated host, its core count)")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error", "critical"])
    _field_flags(s.add_argument_group("every other setting (flag, ROUTEWISE_<FIELD>, or --config key)"),
                 {a.dest for a in s._actions})
    return p


def startup_summary(settings: RouterSettings) -> str:
    """The start-up line's account of what decides: the policy and the file it resolved to, late binding and where
    its batch limits come from."""
    from routewise_vllm.router.policy.registry import model_path

    path = model_path(settings.policy)
    policy = f"policy {settings.policy}" + (f" ({path})" if path is not None and str(path) != settings.policy else "")
    if not settings.late_binding:
        return f"{policy}, late binding off"
    if settings.late_binding_max_num_seqs is not None:
        limits = f"--late-binding-max-num-seqs {settings.late_binding_max_num_seqs}"
    else:
        limits = "inferred from each replica's /metrics"
    if settings.late_binding_replica_max_num_seqs:
        limits += f", {len(settings.late_binding_replica_max_num_seqs)} set per replica"
    return f"{policy}, late binding on (batch limits: {limits}; hold timeout {settings.late_binding_timeout_s:g} s)"


def policy_load_error(settings: RouterSettings) -> str | None:
    """One line naming the first policy (main, A/B treatment, shadow) that does not load or cannot score, if any."""
    from routewise_vllm.router.policy.registry import is_learned, make_policy
    from routewise_vllm.router.serving.reload import check_policy

    for field in ("policy", "ab_treatment", "shadow_policy"):
        name = getattr(settings, field)
        if name is None or not is_learned(name):
            continue
        failed = check_policy(make_policy(name, seed=settings.seed))
        if failed is not None:
            return f"{field} {name!r} does not load: {' '.join(failed[1].split())}"
    return None


async def serve(settings: RouterSettings, socks: list[socket.socket] | None = None, shared=None) -> None:
    """Serves until SIGTERM/SIGINT, then drains. `socks` (listening, ops) and `shared` (router.scale.shared.SharedLoad,
    slot) make this one worker of `router serve --workers N` (router.scale.workers)."""
    from routewise_vllm.router.app import OPS_APP, PROXY, create_app
    from routewise_vllm.router.http.connections import ListenerConfig
    from routewise_vllm.router.http.listener import RouterRunner

    app = create_app(settings, shared=shared)
    access_log = logging.getLogger("router.access") if settings.access_log else None
    listener = ListenerConfig.of(settings)
    runner = RouterRunner(app, config=listener, proxy=app[PROXY], handle_signals=False, access_log=access_log,
                          handler_cancellation=True, shutdown_timeout=settings.drain_timeout_s)
    try:
        await runner.setup()
    except DecisionLogError:
        await app.cleanup()  # close what started before the log failed to open (client sessions, tasks)
        raise
    if socks is None:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=1024, reuse_address=True)
    else:
        site = web.SockSite(runner, socks[0])
    await site.start()
    log = logging.getLogger("router")
    log.info("routewise router on http://%s:%d, %s", settings.host, settings.port, startup_summary(settings))
    ops_runner = None
    if OPS_APP in app:
        ops_runner = RouterRunner(app[OPS_APP], config=listener, handle_signals=False, access_log=None,
                                  shutdown_timeout=1.0)
        await ops_runner.setup()
        ops_host = settings.ops_host or settings.host
        if socks is None:
            await web.TCPSite(ops_runner, ops_host, settings.ops_port, reuse_address=True).start()
        else:
            await web.SockSite(ops_runner, socks[1]).start()
        log.info("metrics and admin API on http://%s:%d", ops_host, settings.ops_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    proxy = app[PROXY]
    log.info("draining: %d requests in flight, waiting up to %.0fs", proxy.inflight, settings.drain_timeout_s)
    proxy.draining = True  # new requests on open connections get 503; the listener closes in cleanup
    await runner.cleanup()  # stops the site, waits for handlers up to drain_timeout_s, runs cleanup contexts
    if ops_runner is not None:
        await ops_runner.cleanup()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "print_config")}
    nones = [k for k, v in overrides.items() if isinstance(v, str) and v.lower() == _OPTIONAL_NONE
             and "None" in str(RouterSettings.model_fields[k].annotation)]
    overrides = {k: v for k, v in overrides.items() if k not in nones}
    try:
        settings = build_settings(args.config, explicit_none=nones, **overrides)
    except ValidationError as exc:
        print(f"router: {format_validation_error(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:  # the config file, or an environment variable pydantic-settings could not decode
        print(f"router: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(redacted(settings), indent=2))
        return 0
    problem = fleet_problem(settings)
    if problem is not None:
        print(f"router: invalid router settings: {problem}", file=sys.stderr)
        return 2
    error = policy_load_error(settings)
    if error is not None:
        if not settings.allow_fallback_start:
            print(f"router: {error} (allow_fallback_start=true serves least-outstanding instead)", file=sys.stderr)
            return 2
        print(f"router: {error}; starting on the fallback, least-outstanding (allow_fallback_start)", file=sys.stderr)
    if settings.shared_state is not None:
        from routewise_vllm.router.scale import fleet_view
        missing = fleet_view.check_client()
        if missing is not None:
            print(f"router: {missing}", file=sys.stderr)
            return 2
        if settings.workers > 1:  # the workers publish their host's share under one id (router.scale.fleet_view)
            os.environ[fleet_view.HOST_ID_ENV] = fleet_view.new_host_id()
    if settings.decision_log_dir is not None:
        try:
            check_directory(settings.decision_log_dir)
        except DecisionLogError as exc:
            print(f"router: {exc}", file=sys.stderr)
            return 2
    pid = " %(process)d" if settings.workers > 1 else ""
    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s{pid} %(name)s: %(message)s")
    from routewise_vllm.router.scale.workers import ListenError, listeners, run_workers

    try:
        if settings.workers > 1:
            return run_workers(settings.workers_config(),
                               lambda socks, shared: serve_worker(settings.for_worker(shared[1]), socks, shared))
        # bound before the event loop starts: a busy port is one line, as with workers
        socks, _ = listeners(settings.workers_config())
    except OSError as exc:
        print(f"router: {exc.strerror if isinstance(exc, ListenError) else exc}", file=sys.stderr)
        return 2
    return serve_worker(settings, socks[0])


def serve_worker(settings: RouterSettings, socks: list[socket.socket] | None = None, shared=None) -> int:
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as r:
        try:
            r.run(serve(settings, socks, shared))
        except DecisionLogError as exc:  # an unwritable --decision-log directory: one line, not a traceback
            print(f"router: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
