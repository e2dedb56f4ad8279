"""The learning deployments: router + `trainer follow` sharing the decision-log and model
volumes, in Kubernetes (deploy/k8s/examples/learning) and compose (docker-compose.learning.yml).
Checked: schemas, that both containers see the same volumes with the right write access, that the
router config is valid RouterSettings with auto-promotion, and that the trainer's arguments are
accepted by the real `trainer follow` parser and point at the router and the volumes."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from routewise_vllm.router.settings import RouterSettings, load_config_file
from routewise_vllm.trainer.cli import build_parser

from .queries import REPO
from .test_k8s import KUBERNETES_VERSION, find, kustomize, pod_spec

LEARNING, OBJECTS = kustomize(REPO / "deploy" / "k8s" / "examples" / "learning")
COMPOSE = REPO / "deploy" / "compose" / "docker-compose.learning.yml"


def follow_args(argv: list[str]):
    args = build_parser().parse_args(argv)
    assert args.command == "follow"
    return args


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_schema_valid(obj: dict) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_k8s_router_and_trainer_share_the_volumes(tmp_path: Path) -> None:
    (deployment,) = find(OBJECTS, "Deployment")
    spec = pod_spec(deployment)
    router = next(c for c in spec["containers"] if c["name"] == "router")
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    volumes = {v["name"]: v for v in spec["volumes"]}
    for v in volumes.values():
        if "persistentVolumeClaim" in v:
            assert find(OBJECTS, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]), v
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (router, trainer)}
    # the router writes the log and only reads models; the trainer the other way round
    assert not mounts["router"]["decisions"].get("readOnly") and mounts["router"]["models"]["readOnly"]
    assert mounts["trainer"]["decisions"]["readOnly"] and not mounts["trainer"]["models"].get("readOnly")

    (cm,) = find(OBJECTS, "ConfigMap", volumes["config"]["configMap"]["name"])
    file = tmp_path / "router.yaml"
    file.write_text(cm["data"]["router.yaml"])
    data = load_config_file(file)
    for key in ("policy", "ab_treatment"):
        assert data[key].startswith(mounts["router"]["models"]["mountPath"] + "/")
    assert data["decision_log_dir"] == mounts["router"]["decisions"]["mountPath"]
    settings = RouterSettings(**(data | {"policy": "learned", "ab_treatment": "learned"}))
    assert settings.ab_auto_promote and settings.ab_share > 0

    args = follow_args(trainer["args"])
    assert args.decision_log == mounts["trainer"]["decisions"]["mountPath"]
    assert args.models == mounts["trainer"]["models"]["mountPath"]
    assert args.router == f"http://127.0.0.1:{router['ports'][0]['containerPort']}"
    assert args.init == data["policy"]  # the seeded primary
    (seed,) = spec["initContainers"]
    assert data["policy"] in seed["command"][-1]
    env = {e["name"] for e in trainer["env"]} & {e["name"] for e in router["env"]}
    assert "ROUTEWISE_ADMIN_TOKEN" in env  # the handover goes through the admin API


def test_compose_learning_override() -> None:
    from routewise_vllm.router.cli import _parser
    from routewise_vllm.router.settings import build_settings

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    router, trainer = services["router"], services["trainer"]
    argv = [a.replace("${AB_SHARE:-0.1}", "0.1") for a in router["command"]]
    args = _parser().parse_args(["serve", *argv])
    settings = build_settings(None, **{k: v for k, v in vars(args).items() if k not in ("command", "config")}
                              | {"policy": "learned", "ab_treatment": "learned", "ab_auto_promote": True})
    assert settings.decision_log_dir is not None
    assert router["environment"]["ROUTEWISE_AB_AUTO_PROMOTE"] == "true"
    follow = follow_args([a.replace("${FOLLOW_EVERY_RECORDS:-5000}", "5000") for a in trainer["command"]])
    vols = lambda svc: {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}  # noqa: E731
    assert vols(trainer)[follow.decision_log] == vols(router)[str(settings.decision_log_dir)] == "decisions"
    assert vols(trainer)[follow.models] == "models" and follow.router == "http://router:8000"
    assert (REPO / "deploy" / "compose" / trainer["build"]["context"] / trainer["build"]["dockerfile"]).is_file()
