"""Settings validation and the `router serve` process: errors name the field, SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from routewise_vllm.router.cli import format_validation_error, main
from routewise_vllm.router.settings import RouterSettings, build_settings, fleet_problem

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kwargs,field,value", [
    (dict(replicas=["http://a:1"], policy="nope"), "policy", "nope"),
    (dict(replicas=["http://a:1"], policy="/no/such/model.onnx"), "policy", "/no/such/model.onnx"),
    (dict(replicas=["http://a:1"], shadow_policy="bogus"), "shadow_policy", "bogus"),
    (dict(replicas=["ftp://a:1"]), "replicas", "ftp://a:1"),
    (dict(replicas=["http://a:1"], ab_share=1.5), "ab_share", "1.5"),
    (dict(replicas=["http://a:1"], port=70000), "port", "70000"),
    (dict(replicas=["http://a:1"], discover="nohostport"), "discover", "nohostport"),
])
def test_bad_settings_name_field_and_value(kwargs, field, value):
    with pytest.raises(ValidationError) as exc:
        RouterSettings(**kwargs)
    msg = format_validation_error(exc.value)
    assert f"{field}:" in msg and value in msg


@pytest.mark.parametrize("argv,expect", [
    (["--admin-token", ""], "admin_token is empty"),
    (["--admin-token-file", "/no/such/token"], "admin_token_file"),
    (["--ops-port", "8000", "--port", "8000"], "ops_port=8000: must differ from port"),
])
def test_cli_refuses_bad_admin_and_ops_settings(capsys, argv, expect):
    """An empty --admin-token used to be accepted silently."""
    assert main(["serve", "--replica", "http://127.0.0.1:1", *argv]) == 2
    assert expect in capsys.readouterr().err


def test_passthrough_paths_from_the_environment(monkeypatch):
    monkeypatch.setenv("ROUTEWISE_PASSTHROUGH_PATHS", "/v1/models,/v1/embeddings")
    assert build_settings(replicas=["http://a:1"]).passthrough_paths == ["/v1/models", "/v1/embeddings"]
    for bad in ("/v1/../admin", "v1/x", "/v1/%2e%2e", "/v1//x"):
        with pytest.raises(ValidationError, match="passthrough_paths"):
            RouterSettings(replicas=["http://a:1"], passthrough_paths=[bad])


def test_no_replicas_cannot_serve_but_is_valid_settings():
    """`--print-config` shows settings without a fleet; serving them is refused (tests/test_cli_errors.py)."""
    assert fleet_problem(RouterSettings()) == "replicas: no replicas; give --replica URL (repeatable) or --discover host:port"
    assert fleet_problem(RouterSettings(discover="vllm:8000")) is None
    assert fleet_problem(RouterSettings(replicas=["http://a:1"])) is None


def test_sources_priority(tmp_path, monkeypatch):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("replicas: [http://10.0.0.1:8000]\nport: 9001\nscrape_interval_s: 2.0\n")
    s = build_settings(cfg)
    assert s.replicas == ["http://10.0.0.1:8000"] and s.port == 9001 and s.policy == "gated"
    assert s.max_stats_age_s is None and s.overload_margin is None  # unset: each arm's kind decides (router.policy.served)
    monkeypatch.setenv("ROUTEWISE_PORT", "9002")
    monkeypatch.setenv("ROUTEWISE_REPLICAS", "http://10.0.0.2:8000,http://10.0.0.3:8000")
    s = build_settings(cfg, policy="least-outstanding")
    assert s.port == 9002 and len(s.replicas) == 2 and s.max_stats_age_s is None and s.overload_ratio is None  # env over file
    assert build_settings(cfg, port=9003).port == 9003  # flags over env
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"replicas": ["http://a:1"], "polcy": "random"}))
    with pytest.raises(ValueError, match="polcy"):
        build_settings(bad)


def test_cli_exit_code_and_message(capsys):
    assert main(["serve", "--replica", "http://127.0.0.1:1", "--policy", "nope"]) == 2
    err = capsys.readouterr().err
    assert "policy" in err and "'nope'" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(what: str, check, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Poll `check()` (async) until true; fail naming `what` if the process exits first or after timeout_s."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert proc.poll() is None, f"router exited ({proc.returncode}) before {what}: {proc.stdout.read().decode()}"
        assert asyncio.get_running_loop().time() < deadline, f"no {what} after {timeout_s} s"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_sigterm_drains_inflight_stream_then_exits(fakes):
    """Order, not timing: after SIGTERM the listener closes while a stream is still in flight (the fake replica
    makes its tokens only when the test releases them), the stream then completes, and the process exits 0."""
    (a,) = await fakes(1)
    a.token_gate = asyncio.Semaphore(1)  # tok0 at once; every later token waits for the test
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(port), "--replica", a.url,
         "--policy", "least-outstanding", "--log-level", "warning"],
        cwd=REPO, env={**os.environ, "ROUTEWISE_DRAIN_TIMEOUT_S": "60"}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    async def answers(path: str) -> bool:
        try:
            async with aiohttp.ClientSession() as s2, s2.get(f"{url}{path}") as r:
                return r.status == 200
        except aiohttp.ClientConnectionError:
            return False

    async def refused() -> bool:
        try:
            async with aiohttp.ClientSession() as s2, s2.get(f"{url}/health"):
                return False
        except aiohttp.ClientConnectionError:
            return True

    try:
        await _until("/ready", lambda: answers("/ready"), proc, timeout_s=60)
        async with aiohttp.ClientSession() as s:
            resp = await s.post(f"{url}/v1/completions",
                                json={"model": "tiny", "prompt": "x", "max_tokens": 20, "stream": True})
            assert b"tok0" in await resp.content.readany()
            proc.send_signal(signal.SIGTERM)
            await _until("a closed listener", refused, proc)  # closed while tok1..tok19 are still to come
            assert a.generation_tokens == 1 and proc.poll() is None
            for _ in range(19):
                a.token_gate.release()
            rest = await asyncio.wait_for(resp.read(), 30)  # the in-flight stream still finishes
            assert b"tok19" in rest and rest.rstrip().endswith(b"[DONE]")
        rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        assert rc == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_scrape_timeout_defaults_to_at_most_the_interval():
    from routewise_vllm.router.settings import RouterSettings

    assert RouterSettings(replicas=["http://127.0.0.1:1"], scrape_interval_s=0.2).scrape_timeout_s == 0.2
    assert RouterSettings(replicas=["http://127.0.0.1:1"]).scrape_timeout_s == 0.8
