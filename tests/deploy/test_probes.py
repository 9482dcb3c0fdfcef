"""Liveness is not readiness: in every rendering (chart and kustomize, each overlay), a stage's
liveness probe asks only whether its process and event loop answer, so an outage behind a stage
(Redis, the talker, code2wav) makes it unready, never restarted."""

from __future__ import annotations

from test_manifests import (
    STACKS,  # noqa: F401 - parametrises the stack fixture
    chart,  # noqa: F401 - the module-scoped fixture
    container,
    stack,  # noqa: F401 - the fixture
    workloads,
)

from qtts.serving.grpc_server import LIVENESS


def test_liveness_probes_ask_for_liveness_and_readiness_for_readiness(stack):  # noqa: F811
    for name, wl in workloads(stack).items():
        c = container(wl)
        live, ready = c["livenessProbe"], c["readinessProbe"]
        if name == "gateway":
            assert live["httpGet"]["path"] == "/livez", live
            assert ready["httpGet"]["path"] in ("/health", "/readyz"), ready
        elif "grpc" in live:
            assert live["grpc"]["service"] == LIVENESS, (name, live)
            assert ready["grpc"]["service"] == "", (name, ready)
        else:  # TLS: the chart's exec of qtts.serving.probe
            assert f"--service={LIVENESS}" in live["exec"]["command"], (name, live)
