"""The learning loop end to end on real vLLM (bounded): the live router (a subprocess) logs its decisions,
`trainer follow --once` (a second process) fine-tunes on them and hands the candidate over as the A/B
treatment, the router serves it, judges it and exports the candidate's prediction error and state.
Every request succeeds throughout."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH

from routewise_vllm.fleet.router_process import ADMIN_TOKEN, start_router
from routewise_vllm.fleet.vllm import REPO_ROOT, SERVED_MODEL_NAME

pytestmark = pytest.mark.vllm


async def stream_requests(base_url: str, n: int, concurrency: int = 6) -> list[int]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)

    async def one(session, i: int) -> int:
        async with sem:
            body = {"model": SERVED_MODEL_NAME, "prompt": "tell me a story " * (5 + i % 40), "max_tokens": 16 + (i % 5) * 16,
                    "stream": True, "ignore_eos": True}
            async with session.post(f"{base_url}/v1/completions", json=body, headers={"x-routewise-key": f"u{i}"}) as resp:
                await resp.read()
                return resp.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


def test_follow_fine_tunes_on_the_live_log_and_hands_over(vllm_servers, tmp_path: Path):
    primary = shutil.copy(DEFAULT_MODEL_PATH, tmp_path / "primary.onnx")
    logdir, models = tmp_path / "decisions", tmp_path / "models"
    router = start_router(list(vllm_servers), str(primary), tmp_path / "router-logs", env={
        "ROUTEWISE_DECISION_LOG_DIR": str(logdir), "ROUTEWISE_AB_TREATMENT": str(primary), "ROUTEWISE_AB_SHARE": "0.5",
        "ROUTEWISE_AB_AUTO_PROMOTE": "true", "ROUTEWISE_AB_WINDOW_REQUESTS": "100", "ROUTEWISE_AB_MIN_SAMPLES": "50",
    })
    try:
        statuses = asyncio.run(stream_requests(router.base_url, 160))
        assert statuses == [200] * 160
        deadline = time.monotonic() + 60  # an outer bound for a busy host: the log writer flushes in the background
        while sum(f.read_text().count("\n") for f in logdir.glob("decisions-*.jsonl")) < 160 and time.monotonic() < deadline:
            time.sleep(0.1)
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), ROUTEWISE_ADMIN_TOKEN=ADMIN_TOKEN, OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "routewise_vllm.trainer", "follow", "--decision-log", str(logdir), "--models", str(models),
                            "--init", str(primary), "--router", router.base_url, "--every-records", "100",
                            "--min-improvement", "-1", "--once"],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        doc = json.loads(r.stdout)
        assert doc["action"] == "handed_over" and doc["router_status"] == 200, doc
        report = doc["report"]
        assert report["records"] >= 160 and report["val_samples"] >= 1
        candidate = str((models / "candidate-000001.onnx").resolve())
        status, body = router.get("/admin/ab", admin=True)
        ab = json.loads(body)
        assert status == 200 and ab["promotion"]["candidate"] == candidate and ab["promotion"]["state"] == "evaluating", ab
        policy = router.admin_policy()["arms"]["treatment"]
        assert policy["version"] == report["policy_version"]
        # the candidate serves real traffic; nothing fails
        assert asyncio.run(stream_requests(router.base_url, 40)) == [200] * 40
        page = router.metrics()
        text = router.get("/metrics")[1].decode()
        assert f'llm_router_policy_candidate_mae_log_ttft{{stage="after"}} {report["after"]["mae_log_ttft"]}' in text
        assert 'llm_router_policy_candidate_state{state="evaluating"} 1.0' in text
        assert page is not None
    finally:
        router.stop()
