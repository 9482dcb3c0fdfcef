"""The kustomize prod overlay deploys the Helm chart's ServiceMonitor and PrometheusRule (with
values-prod.yaml): one source, the chart's templates/monitoring.yaml, rendered for the plain
manifests by deploy/k8s/monitoring.py into deploy/k8s/overlays/prod/monitoring.yaml. The committed
file is what the chart renders now; the objects scrape every stage of the rendered overlay and
their alerts select its pods."""

from __future__ import annotations

import importlib.util
import re

import pytest
import yaml
from test_manifests import (
    OVERLAYS,
    ROOT,
    STAGES,
    chart,  # noqa: F401 - the module-scoped fixture
    helm_values_file,
    kustomize,
    of_kind,
    selects,
    workloads,
)
from test_observability import check_promql

SCRIPT = ROOT / "deploy" / "k8s" / "monitoring.py"


def generator():
    spec = importlib.util.spec_from_file_location("k8s_monitoring", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prod() -> list[dict]:
    return kustomize(OVERLAYS["prod"])


def alerts(rule: dict) -> dict[str, dict]:
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_the_committed_file_is_the_charts_rendering():
    gen = generator()
    assert gen.OUT.read_text() == gen.text(), "run: python deploy/k8s/monitoring.py --write"


def test_prod_overlay_deploys_the_charts_monitor_and_rules(prod, chart):  # noqa: F811
    (sm,) = of_kind(prod, "ServiceMonitor")
    (rule,) = of_kind(prod, "PrometheusRule")
    # The chart installed as release qwen3-tts in namespace qwen3-tts: the names the base uses.
    rendered = chart.render(
        helm_values_file("prod"), name="qwen3-tts", namespace="qwen3-tts", is_install=True
    )
    helm = [
        d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d
    ]
    (helm_sm,) = of_kind(helm, "ServiceMonitor")
    (helm_rule,) = of_kind(helm, "PrometheusRule")
    assert sm["metadata"]["namespace"] == rule["metadata"]["namespace"] == "qwen3-tts"
    # The same scrape: endpoints, namespace and stage selection; the chart also selects its release.
    for key in ("endpoints", "namespaceSelector"):
        assert sm["spec"][key] == helm_sm["spec"][key], key
    assert sm["spec"]["selector"]["matchExpressions"] == helm_sm["spec"]["selector"]["matchExpressions"]
    assert helm_sm["spec"]["selector"]["matchLabels"].pop("app.kubernetes.io/instance") == "qwen3-tts"
    assert sm["spec"]["selector"]["matchLabels"] == helm_sm["spec"]["selector"]["matchLabels"]
    # The same alerts, thresholds, durations, labels and annotations; the expressions differ only
    # in the pods' name prefix (the chart's are `<release>-<stage>-...`, the base's `<stage>-...`).
    ours, theirs = alerts(rule), alerts(helm_rule)
    assert set(ours) == set(theirs) and len(ours) >= 10
    for name, r in ours.items():
        other = theirs[name]
        assert (r["for"], r["labels"], r["annotations"]) == (
            other["for"],
            other["labels"],
            other["annotations"],
        )
        assert r["expr"] == re.sub(r'pod=~"qwen3-tts-([a-z0-9-]+?)-\.\+"', r'pod=~"\1-.+"', other["expr"]), (
            name
        )


def test_the_monitor_scrapes_every_stage_of_the_overlay(prod):
    (sm,) = of_kind(prod, "ServiceMonitor")
    match = sm["spec"]["selector"]["matchLabels"]
    (expr,) = sm["spec"]["selector"]["matchExpressions"]
    assert set(expr["values"]) == set(STAGES)
    namespaces = set(sm["spec"]["namespaceSelector"]["matchNames"])
    for name, wl in workloads(prod).items():
        labels = wl["spec"]["template"]["metadata"]["labels"]
        services = [
            s
            for s in of_kind(prod, "Service")
            if selects(s["spec"].get("selector", {}), labels)
            and selects(match, s["metadata"]["labels"])
            and s["metadata"]["labels"].get("app.kubernetes.io/component") in expr["values"]
            and s["metadata"]["namespace"] in namespaces
            and "metrics" in [p["name"] for p in s["spec"]["ports"]]
        ]
        assert services, f"{name}: no Service the ServiceMonitor scrapes on `metrics`"


def test_the_alerts_select_the_overlays_pods(prod):
    (rule,) = of_kind(prod, "PrometheusRule")
    loads = workloads(prod)
    down = {r["labels"]["stage"]: r for r in alerts(rule).values() if r["alert"].startswith("TTSStageDown")}
    assert set(down) == set(STAGES)
    for r in alerts(rule).values():
        check_promql(r["expr"])
        assert 'namespace="qwen3-tts"' in r["expr"], r["alert"]
        for stage in re.findall(r'pod=~"([a-z0-9-]+)-\.\+"', r["expr"]):
            wl = loads[stage]  # a Deployment's pods are <name>-<hash>-<id>, a StatefulSet's <name>-<i>
            assert wl["metadata"]["name"] == stage and wl["metadata"]["namespace"] == "qwen3-tts"
    for stage, r in down.items():
        assert f'pod=~"{stage}-.+"' in r["expr"], r["expr"]


def test_the_generator_refuses_a_chart_it_does_not_understand():
    gen = generator()
    with pytest.raises(SystemExit, match="unexpected pod matchers"):
        gen._plain_pod_names('up{namespace="x",pod=~"other-talker-.+"}')
    assert gen._plain_pod_names('up{pod=~"qwen3-tts-speaker-cache-.+"}') == 'up{pod=~"speaker-cache-.+"}'
    assert yaml.safe_load_all(gen.OUT.read_text())
