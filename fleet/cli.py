"""`fleet` command line: emulate, loadgen, demo, calibrate, fidelity (live-fleet tools; thin layer over their modules)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fleet import calibrate, demo, emulator, fidelity, loadgen
from simulator.traces import TRACES_DIR_HELP, TraceError, use_traces_dir


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "emulate": Command(
        "serve an emulated vLLM replica (OpenAI API + vLLM /metrics) in wall-clock time",
        emulator.add_arguments,
        emulator.main,
    ),
    "loadgen": Command(
        "replay a trace (or Poisson load) open loop against an OpenAI-compatible URL",
        loadgen.add_arguments,
        loadgen.main,
    ),
    "demo": Command(
        "CPU demo: emulated fleet + router (A/B: least-outstanding vs learned) + trace replay",
        demo.add_arguments,
        demo.main,
    ),
    "calibrate": Command(
        "profile a running vLLM server from outside and write a measured cost-model profile",
        calibrate.add_arguments,
        calibrate.main,
    ),
    "fidelity": Command(
        "sim-to-real: a trace segment through the live router to a real vLLM fleet vs the simulator on calibrated profiles",
        fidelity.add_arguments,
        fidelity.main,
    ),
}
READS_TRACES = {"loadgen", "demo", "fidelity"}  # these take --traces-dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet",
        description="Live-fleet tools: emulated vLLM replicas, trace load generator, CPU demo.",
        epilog="Run `fleet <command> --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        if name in READS_TRACES:
            p.add_argument("--traces-dir", metavar="DIR", help=TRACES_DIR_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if getattr(args, "traces_dir", None):
            use_traces_dir(args.traces_dir)
        return int(COMMANDS[args.command].run(args) or 0)
    except TraceError as e:
        print(f"fleet {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
