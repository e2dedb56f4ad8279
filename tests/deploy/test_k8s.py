"""Kubernetes manifests: every built-in kind validated (strictly: unknown fields fail) against the
Kubernetes 1.31 OpenAPI schemas bundled by kubernetes-validate, plus the cross-references a schema
cannot see: selectors and labels, Service ports, probes on the router's real paths, ConfigMap keys,
the router config against RouterSettings, the ServiceMonitor, discovery DNS, and the kustomizations."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from router.settings import RouterSettings, load_config_file

from .queries import REPO

K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.31.0"
CRDS = {"ServiceMonitor", "PrometheusRule", "Kustomization"}  # no schema bundled: checked structurally below
ROUTER_PATHS = {"/health", "/ready"}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomize(root: Path) -> tuple[dict, list[dict]]:
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    return k, [d for r in k["resources"] for d in docs(root / r)]


BASE, BASE_OBJECTS = kustomize(K8S)
SIDECAR, SIDECAR_OBJECTS = kustomize(K8S / "examples" / "sidecar")
ALL_OBJECTS = BASE_OBJECTS + SIDECAR_OBJECTS


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def pod_spec(o: dict) -> dict:
    return o["spec"]["template"]["spec"]


def router_containers(objects: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, container) for every container running the router image."""
    out = []
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            spec = pod_spec(o)
            for c in spec.get("initContainers", []) + spec["containers"]:
                if c["image"].startswith("routewise-router") and c.get("args"):
                    out.append((o, c))
    return out


@pytest.mark.parametrize("obj", [o for o in ALL_OBJECTS if o["kind"] not in CRDS],
                         ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_schema_valid(obj: dict) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_a_typo() -> None:
    service = dict(find(BASE_OBJECTS, "Service", "routewise-router")[0])
    service["spec"] = {**service["spec"], "selectr": {"a": "b"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("root", [K8S, K8S / "examples" / "sidecar"], ids=["base", "sidecar"])
def test_kustomization_lists_every_manifest(root: Path) -> None:
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization" and k["namespace"] == "routewise"
    listed = set(k["resources"])
    assert all((root / r).is_file() for r in listed)
    present = {p.name for p in root.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_workload_selectors_match_their_pod_labels() -> None:
    for o in ALL_OBJECTS:
        if o["kind"] in ("Deployment", "StatefulSet"):
            labels = o["spec"]["template"]["metadata"]["labels"]
            assert o["spec"]["selector"]["matchLabels"].items() <= labels.items(), o["metadata"]["name"]


def test_services_select_pods_and_name_real_ports() -> None:
    workloads = [o for o in BASE_OBJECTS if o["kind"] in ("Deployment", "StatefulSet")]
    for svc in find(BASE_OBJECTS, "Service"):
        selected = [w for w in workloads if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, svc["metadata"]["name"]
        port_names = {p["name"] for c in pod_spec(selected[0])["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (svc["metadata"]["name"], port)


def test_router_probes_hit_real_router_paths() -> None:
    assert router_containers(ALL_OBJECTS), "no router container found"
    for o, c in router_containers(ALL_OBJECTS):
        ports = {p["name"] for p in c["ports"]}
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["path"] in ROUTER_PATHS
            assert c[probe]["httpGet"]["port"] in ports
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod_spec(o)["securityContext"]["runAsNonRoot"] is True


def test_router_serves_the_probe_paths() -> None:
    from router.app import create_app
    from router.settings import build_settings

    app = create_app(build_settings(replicas=["http://127.0.0.1:9"], policy="least-outstanding"))
    paths = {r.resource.canonical for r in app.router.routes() if r.method == "GET"}
    assert ROUTER_PATHS <= paths, paths


def config_for(workload: dict, container: dict, objects: list[dict]) -> tuple[dict, Path]:
    """The router.yaml a router container reads: --config path -> volume mount -> ConfigMap key."""
    args = container["args"]
    config_path = Path(args[args.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if config_path.parent == Path(m["mountPath"]))
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    (cm,) = find(objects, "ConfigMap", volume["configMap"]["name"])
    items = {i["path"]: i["key"] for i in volume["configMap"].get("items", [])}
    key = items.get(config_path.name, config_path.name)
    assert key in cm["data"], f"ConfigMap {cm['metadata']['name']} has no key {key}"
    return yaml.safe_load(cm["data"][key]), config_path


def test_every_mounted_volume_is_declared() -> None:
    for o in ALL_OBJECTS:
        if o["kind"] in ("Deployment", "StatefulSet"):
            spec = pod_spec(o)
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for c in spec.get("initContainers", []) + spec["containers"]:
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes, (o["metadata"]["name"], c["name"], m["name"])
            for v in volumes.values():
                if "configMap" in v:
                    assert find(ALL_OBJECTS, "ConfigMap", v["configMap"]["name"]), v
                if "persistentVolumeClaim" in v:
                    assert find(BASE_OBJECTS, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]), v


@pytest.mark.parametrize("objects", [BASE_OBJECTS, SIDECAR_OBJECTS], ids=["base", "sidecar"])
def test_router_config_is_valid_router_settings(objects: list[dict], tmp_path: Path) -> None:
    (workload, container), = router_containers(objects)
    config, _ = config_for(workload, container, objects)
    file = tmp_path / "router.yaml"
    file.write_text(yaml.safe_dump(config))
    data = load_config_file(file)  # raises on unknown keys
    if data["policy"].endswith(".onnx"):  # lives on the policy volume in the cluster
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(data["policy"].startswith(m + "/") for m in mounts), data["policy"]
        data["policy"] = "learned"
    settings = RouterSettings(**data)
    assert settings.port == next(p["containerPort"] for p in container["ports"])
    # discovery resolves the headless vLLM Service of the base manifests
    host, port = settings.discover.rsplit(":", 1)
    name, namespace = host.split(".")[:2]
    (svc,) = find(BASE_OBJECTS, "Service", name)
    assert svc["spec"]["clusterIP"] == "None"
    assert namespace == BASE["namespace"] and host.endswith(".svc.cluster.local")
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}


def test_policy_seed_writes_where_the_router_reads() -> None:
    (deployment,) = find(BASE_OBJECTS, "Deployment", "routewise-router")
    (seed,) = pod_spec(deployment)["initContainers"]
    router = next(c for c in pod_spec(deployment)["containers"] if c["name"] == "router")
    config, _ = config_for(deployment, router, BASE_OBJECTS)
    policy_mount = next(m for m in router["volumeMounts"] if m["name"] == "policy")
    assert policy_mount["readOnly"] is True
    assert config["policy"].startswith(policy_mount["mountPath"] + "/")
    assert config["policy"] in seed["command"][-1]
    assert any(m["name"] == "policy" and m["mountPath"] == policy_mount["mountPath"] for m in seed["volumeMounts"])


def test_servicemonitor_scrapes_the_router_service() -> None:
    (monitor,) = find(BASE_OBJECTS, "ServiceMonitor", "routewise-router")
    (svc,) = find(BASE_OBJECTS, "Service", "routewise-router")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [BASE["namespace"]]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    # the job label the alerts and dashboards are written for (deploy/prometheus/prometheus.yml)
    assert svc["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "routewise-router"


def test_sidecar_is_a_native_sidecar_next_to_the_app() -> None:
    (deployment,) = find(SIDECAR_OBJECTS, "Deployment")
    (router,) = [c for c in pod_spec(deployment)["initContainers"] if c["name"] == "router"]
    assert router["restartPolicy"] == "Always"
    app = pod_spec(deployment)["containers"][0]
    port = router["ports"][0]["containerPort"]
    assert {"name": "OPENAI_BASE_URL", "value": f"http://127.0.0.1:{port}/v1"} in app["env"]


def test_images_are_pinned() -> None:
    for o in ALL_OBJECTS:
        if o["kind"] in ("Deployment", "StatefulSet"):
            spec = pod_spec(o)
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


def test_prometheusrule_carries_exactly_the_alerts_file() -> None:
    (rule,) = find(BASE_OBJECTS, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"], "copy deploy/prometheus/alerts.yml's groups into prometheusrule.yaml"
