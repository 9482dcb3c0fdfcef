"""Transport security in the manifests: NetworkPolicies that let through exactly the calls the
services are configured to make (read from their rendered flags), TLS mounted from a Secret into
every stage with probes that use it, and the credentials (API keys, internal token, Redis
password) taken from Secrets."""

from __future__ import annotations

import base64
import importlib
from urllib.parse import urlsplit

import pytest
from test_manifests import (
    NAMESPACE,
    OTHER_VALUES,
    SERVICE_MODULE,
    STAGES,
    _helm,
    chart,  # noqa: F401 - the module-scoped fixture
    component,
    container,
    expanded_args,
    flags,
    mount_secrets,
    of_kind,
    render_chart,
    selects,
    stack,  # noqa: F401 - the parametrized fixture (every rendering of the stack)
    workloads,
)

from qtts.serving import probe as qtts_probe

PODS = (*STAGES, "redis")
OUTSIDE = "outside"  # a client in another namespace or outside the cluster
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


def pods(docs: list[dict]) -> dict[str, dict[str, str]]:
    """Pod labels of every stage and Redis, by component."""
    found = {component(d): d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    return {name: found[name]["spec"]["template"]["metadata"]["labels"] for name in PODS if name in found}


def _peer_admits(peer: dict, src: str, labels: dict[str, str]) -> bool:
    if "podSelector" in peer and "namespaceSelector" not in peer:  # a pod of the same namespace
        return src != OUTSIDE and selects(peer["podSelector"].get("matchLabels", {}), labels)
    return False  # namespaceSelector / ipBlock peers: monitoring or what the values name, not a stage


def allowed(docs: list[dict]) -> set[tuple[str, str, int]]:
    """(source, destination, port) the NetworkPolicies let through, for every stage, Redis and a
    client from outside; ports of a rule that names peers other than pods count for OUTSIDE only
    when the rule names no peers at all (anyone)."""
    labels = pods(docs)
    policies = of_kind(docs, "NetworkPolicy")
    out = set()
    for dst, dst_labels in labels.items():
        mine = [p for p in policies if selects(p["spec"]["podSelector"].get("matchLabels", {}), dst_labels)]
        assert mine, f"no NetworkPolicy selects {dst}"
        for policy in mine:
            for rule in policy["spec"].get("ingress", []):
                ports = [p["port"] for p in rule.get("ports", [])]
                assert ports, f"{policy['metadata']['name']}: a rule without ports opens every port"
                for src in (*labels, OUTSIDE):
                    peers = rule.get("from")
                    if peers is None or any(_peer_admits(peer, src, labels.get(src, {})) for peer in peers):
                        out |= {(src, dst, port) for port in ports}
    return out


def _component_of_host(docs: list[dict], host: str) -> str:
    """The stage a configured address's host reaches: <service>[.ns...] or <pod>.<headless service>."""
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    first, _, rest = host.partition(".")
    name = first if first in services else rest.partition(".")[0]
    selector = services[name]["spec"]["selector"]
    (found,) = [c for c, lab in pods(docs).items() if selects(selector, lab)]
    return found


def _redis_url(docs: list[dict], c: dict) -> str:
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "REDIS_URL"]
    (secret,) = [s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == ref["name"]]
    if ref["key"] in secret.get("stringData", {}):
        return secret["stringData"][ref["key"]]
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def calls(docs: list[dict]) -> set[tuple[str, str, int]]:
    """(caller, callee, port) of every address the services are started with."""
    loads = workloads(docs)
    out = set()
    for caller, flag_names in (
        ("gateway", ("--talker", "--speaker-cache")),
        ("talker", ("--code2wav", "--speaker-cache")),
    ):
        given = flags(expanded_args(docs, container(loads[caller])))
        for flag in flag_names:
            for address in given[flag].removeprefix("dns:///").split(","):
                host, _, port = address.rpartition(":")
                out.add((caller, _component_of_host(docs, host), int(port)))
    if "redis" in pods(docs):
        url = urlsplit(_redis_url(docs, container(loads["speaker-cache"])))
        out.add(("speaker-cache", _component_of_host(docs, url.hostname), url.port))
    return out


def metrics_ports(docs: list[dict]) -> dict[str, int]:
    loads = workloads(docs)
    return {
        n: {p["name"]: p["containerPort"] for p in container(w)["ports"]}["metrics"] for n, w in loads.items()
    }


# ---------------------------------------------------------------- NetworkPolicies


def test_a_default_deny_policy_covers_every_pod(stack):  # noqa: F811
    policies = of_kind(stack, "NetworkPolicy")
    deny = [p for p in policies if not p["spec"].get("ingress") and p["spec"]["policyTypes"] == ["Ingress"]]
    assert len(deny) == 1
    for name, labels in pods(stack).items():
        assert selects(deny[0]["spec"]["podSelector"]["matchLabels"], labels), name


def test_policies_allow_exactly_the_calls_the_services_make(stack):  # noqa: F811
    opened = allowed(stack)
    public = {(d, p) for s, d, p in opened if s == OUTSIDE}
    # What only some pods of the stack may reach (the public ports take every pod as well).
    internal = {(s, d, p) for s, d, p in opened if s not in (OUTSIDE, d) and (d, p) not in public}
    made = calls(stack)
    assert made >= {
        ("gateway", "talker", 50052),
        ("gateway", "speaker-cache", 50054),
        ("talker", "code2wav", 50053),
        ("talker", "speaker-cache", 50054),
        ("speaker-cache", "redis", 6379),
    }
    assert internal == made
    # From outside: the gateway's HTTP and gRPC ports, nothing else.
    assert public == {("gateway", 8000), ("gateway", 50051)}
    # Every metrics port takes the monitoring namespace, and only it.
    policies = of_kind(stack, "NetworkPolicy")
    for name, port in metrics_ports(stack).items():
        rules = [
            r
            for p in policies
            if selects(p["spec"]["podSelector"].get("matchLabels", {}), pods(stack)[name])
            for r in p["spec"].get("ingress", [])
            if port in [q["port"] for q in r["ports"]]
        ]
        assert [r["from"] for r in rules] == [[{"namespaceSelector": {"matchLabels": MONITORING}}]], name


DNS = "dns"  # the cluster DNS (kube-dns in kube-system)
ANYWHERE = "anywhere"


def egress_allowed(docs: list[dict]) -> set[tuple[str, str, int]]:
    """(source, destination, port) the egress policies let out of every stage and Redis: a stage
    or Redis, DNS, or ANYWHERE for a rule that names no peer."""
    labels = pods(docs)
    policies = [p for p in of_kind(docs, "NetworkPolicy") if "Egress" in p["spec"]["policyTypes"]]
    out = set()
    for src, src_labels in labels.items():
        mine = [p for p in policies if selects(p["spec"]["podSelector"].get("matchLabels", {}), src_labels)]
        assert mine, f"no egress policy selects {src}"
        for policy in mine:
            for rule in policy["spec"].get("egress", []):
                ports = [p["port"] for p in rule.get("ports", [])]
                assert ports, f"{policy['metadata']['name']}: an egress rule without ports opens every port"
                for peer in rule.get("to") or [None]:
                    if peer is None:
                        out |= {(src, ANYWHERE, port) for port in ports}
                    elif "namespaceSelector" in peer:
                        assert peer["namespaceSelector"]["matchLabels"] == {
                            "kubernetes.io/metadata.name": "kube-system"
                        }
                        assert peer["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
                        out |= {(src, DNS, port) for port in ports}
                    else:
                        for dst, dst_labels in labels.items():
                            if selects(peer["podSelector"].get("matchLabels", {}), dst_labels):
                                out |= {(src, dst, port) for port in ports}
    return out


def test_egress_lets_out_only_dns_and_the_calls_the_services_make(stack):  # noqa: F811
    out = egress_allowed(stack)
    assert {(s, d, p) for s, d, p in out if d not in (DNS, ANYWHERE)} == calls(stack)
    assert not [o for o in out if o[1] == ANYWHERE]
    for name in pods(stack):
        assert {(name, DNS, 53)} <= out, name


def test_network_policy_values_narrow_or_turn_them_off(chart):  # noqa: F811
    docs = render_chart(chart, OTHER_VALUES)
    opened = allowed(docs)
    # gatewayFrom names the ingress namespace: nothing is open to any client any more...
    assert not [o for o in opened if o[0] == OUTSIDE]
    (gateway_policy,) = [
        p for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-gateway")
    ]
    assert gateway_policy["spec"]["ingress"][0]["from"] == OTHER_VALUES["networkPolicy"]["gatewayFrom"]
    # ...metricsFrom [] closes the metrics ports, and an external Redis needs no policy.
    assert not {(d, p) for _, d, p in opened} & set(metrics_ports(docs).items())
    assert "redis" not in {d for _, d, _ in opened}
    assert not of_kind(render_chart(chart, {"networkPolicy": {"enabled": False}}), "NetworkPolicy")
    # An external Redis is reached on its usual ports, wherever it is; egress: false, no egress.
    assert {("speaker-cache", ANYWHERE, 6379), ("speaker-cache", ANYWHERE, 6380)} <= egress_allowed(docs)
    no_egress = render_chart(chart, {"networkPolicy": {"egress": False}})
    assert not [p for p in of_kind(no_egress, "NetworkPolicy") if "Egress" in p["spec"]["policyTypes"]]


# ---------------------------------------------------------------- TLS between the services


TLS_VALUES = {"tls": {"enabled": True, "secretName": "qwen3-tts-tls"}}


def _volume(wl: dict, name: str) -> dict:
    (vol,) = [v for v in wl["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return vol


def _mount(wl: dict, name: str) -> str:
    (m,) = [m for m in container(wl)["volumeMounts"] if m["name"] == name]
    assert m["readOnly"] is True
    return m["mountPath"]


@pytest.mark.parametrize("mtls", [True, False])
def test_tls_reaches_every_stage_and_its_probes(chart, mtls, tmp_path):  # noqa: F811
    values = {"tls": {**TLS_VALUES["tls"], "mtls": mtls}}
    docs = render_chart(chart, values)
    for name, wl in workloads(docs).items():
        c = container(wl)
        vol = _volume(wl, "tls")
        assert vol["secret"]["secretName"] == "qwen3-tts-tls" and vol["secret"]["defaultMode"] == 0o440
        tls_dir = _mount(wl, "tls")
        given = flags(c["args"])
        assert (given["--tls-cert"], given["--tls-key"], given["--tls-ca"]) == (
            f"{tls_dir}/tls.crt",
            f"{tls_dir}/tls.key",
            f"{tls_dir}/ca.crt",
        ), name
        assert ("--tls-client-auth" in given) is (not mtls), name
        # The stages that dial others check their certificates for the one shared name.
        if name in ("gateway", "talker"):
            assert given["--tls-server-name"] == "qwen3-tts-internal", name
        else:
            assert "--tls-server-name" not in given, name
        # The rendered flags pass the service's own validation with the mounted Secret in place.
        moved = mount_secrets(wl, tmp_path / name)
        args = expanded_args(docs, c)[1:]
        runtime = {"<REDIS_URL>": "redis://redis:6379/0", "<POD_NAME>": "code2wav-0", **moved}
        for placeholder, value in runtime.items():
            args = [a.replace(placeholder, value) for a in args]
        config = importlib.import_module(f"services.{SERVICE_MODULE[name]}.config").config_from_args(args)
        assert config.tls.enabled, name
        if name != "gateway":  # the gateway serves no internal port
            assert config.tls.mutual is mtls, name
        # No gRPC probe is left (the kubelet's is plaintext); each runs qtts.serving.probe with the
        # pod's files.
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c[kind]
            assert "grpc" not in p, f"{name}.{kind}"
            if "exec" in p:
                cmd = p["exec"]["command"]
                assert cmd[:3] == ["python", "-m", "qtts.serving.probe"], f"{name}.{kind}"
                assert (
                    "--tls-server-name=qwen3-tts-internal" in cmd and f"--tls-cert={tls_dir}/tls.crt" in cmd
                )
                probe_args = [a.replace(tls_dir, moved[tls_dir]) for a in cmd[3:]]
                # Parses and validates (exit 2 otherwise); nothing listens here, so UNREACHABLE (1).
                assert qtts_probe.main([*probe_args, "--timeout=0.5"]) == 1, f"{name}.{kind}"


def test_tls_without_a_secret_is_refused(chart):  # noqa: F811
    helm = _helm()
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)):
        chart.render({"tls": {"enabled": True}}, name="tts", namespace=NAMESPACE)


def test_plain_defaults_keep_grpc_probes_and_no_tls(stack):  # noqa: F811
    for name, wl in workloads(stack).items():
        c = container(wl)
        assert not [a for a in c["args"] if a.startswith("--tls-")], name
        assert not [v for v in wl["spec"]["template"]["spec"].get("volumes", []) if v["name"] == "tls"], name


# ---------------------------------------------------------------- public TLS and credentials


def test_public_tls_api_keys_and_internal_token_come_from_secrets(chart):  # noqa: F811
    docs = render_chart(chart, OTHER_VALUES)
    loads = workloads(docs)
    gw = loads["gateway"]
    c = container(gw)
    given = flags(c["args"])
    public_dir = _mount(gw, "public-tls")
    assert _volume(gw, "public-tls")["secret"]["secretName"] == "public-tls"
    assert (given["--public-tls-cert"], given["--public-tls-key"]) == (
        f"{public_dir}/tls.crt",
        f"{public_dir}/tls.key",
    )
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert c["startupProbe"]["httpGet"]["scheme"] == "HTTPS"
    keys = _volume(gw, "api-keys")["secret"]
    assert keys["secretName"] == "gateway-api-keys" and keys["items"] == [{"key": "keys", "path": "api-keys"}]
    assert given["--api-keys-file"] == f"{_mount(gw, 'api-keys')}/api-keys"
    for name, wl in loads.items():
        env = {e["name"]: e for e in container(wl)["env"]}
        var = f"TTS_{SERVICE_MODULE[name].upper()}_INTERNAL_TOKEN"
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "internal-token", "key": "token"}, name
    # Given Secrets: the chart generates none.
    assert not [s for s in of_kind(docs, "Secret") if s["metadata"]["name"].endswith("-auth")]
    # Turned off (generate: false, no Secret): none of it.
    off = {"auth": {"apiKeys": {"generate": False}, "internalToken": {"generate": False}}}
    plain = workloads(render_chart(chart, off))
    assert not [
        a for a in container(plain["gateway"])["args"] if a.startswith(("--public-tls", "--api-keys"))
    ]
    for name, wl in plain.items():
        assert not [e for e in container(wl)["env"] if e["name"].endswith("_INTERNAL_TOKEN")], name
    assert not [
        s for s in of_kind(render_chart(chart, off), "Secret") if s["metadata"]["name"].endswith("-auth")
    ]


def test_by_default_the_chart_generates_api_keys_and_the_internal_token(chart):  # noqa: F811
    """Secure by default: with no values the gateway requires an API key and every stage the
    internal token, both generated into one Secret (random, long), none of it open."""
    docs = render_chart(chart)
    (auth,) = [s for s in of_kind(docs, "Secret") if s["metadata"]["name"].endswith("-auth")]
    data = auth["stringData"]
    assert data["api-keys"].startswith("tts-") and len(data["api-keys"]) == 44
    assert len(data["internal-token"]) == 48 and data["internal-token"].isalnum()
    loads = workloads(docs)
    gw = loads["gateway"]
    assert flags(container(gw)["args"])["--api-keys-file"] == f"{_mount(gw, 'api-keys')}/api-keys"
    keys = _volume(gw, "api-keys")["secret"]
    assert keys["secretName"] == auth["metadata"]["name"] and keys["items"] == [
        {"key": "api-keys", "path": "api-keys"}
    ]
    for name, wl in loads.items():
        env = {e["name"]: e for e in container(wl)["env"]}
        var = f"TTS_{SERVICE_MODULE[name].upper()}_INTERNAL_TOKEN"
        ref = env[var]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": auth["metadata"]["name"], "key": "internal-token"}, name


# ---------------------------------------------------------------- the Redis password


def _redis(docs: list[dict]) -> dict | None:
    found = [d for d in docs if d["kind"] == "StatefulSet" and component(d) == "redis"]
    return container(found[0]) if found else None


def _password_file_source(docs: list[dict]) -> tuple[str, str] | None:
    wl = workloads(docs)["speaker-cache"]
    given = flags(container(wl)["args"])
    if "--redis-password-file" not in given:
        return None
    secret = _volume(wl, "redis-password")["secret"]
    (item,) = secret["items"]
    assert given["--redis-password-file"] == f"{_mount(wl, 'redis-password')}/{item['path']}"
    return secret["secretName"], item["key"]


def test_the_charts_valkey_wants_a_password_that_speaker_cache_reads_from_a_file(chart):  # noqa: F811
    docs = render_chart(chart)
    redis = _redis(docs)
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = {e["name"]: e for e in redis["env"]}
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert env["REDISCLI_AUTH"]["value"] == "$(REDIS_PASSWORD)"  # for the readiness probe's CLI
    (secret,) = [s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == ref["name"]]
    password = secret["stringData"][ref["key"]]
    assert len(password) == 32 and password.isalnum()
    assert _password_file_source(docs) == (ref["name"], ref["key"])
    # An existing Secret instead of the generated one.
    docs = render_chart(chart, {"redis": {"auth": {"existingSecret": "voice-store", "secretKey": "pw"}}})
    ref = {e["name"]: e for e in _redis(docs)["env"]}["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "voice-store", "key": "pw"} and _password_file_source(docs) == (
        "voice-store",
        "pw",
    )
    assert "redis-password" not in of_kind(docs, "Secret")[0]["stringData"]
    # Off: no password anywhere.
    docs = render_chart(chart, {"redis": {"auth": {"enabled": False}}})
    assert "--requirepass" not in _redis(docs)["args"] and _password_file_source(docs) is None
    # An external Redis: from its own Secret when given (OTHER_VALUES), else only in its URL.
    assert _password_file_source(render_chart(chart, OTHER_VALUES)) == ("managed-redis", "password")
    external = {"redis": {"enabled": False, "external": {"existingSecret": "managed-redis"}}}
    assert _password_file_source(render_chart(chart, external)) is None
