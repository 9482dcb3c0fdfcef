"""Secure by default in the kustomize tree, as in the chart: the base requires one Secret,
`qwen3-tts-auth`, that it never ships (kustomize cannot make random values, and a generated
password in the repository is no password), and `deploy/k8s/make-secret.sh` prints it with fresh
random credentials. From it the gateway reads its API keys (a file), every stage the internal
token (an env var the service reads), Valkey its password and speaker_cache the same password (a
file). Without the Secret no pod starts: nothing runs open."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_manifests import (
    KUBE_VERSIONS,
    KUSTOMIZE_DIR,
    OVERLAYS,
    SERVICE_MODULE,
    component,
    container,
    expanded_args,
    flags,
    kustomize,
    of_kind,
)

SECRET = "qwen3-tts-auth"
MAKE_SECRET = KUSTOMIZE_DIR / "make-secret.sh"
RENDERINGS = {"base": KUSTOMIZE_DIR, **{f"overlay-{name}": path for name, path in OVERLAYS.items()}}
STAGE_MODULES = {**SERVICE_MODULE, "aligner": "aligner"}


@pytest.fixture(scope="module")
def with_aligner(tmp_path_factory) -> list[dict]:
    """The base with the aligner component, as an overlay adds it."""
    root = tmp_path_factory.mktemp("kustomize-aligner")
    shutil.copytree(KUSTOMIZE_DIR, root / "k8s")
    (root / "with-aligner").mkdir()
    (root / "with-aligner" / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../k8s/base\ncomponents:\n  - ../k8s/components/aligner\n"
    )
    return kustomize(root / "with-aligner")


@pytest.fixture(scope="module", params=[*RENDERINGS, "with-aligner"])
def rendered(request, with_aligner) -> list[dict]:
    return with_aligner if request.param == "with-aligner" else kustomize(RENDERINGS[request.param])


def _pods(docs: list[dict]) -> dict[str, dict]:
    return {component(d): d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def _from_secret(c: dict, var: str) -> dict:
    (entry,) = [e for e in c.get("env", []) if e["name"] == var]
    ref = entry["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional"), f"{var}: an optional Secret would let the pod start without it"
    return {"name": ref["name"], "key": ref["key"]}


def _file_from_secret(workload: dict, path: str) -> dict:
    """The Secret and key mounted at the file `path` of the workload's container."""
    c = container(workload)
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    assert not secret.get("optional")
    (item,) = [i for i in secret["items"] if f"{mount['mountPath']}/{i['path']}" == path]
    return {"name": secret["secretName"], "key": item["key"]}


def _referenced_keys(docs: list[dict]) -> set[str]:
    """Every key of qwen3-tts-auth that a workload reads, as an env var or a file."""
    keys = set()
    for wl in _pods(docs).values():
        spec = wl["spec"]["template"]["spec"]
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] == SECRET:
                    keys.add(ref["key"])
        for v in spec.get("volumes", []):
            if v.get("secret", {}).get("secretName") == SECRET:
                keys |= {i["key"] for i in v["secret"]["items"]}
    return keys


def make_secret(*args: str) -> dict:
    out = subprocess.run(
        ["sh", str(MAKE_SECRET), *args], capture_output=True, text=True, timeout=30, check=True
    )
    (doc,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    return doc


def test_every_stage_requires_the_internal_token_from_the_secret(rendered):
    pods = _pods(rendered)
    stages = [name for name in pods if name != "redis"]
    assert {"gateway", "talker", "code2wav", "speaker-cache"} <= set(stages)
    for name in stages:
        var = f"TTS_{STAGE_MODULES[name].upper()}_INTERNAL_TOKEN"
        assert _from_secret(container(pods[name]), var) == {"name": SECRET, "key": "internal-token"}, name


def test_the_gateway_requires_api_keys_from_the_secret(rendered):
    gateway = _pods(rendered)["gateway"]
    path = flags(expanded_args(rendered, container(gateway)))["--api-keys-file"]
    assert _file_from_secret(gateway, path) == {"name": SECRET, "key": "api-keys"}


def test_valkey_requires_the_password_that_speaker_cache_sends(rendered):
    pods = _pods(rendered)
    redis = container(pods["redis"])
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert _from_secret(redis, "REDIS_PASSWORD") == {"name": SECRET, "key": "redis-password"}
    env = {e["name"]: e.get("value") for e in redis["env"]}
    assert env["REDISCLI_AUTH"] == env["VALKEYCLI_AUTH"] == "$(REDIS_PASSWORD)"  # the readiness probe's CLI
    speaker_cache = pods["speaker-cache"]
    path = flags(expanded_args(rendered, container(speaker_cache)))["--redis-password-file"]
    assert _file_from_secret(speaker_cache, path) == {"name": SECRET, "key": "redis-password"}


def test_the_rendering_ships_no_credentials(rendered):
    assert not [s for s in of_kind(rendered, "Secret") if s["metadata"]["name"] == SECRET]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_make_secret_prints_the_secret_the_manifests_read(rendered, kube_version):
    doc = make_secret()
    kubernetes_validate.validate(doc, kube_version, strict=True)
    namespace = yaml.safe_load((KUSTOMIZE_DIR / "base" / "kustomization.yaml").read_text())["namespace"]
    assert (doc["metadata"]["name"], doc["metadata"]["namespace"]) == (SECRET, namespace)
    assert set(doc["stringData"]) == _referenced_keys(rendered)


def test_make_secret_draws_fresh_long_random_values_and_takes_a_namespace():
    first, second = make_secret(), make_secret("voice")
    assert second["metadata"]["namespace"] == "voice"
    data = first["stringData"]
    assert data["api-keys"].startswith("tts-") and len(data["api-keys"]) == 44
    assert len(data["internal-token"]) == 48 and data["internal-token"].isalnum()
    assert len(data["redis-password"]) == 32 and data["redis-password"].isalnum()
    assert not set(data.values()) & set(second["stringData"].values())


def test_make_secret_is_named_in_the_deploy_readme():
    readme = (Path(__file__).resolve().parents[2] / "deploy" / "README.md").read_text()
    assert "deploy/k8s/make-secret.sh | kubectl create -f -" in readme
