"""docker/k8s/: every object valid against Kubernetes' own schemas (kubernetes-validate, strict), and the
fields that tie them together agree with the server: probe paths and ports, flags, metric names, selectors."""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from server.app import _add_service_routes
from server.cli import build_parser
from server.metrics import ServerMetrics
from server.settings import resolve_settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "docker" / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, (kind, name, len(matches))
    return matches[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def named_port(c: dict[str, Any], name: str) -> int:
    return {p["name"]: p["containerPort"] for p in c["ports"]}[name]


def entrypoint_args() -> list[str]:
    """The flags the Dockerfile's ENTRYPOINT gives `pagedserve serve` (the pod's args are appended)."""
    line = next(ln for ln in (REPO / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT"))
    words = yaml.safe_load(line.removeprefix("ENTRYPOINT"))
    assert words[:2] == ["pagedserve", "serve"], words
    return words[2:]


def test_every_object_is_valid_kubernetes() -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: `pip install kubernetes-validate` (.ci/install does)")
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap",
                                         "ServiceAccount", "Role", "RoleBinding"}
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)      # raises on an unknown or mistyped field


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]


def test_replica_probes_ports_and_flags_match_the_server() -> None:
    deployment = find("Deployment", "pagedserve")
    c = container(deployment)
    flags = entrypoint_args() + c["args"]
    settings = resolve_settings(build_parser().parse_args(["serve", *flags]), environ={})
    assert settings.vllm_metric_names and settings.host == "0.0.0.0"
    assert named_port(c, "http") == settings.port
    app = FastAPI()
    _add_service_routes(app)
    health = {route.path for route in app.routes} & {"/health"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in health and get["port"] == "http", probe
    # Readiness must notice a draining replica (503 on SIGTERM) before the grace period runs out.
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.drain_timeout
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = find("Service", "pagedserve")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http"}


def test_autoscaler_metric_is_one_we_serve() -> None:
    hpa = find("HorizontalPodAutoscaler", "pagedserve")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedserve"}
    (spec,) = hpa["spec"]["metrics"]
    name = spec["pods"]["metric"]["name"]
    families = {f.name: f.type for f in text_string_to_metric_families(ServerMetrics("m", 64).render().decode())}
    assert families.get(name) == "gauge", name
    rules = yaml.safe_load(find("ConfigMap", "prometheus-adapter-pagedserve")["data"]["config.yaml"])["rules"]
    (rule,) = rules
    assert rule["seriesQuery"].startswith(name + "{") and rule["name"]["as"] == name
    annotations = find("Deployment", "pagedserve")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == named_port(container(find("Deployment", "pagedserve")), "http")


def test_router_finds_the_replicas() -> None:
    router = find("Deployment", "pagedserve-router")
    c = container(router)
    args = [re.sub(r"\$\(POD_NAMESPACE\)", "default", a) for a in c["args"]]
    assert {e["name"] for e in c["env"]} >= {"POD_NAMESPACE"}
    replica = find("Deployment", "pagedserve")
    labels = replica["spec"]["template"]["metadata"]["labels"]

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert "--service-discovery" in args
    key, _, val = value("--selector").partition("=")
    assert labels.get(key) == val
    assert int(value("--service-discovery-port")) == named_port(container(replica), "http")
    assert value("--health-check-endpoint") == container(replica)["readinessProbe"]["httpGet"]["path"]
    assert int(value("--port")) == named_port(c, "http")
    assert int(value("--prometheus-port")) == named_port(c, "metrics")
    # The pods it watches: its service account may list and watch them.
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "pagedserve-router"
    (rule,) = find("Role", "pagedserve-router")["rules"]
    assert "pods" in rule["resources"] and {"list", "watch"} <= set(rule["verbs"])
    binding = find("RoleBinding", "pagedserve-router")
    assert binding["roleRef"]["name"] == "pagedserve-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pagedserve-router"}]
    try:
        from vllm_router.launch_router import parse_router_args
    except ImportError:
        pytest.fail("vllm-router is not installed: `pip install vllm-router` (.ci/install does)")
    parsed = parse_router_args(args)          # the router's own parser accepts every flag
    assert parsed.service_discovery and parsed.policy == "cache_aware", shlex.join(args)
