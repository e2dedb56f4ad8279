"""`fleet` command line: emulate, loadgen, demo (the live-fleet tools; thin layer over their modules)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fleet import demo, emulator, loadgen


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
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet",
        description="Live-fleet tools: emulated vLLM replicas, trace load generator, CPU demo.",
        epilog="Run `fleet <command> --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return int(COMMANDS[args.command].run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
