"""`fleet` command line: emulate, loadgen, demo, calibrate, fidelity (live-fleet tools; thin layer over their modules)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from routewise_vllm.fleet import calibrate, demo, emulator, fidelity, loadgen
from routewise_vllm.simulator import commands
from routewise_vllm.simulator.commands import Command


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
        reads_traces=True,
    ),
    "demo": Command(
        "CPU demo: emulated fleet + router (A/B: least-outstanding vs learned) + trace replay",
        demo.add_arguments,
        demo.main,
        reads_traces=True,
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
        reads_traces=True,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    return commands.build_parser(
        "fleet", "Live-fleet tools: emulated vLLM replicas, trace load generator, CPU demo, calibration, fidelity.",
        COMMANDS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return commands.run_command(build_parser(), COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
