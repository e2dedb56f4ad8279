"""The vLLM emulator: engine (the replica model in wall-clock time), metrics (vLLM's /metrics), api (the server)."""

from routewise_vllm.fleet.emulator.api import API_KEY, ENGINE_KEY, add_arguments, main, make_app
from routewise_vllm.fleet.emulator.engine import EmulatorSettings, WallClockEngine

__all__ = ["API_KEY", "ENGINE_KEY", "EmulatorSettings", "WallClockEngine", "add_arguments", "main", "make_app"]
