"""The images, built and run with podman (no Docker daemon or image registry needed).

scripts/podman-images.sh installs podman, runc and mmdebstrap when missing (apt-get, as root), makes the base
image from Debian's packages unless localhost/routewise-base:bookworm exists, and builds the router, emulator and
trainer images from deploy/docker/ (layers cached between runs). Then:
- the router image in front of two emulated replicas on the host (`fleet emulate`, loopback ports): completions
  streamed and not through the openai client, /health, /ready and /metrics from outside the container, the
  image's HEALTHCHECK, the process's uid on the host, and the learned policy deciding (fallbacks by reason);
- the trainer image: its CLI, torch 2.13.0, a non-root user;
- deploy/compose/docker-compose.cpu.yml under podman-compose (`bench` tier: it builds the emulator image too, about
  2-3 minutes on 2 cores): the emulators, the router and the loadgen profile on the compose network. Prometheus
  and Grafana run from registry images, which cannot be pulled where no registry is reachable: that test (`bench`
  tier) says so and skips unless both images are already in local storage.
The trainer image (torch inside: the longest build) is the `bench` tier too; CI builds and runs the router image.
Where podman cannot start a container at all these skip with the reason, and fail under CI, which runs podman.
Every container, pod network and process the tests start is removed by its name or id.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.ci import skip_or_fail
from tests.fakes.ports import announced_port

from .queries import REPO
from .test_observability import Processes, free_port, http_get, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TAG = "0.1.0"
BASE_IMAGE = "localhost/routewise-base:bookworm"
COMPOSE_FILE = REPO / "deploy" / "compose" / "docker-compose.cpu.yml"
BUILT_HERE = {"routewise-router", "routewise-emulator"}  # images the compose file builds from this repository
NON_ROOT_UID = 10001
SCRIPT_TIMEOUT_S = 2400  # cold: apt-get install, mmdebstrap, three builds, on a busy 2-core machine
NAME = f"routewise-test-{os.getpid()}"


class Podman:
    def __init__(self, conf_dir: Path, logs: Path) -> None:
        self.env = os.environ | {"ROUTEWISE_PODMAN_DIR": str(conf_dir), "CONTAINERS_CONF": str(conf_dir / "containers.conf")}
        self.logs = logs
        self.built: set[str] = set()

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check:
            assert r.returncode == 0, f"podman {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()[-2000:]}"
        return r

    def script(self, *images: str) -> None:
        """scripts/podman-images.sh IMAGES (niced: it competes with everything else on the machine)."""
        log = self.logs / f"build-{'-'.join(images) or 'env'}.log"
        with open(log, "w") as out:
            r = subprocess.run(["nice", "bash", str(REPO / "scripts" / "podman-images.sh"), *images], cwd=REPO,
                               env=self.env, stdout=out, stderr=subprocess.STDOUT, timeout=SCRIPT_TIMEOUT_S)
        text = log.read_text()
        for line in re.findall(r"podman-images: .* built in \d+ s", text):
            print(line)
        assert r.returncode == 0, f"scripts/podman-images.sh {' '.join(images)}: exit {r.returncode}\n{text[-4000:]}"

    def image(self, name: str) -> str:
        if name not in self.built:
            self.script(name)
            self.built.add(name)
        return f"routewise-{name}:{TAG}"

    def remove(self, *containers: str) -> None:
        for c in containers:
            self("rm", "--force", "--time", "5", c, check=False)


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    tmp = tmp_path_factory.mktemp("podman")
    env_only = subprocess.run(["bash", "-c", ". scripts/podman-env.sh"], cwd=REPO, capture_output=True, text=True,
                              timeout=900, env=os.environ | {"ROUTEWISE_PODMAN_DIR": str(tmp)})
    if env_only.returncode != 0 or not shutil.which("podman"):
        skip_or_fail(f"podman could not be installed (apt-get install -y podman runc mmdebstrap): "
                     f"{env_only.stderr.strip().splitlines()[-1:] or ['no output']}")
    p = Podman(tmp, tmp)
    info = p("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if info.returncode != 0:
        skip_or_fail(f"podman cannot start here: {(info.stderr.strip().splitlines() or ['podman info failed'])[-1]}")
    p.script("base")  # made with mmdebstrap unless it exists
    run = p("run", "--rm", "--network", "none", BASE_IMAGE, "true", check=False)
    if run.returncode != 0:
        skip_or_fail(f"podman cannot start a container here: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
    return p


def scrape(url: str) -> dict[str, list[tuple[dict, float]]]:
    status, body = http_get(url + "/metrics", timeout=10)
    assert status == 200
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def send_completions(base_url: str, n: int) -> None:
    """One streamed chat completion, then n completions, 8 at a time, through the openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hello"}], max_tokens=16, stream=True) if c.choices]
    assert len(chunks) > 1 and "".join(chunks).strip(), chunks

    def one(i: int) -> str:
        r = client.completions.create(model="llama", prompt=f"request {i} " * (1 + i % 7), max_tokens=8 + i % 5)
        assert r.usage.completion_tokens == 8 + i % 5, r
        return r.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(n)))
    assert all(t.strip() for t in texts)


def assert_learned_policy_decides(metrics: dict, requests: int, policy: str = "gated") -> None:
    """The default policy (the shipped model behind its gate) decides most of the decisions itself."""
    decisions = sum(v for labels, v in metrics["llm_router_decision_latency_seconds_count"] if labels["policy"] == policy)
    fallbacks = {labels["reason"]: v for labels, v in metrics["llm_router_fallbacks_total"] if labels["policy"] == policy}
    assert decisions >= requests, (decisions, requests)
    assert sum(fallbacks.values()) * 2 < decisions, f"most of {decisions:.0f} decisions fell back: {fallbacks}"
    info = [labels for labels, v in metrics["llm_router_policy_info"] if v == 1]
    assert [i["name"] for i in info] == [policy], info
    print(f"decisions {decisions:.0f}, fallbacks by reason {fallbacks}")


def assert_healthy(podman: Podman, container: str) -> None:
    """The container's health check, run once now (podman schedules none where there is no systemd)."""
    run = podman("healthcheck", "run", container, check=False)  # prints "unhealthy" and exits 1 on failure
    status = podman("inspect", "--format", "{{.State.Health.Status}}", container).stdout.strip()
    assert (run.returncode, status) == (0, "healthy"), (container, run.stdout, run.stderr)


def test_router_image_serves_two_emulated_replicas(podman: Podman, tmp_path: Path) -> None:
    image = podman.image("router")
    ports = [free_port()]  # the router's: the image's HEALTHCHECK reads it from ROUTEWISE_PORT; the emulators say theirs
    router_url = f"http://127.0.0.1:{ports[0]}"
    procs = Processes()
    container = f"{NAME}-router"
    try:
        for i, profile in enumerate(("llama3-8b-a100", "llama3-8b-l4")):
            log = tmp_path / f"emulator-{i}.log"
            proc = procs.start(f"emulator-{i}", [sys.executable, "-m", "routewise_vllm.fleet", "emulate", "--port", "0",
                                                 "--served-model-name", "llama", "--profile", profile], log)
            ports.append(port := announced_port(proc, log, f"emulator {i}"))
            wait_for(f"emulator {i}", lambda p=port: http_get(f"http://127.0.0.1:{p}/health")[0] == 200, 60, proc, log)
        # the port by environment, so the image's HEALTHCHECK (which reads ROUTEWISE_PORT) probes the right one
        podman("run", "--detach", "--name", container, "--network", "host",
               "--env", "ROUTEWISE_HOST=127.0.0.1", "--env", f"ROUTEWISE_PORT={ports[0]}", image,
               *[a for p in ports[1:] for a in ("--replica", f"http://127.0.0.1:{p}")])

        def ready() -> dict | None:
            state = podman("inspect", "--format", "{{.State.Status}}", container).stdout.strip()
            assert state == "running", f"router container {state}: {podman('logs', container, check=False).stderr[-3000:]}"
            status, body = http_get(router_url + "/ready")
            return json.loads(body) if status == 200 else None

        state = wait_for("the router container's /ready", ready, 120)
        assert state["healthy_replicas"] == 2 and state["policies"]["main"] == {"serving": "gated", "error": None}
        assert http_get(router_url + "/health") == (200, b'{"status": "ok"}')

        send_completions(router_url, 24)
        assert_learned_policy_decides(scrape(router_url), 25)

        assert_healthy(podman, container)
        # the policy's compiled fast path was built into the image and loads there
        fast = podman("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c",
                      "from routewise_vllm.router.policy import fastnet; print(fastnet.available())")
        assert fast.stdout.strip() == "True", fast.stdout + fast.stderr
        assert podman("inspect", "--format", "{{.Config.User}}", container).stdout.strip() == f"{NON_ROOT_UID}:{NON_ROOT_UID}"
        pid = podman("inspect", "--format", "{{.State.Pid}}", container).stdout.strip()
        uids = re.search(r"^Uid:\s+(.*)$", Path(f"/proc/{pid}/status").read_text(), re.M).group(1).split()
        assert uids == [str(NON_ROOT_UID)] * 4, uids  # real, effective, saved, filesystem: on the host, from outside
    finally:
        podman.remove(container)
        procs.stop_all()
    assert podman("ps", "--all", "--quiet", "--filter", f"name=^{container}$").stdout.strip() == ""


@pytest.mark.bench
def test_trainer_image(podman: Podman) -> None:
    image = podman.image("trainer")
    help_ = podman("run", "--rm", "--network", "none", image, "--help")
    assert "follow" in help_.stdout and "train" in help_.stdout, help_.stdout
    probe = podman("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c",
                   "import os, torch, trainer, router; print(os.getuid(), torch.__version__)")
    uid, version = probe.stdout.split()
    assert int(uid) == NON_ROOT_UID and version.split("+")[0] == "2.13.0", probe.stdout


def compose_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


class Compose:
    def __init__(self, podman: Podman, env: dict[str, str]) -> None:
        self.podman, self.project = podman, f"rwtest{os.getpid()}"
        self.env = podman.env | env

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "podman_compose", "--project-name", self.project, "--file", str(COMPOSE_FILE), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=COMPOSE_FILE.parent)
        assert r.returncode == 0, f"podman-compose {' '.join(args)}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
        return r

    def container(self, service: str) -> str:
        ids = self.podman("ps", "--all", "--quiet", "--filter", f"label=io.podman.compose.project={self.project}",
                          "--filter", f"label=io.podman.compose.service={service}").stdout.split()
        assert len(ids) == 1, (service, ids)
        return ids[0]

    def down(self) -> None:
        try:
            self("down", "--timeout", "5", timeout=180)
        finally:  # whatever down left behind, by this project's label
            ids = self.podman("ps", "--all", "--quiet", "--filter",
                              f"label=io.podman.compose.project={self.project}", check=False).stdout.split()
            self.podman.remove(*ids)
            self.podman("network", "rm", "--force", f"{self.project}_default", check=False)


def ensure_podman_compose() -> None:
    try:
        import podman_compose  # noqa: F401
    except ImportError:  # in the [test] extra; an older venv gets it here
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "podman-compose"], capture_output=True,
                           text=True, timeout=600)
        if r.returncode != 0:
            skip_or_fail(f"podman-compose not installed and pip could not install it: {r.stderr.strip()[-300:]}")


@pytest.mark.bench
def test_cpu_compose_stack_under_podman_compose(podman: Podman) -> None:
    """The emulators, the router and the loadgen profile of docker-compose.cpu.yml, on the compose network: the
    router reaches the emulators by service name and clients reach it through the published loopback port."""
    ensure_podman_compose()
    podman.image("router")
    podman.image("emulator")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    compose = Compose(podman, {"ROUTER_PORT": str(port), "LOAD_RATE": "4", "LOAD_DURATION": "5"})
    try:
        compose("up", "--detach", "--no-build", "vllm-0", "vllm-1", "router")
        def ready() -> dict | None:
            status, body = http_get(url + "/ready")
            return json.loads(body) if status == 200 else None

        state = wait_for("the compose router's /ready", ready, 120)
        assert state["healthy_replicas"] == 2 and state["policies"]["main"]["serving"] == "gated", state
        send_completions(url, 8)
        # podman runs no health check on its own without systemd; each service's check, run once, passes
        for service in ("vllm-0", "vllm-1", "router"):
            assert_healthy(podman, compose.container(service))
        compose("--profile", "load", "up", "--detach", "--no-build", "loadgen")
        loadgen = compose.container("loadgen")
        exit_code = podman("wait", loadgen, timeout=120).stdout.strip()
        logs = podman("logs", loadgen)
        output = logs.stdout + logs.stderr
        assert exit_code == "0", output[-3000:]
        assert re.search(r"loadgen: \d+ requests over 5 s from poisson", output), output[-3000:]
        metrics = scrape(url)
        assert_learned_policy_decides(metrics, 9)
        replicas = {labels["replica"] for labels, v in metrics["llm_router_requests_total"] if v > 0}
        assert replicas <= {"vllm-0:8000", "vllm-1:8000"} and replicas, replicas
    finally:
        compose.down()
    assert podman("ps", "--all", "--quiet", "--filter", f"label=io.podman.compose.project={compose.project}").stdout == ""


@pytest.mark.bench
def test_cpu_compose_observability_services(podman: Podman) -> None:
    """Prometheus and Grafana of docker-compose.cpu.yml run from registry images; where those are not in local
    storage and no registry is reachable (as on this project's machines), this says which and skips."""
    ensure_podman_compose()
    services = compose_services()
    registry = {name: svc["image"] for name, svc in services.items()
                if svc["image"].split(":")[0] not in BUILT_HERE}
    assert set(registry) == {"prometheus", "grafana"}, registry
    missing = {n: i for n, i in registry.items() if podman("image", "exists", i, check=False).returncode != 0}
    if missing:
        pytest.skip("not run: " + ", ".join(f"{n} ({i})" for n, i in missing.items())
                    + " not in local image storage and not buildable here; only an image registry has them "
                    "(podman load them to run this)")
    podman.image("router")
    podman.image("emulator")
    port = free_port()
    compose = Compose(podman, {"ROUTER_PORT": str(port)})
    try:
        compose("up", "--detach", "--no-build", "vllm-0", "vllm-1", "router", "prometheus", "grafana")
        wait_for("Prometheus ready", lambda: http_get("http://127.0.0.1:9090/-/ready")[0] == 200, 120)
        wait_for("Grafana healthy", lambda: http_get("http://127.0.0.1:3000/api/health")[0] == 200, 120)

        def router_target_up() -> bool:
            status, body = http_get("http://127.0.0.1:9090/api/v1/query?query=up%7Bjob%3D%22routewise-router%22%7D")
            return status == 200 and any(r["value"][1] == "1" for r in json.loads(body)["data"]["result"])

        wait_for("Prometheus scraping the router", router_target_up, 120)
    finally:
        compose.down()
