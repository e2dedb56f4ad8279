"""fleet.router_process: the live router as a subprocess, on the port it bound itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from routewise_vllm.fleet.router_process import start_router
from routewise_vllm.fleet.vllm import listening_ports
from tests.fakes.ports import announced_port

pytestmark = pytest.mark.timeout(120)


def test_the_router_binds_port_0_and_is_reached_on_the_port_it_took(tmp_path):
    log = tmp_path / "emulator.log"
    with open(log, "wb") as out:
        emulator = subprocess.Popen([sys.executable, "-m", "routewise_vllm.fleet", "emulate", "--port", "0",
                                     "--profile", "llama3-8b-a100"], stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{announced_port(emulator, log, 'fleet emulate')}"
        router = start_router([url], "least-outstanding", tmp_path / "router")
        try:
            assert router.process.args[router.process.args.index("--port") + 1] == "0"  # nothing picked beforehand
            assert router.port > 0 and listening_ports(router.process.pid) == {router.port}
            assert router.admin_replicas().keys() == {url.removeprefix("http://")}
        finally:
            assert router.stop() == 0, router.log_tail()
    finally:
        emulator.terminate()
        emulator.wait(10)
