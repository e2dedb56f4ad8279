"""The fleets of real vLLM CPU servers (fleet/vllm.py): the arguments each server gets and the cores it runs on."""

from __future__ import annotations

import json

import pytest

from routewise_vllm.fleet.vllm import (
    DEEP_ROOMY_FLEET_ARGS, FLEET_ARGS, ROOMY, SLOW_ROOMY_FLEET_ARGS, SMALL, parse_cpu_list, slow_roomy_fleet_args,
)


def _override(args: list[str]) -> dict:
    return json.loads(args[args.index("--hf-overrides") + 1])


def _kv(args: list[str]) -> str:
    return args[args.index("--kv-cache-memory-bytes") + 1]


def test_the_12_layer_fleet_is_the_one_earlier_runs_measured():
    assert SLOW_ROOMY_FLEET_ARGS == [
        FLEET_ARGS[SMALL],
        [*FLEET_ARGS[ROOMY], "--hf-overrides", json.dumps({"num_hidden_layers": 12})],
    ]


def test_a_deeper_roomy_server_gets_kv_bytes_for_the_same_tokens():
    small, roomy = DEEP_ROOMY_FLEET_ARGS
    assert small == FLEET_ARGS[SMALL]
    assert _override(roomy) == {"num_hidden_layers": 48}
    assert _kv(roomy) == "64M"  # 4x the layers of the 16 MiB 12-layer server
    assert roomy[roomy.index("--max-num-seqs") + 1] == "16"
    assert _kv(slow_roomy_fleet_args(3)[1]) == "4M"


def test_a_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="layers must be >= 1, got 0"):
        slow_roomy_fleet_args(0)


def test_cpu_lists_parse_like_taskset():
    assert parse_cpu_list("1") == [1]
    assert parse_cpu_list("2-3,0") == [0, 2, 3]
    assert parse_cpu_list(" 0 , 0-1") == [0, 1]
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match="is not a CPU number or a range like 2-3"):
            parse_cpu_list(bad)


def test_servers_start_on_the_cores_given_one_each_in_turn(monkeypatch, tmp_path):
    from routewise_vllm.fleet import vllm

    started = []

    class Started:
        def wait_healthy(self, deadline):
            pass

    def fake_launch(python, model_dir, port, work, core, extra):
        started.append(core)
        ports.append(port)
        return Started()

    ports: list[int] = []
    monkeypatch.setattr(vllm, "launch_server", fake_launch)
    vllm.start_servers(3, tmp_path, "python", tmp_path, base_port=40000, cores=[2, 5])
    assert started == [2, 5, 2] and ports == [40000, 40001, 40002]
    started.clear()
    ports.clear()
    monkeypatch.setattr(vllm, "cpu_ids", lambda: [0, 1])
    vllm.start_servers(2, tmp_path, "python", tmp_path)
    assert started == [0, 1]
    assert ports == [0, 0]  # no port picked here for another program to take first: each server binds its own


def test_a_server_on_port_0_is_found_on_the_port_it_bound(tmp_path):
    """What `wait_healthy` reads for a server started with --port 0: the port its own process listens on."""
    import subprocess
    import sys
    import time

    from routewise_vllm.fleet.vllm import listening_ports

    script = ("import socket, sys, time; s = socket.create_server(('127.0.0.1', 0)); "
              "print(s.getsockname()[1], flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        bound = int(child.stdout.readline())
        deadline = time.monotonic() + 10
        while not (found := listening_ports(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found == {bound}
    finally:
        child.kill()
        child.wait()
    assert listening_ports(child.pid) == set()  # gone
