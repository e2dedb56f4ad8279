"""Kubernetes manifests, as `kubectl kustomize` renders each kustomization (the base, every overlay, the examples):
every built-in kind validated (strictly: unknown fields fail) against the Kubernetes 1.31 OpenAPI schemas bundled
by kubernetes-validate, plus the cross-references a schema cannot see: selectors and labels, Service ports, probes
on the router's real paths, ConfigMap keys, the router config against RouterSettings, the ServiceMonitor,
discovery DNS, volumes and claims, and what the base needs from a cluster (nothing beyond a default
StorageClass) against what each overlay adds."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from routewise_vllm.router.settings import RouterSettings, load_config_file
from tests.ci import in_ci

from .queries import REPO

K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.31.0"
CRDS = {"ServiceMonitor", "PrometheusRule"}  # no schema bundled: checked structurally below
ROUTER_PATHS = {"/health", "/ready"}
NAMESPACE = "routewise"
# every kustomization an operator can apply; examples/learning is checked in test_learning_deploy.py
ROOTS = {
    "base": K8S,
    "prometheus-operator": K8S / "overlays" / "prometheus-operator",
    "shared-policy": K8S / "overlays" / "shared-policy",
    "sidecar": K8S / "examples" / "sidecar",
}
COMPONENTS = {"prometheus-operator": K8S / "components" / "prometheus-operator",
              "shared-policy": K8S / "components" / "shared-policy"}
SHARED_POLICY_PATH = "/var/lib/routewise/policy/policy.onnx"


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path:
        return path
    reason = "kubectl not installed: it renders the kustomizations (`kubectl kustomize`, any kubectl >= 1.27)"
    if in_ci():
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@functools.cache
def render(root: Path) -> tuple[dict, ...]:
    """The objects `kubectl kustomize root` builds, as `kubectl apply -k root` would send them."""
    r = subprocess.run([kubectl(), "kustomize", str(root)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {root.relative_to(REPO)}: {r.stderr.strip()}"
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def kustomize(root: Path) -> tuple[dict, list[dict]]:
    """(the kustomization file at root, the objects it renders)."""
    return yaml.safe_load((root / "kustomization.yaml").read_text()), list(render(root))


BASE = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
BASE_OBJECTS = list(render(K8S))
OBJECTS = {name: list(render(root)) for name, root in ROOTS.items()}


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def key(o: dict) -> tuple[str, str]:
    return o["kind"], o["metadata"]["name"]


def pod_spec(o: dict) -> dict:
    return o["spec"]["template"]["spec"]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def router_containers(objects: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, container) for every container running the router image."""
    out = []
    for o in workloads(objects):
        spec = pod_spec(o)
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["image"].startswith("routewise-router") and c.get("args"):
                out.append((o, c))
    return out


def distinct_objects() -> list[tuple[str, dict]]:
    """(kustomization, object) for each distinct rendered object, named by the first kustomization rendering it."""
    seen: list[dict] = []
    out = []
    for name, objects in OBJECTS.items():
        for o in objects:
            if o not in seen:
                seen.append(o)
                out.append((name, o))
    return out


@pytest.mark.parametrize("name,obj", [(n, o) for n, o in distinct_objects() if o["kind"] not in CRDS],
                         ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}")
def test_schema_valid(name: str, obj: dict) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_a_typo() -> None:
    service = dict(find(BASE_OBJECTS, "Service", "routewise-router")[0])
    service["spec"] = {**service["spec"], "selectr": {"a": "b"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)


def declared_files(root: Path) -> set[str]:
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    return {r for r in k.get("resources", []) if r.endswith(".yaml")} | {p["path"] for p in k.get("patches", [])}


@pytest.mark.parametrize("root", [K8S / "base", *COMPONENTS.values(), ROOTS["sidecar"], K8S / "examples" / "learning"],
                         ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_lists_every_manifest(root: Path) -> None:
    listed = declared_files(root)
    assert all((root / r).is_file() for r in listed)
    present = {p.name for p in root.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize("name", ROOTS)
def test_every_object_lands_in_the_namespace(name: str) -> None:
    for o in OBJECTS[name]:
        if o["kind"] == "Namespace":
            assert o["metadata"]["name"] == NAMESPACE
        else:
            assert o["metadata"].get("namespace") == NAMESPACE, (name, key(o))
    assert BASE["namespace"] == NAMESPACE


def test_the_top_level_kustomization_is_the_base() -> None:
    assert render(K8S) == render(K8S / "base")


def test_base_applies_on_a_plain_cluster() -> None:
    """Built-in kinds only (every one has a bundled schema, so none needs a CRD), no ReadWriteMany claim, and the
    router serving the model of its image rather than a file on a volume."""
    for o in BASE_OBJECTS:
        assert o["kind"] not in CRDS and "coreos" not in o["apiVersion"], key(o)
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    claims = find(BASE_OBJECTS, "PersistentVolumeClaim") + [
        t for s in find(BASE_OBJECTS, "StatefulSet") for t in s["spec"].get("volumeClaimTemplates", [])]
    assert claims, "the vLLM model cache claims nothing"
    for claim in claims:
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"], claim["metadata"]["name"]
        assert "storageClassName" not in claim["spec"]  # the cluster's default
    (workload, router), = router_containers(BASE_OBJECTS)
    config, _ = config_for(workload, router, BASE_OBJECTS)
    assert effective_policy(router, config) == "gated"
    assert not [v for w in workloads(BASE_OBJECTS) for v in pod_spec(w).get("volumes", []) if "persistentVolumeClaim" in v]


def test_vllm_keeps_its_model_cache_on_a_persistent_volume() -> None:
    (vllm,) = find(BASE_OBJECTS, "StatefulSet", "vllm")
    (container,) = pod_spec(vllm)["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/root/.cache/huggingface"]
    assert mount["name"] not in {v["name"] for v in pod_spec(vllm)["volumes"]}  # not an emptyDir
    (template,) = [t for t in vllm["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == mount["name"]]
    assert template["spec"]["resources"]["requests"]["storage"]


def added_and_changed(name: str) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    base = {key(o): o for o in BASE_OBJECTS}
    overlay = {key(o): o for o in OBJECTS[name]}
    assert base.keys() <= overlay.keys(), f"{name} drops {base.keys() - overlay.keys()}"
    return overlay.keys() - base.keys(), {k for k in base if base[k] != overlay[k]}


def test_prometheus_operator_overlay_adds_only_its_resources() -> None:
    added, changed = added_and_changed("prometheus-operator")
    assert added == {("ServiceMonitor", "routewise-router"), ("ServiceMonitor", "vllm"),
                     ("PrometheusRule", "routewise-router")}
    assert not changed


def test_shared_policy_overlay_serves_the_file_on_the_volume() -> None:
    added, changed = added_and_changed("shared-policy")
    assert added == {("PersistentVolumeClaim", "routewise-policy")}
    assert changed == {("Deployment", "routewise-router")}
    (claim,) = find(OBJECTS["shared-policy"], "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (workload, router), = router_containers(OBJECTS["shared-policy"])
    config, _ = config_for(workload, router, OBJECTS["shared-policy"])
    assert effective_policy(router, config) == SHARED_POLICY_PATH
    # the rest of the router container is the base's, merged rather than replaced
    (_, base_router), = router_containers(BASE_OBJECTS)
    assert {k: v for k, v in router.items() if k not in ("env", "volumeMounts")} == \
           {k: v for k, v in base_router.items() if k not in ("env", "volumeMounts")}
    assert [e for e in router["env"] if e["name"] != "ROUTEWISE_POLICY"] == base_router["env"]


def test_the_components_combine_in_one_overlay(tmp_path: Path) -> None:
    rel = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE,
        "resources": [str(rel / "base")], "components": [str(rel / "components" / c) for c in COMPONENTS]}))
    objects = render(tmp_path)
    kinds = {key(o) for o in objects}
    for name in COMPONENTS:
        assert {key(o) for o in OBJECTS[name]} <= kinds
    (_, router), = router_containers(list(objects))
    assert {"name": "ROUTEWISE_POLICY", "value": SHARED_POLICY_PATH} in router["env"]


@pytest.mark.parametrize("name", ROOTS)
def test_workload_selectors_match_their_pod_labels(name: str) -> None:
    for o in workloads(OBJECTS[name]):
        labels = o["spec"]["template"]["metadata"]["labels"]
        assert o["spec"]["selector"]["matchLabels"].items() <= labels.items(), o["metadata"]["name"]


def test_services_select_pods_and_name_real_ports() -> None:
    for svc in find(BASE_OBJECTS, "Service"):
        selected = [w for w in workloads(BASE_OBJECTS)
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, svc["metadata"]["name"]
        port_names = {p["name"] for c in pod_spec(selected[0])["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (svc["metadata"]["name"], port)


@pytest.mark.parametrize("name", ROOTS)
def test_router_probes_hit_real_router_paths(name: str) -> None:
    assert router_containers(OBJECTS[name]), "no router container found"
    for o, c in router_containers(OBJECTS[name]):
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
    from routewise_vllm.router.app import create_app
    from routewise_vllm.router.settings import build_settings

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
    cm_key = items.get(config_path.name, config_path.name)
    assert cm_key in cm["data"], f"ConfigMap {cm['metadata']['name']} has no key {cm_key}"
    return yaml.safe_load(cm["data"][cm_key]), config_path


def effective_policy(container: dict, config: dict) -> str:
    """The policy the router serves: ROUTEWISE_POLICY in the container's environment over the config file's key."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    return env.get("ROUTEWISE_POLICY") or config["policy"]


@pytest.mark.parametrize("name", ROOTS)
def test_every_mounted_volume_is_declared(name: str) -> None:
    objects = OBJECTS[name]
    for o in workloads(objects):
        spec = pod_spec(o)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claim_templates = {t["metadata"]["name"] for t in o["spec"].get("volumeClaimTemplates", [])}
        for c in spec.get("initContainers", []) + spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes.keys() | claim_templates, (o["metadata"]["name"], c["name"], m["name"])
        for v in volumes.values():
            if "configMap" in v:
                assert find(objects, "ConfigMap", v["configMap"]["name"]), v
            if "persistentVolumeClaim" in v:
                assert find(objects, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]), v


@pytest.mark.parametrize("name", ["base", "shared-policy", "sidecar"])
def test_router_config_is_valid_router_settings(name: str, tmp_path: Path) -> None:
    objects = OBJECTS[name]
    (workload, container), = router_containers(objects)
    config, _ = config_for(workload, container, objects)
    file = tmp_path / "router.yaml"
    file.write_text(yaml.safe_dump(config))
    data = load_config_file(file)  # raises on unknown keys
    policy = effective_policy(container, data)
    if policy.endswith(".onnx"):  # lives on the policy volume in the cluster
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(policy.startswith(m + "/") for m in mounts), policy
        data["policy"] = "learned"
    settings = RouterSettings(**data)
    assert settings.port == next(p["containerPort"] for p in container["ports"])
    # discovery resolves the headless vLLM Service of the base manifests
    host, port = settings.discover.rsplit(":", 1)
    svc_name, namespace = host.split(".")[:2]
    (svc,) = find(BASE_OBJECTS, "Service", svc_name)
    assert svc["spec"]["clusterIP"] == "None"
    assert namespace == BASE["namespace"] and host.endswith(".svc.cluster.local")
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}


def test_policy_seed_writes_where_the_router_reads() -> None:
    objects = OBJECTS["shared-policy"]
    (deployment,) = find(objects, "Deployment", "routewise-router")
    (seed,) = pod_spec(deployment)["initContainers"]
    router = next(c for c in pod_spec(deployment)["containers"] if c["name"] == "router")
    config, _ = config_for(deployment, router, objects)
    policy = effective_policy(router, config)
    policy_mount = next(m for m in router["volumeMounts"] if m["name"] == "policy")
    assert policy_mount["readOnly"] is True
    assert policy.startswith(policy_mount["mountPath"] + "/")
    assert policy in seed["command"][-1]
    assert any(m["name"] == "policy" and m["mountPath"] == policy_mount["mountPath"] for m in seed["volumeMounts"])


def test_servicemonitor_scrapes_the_router_service() -> None:
    objects = OBJECTS["prometheus-operator"]
    (monitor,) = find(objects, "ServiceMonitor", "routewise-router")
    (svc,) = find(objects, "Service", "routewise-router")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [BASE["namespace"]]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    # the job label the alerts and dashboards are written for (deploy/prometheus/prometheus.yml)
    assert svc["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "routewise-router"


def test_sidecar_is_a_native_sidecar_next_to_the_app() -> None:
    (deployment,) = find(OBJECTS["sidecar"], "Deployment")
    (router,) = [c for c in pod_spec(deployment)["initContainers"] if c["name"] == "router"]
    assert router["restartPolicy"] == "Always"
    app = pod_spec(deployment)["containers"][0]
    port = router["ports"][0]["containerPort"]
    assert {"name": "OPENAI_BASE_URL", "value": f"http://127.0.0.1:{port}/v1"} in app["env"]


@pytest.mark.parametrize("name", ROOTS)
def test_images_are_pinned(name: str) -> None:
    for o in workloads(OBJECTS[name]):
        spec = pod_spec(o)
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


def test_prometheusrule_carries_exactly_the_alerts_file() -> None:
    (rule,) = find(OBJECTS["prometheus-operator"], "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"], \
        "copy deploy/prometheus/alerts.yml's groups into deploy/k8s/components/prometheus-operator/prometheusrule.yaml"
