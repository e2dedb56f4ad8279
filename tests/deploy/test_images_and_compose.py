"""Dockerfiles and compose files, checked structurally: no Docker engine runs where the tests
run, so images are not built here. Checked: base images, non-root USER, HEALTHCHECK on the
router's /health, no torch in the router image (its install line and the dependencies it
installs), torch==2.13.0 in the trainer image, COPY sources that exist and survive the
.dockerignore, and compose commands that the real CLIs accept."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field

import pytest
import yaml

from .queries import REPO

DOCKER = REPO / "deploy" / "docker"
COMPOSE = REPO / "deploy" / "compose"
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.cpu.yml")


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse_dockerfile(name: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile, joining continued lines."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
            stages.append(Stage(base))
        elif not stages:
            assert op == "ARG", f"{name}: {op} before FROM"
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            stages[-1].instructions.append((op, rest))
    return args, stages


def stage_args(stage: Stage) -> dict[str, str]:
    return dict(a.partition("=")[::2] for a in stage.all("ARG"))


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def dockerignore_allows(ignore_file: str, path: str) -> bool:
    allowed = True
    for line in (DOCKER / ignore_file).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removesuffix("/**")):
            allowed = negate
    return allowed


@pytest.mark.parametrize("name", ["Dockerfile.router", "Dockerfile.trainer"])
def test_image_basics(name: str) -> None:
    _, stages = parse_dockerfile(name)
    final = stages[-1]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", final.base), final.base
    users = final.all("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name}: runs as {users}"
    assert final.all("ENTRYPOINT")
    for stage in stages:
        for src in (a.split()[:-1] for a in stage.all("COPY") if not a.startswith("--from")):
            for path in src:
                assert (REPO / path).exists(), f"{name}: COPY {path} does not exist"
                assert dockerignore_allows(f"{name}.dockerignore", path), f"{name}: {path} excluded by .dockerignore"


def test_router_image_has_no_torch() -> None:
    args, stages = parse_dockerfile("Dockerfile.router")
    installs = [r for s in stages for r in s.all("RUN") if "pip install" in r]
    pip_commands = [cmd for r in installs for cmd in r.split("&&") if "pip install" in cmd]
    assert pip_commands and not [cmd for cmd in pip_commands if "torch" in cmd], pip_commands
    # what it installs: the project with EXTRAS (default none; the emulator build uses [sim])
    extras = stage_args(stages[0])["EXTRAS"].strip('"')
    assert extras == ""
    project = pyproject()["project"]
    for deps in (project["dependencies"], project["optional-dependencies"]["sim"]):
        assert not [d for d in deps if re.match(r"torch\b", d)], deps
    # and the build fails if torch sneaks in anyway
    assert any("import torch" in r and "exit 1" in r for r in installs)


def test_router_image_healthcheck_and_port() -> None:
    _, stages = parse_dockerfile("Dockerfile.router")
    final = stages[-1]
    (health,) = final.all("HEALTHCHECK")
    assert "/health" in health and "CMD" in health
    env = " ".join(final.all("ENV"))
    port = re.search(r"ROUTEWISE_PORT=(\d+)", env).group(1)
    assert final.all("EXPOSE") == [port]
    assert shlex.split(final.all("ENTRYPOINT")[0].replace('"', "").strip("[]").replace(",", " ")) == ["router", "serve"]
    assert "router" in pyproject()["project"]["scripts"]


def test_trainer_image_pins_torch() -> None:
    args, stages = parse_dockerfile("Dockerfile.trainer")
    final = stages[-1]
    assert stage_args(final)["TORCH_VERSION"] == "2.13.0"
    runs = " ".join(final.all("RUN"))
    assert '"torch==${TORCH_VERSION}"' in runs and '".[train]"' in runs
    assert "torch==2.13.0" in pyproject()["project"]["optional-dependencies"]["train"]


def compose(name: str) -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())


def expand_defaults(value: str) -> str:
    """${VAR:-default} -> default (what compose uses when VAR is unset)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def cli_flags(*module_args: str) -> set[str]:
    r = subprocess.run([sys.executable, "-m", *module_args, "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", r.stdout))


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_router_command_is_accepted(name: str) -> None:
    from routewise_vllm.router.cli import _parser
    from routewise_vllm.router.settings import build_settings

    services = compose(name)["services"]
    router = services["router"]
    argv = [expand_defaults(a) for a in router["command"]]
    args = _parser().parse_args(["serve", *argv])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    settings = build_settings(None, **overrides)
    assert settings.host == "0.0.0.0" and settings.port == 8000
    # it routes to exactly the replica services of the file
    replicas = {s for s in services if s.startswith("vllm-")}
    assert {f"http://{s}:8000" for s in replicas} == set(settings.replicas)
    assert router["build"]["dockerfile"] == "deploy/docker/Dockerfile.router"
    assert (COMPOSE / router["build"]["context"] / router["build"]["dockerfile"]).is_file()
    assert "127.0.0.1:8000:8000" in [expand_defaults(p) for p in router["ports"]]


def test_cpu_compose_emulators_and_loadgen_use_real_flags() -> None:
    services = compose("docker-compose.cpu.yml")["services"]
    emulate, loadgen = cli_flags("routewise_vllm.fleet", "emulate"), cli_flags("routewise_vllm.fleet", "loadgen")
    for name in ("vllm-0", "vllm-1"):
        svc = services[name]
        assert svc["entrypoint"] == ["fleet", "emulate"]
        argv = [expand_defaults(a) for a in svc["command"]]
        assert {a.split("=")[0] for a in argv} <= emulate, argv
        profile = next(a.split("=", 1)[1] for a in argv if a.startswith("--profile="))
        assert (REPO / "simulator" / "profiles" / f"{profile}.yaml").is_file(), profile
        assert svc["build"]["args"]["EXTRAS"] == "[sim]"
    argv = [expand_defaults(a) for a in services["loadgen"]["command"]]
    assert {a.split("=")[0] for a in argv} <= loadgen, argv


def test_gpu_compose_gives_each_replica_its_own_gpu() -> None:
    services = compose("docker-compose.yml")["services"]
    gpus = []
    for name in ("vllm-0", "vllm-1"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        assert "--port=8000" in services[name]["command"]
        assert not services[name]["image"].endswith(":latest")
    assert len(set(gpus)) == len(gpus) == 2


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_observability_wiring(name: str) -> None:
    services = compose(name)["services"]
    for svc in services.values():
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("."):
                assert (COMPOSE / host).exists(), f"{name}: {host} does not exist"
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name}: {port} published beyond loopback"
    prom = services["prometheus"]
    assert "../prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in prom["volumes"]
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{s}:8000" for s in services if s.startswith("vllm-") or s == "router"}
