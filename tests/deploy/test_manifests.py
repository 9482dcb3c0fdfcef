"""Deployment manifests: the Helm chart rendered by Helm's own engine (the Helm v4 Go SDK through
`helm-python-sdk`), the kustomize tree rendered by `kubectl kustomize`, both validated against the
Kubernetes JSON schemas shipped by `kubernetes-validate`, plus the images' entry point (the
Dockerfiles and the wheel: test_packaging.py)."""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "qwen3-tts"
KUSTOMIZE_DIR = ROOT / "deploy" / "k8s"
OVERLAYS = {name: KUSTOMIZE_DIR / "overlays" / name for name in ("dev", "prod")}
STACKS = ["helm", "kustomize", "helm-dev", "helm-prod", "kustomize-dev", "kustomize-prod"]
# Custom resources of operators (Prometheus Operator, KEDA): not in the Kubernetes schemas;
# tests/deploy/test_observability.py checks them.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"}
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"

# Oldest Kubernetes the chart supports (gRPC probes are GA from 1.27) and the newest schemas shipped.
KUBE_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
NAMESPACE = "voice"
GPU = "nvidia.com/gpu"
STAGES = ("gateway", "talker", "code2wav", "speaker-cache")
GPU_STAGES = ("talker", "code2wav")
SERVICE_MODULE = {
    "gateway": "gateway",
    "talker": "talker",
    "code2wav": "code2wav",
    "speaker-cache": "speaker_cache",
}
# Flags each service is started with (from the services' command lines).
REQUIRED_FLAGS = {
    "gateway": {
        "--host",
        "--http-port",
        "--grpc-port",
        "--talker",
        "--speaker-cache",
        "--metrics-port",
        "--max-streams",
        "--drain-seconds",
    },
    "talker": {
        "--host",
        "--port",
        "--model",
        "--device",
        "--dtype",
        "--code2wav",
        "--speaker-cache",
        "--metrics-port",
        "--max-batch",
        "--engine",
        "--prefill-buckets",
        "--drain-seconds",
    },
    "code2wav": {
        "--host",
        "--port",
        "--model",
        "--device",
        "--dtype",
        "--max-states",
        "--decode-engine",
        "--decode-precision",
        "--replica-name",
        "--metrics-port",
        "--drain-seconds",
    },
    "speaker-cache": {"--host", "--port", "--redis-url", "--metrics-port", "--drain-seconds"},
}
# Service ports each stage must expose by name.
SERVICE_PORTS = {
    "gateway": {"http": 8000, "grpc": 50051, "metrics": 9100},
    "talker": {"grpc": 50052, "metrics": 9102},
    "code2wav": {"grpc": 50053, "metrics": 9103},
    "speaker-cache": {"grpc": 50054, "metrics": 9104},
}


# ---------------------------------------------------------------- rendering


def _helm():
    try:
        import helm_python
    except ImportError:  # pragma: no cover - requirements-test.txt pins it
        pytest.skip("helm-python-sdk (Helm's Go SDK) is not installed")
    return helm_python


@pytest.fixture(scope="module")
def chart():
    helm = _helm()
    loaded = helm.Chart.load(str(CHART))
    yield loaded
    loaded.close()


def render_chart(chart, values: dict | None = None) -> list[dict]:
    rendered = chart.render(values, name="tts", namespace=NAMESPACE, is_install=True)
    docs: list[dict] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def tool(name: str) -> str:
    """A command-line tool from this environment (pinned in requirements-test.txt), else from PATH."""
    in_env = Path(sys.prefix) / "bin" / name
    if in_env.exists():
        return str(in_env)
    found = shutil.which(name)
    if not found:  # pragma: no cover - requirements-test.txt pins every tool used here
        pytest.skip(f"{name} is not installed")
    return found


@functools.cache
def _kustomize(path: Path) -> str:
    return subprocess.run(
        [tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=True
    ).stdout


def kustomize(path: Path) -> list[dict]:
    """`kubectl kustomize <path>` as objects (rendered once per session)."""
    return [d for d in yaml.safe_load_all(_kustomize(path)) if d]


def helm_values_file(overlay: str) -> dict:
    return yaml.safe_load((CHART / f"values-{overlay}.yaml").read_text())


@pytest.fixture(scope="module")
def kustomize_docs() -> list[dict]:
    return kustomize(KUSTOMIZE_DIR)


@pytest.fixture(scope="module")
def helm_default_docs(chart) -> list[dict]:
    return render_chart(chart)


def stack_docs(source: str, chart) -> list[dict]:
    """`helm`, `kustomize`, or either with `-dev` / `-prod`: the overlay or its values file."""
    tool_name, _, overlay = source.partition("-")
    if tool_name == "kustomize":
        return kustomize(OVERLAYS[overlay] if overlay else KUSTOMIZE_DIR)
    return render_chart(chart, helm_values_file(overlay) if overlay else None)


@pytest.fixture(scope="module", params=STACKS)
def stack(request, chart) -> list[dict]:
    """The whole stack as plain objects: the chart (defaults, dev or prod values) or deploy/k8s
    (the base, dev or prod overlay)."""
    return stack_docs(request.param, chart)


# ---------------------------------------------------------------- helpers over objects


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def component(obj: dict) -> str:
    labels = (
        obj["spec"]["template"]["metadata"]["labels"]
        if "template" in obj.get("spec", {})
        else obj["metadata"]["labels"]
    )
    return labels["app.kubernetes.io/component"]


def workloads(docs: list[dict]) -> dict[str, dict]:
    found = {component(d): d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    return {name: found[name] for name in STAGES if name in found}


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def config_values(docs: list[dict]) -> dict[str, str]:
    """Every key of every ConfigMap (for the $(VAR) references of the kustomize tree)."""
    values: dict[str, str] = {}
    for cm in of_kind(docs, "ConfigMap"):
        values.update(cm.get("data", {}))
    return values


def expanded_args(docs: list[dict], c: dict) -> list[str]:
    """Container args with $(VAR) expanded as the kubelet does; fails on a reference to no variable."""
    env: dict[str, str] = {}
    cms = {cm["metadata"]["name"]: cm.get("data", {}) for cm in of_kind(docs, "ConfigMap")}
    for src in c.get("envFrom", []):
        env.update(cms[src["configMapRef"]["name"]])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", f"<{e['name']}>")

    def sub(match: re.Match) -> str:
        assert match.group(1) in env, f"{c['name']}: $({match.group(1)}) names no variable"
        return env[match.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in c["args"]]


def flags(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args if a.startswith("--"))


def max_stream_seconds(docs: list[dict], chart_values: dict | None) -> int:
    if chart_values is not None:
        return int(chart_values["global"]["maxStreamSeconds"])
    return int(config_values(docs)["MAX_STREAM_SECONDS"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def drop_nulls(d: dict) -> dict:
    """Remove keys set to null, as Helm does when it merges user values over the defaults."""
    for k in [k for k, v in d.items() if v is None]:
        del d[k]
    for v in d.values():
        if isinstance(v, dict):
            drop_nulls(v)
    return d


def chart_values(overrides: dict | None = None) -> dict:
    """The chart's defaults with `overrides` merged over them the way Helm merges values."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return drop_nulls(deep_merge(values, overrides or {}))


# ---------------------------------------------------------------- schema validation


OTHER_VALUES = {
    "redis": {
        "enabled": False,
        "external": {"existingSecret": "managed-redis", "secretKey": "url"},
        "auth": {"existingSecret": "managed-redis", "secretKey": "password"},
    },
    "model": {
        "volume": {"persistentVolumeClaim": None, "hostPath": {"path": "/data/models", "type": "Directory"}}
    },
    "gateway": {"autoscaling": {"enabled": True}, "nodeSelector": {"pool": "cpu"}},
    "talker": {
        "autoscaling": {
            "enabled": True,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "tts_talker_active_streams"},
                        "target": {"type": "AverageValue", "averageValue": "200"},
                    },
                }
            ],
        }
    },
    "code2wav": {
        "replicaCount": 4,
        "extraArgs": ["--load-format=dummy"],
        "env": [{"name": "CUDA_MODULE_LOADING", "value": "LAZY"}],
    },
    "speakerCache": {"pdb": {"maxUnavailable": None, "minAvailable": 1}},
    # Transport security and credentials, every option on (tests/deploy/test_network_security.py).
    "tls": {"enabled": True, "secretName": "qwen3-tts-tls", "mtls": False, "publicSecretName": "public-tls"},
    "auth": {
        "apiKeys": {"existingSecret": "gateway-api-keys", "secretKey": "keys"},
        "internalToken": {"existingSecret": "internal-token", "secretKey": "token"},
    },
    "networkPolicy": {
        "gatewayFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}],
        "metricsFrom": [],
    },
}


@pytest.mark.parametrize("source", ["helm-other-values", *STACKS])
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(source, kube_version, chart):
    docs = render_chart(chart, OTHER_VALUES) if source == "helm-other-values" else stack_docs(source, chart)
    assert docs
    for doc in [d for d in docs if d["kind"] not in CRD_KINDS]:
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']} ({kube_version}): {exc.message} at {list(exc.path)}"
            )


def test_values_schema_is_valid_json_schema_and_accepts_the_defaults():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(chart_values())
    jsonschema.Draft7Validator(schema).validate(chart_values(OTHER_VALUES))


BAD_VALUES = {
    "gpu-request-missing": {"talker": {"resources": {"requests": {GPU: None}}}},
    "gpu-limit-missing": {"code2wav": {"resources": {"limits": {GPU: None}}}},
    "negative-replicas": {"gateway": {"replicaCount": -1}},
    "code2wav-autoscaling": {"code2wav": {"autoscaling": {"enabled": True}}},
    "external-redis-without-secret": {"redis": {"enabled": False}},
    "probe-without-handler": {"talker": {"startupProbe": {"grpc": None}}},
    "misspelled-key": {"talker": {"replicas": 2}},
    "misspelled-top-level-key": {"talkr": {"replicaCount": 2}},
    "no-code2wav-replica": {"code2wav": {"replicaCount": 0}},
    "no-talker-replica": {"talker": {"replicaCount": 0}},
    "unknown-autoscaling-provider": {"talker": {"autoscaling": {"provider": "cpu"}}},
    "misspelled-monitoring-key": {"monitoring": {"serviceMonitors": {"enabled": True}}},
    "two-model-volumes": {"model": {"volume": {"hostPath": {"path": "/data/models"}}}},
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_schema_rejects_bad_values(case, chart):
    helm = _helm()
    merged = chart_values(BAD_VALUES[case])
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(merged)), case
    with pytest.raises(helm.HelmValuesError):
        chart.render(BAD_VALUES[case], name="tts", namespace=NAMESPACE)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"gateway": {"terminationGracePeriodSeconds": 340}}, "must exceed"),
        ({"global": {"maxStreamSeconds": 600}}, "must exceed"),
        ({"talker": {"resources": {"requests": {GPU: 2}}}}, "must equal the limit"),
        ({"gateway": {"settings": {"maxNewFramesLimit": 8192}}}, "shorter than"),
    ],
)
def test_chart_refuses_inconsistent_values(chart, values, message):
    helm = _helm()
    with pytest.raises(helm.HelmRenderError, match=message):
        chart.render(values, name="tts", namespace=NAMESPACE)


def test_chart_lints_without_warnings():
    helm = _helm()
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    # Severity 1 is INFO (e.g. "icon is recommended"); 2 and up are warnings and errors.
    assert [m for m in report["messages"] if m["severity"] > 1] == []


# ---------------------------------------------------------------- what every stage must have


def test_every_stage_has_probes_resources_grace_prestop_and_a_pdb(request, stack):
    values = chart_values() if "helm" in request.node.callspec.id else None
    limit = max_stream_seconds(stack, values)
    loads = workloads(stack)
    assert set(loads) == set(STAGES)
    assert loads["code2wav"]["kind"] == "StatefulSet"
    pdbs = of_kind(stack, "PodDisruptionBudget")
    for name, wl in loads.items():
        pod = wl["spec"]["template"]["spec"]
        c = container(wl)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, f"{name}: no {probe}"
        # Weight loading: the startup probe allows at least five minutes.
        sp = c["startupProbe"]
        assert sp["periodSeconds"] * sp["failureThreshold"] >= 300, name
        res = c["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"]), name
        if name in GPU_STAGES:
            assert int(res["requests"][GPU]) == int(res["limits"][GPU]) >= 1, name
            assert any(t.get("key") == GPU for t in pod.get("tolerations", [])), name
        else:
            assert GPU not in res["limits"] and GPU not in res["requests"], name
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] > limit + sleep, name
        args = flags(expanded_args(stack, c))
        assert int(float(args["--drain-seconds"])) >= limit, f"{name}: drains shorter than a stream"
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        labels = wl["spec"]["template"]["metadata"]["labels"]
        assert [p for p in pdbs if selects(p["spec"]["selector"]["matchLabels"], labels)], f"{name}: no PDB"
        ann = wl["spec"]["template"]["metadata"]["annotations"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == ports["metrics"]
        assert int(args["--metrics-port"]) == ports["metrics"], name


def test_stages_run_their_service_with_its_flags(stack):
    for name, wl in workloads(stack).items():
        c = container(wl)
        args = expanded_args(stack, c)
        assert args[0] == SERVICE_MODULE[name], f"{name}: starts {args[0]}"
        given = flags(args)
        assert REQUIRED_FLAGS[name] <= set(given), f"{name}: missing {REQUIRED_FLAGS[name] - set(given)}"
        # The services bind 127.0.0.1 by default, which neither the kubelet's probes nor other pods reach.
        assert given["--host"] == "0.0.0.0", name
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        grpc_flag = "--grpc-port" if name == "gateway" else "--port"
        assert int(given[grpc_flag]) == ports["grpc"], name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "grpc" in c[probe]:
                assert c[probe]["grpc"]["port"] == ports["grpc"], f"{name}.{probe}"
                assert "service" in c[probe]["grpc"]
            elif "httpGet" in c[probe]:
                assert c[probe]["httpGet"]["port"] in ("http", ports.get("http")), f"{name}.{probe}"
    gw = container(workloads(stack)["gateway"])
    assert gw["readinessProbe"]["httpGet"]["path"] == "/health"
    assert (
        flags(expanded_args(stack, container(workloads(stack)["code2wav"])))["--replica-name"] == "<POD_NAME>"
    )


def mount_secrets(wl: dict, root: Path) -> dict[str, str]:
    """Stand-ins under `root` for the Secrets a workload mounts (a test CA's certificates for a
    whole Secret, a line of text for each item); {mount path: stand-in folder}."""
    from tests.tls_certs import TestCA

    volumes = {v["name"]: v for v in wl["spec"]["template"]["spec"]["volumes"]}
    moved = {}
    for m in container(wl).get("volumeMounts", []):
        secret = volumes[m["name"]].get("secret")
        if secret is None:
            continue
        folder = root / m["name"]
        if secret.get("items"):
            folder.mkdir(parents=True)
            for item in secret["items"]:
                (folder / item["path"]).write_text("stand-in-secret\n")
        else:
            files = TestCA(folder / "ca").issue("pod")
            folder.mkdir(exist_ok=True)
            for src, dst in ((files.cert, "tls.crt"), (files.key, "tls.key"), (files.ca, "ca.crt")):
                shutil.copy(src, folder / dst)
        moved[m["mountPath"]] = str(folder)
    return moved


def test_each_service_accepts_its_rendered_arguments(stack, tmp_path):
    """The arguments go through the service's own parser and validation, as at container start
    (with the Secrets it mounts)."""
    runtime_values = {"<POD_NAME>": "code2wav-0", "<REDIS_URL>": "redis://redis:6379/0"}
    for name, wl in workloads(stack).items():
        args = expanded_args(stack, container(wl))
        runtime = {**runtime_values, **mount_secrets(wl, tmp_path / name)}
        for placeholder, value in runtime.items():
            args = [a.replace(placeholder, value) for a in args]
        config_module = importlib.import_module(f"services.{SERVICE_MODULE[name]}.config")
        config = config_module.config_from_args(args[1:])
        assert config.host == "0.0.0.0", name
        if name == "talker":
            assert len(config.code2wav) == workloads(stack)["code2wav"]["spec"]["replicas"]


def test_services_expose_the_right_ports_and_select_their_stage(stack):
    loads = workloads(stack)
    services = of_kind(stack, "Service")
    for name, expected in SERVICE_PORTS.items():
        labels = loads[name]["spec"]["template"]["metadata"]["labels"]
        mine = [s for s in services if selects(s["spec"]["selector"], labels)]
        assert mine, f"{name}: no Service"
        ports = {p["name"]: p["containerPort"] for p in container(loads[name])["ports"]}
        for svc in mine:
            by_name = {p["name"]: p for p in svc["spec"]["ports"]}
            assert {k: v["port"] for k, v in by_name.items()} == expected, svc["metadata"]["name"]
            for p in by_name.values():
                assert p["targetPort"] in ports and ports[p["targetPort"]] == p["port"]
            # A Service must not also pick up another stage's pods.
            for other, wl in loads.items():
                if other != name:
                    assert not selects(svc["spec"]["selector"], wl["spec"]["template"]["metadata"]["labels"])


def test_speaker_cache_reads_the_redis_url_from_a_secret(stack):
    c = container(workloads(stack)["speaker-cache"])
    assert flags(c["args"])["--redis-url"] == "$(REDIS_URL)"
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "REDIS_URL"]
    secret = [s for s in of_kind(stack, "Secret") if s["metadata"]["name"] == ref["name"]]
    assert secret and ref["key"] in (secret[0].get("stringData") or secret[0].get("data"))
    assert [d for d in of_kind(stack, "StatefulSet") if component(d) == "redis"]


def test_gpu_stages_mount_the_model_snapshot_read_only(stack):
    for name in GPU_STAGES:
        wl = workloads(stack)[name]
        c = container(wl)
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
        assert mount["readOnly"] is True
        (vol,) = [v for v in wl["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
        assert vol.get("persistentVolumeClaim", {}).get("readOnly") is True or "hostPath" in vol
        model = flags(expanded_args(stack, c))["--model"]
        assert (
            model.startswith(mount["mountPath"].rstrip("/") + "/")
            and len(model) > len(mount["mountPath"]) + 1
        )


# ---------------------------------------------------------------- code2wav addressing


def code2wav_addresses(docs: list[dict]) -> list[str]:
    return flags(expanded_args(docs, container(workloads(docs)["talker"])))["--code2wav"].split(",")


def check_talker_addresses_every_replica(docs: list[dict], namespace: str | None) -> None:
    sts = workloads(docs)["code2wav"]
    headless = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"
    port = {p["name"]: p["containerPort"] for p in container(sts)["ports"]}["grpc"]
    addrs = code2wav_addresses(docs)
    assert len(addrs) == sts["spec"]["replicas"]
    for i, addr in enumerate(addrs):
        host, _, addr_port = addr.rpartition(":")
        assert int(addr_port) == port
        labels = host.split(".")
        assert labels[:2] == [f"{sts['metadata']['name']}-{i}", sts["spec"]["serviceName"]], addr
        if namespace is not None and len(labels) > 2:
            assert labels[2] == namespace and labels[3] == "svc", addr


@pytest.mark.parametrize("replicas", [1, 2, 5])
def test_helm_talker_addresses_every_code2wav_replica(chart, replicas):
    docs = render_chart(chart, {"code2wav": {"replicaCount": replicas}})
    check_talker_addresses_every_replica(docs, NAMESPACE)


def test_kustomize_talker_addresses_every_code2wav_replica(kustomize_docs):
    check_talker_addresses_every_replica(kustomize_docs, None)
    namespaces = {d["metadata"].get("namespace") for d in kustomize_docs if d["kind"] != "Namespace"}
    assert namespaces == {"qwen3-tts"}


def test_scaling_code2wav_rolls_the_talker_only(chart):
    two = workloads(render_chart(chart, {"code2wav": {"replicaCount": 2}}))
    three = workloads(render_chart(chart, {"code2wav": {"replicaCount": 3}}))
    assert two["talker"]["spec"]["template"] != three["talker"]["spec"]["template"]
    for name in ("gateway", "speaker-cache", "code2wav"):
        assert two[name]["spec"]["template"] == three[name]["spec"]["template"], name


def test_kustomize_replica_list_is_read_by_the_talker_only(kustomize_docs):
    cms = {cm["metadata"]["name"]: cm for cm in of_kind(kustomize_docs, "ConfigMap")}
    (replica_cm,) = [n for n, cm in cms.items() if "CODE2WAV_ADDRS" in cm.get("data", {})]
    readers = [
        name
        for name, wl in workloads(kustomize_docs).items()
        if any(s["configMapRef"]["name"] == replica_cm for s in container(wl).get("envFrom", []))
    ]
    assert readers == ["talker"]


def test_helm_other_values_take_effect(chart):
    docs = render_chart(chart, OTHER_VALUES)
    loads = workloads(docs)
    assert not [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and component(d) == "redis"]
    (ref,) = [
        e["valueFrom"]["secretKeyRef"]
        for e in container(loads["speaker-cache"])["env"]
        if e["name"] == "REDIS_URL"
    ]
    assert ref == {"name": "managed-redis", "key": "url"}
    hpas = {h["spec"]["scaleTargetRef"]["name"] for h in of_kind(docs, "HorizontalPodAutoscaler")}
    assert hpas == {loads["gateway"]["metadata"]["name"], loads["talker"]["metadata"]["name"]}
    assert "replicas" not in loads["gateway"]["spec"] and "replicas" not in loads["talker"]["spec"]
    assert "--load-format=dummy" in container(loads["code2wav"])["args"]
    (vol,) = [v for v in loads["talker"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    assert vol["hostPath"]["path"] == "/data/models"
    assert len(code2wav_addresses(docs)) == 4


# ---------------------------------------------------------------- image


def test_entrypoint_runs_the_named_service_module(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake_python.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["sh", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=10
        )

    ok = run("talker", "--port=50052", "--model=/models/a b")
    assert ok.returncode == 0 and ok.stdout.splitlines() == [
        "-m",
        "services.talker",
        "--port=50052",
        "--model=/models/a b",
    ]
    assert run("speaker-cache").stdout.splitlines() == ["-m", "services.speaker_cache"]
    for bad in (["nope"], ["../gateway"], []):
        res = run(*bad)
        assert res.returncode == 64 and res.stdout == "", bad


def test_talker_service_is_headless_so_the_gateway_spreads_streams(helm_default_docs, kustomize_docs):
    """The gateway round-robins Generate calls over the addresses it resolves: the talker Service
    must be headless (one address per pod) and the gateway must use the dns resolver."""
    for docs, expanded in ((helm_default_docs, {}), (kustomize_docs, _kustomize_env(kustomize_docs))):
        services = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("talker")]
        assert len(services) == 1 and services[0]["spec"].get("clusterIP") == "None"
        gateway = next(
            d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("gateway")
        )
        args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
        talker = next(a.split("=", 1)[1] for a in args if a.startswith("--talker="))
        talker = expanded.get(talker.strip("$()"), talker)
        assert talker.startswith("dns:///") and talker.endswith(":50052")


def _kustomize_env(docs: list[dict]) -> dict[str, str]:
    """Values of the ConfigMaps the kustomize manifests read their `$(VAR)` arguments from."""
    env: dict[str, str] = {}
    for d in docs:
        if d["kind"] == "ConfigMap":
            env.update(d.get("data") or {})
    return env
