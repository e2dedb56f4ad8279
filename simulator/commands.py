"""The shape both thin CLIs (`simulator`, `fleet`) share: a table of subcommands, `--traces-dir` where a
command reads traces, and one-line errors for the exceptions a command names as usage errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from routewise_vllm.simulator.traces import TRACES_DIR_HELP, TraceError, use_traces_dir

EXIT_USAGE = 2


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    reads_traces: bool = False  # takes --traces-dir (else $ROUTEWISE_TRACES_DIR, else the shipped copy)


def build_parser(prog: str, description: str, commands: Mapping[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=f"Run `{prog} <command> --help` for a command's options."
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, cmd in commands.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        if cmd.reads_traces:
            p.add_argument("--traces-dir", metavar="DIR", help=TRACES_DIR_HELP)
    return parser


def run_command(
    parser: argparse.ArgumentParser,
    commands: Mapping[str, Command],
    argv: Sequence[str] | None,
    usage_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Parse, point trace lookups at `--traces-dir`, run; a usage error is one line on stderr and exit 2."""
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if getattr(args, "traces_dir", None):
            use_traces_dir(args.traces_dir)
        return int(commands[args.command].run(args) or 0)
    except (TraceError, *usage_errors) as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
