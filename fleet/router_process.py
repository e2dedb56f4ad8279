"""The live router as a real subprocess (`router serve`), plus readers of its /metrics and admin API.

Running the router through its CLI tests what a deployment runs: flag and environment parsing, uvloop, the
signal-driven drain, and a separate process whose event loop the test's load generator does not share.
Stdlib + prometheus_client only; loopback only; `stop()` SIGTERMs the router's own process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from routewise_vllm.fleet.vllm import REPO_ROOT, free_ports, listening_ports, log_tail

ADMIN_TOKEN = "fleet-admin-token"


@dataclass
class RouterProcess:
    port: int  # 0 until wait_ready reads the port a router started on port 0 bound
    process: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n_lines: int = 40) -> str:
        return log_tail(self.log_path, n_lines)

    def get(self, path: str, admin: bool = False, timeout_s: float = 5.0, method: str = "GET") -> tuple[int, bytes]:
        req = urllib.request.Request(f"{self.base_url}{path}", method=method)
        if admin:
            req.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def metrics(self) -> "RouterMetricsPage":
        status, body = self.get("/metrics")
        assert status == 200, f"router /metrics answered {status}"
        return RouterMetricsPage.parse(body.decode())

    def admin_replicas(self) -> dict[str, dict]:
        status, body = self.get("/admin/replicas", admin=True)
        assert status == 200, f"/admin/replicas answered {status}: {body[:300]!r}"
        return {r["id"]: r for r in json.loads(body)["replicas"]}

    def admin_post(self, path: str) -> dict:
        status, body = self.get(path, admin=True, method="POST")
        assert status == 200, f"POST {path} answered {status}: {body[:300]!r}"
        return json.loads(body)

    def admin_policy(self) -> dict:
        status, body = self.get("/admin/policy", admin=True)
        assert status == 200, f"/admin/policy answered {status}: {body[:300]!r}"
        return json.loads(body)

    def wait_ready(self, n_routable: int, timeout_s: float = 30.0) -> None:
        """Until /ready reports n_routable replicas; raise with the log tail if the router exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited with rc={self.process.returncode}; log:\n{self.log_tail()}")
            if self.port == 0:  # started on port 0: the one its process listens on, once it does
                ports = listening_ports(self.process.pid)
                if len(ports) > 1:
                    raise RuntimeError(f"router listens on several ports {sorted(ports)}; log:\n{self.log_tail()}")
                if not ports:
                    time.sleep(0.05)
                    continue
                self.port = ports.pop()
            try:
                status, body = self.get("/ready", timeout_s=2.0)
                last = (status, body)
                if status == 200 and json.loads(body)["healthy_replicas"] == n_routable:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"router not ready with {n_routable} replicas in {timeout_s}s (last {last}); log:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM (the router drains and exits 0); SIGKILL the group if it does not exit in time. Returns the rc."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10.0)
                return None
        return self.process.returncode


def start_router(
    replica_urls: list[str], policy: str, log_dir: Path, scrape_interval_s: float = 0.2,
    env: dict[str, str] | None = None,
) -> RouterProcess:
    """`router serve` on a free loopback port in its own process group; waits until every replica is routable.
    One router process binds port 0 (the port is read off its socket: none is picked for another program to take
    first); several workers share one port, picked here."""
    port = free_ports(1)[0] if int((env or {}).get("ROUTEWISE_WORKERS", "1")) > 1 else 0
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"router-{port}.log"
    if not port:  # named before the port is known: the first free router-port0-N.log
        log_path = next(p for i in range(1, 10_000) if not (p := log_dir / f"router-port0-{i}.log").exists())
    args = [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, "--admin-token", ADMIN_TOKEN, "--scrape-interval", str(scrape_interval_s),
            "--log-level", "info"]
    for url in replica_urls:
        args += ["--replica", url]
    full_env = {
        **os.environ,
        "ROUTEWISE_SCRAPE_TIMEOUT_S": str(scrape_interval_s),  # must not exceed the interval
        "ROUTEWISE_DRAIN_TIMEOUT_S": "5",
        "ROUTEWISE_LATE_BINDING": "0",  # per request unless `env` turns it on (<policy>+late), as the simulator runs it
        **(env or {}),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, cwd=REPO_ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    router = RouterProcess(port, process, log_path)
    try:
        router.wait_ready(len(replica_urls))
    except BaseException:
        router.stop()
        raise
    return router


@dataclass
class RouterMetricsPage:
    """Samples of one router /metrics page, read with prometheus_client's parser (independent of router/)."""

    gauges: dict[str, dict[str, float]]  # gauge name -> replica -> value
    requests: dict[str, dict[str, float]]  # replica -> code_class -> llm_router_requests_total
    upstream_errors: dict[str, float]  # replica -> all kinds
    scrape_errors: dict[str, dict[str, float]]  # replica -> kind -> count
    retries: float
    fallbacks: dict[str, float]  # reason -> count (all policies)
    policy_info: list[dict[str, str]]
    ttft_counts: dict[str, float] = field(default_factory=dict)  # replica -> first tokens relayed (all arms)
    ttft_sums: dict[str, float] = field(default_factory=dict)  # replica -> seconds to those first tokens

    @classmethod
    def parse(cls, text: str) -> "RouterMetricsPage":
        gauges: dict[str, dict[str, float]] = defaultdict(dict)
        requests: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        upstream: dict[str, float] = defaultdict(float)
        scrape_errors: dict[str, dict[str, float]] = defaultdict(dict)
        fallbacks: dict[str, float] = defaultdict(float)
        retries = 0.0
        info: list[dict[str, str]] = []
        ttft_counts: dict[str, float] = defaultdict(float)
        ttft_sums: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "llm_router_requests_total":
                    requests[s.labels["replica"]][s.labels["code_class"]] += s.value
                elif s.name == "llm_router_upstream_errors_total":
                    upstream[s.labels["replica"]] += s.value
                elif s.name == "llm_router_scrape_errors_total":
                    scrape_errors[s.labels["replica"]][s.labels["kind"]] = s.value
                elif s.name == "llm_router_retries_total":
                    retries += s.value
                elif s.name == "llm_router_fallbacks_total":
                    fallbacks[s.labels["reason"]] += s.value
                elif s.name == "llm_router_ttft_seconds_count":
                    ttft_counts[s.labels["replica"]] += s.value
                elif s.name == "llm_router_ttft_seconds_sum":
                    ttft_sums[s.labels["replica"]] += s.value
                elif s.name == "llm_router_policy_info":
                    info.append(dict(s.labels))
                elif family.type == "gauge" and "replica" in s.labels:
                    gauges[s.name][s.labels["replica"]] = s.value
        return cls(dict(gauges), {k: dict(v) for k, v in requests.items()}, dict(upstream), dict(scrape_errors), retries,
                   dict(fallbacks), info, dict(ttft_counts), dict(ttft_sums))

    def gauge(self, name: str, replica: str) -> float | None:
        return self.gauges.get(name, {}).get(replica)

    def requests_of(self, replica: str) -> float:
        return sum(self.requests.get(replica, {}).values())
