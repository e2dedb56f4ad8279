"""Where more than one router runs, the deploy files give them a Redis for the shared fleet view: the Kubernetes
router config points shared_state at the Redis Service of the same kustomization, and the compose override's two
routers both reach the override's Redis with commands the router accepts."""

from __future__ import annotations

import yaml
from yarl import URL

from routewise_vllm.router.cli import _parser
from routewise_vllm.router.settings import build_settings

from .queries import REPO
from .test_k8s import BASE, BASE_OBJECTS, find, pod_spec

COMPOSE = REPO / "deploy" / "compose"


def test_k8s_routers_share_state_through_the_redis_of_the_kustomization() -> None:
    (deployment,) = find(BASE_OBJECTS, "Deployment", "routewise-router")
    assert deployment["spec"]["replicas"] > 1  # why it is there
    (cm,) = find(BASE_OBJECTS, "ConfigMap", "routewise-router-config")
    url = URL(yaml.safe_load(cm["data"]["router.yaml"])["shared_state"])
    name, namespace = url.host.split(".")[:2]  # type: ignore[union-attr]
    assert namespace == BASE["namespace"] and url.host.endswith(".svc.cluster.local")  # type: ignore[union-attr]
    (svc,) = find(BASE_OBJECTS, "Service", name)
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == url.port]
    (redis,) = find(BASE_OBJECTS, "StatefulSet", name)
    assert svc["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    (container,) = pod_spec(redis)["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    assert container["image"].startswith("redis:")


def test_compose_override_runs_two_routers_on_one_redis() -> None:
    override = yaml.safe_load((COMPOSE / "docker-compose.routers.yml").read_text())["services"]
    base = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    url = "redis://redis:6379/0"
    assert URL(url).host in override
    assert override["router"]["environment"]["ROUTEWISE_SHARED_STATE"] == url
    router2 = override["router-2"]
    assert router2["environment"]["ROUTEWISE_SHARED_STATE"] == url
    assert router2["image"] == base["router"]["image"]
    argv = [a.replace("${ROUTEWISE_POLICY:-gated}", "gated") for a in router2["command"]]
    args = _parser().parse_args(["serve", *argv])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    settings = build_settings(None, **{**overrides, "shared_state": url})
    assert set(settings.replicas) == {f"http://{s}:8000" for s in base if s.startswith("vllm-")}
    assert all(p.startswith("127.0.0.1:") for p in router2["ports"])
