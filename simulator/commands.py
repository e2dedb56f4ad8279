"""The shape the thin CLIs (`simulator`, `fleet`, and `trainer`'s parser) share: a table of subcommands,
`--traces-dir` where a command reads traces, `--version`, and one-line errors: a bad flag value or an exception a
command names as a usage error is one line on stderr and exit 2, before anything starts."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from typing import NoReturn
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from routewise_vllm.simulator.traces import TRACES_DIR_HELP, TraceError, use_traces_dir

EXIT_USAGE = 2
DISTRIBUTION = "routewise-vllm"  # the name on the package index (pyproject.toml [project] name; a test holds them equal)


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one line (`prog: error: what`, exit 2) instead of the usage block and the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's default in --help, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS, False, [], ()):
            return text
        return f"{text} (default: %(default)s)"


def positive(kind: type = float) -> Callable[[str], float]:
    """An argparse type: a number above 0, else the flag's error names the value."""

    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid float value"
    return parse


def share(text: str) -> float:
    """An argparse type: a fraction in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a share between 0 and 1")
    return value


share.__name__ = "float"


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s ({DISTRIBUTION}) {version()}")


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    reads_traces: bool = False  # takes --traces-dir (else $ROUTEWISE_TRACES_DIR, else the shipped copy)


def build_parser(prog: str, description: str, commands: Mapping[str, Command]) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog, description=description, epilog=f"Run `{prog} <command> --help` for a command's options.",
        formatter_class=DefaultsFormatter,
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, cmd in commands.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, formatter_class=DefaultsFormatter)
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
