"""The chart's autoscaling and observability objects: talker HPA on streams per pod (served by the
shipped prometheus-adapter rules) or a KEDA ScaledObject, ServiceMonitor / PodMonitor, alert rules,
and the Grafana dashboard as a ConfigMap. CRD objects are checked for the fields their operators
read; every core object still passes the Kubernetes schemas."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest
import yaml
from test_manifests import (
    CHART,
    KUBE_VERSIONS,
    NAMESPACE,
    ROOT,
    STAGES,
    chart,  # noqa: F401 - the module-scoped fixture
    of_kind,
    render_chart,
    selects,
    workloads,
)

ADAPTER_VALUES = ROOT / "deploy" / "prometheus-adapter" / "values.yaml"
DASHBOARD = CHART / "dashboards" / "qwen3-tts.json"
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"}
EVERYTHING = {
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    },
    "talker": {"autoscaling": {"enabled": True}},
}
KEDA = {"talker": {"autoscaling": {"enabled": True, "provider": "keda", "targetActiveStreams": 150}}}


def exported_metrics() -> set[str]:
    """Every tts_ series name the services' metrics (qtts/serving/metrics.py) register, counters
    with `_total` and histograms with their suffixes."""
    from prometheus_client import CollectorRegistry

    from qtts.serving import metrics

    names: set[str] = set()
    for cls in (
        metrics.GatewayMetrics,
        metrics.TalkerMetrics,
        metrics.Code2WavMetrics,
        metrics.SpeakerCacheMetrics,
        metrics.AlignerMetrics,
    ):
        registry = CollectorRegistry()
        cls(registry)
        names |= {f.name for f in registry.collect() if f.name.startswith("tts_")}
    return names | {n + s for n in names for s in ("_total", "_bucket", "_sum", "_count")}


def metric_names(promql: str) -> set[str]:
    """Series names a PromQL expression selects (label names inside {...} are skipped)."""
    without_matchers = re.sub(r"\{[^}]*\}", "{}", promql)
    return set(re.findall(r"\b(tts_[a-z0-9_]+|up)\b(?=\{|\[|\))", without_matchers))


def check_promql(expr: str) -> None:
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    assert expr.count("[") == expr.count("]"), expr
    names = metric_names(expr)
    assert names, expr
    unknown = names - exported_metrics() - {"up"}
    assert not unknown, f"{expr}: {unknown} are not exported by qtts/serving/metrics.py"


@pytest.fixture(scope="module")
def everything(chart) -> list[dict]:  # noqa: F811
    return render_chart(chart, EVERYTHING)


def test_defaults_need_no_operator_crds(chart):  # noqa: F811
    docs = render_chart(chart)
    assert not [d for d in docs if d["kind"] in CRD_KINDS]
    assert not [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]


@pytest.mark.parametrize("values", [EVERYTHING, KEDA], ids=["monitoring", "keda"])
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_core_objects_validate_and_crd_objects_name_their_api(chart, values, kube_version):  # noqa: F811
    for doc in render_chart(chart, values):
        if doc["kind"] in CRD_KINDS:
            group = doc["apiVersion"].split("/")[0]
            assert group in ("monitoring.coreos.com", "keda.sh"), doc["apiVersion"]
            assert doc["metadata"]["name"] and doc["spec"]
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({kube_version}): {exc.message}")


def test_monitors_scrape_every_stage_on_its_metrics_port(everything):
    loads = workloads(everything)
    (sm,) = of_kind(everything, "ServiceMonitor")
    (pm,) = of_kind(everything, "PodMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for monitor, endpoints in ((sm, "endpoints"), (pm, "podMetricsEndpoints")):
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (endpoint,) = monitor["spec"][endpoints]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        (expr,) = monitor["spec"]["selector"]["matchExpressions"]
        assert expr["key"] == "app.kubernetes.io/component" and set(expr["values"]) == set(STAGES)
    sm_labels = sm["spec"]["selector"]["matchLabels"]
    for name, wl in loads.items():
        labels = wl["spec"]["template"]["metadata"]["labels"]
        assert (
            selects(pm["spec"]["selector"]["matchLabels"], labels)
            and labels["app.kubernetes.io/component"] in STAGES
        )
        ports = [p["name"] for p in wl["spec"]["template"]["spec"]["containers"][0]["ports"]]
        assert "metrics" in ports, name
        services = [s for s in of_kind(everything, "Service") if selects(s["spec"]["selector"], labels)]
        assert any(
            selects(sm_labels, s["metadata"]["labels"])
            and "metrics" in [p["name"] for p in s["spec"]["ports"]]
            for s in services
        ), f"{name}: no Service the ServiceMonitor scrapes"


def test_alert_rules_cover_underruns_refusals_step_budget_and_stage_down(everything):
    (rule,) = of_kind(everything, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    for name in (
        "TTSTalkerUnderruns",
        "TTSCode2WavUnderruns",
        "TTSGatewayUnderruns",
        "TTSAdmissionRefusals",
        "TTSTalkerStepOverBudget",
    ):
        assert name in alerts, name
    assert "tts_talker_underruns_total" in alerts["TTSTalkerUnderruns"]["expr"]
    assert "tts_code2wav_underruns_total" in alerts["TTSCode2WavUnderruns"]["expr"]
    assert "tts_gateway_underruns_total" in alerts["TTSGatewayUnderruns"]["expr"]
    assert "tts_talker_refused_total" in alerts["TTSAdmissionRefusals"]["expr"]
    assert "tts_talker_step_seconds_bucket" in alerts["TTSTalkerStepOverBudget"]["expr"]
    assert alerts["TTSTalkerStepOverBudget"]["expr"].endswith("> 0.06")
    down = {r["labels"]["stage"]: r for r in alerts.values() if r["alert"].startswith("TTSStageDown")}
    assert set(down) == set(STAGES)
    for stage, r in down.items():
        assert r["labels"]["severity"] == "critical"
        assert f'pod=~"tts-qwen3-tts-{stage}-.+"' in r["expr"] and "absent(up{" in r["expr"]
    for r in alerts.values():
        check_promql(r["expr"])
        assert f'namespace="{NAMESPACE}"' in r["expr"], r["alert"]
        assert re.fullmatch(r"[0-9]+[smh]", r["for"]) and r["annotations"]["summary"], r["alert"]


def test_alert_thresholds_come_from_values(chart):  # noqa: F811
    docs = render_chart(
        chart,
        {
            "monitoring": {
                "prometheusRule": {"enabled": True, "stepBudgetSeconds": 0.07, "refusalsPerSecond": 0.5}
            }
        },
    )
    (rule,) = of_kind(docs, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts["TTSTalkerStepOverBudget"]["expr"].endswith("> 0.07")
    assert alerts["TTSAdmissionRefusals"]["expr"].endswith("> 0.5")


def test_dashboard_configmap_carries_the_dashboard_with_namespace_and_pod_variables(everything):
    (cm,) = [d for d in of_kind(everything, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["qwen3-tts.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "pod"} <= set(variables)
    assert "$namespace" in json.dumps(variables["pod"]["query"])
    exprs = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        exprs += [t["expr"] for t in panel.get("targets", []) if "expr" in t]
    assert exprs
    for expr in exprs:
        check_promql(expr)
        # Every series selector is filtered by both variables.
        for selector in re.findall(r"\btts_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert 'namespace=~"$namespace"' in selector and 'pod=~"$pod"' in selector, expr


def test_dashboard_configmap_namespace_can_be_the_grafana_one(chart):  # noqa: F811
    docs = render_chart(
        chart, {"monitoring": {"grafanaDashboard": {"enabled": True, "namespace": "grafana"}}}
    )
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["namespace"] == "grafana"


def adapter_rules() -> dict[str, dict]:
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert values["rules"]["default"] is False
    return {r["name"]["as"]: r for r in values["rules"]["custom"]}


def test_prometheus_adapter_rules_serve_exported_talker_metrics_per_pod():
    rules = adapter_rules()
    assert "tts_talker_active_streams" in rules
    for name, rule in rules.items():
        series = re.match(r"([a-z_0-9]+)\{", rule["seriesQuery"]).group(1)
        assert series in exported_metrics(), name
        assert re.fullmatch(rule["name"]["matches"], series), name
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        assert (
            "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"]
            and "<<.GroupBy>>" in rule["metricsQuery"]
        )


def test_talker_hpa_scales_on_active_streams_per_pod_through_the_adapter(everything):
    loads = workloads(everything)
    (hpa,) = of_kind(everything, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == loads["talker"]["metadata"]["name"]
    assert "replicas" not in loads["talker"]["spec"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] in adapter_rules()
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "192"}
    # Scale in one pod at a time, slowly: a removed talker drains its streams first.
    assert hpa["spec"]["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 120}
    ]


def test_keda_scaled_object_replaces_the_talker_hpa(chart):  # noqa: F811
    docs = render_chart(chart, KEDA)
    loads = workloads(docs)
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    (so,) = of_kind(docs, "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": loads["talker"]["metadata"]["name"],
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    assert "replicas" not in loads["talker"]["spec"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["threshold"] == "150" and meta["serverAddress"].startswith("http")
    check_promql(meta["query"])
    assert (
        meta["query"].startswith("sum(tts_talker_active_streams{")
        and f'namespace="{NAMESPACE}"' in meta["query"]
    )
    assert (
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
            "stabilizationWindowSeconds"
        ]
        == 300
    )


def test_gateway_hpa_stays_on_cpu(chart):  # noqa: F811
    docs = render_chart(chart, {"gateway": {"autoscaling": {"enabled": True}}})
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
