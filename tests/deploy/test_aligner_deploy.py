"""The optional aligner stage in the Helm chart and as a kustomize component: off by default
(nothing rendered, the gateway without --aligner); on, its own Deployment with its replica count,
a GPU, probes, a PDB, a Service the gateway dials, an ingress policy from the gateway only, and
flags its service accepts."""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from test_manifests import (
    CHART,
    KUBE_VERSIONS,
    KUSTOMIZE_DIR,
    _helm,
    component,
    container,
    expanded_args,
    flags,
    of_kind,
    render_chart,
    workloads,
)

from services.aligner.config import config_from_args as aligner_config
from services.gateway.config import config_from_args as gateway_config

ON = {"aligner": {"enabled": True, "replicaCount": 3}}


def deployments(docs: list[dict]) -> dict[str, dict]:
    return {component(d): d for d in docs if d["kind"] == "Deployment"}


@pytest.fixture(scope="module")
def loaded_chart():
    loaded = _helm().Chart.load(str(CHART))
    yield loaded
    loaded.close()


def test_off_by_default(loaded_chart):
    docs = render_chart(loaded_chart)
    assert "aligner" not in deployments(docs)
    assert not any(component(d) == "aligner" for d in docs)
    gateway_args = container(workloads(docs)["gateway"])["args"]
    assert not any(a.startswith("--aligner") for a in gateway_args)


def test_enabled_runs_its_own_deployment_that_the_gateway_dials(loaded_chart):
    docs = render_chart(loaded_chart, ON)
    loads = deployments(docs)
    wl = loads["aligner"]
    assert wl["spec"]["replicas"] == 3
    c = container(wl)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
    args = expanded_args(docs, c)
    assert args[0] == "aligner"
    config = aligner_config(args[1:])
    assert (config.host, config.port, config.metrics_port) == ("0.0.0.0", 50050, 9101)
    assert config.model == "/models/Qwen3-ForcedAligner-0.6B" and config.device == "cuda"
    assert any(m["name"] == "models" and m["readOnly"] for m in c["volumeMounts"])
    gw = flags(expanded_args(docs, container(loads["gateway"]))[1:])
    service = [s for s in of_kind(docs, "Service") if component(s) == "aligner"]
    assert len(service) == 1 and {p["port"] for p in service[0]["spec"]["ports"]} == {50050, 9101}
    assert gw["--aligner"].startswith(service[0]["metadata"]["name"]) and gw["--aligner"].endswith(":50050")
    gateway_config(expanded_args(docs, container(loads["gateway"]))[1:])  # the gateway accepts it
    assert any(component(p) == "aligner" for p in of_kind(docs, "PodDisruptionBudget"))


def test_enabled_aligner_takes_grpc_from_the_gateway_only(loaded_chart):
    docs = render_chart(loaded_chart, {**ON, "networkPolicy": {"enabled": True}})
    policies = [p for p in of_kind(docs, "NetworkPolicy") if component(p) == "aligner"]
    assert len(policies) == 1
    grpc_rules = [r for r in policies[0]["spec"]["ingress"] if {p["port"] for p in r["ports"]} == {50050}]
    sources = [
        f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in grpc_rules for f in r["from"]
    ]
    assert sources == ["gateway"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_enabled_manifests_validate(loaded_chart, kube_version):
    for doc in render_chart(loaded_chart, {**ON, "networkPolicy": {"enabled": True}}):
        if doc["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"):
            continue
        kubernetes_validate.validate(doc, kube_version, strict=True)


@pytest.fixture(scope="module")
def kustomized(tmp_path_factory) -> list[dict]:
    """The base with the aligner component, as an overlay would add it."""
    root = tmp_path_factory.mktemp("kustomize")
    shutil.copytree(KUSTOMIZE_DIR, root / "k8s")
    (root / "with-aligner").mkdir()
    (root / "with-aligner" / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../k8s/base\ncomponents:\n  - ../k8s/components/aligner\n"
    )
    out = subprocess.run(
        ["kubectl", "kustomize", str(root / "with-aligner")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_kustomize_component_adds_the_stage_and_the_gateway_flag(kustomized):
    loads = deployments(kustomized)
    c = container(loads["aligner"])
    config = aligner_config(expanded_args(kustomized, c)[1:])
    assert (config.port, config.model, config.max_batch) == (50050, "/models/Qwen3-ForcedAligner-0.6B", 32)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    gw = gateway_config(expanded_args(kustomized, container(loads["gateway"]))[1:])
    assert gw.aligner == "aligner:50050"
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        (mine,) = [d for d in kustomized if d["kind"] == kind and d["metadata"]["name"] == "aligner"]
        assert mine["metadata"]["namespace"] == "qwen3-tts"
    for doc in kustomized:
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)


def test_kustomize_base_has_no_aligner():
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZE_DIR)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert "aligner" not in deployments(docs)
    gateway_args = container(deployments(docs)["gateway"])["args"]
    assert not any(a.startswith("--aligner") for a in gateway_args)
