"""Every dashboard query and alert rule, run against a real Prometheus scraping a running router.

Stack (all loopback, own process groups, stopped by process group at the end):
  two fake vLLM servers (tests/deploy/fake_vllm.py; "b" fails every second /metrics scrape)
  + two broken ones ("x" and "y" answer every generation with 503: the router retries elsewhere and
    ejects the first of them to reach the breaker; ejecting the second would put 3 of 5 replicas out
    of rotation, over the 0.5 panic threshold, so that ejection is refused and counted)
  + one dead replica URL (nothing listens: health and scrape errors, an unhealthy replica)
  -> `router serve` (decision budget forced to 1 ns, so every decision records an
     `over_budget` fallback and llm_router_fallbacks_total has samples)
  <- Debian's /usr/bin/prometheus, scraping the router every second and evaluating
     deploy/prometheus/alerts.yml every second.
Traffic goes through the official `openai` client: streaming and non-streaming completions and
chat, plus requests that fail on one server (retried), on every server (5xx) and with an unknown
model (4xx).

What "returns data" means: a non-empty result with at least one finite sample. Dashboard targets
and the variable query must return data. A whole alert expression must evaluate without error but
may be empty (its threshold is not crossed under healthy traffic: that is the point); each of its
"signals" (every and/or/unless operand with its trailing threshold comparison removed, see
queries.alert_signals) must return data. The router runs an A/B split, a shadow policy and automatic
promotion, and a candidate (the shipped model with a fine-tuning card beside it) is reloaded into the treatment
arm before the traffic, so every panel, the candidate's prediction error included, has data.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.fakes.ports import announced_port, listening_port

from .queries import ALERTS, REPO, Query, alert_queries, alert_rules, dashboard_queries
from .tools import require_tool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAFFIC_S = 5.0
ADMIN_TOKEN = "observability-test-token"
CANDIDATE_CARD = {"finetune": {"validation_before": {"mae_log_ttft": 0.61}, "validation_after": {"mae_log_ttft": 0.42}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise AssertionError(f"{what}: process exited with {proc.returncode}\n{tail}")
        try:
            value = check()
            if value:
                return value
        except (OSError, ValueError) as exc:
            last_exc = exc
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_exc})\n{tail}")


@dataclass
class Processes:
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        with open(log, "wb") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=REPO, env=env)
        self.procs.append((name, p))
        return p

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        status, body = http_get(f"{self.url}/api/v1/{path}?{query}", timeout=10)
        doc = json.loads(body)
        if status != 200 or doc.get("status") != "success":
            raise AssertionError(f"{path} {params}: HTTP {status}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: result type {data['resultType']}"
        return data["result"]


@dataclass
class Stack:
    prometheus: Prometheus
    router_url: str
    traffic: dict


def router_help() -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "routewise_vllm.router", "serve", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.fail(f"`router serve --help` failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def load_candidate(router_url: str, tmp: Path) -> None:
    """What `trainer follow` hands over: a model with its card (NAME.json) beside it, reloaded into the treatment."""
    from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH

    model = Path(shutil.copy(DEFAULT_MODEL_PATH, tmp / "candidate.onnx"))
    model.with_suffix(".json").write_text(json.dumps(CANDIDATE_CARD))
    req = urllib.request.Request(f"{router_url}/admin/policy/reload", method="POST",
                                 data=json.dumps({"path": str(model), "arm": "treatment"}).encode(),
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200, r.read()


def drive_traffic(base_url: str, seconds: float) -> dict:
    """Mixed OpenAI traffic for `seconds`; returns counts per outcome."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-checked", max_retries=0, timeout=15)
    counts = {"ok": 0, "4xx": 0, "5xx": 0}

    def one(i: int) -> str:
        user = f"user-{i}"  # the A/B split hashes a request key; vary it so both arms get traffic
        kind = i % 10
        try:
            if kind in (0, 1, 2, 3):
                stream = client.completions.create(model="tiny", prompt=f"hello {i} " * 8, max_tokens=6,
                                                   stream=True, user=user)
                assert sum(len(c.choices[0].text) for c in stream if c.choices) > 0
            elif kind in (4, 5):
                stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"hi {i}"}],
                                                        max_tokens=6, stream=True, user=user)
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            elif kind == 6:
                r = client.completions.create(model="tiny", prompt=f"plain {i}", max_tokens=4, user=user)
                assert r.choices[0].text
            elif kind == 7:  # one fake fails it: retried on the other before the first byte
                r = client.completions.create(model="tiny", prompt=f"fail-on-{'ab'[i // 10 % 2]} {i}", max_tokens=4,
                                              user=user)
            elif kind == 8:
                client.completions.create(model="tiny", prompt=f"fail-everywhere {i}", max_tokens=4, user=user)
            else:
                client.completions.create(model="no-such-model", prompt="x", max_tokens=4, user=user)
            return "ok"
        except openai.APIStatusError as exc:
            return "4xx" if exc.status_code < 500 else "5xx"
        except openai.APIError:
            return "5xx"

    deadline = time.monotonic() + seconds
    i = 0
    with ThreadPoolExecutor(max_workers=4) as pool:
        while time.monotonic() < deadline:
            for outcome in pool.map(one, range(i, i + 20)):
                counts[outcome] += 1
            i += 20
    return counts


def router_requests_total(router_url: str) -> float:
    _, body = http_get(f"{router_url}/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("llm_router_requests_total{"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    prometheus_bin = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("observability")
    help_text = router_help()
    assert "--ab-treatment" in help_text and "--shadow-policy" in help_text, help_text
    procs = Processes()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        fakes = []
        for name in ("a", "b", "x", "y"):
            cmd = [sys.executable, str(Path(__file__).with_name("fake_vllm.py")), "--port", "0", "--name", name]
            if name == "b":
                cmd.append("--flaky-metrics")
            if name in ("x", "y"):
                cmd.append("--fail-all")
            log = tmp / f"fake-{name}.log"
            p = procs.start(f"fake-{name}", cmd, log, env)
            fakes.append(f"http://127.0.0.1:{announced_port(p, log, f'fake {name}', 30)}")
            wait_for(f"fake {name}", lambda u=fakes[-1]: http_get(f"{u}/health")[0] == 200, 30, p, log)
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here

        config = tmp / "router.yaml"
        config.write_text(yaml.safe_dump({
            "decision_budget_s": 1e-9,  # every decision over budget -> an over_budget fallback
            "scrape_interval_s": 0.5, "scrape_timeout_s": 0.4,
            "health_interval_s": 0.5, "health_timeout_s": 0.4, "health_failure_threshold": 1,
            "connect_timeout_s": 0.5, "breaker_cooldown_s": 600, "max_ejected_ratio": 0.5,
            # late binding with one request per replica: the 4 clients outnumber the routable replicas, so
            # requests are held and the late-binding panels have data
            "late_binding": True, "late_binding_max_num_seqs": 1, "late_binding_timeout_s": 0.5,
            # a model reloaded into the treatment arm is a candidate: its card's prediction error is exported
            "ab_auto_promote": True, "admin_token": ADMIN_TOKEN,
        }))
        cmd = [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", "0",
               *(arg for url in (*fakes, dead) for arg in ("--replica", url)),
               "--policy", "learned", "--config", str(config)]
        # automatic promotion judges learned arms only: the shipped model on both, until the candidate arrives
        cmd += ["--shadow-policy", "round-robin", "--ab-treatment", "learned", "--ab-share", "0.5"]
        router_log = tmp / "router.log"
        router = procs.start("router", cmd, router_log, env)
        router_port = listening_port(router, "router", 60, router_log)  # --port 0: the one it bound
        router_url = f"http://127.0.0.1:{router_port}"
        wait_for("router /ready", lambda: http_get(f"{router_url}/ready")[0] == 200, 60, router, router_log)
        load_candidate(router_url, tmp)

        prom_config = tmp / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [{"job_name": "routewise-router",
                                "static_configs": [{"targets": [f"127.0.0.1:{router_port}"]}]}],
        }))
        prom_log = tmp / "prometheus.log"
        prom_proc = procs.start("prometheus", [
            prometheus_bin, f"--config.file={prom_config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
            "--web.listen-address=127.0.0.1:0", "--log.level=warn",
        ], prom_log, env)
        prom_port = listening_port(prom_proc, "prometheus", 60, prom_log)
        prom = Prometheus(f"http://127.0.0.1:{prom_port}")
        wait_for("prometheus ready", lambda: http_get(f"{prom.url}/-/ready")[0] == 200, 60, prom_proc, prom_log)
        wait_for("first scrape of the router", lambda: prom.query('up{job="routewise-router"} == 1'), 30,
                 prom_proc, prom_log)

        traffic = drive_traffic(router_url, TRAFFIC_S)
        # Prometheus has scraped everything once its copy of the request counter matches the router's.
        want = router_requests_total(router_url)
        wait_for(f"prometheus to see {want} requests", lambda: any(
            float(s["value"][1]) == want for s in prom.query("sum(llm_router_requests_total)")), 30, prom_proc, prom_log)
        wait_for("alert rules evaluated", lambda: all(
            r["health"] != "unknown" for g in prom.api("rules")["groups"] for r in g["rules"]), 30, prom_proc, prom_log)
        yield Stack(prom, router_url, traffic)
    finally:
        procs.stop_all()


def has_finite_sample(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_traffic_mix_reached_the_router(stack: Stack) -> None:
    assert stack.traffic["ok"] > 20, stack.traffic
    assert stack.traffic["4xx"] > 0 and stack.traffic["5xx"] > 0, stack.traffic


@pytest.mark.parametrize("q", dashboard_queries(), ids=lambda q: q.id)
def test_dashboard_query_returns_data(q: Query, stack: Stack) -> None:
    result = stack.prometheus.query(q.expr)
    assert has_finite_sample(result), f"{q.id}: no finite sample for {q.expr}\n{result}"


@pytest.mark.parametrize("q", alert_queries(), ids=lambda q: q.id)
def test_alert_expression(q: Query, stack: Stack) -> None:
    result = stack.prometheus.query(q.expr)  # raises on a parse or evaluation error
    if q.must_have_data:
        assert has_finite_sample(result), f"{q.id}: no finite sample for {q.expr}\n{result}"


def test_prometheus_loaded_and_evaluates_every_alert_rule(stack: Stack) -> None:
    loaded = {r["name"]: r for g in stack.prometheus.api("rules")["groups"] for r in g["rules"]}
    expected = {r.get("alert") or r.get("record") for r in alert_rules()}
    assert set(loaded) == expected
    bad = {n: r.get("lastError") for n, r in loaded.items() if r["health"] != "ok"}
    assert not bad, bad


def test_forced_fallbacks_are_visible(stack: Stack) -> None:
    """A query that must be non-zero: the 1 ns budget makes every decision fall back."""
    result = stack.prometheus.query('sum(rate(llm_router_fallbacks_total{reason="over_budget"}[1m]))')
    assert result and float(result[0]["value"][1]) > 0, result


def test_dead_replica_is_unhealthy(stack: Stack) -> None:
    result = stack.prometheus.query("min(llm_router_replica_healthy)")
    assert result and float(result[0]["value"][1]) == 0, result
    # a, b and the broken replica whose ejection the panic threshold refused; the dead one and one ejected out
    assert float(stack.prometheus.query("sum(llm_router_replica_healthy)")[0]["value"][1]) == 3


def test_one_broken_replica_ejected_the_other_refused(stack: Stack) -> None:
    ejected = stack.prometheus.query("sum(llm_router_replica_ejections_total)")
    assert ejected and float(ejected[0]["value"][1]) == 1, ejected
    refused = stack.prometheus.query("sum(llm_router_ejections_refused_total)")
    assert refused and float(refused[0]["value"][1]) >= 1, refused
