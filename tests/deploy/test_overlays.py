"""The dev and prod overlays (kustomize) and values files (chart), disruption budgets, and the
in-cluster Redis: a StatefulSet on a PVC whose eviction policy drops cached prompts, never a named
voice, and refuses a voice it has no room for (checked against a real redis-server)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import numpy as np
import pytest
import yaml
from test_manifests import (
    GPU,
    OVERLAYS,
    STACKS,
    chart,  # noqa: F401 - the module-scoped fixture
    check_talker_addresses_every_replica,
    component,
    container,
    of_kind,
    selects,
    stack_docs,
    workloads,
)

from qtts.request.errors import ResourceExhausted
from services.launcher import free_port
from services.speaker_cache.records import PromptRecord, VoiceRecord
from services.speaker_cache.redis_store import RedisStore

GPU_STAGES = ("talker", "code2wav")
POOL_KEY = "qwen3-tts.io/gpu-pool"


def pdb_of(docs: list[dict], wl: dict) -> dict:
    labels = wl["spec"]["template"]["metadata"]["labels"]
    (pdb,) = [
        p
        for p in of_kind(docs, "PodDisruptionBudget")
        if selects(p["spec"]["selector"]["matchLabels"], labels)
    ]
    return pdb["spec"]


def fewest_replicas(docs: list[dict], wl: dict) -> int:
    hpas = [
        h
        for h in of_kind(docs, "HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == wl["metadata"]["name"]
    ]
    return hpas[0]["spec"]["minReplicas"] if hpas else wl["spec"]["replicas"]


@pytest.mark.parametrize("source", STACKS)
def test_gpu_stage_budgets_never_evict_the_last_pod(source, chart):  # noqa: F811
    docs = stack_docs(source, chart)
    loads = workloads(docs)
    for name in GPU_STAGES:
        spec = pdb_of(docs, loads[name])
        if "minAvailable" in spec:
            assert int(spec["minAvailable"]) >= 1, (source, name)
        else:
            # maxUnavailable 1 keeps one pod only where there are at least two.
            assert spec["maxUnavailable"] == 1 and fewest_replicas(docs, loads[name]) >= 2, (source, name)


@pytest.mark.parametrize("source", ["helm", "kustomize"])
def test_the_single_default_talker_is_never_evicted(source, chart):  # noqa: F811
    docs = stack_docs(source, chart)
    talker = workloads(docs)["talker"]
    assert talker["spec"]["replicas"] == 1 and pdb_of(docs, talker) == {
        "minAvailable": 1,
        "selector": pdb_of(docs, talker)["selector"],
    }


@pytest.mark.parametrize("source", ["helm-dev", "kustomize-dev"])
def test_dev_runs_one_pod_per_stage_with_talker_and_code2wav_on_one_node(source, chart):  # noqa: F811
    docs = stack_docs(source, chart)
    loads = workloads(docs)
    assert {name: wl["spec"]["replicas"] for name, wl in loads.items()} == dict.fromkeys(loads, 1)
    code2wav = loads["code2wav"]["spec"]["template"]["spec"]
    (term,) = code2wav["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(
        term["labelSelector"]["matchLabels"], loads["talker"]["spec"]["template"]["metadata"]["labels"]
    )
    for name in GPU_STAGES:
        assert int(container(loads[name])["resources"]["limits"][GPU]) == 1
        assert pdb_of(docs, loads[name])["minAvailable"] == 1
    check_talker_addresses_every_replica(docs, None)


@pytest.mark.parametrize(
    ("file", "kind"), [("gpu-time-slicing.yaml", "timeSlicing"), ("gpu-mps-sharing.yaml", "mps")]
)
def test_dev_gpu_sharing_configs_advertise_the_gpu_twice(file, kind):
    (cm,) = yaml.safe_load_all((OVERLAYS["dev"] / file).read_text())
    config = yaml.safe_load(cm["data"]["any"])
    assert set(config["sharing"]) == {kind}
    (resource,) = config["sharing"][kind]["resources"]
    assert resource["name"] == GPU and resource["replicas"] >= len(GPU_STAGES)
    # The command in the file's header points the operator at this ConfigMap.
    assert f'"name": "{cm["metadata"]["name"]}"' in (OVERLAYS["dev"] / file).read_text()


@pytest.mark.parametrize("source", ["helm-prod", "kustomize-prod"])
def test_prod_puts_the_gpu_stages_on_separate_pools_and_spreads_every_stage(source, chart):  # noqa: F811
    docs = stack_docs(source, chart)
    loads = workloads(docs)
    pools = {}
    for name in GPU_STAGES:
        pod = loads[name]["spec"]["template"]["spec"]
        pools[name] = pod["nodeSelector"][POOL_KEY]
        tolerated = {(t["key"], t.get("value")) for t in pod["tolerations"]}
        assert {(GPU, None), (POOL_KEY, pools[name])} <= tolerated, name
    assert pools["talker"] != pools["code2wav"]
    for name, wl in loads.items():
        pod = wl["spec"]["template"]["spec"]
        labels = wl["spec"]["template"]["metadata"]["labels"]
        spread = {c["topologyKey"]: c for c in pod["topologySpreadConstraints"]}
        assert {"topology.kubernetes.io/zone", "kubernetes.io/hostname"} <= set(spread), name
        for c in spread.values():
            assert c["maxSkew"] == 1 and selects(c["labelSelector"]["matchLabels"], labels), name
            # Only this stage's pods count.
            for other, owl in loads.items():
                if other != name:
                    assert not selects(
                        c["labelSelector"]["matchLabels"], owl["spec"]["template"]["metadata"]["labels"]
                    )
        assert fewest_replicas(docs, wl) >= 2, name
        assert pdb_of(docs, wl) == {"maxUnavailable": 1, "selector": pdb_of(docs, wl)["selector"]}, name
    check_talker_addresses_every_replica(docs, None)


@pytest.mark.parametrize("source", STACKS)
def test_redis_is_a_statefulset_on_a_claim_with_aof_and_volatile_lru(source, chart):  # noqa: F811
    docs = stack_docs(source, chart)
    (redis,) = [d for d in of_kind(docs, "StatefulSet") if component(d) == "redis"]
    assert redis["spec"]["replicas"] == 1
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    (mount,) = container(redis)["volumeMounts"]
    assert claim["metadata"]["name"] == mount["name"] and mount["mountPath"] == "/data"
    assert (
        claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        and claim["spec"]["resources"]["requests"]["storage"]
    )
    args = container(redis)["args"]
    opts = dict(zip(args[::2], args[1::2], strict=True))
    assert opts["--appendonly"] == "yes" and opts["--maxmemory-policy"] == "volatile-lru"
    assert container(redis)["image"].startswith("valkey/valkey:")
    assert "valkey-cli" in container(redis)["readinessProbe"]["exec"]["command"]


# ---------------------------------------------------------------- the eviction policy, for real


@pytest.fixture
def small_redis(tmp_path, chart):  # noqa: F811
    """A redis-server with the deployed eviction policy and 4 MB of memory."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it: .ci/system-deps)")
    (redis,) = [d for d in of_kind(stack_docs("kustomize", chart), "StatefulSet") if component(d) == "redis"]
    args = container(redis)["args"]
    policy = args[args.index("--maxmemory-policy") + 1]
    port = free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
            "--maxmemory",
            "4mb",
            "--maxmemory-policy",
            policy,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis as redis_lib

    client = redis_lib.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    try:
        for _ in range(200):
            try:
                if client.ping():
                    break
            except redis_lib.exceptions.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not answer PING")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def _prompt(i: int) -> PromptRecord:
    codes = np.full((3000, 16), i % 2048, dtype="<i2").tobytes()  # ~96 KB
    return PromptRecord("m", b"\0" * 32, 8, codes, 3000, 16, "hi")


def _voice(i: int) -> VoiceRecord:
    pcm = np.full(50_000, i, dtype="<f4").tobytes()  # 200 KB
    return VoiceRecord(name=f"v{i}", reference_pcm_f32=pcm, sample_rate_hz=24000, reference_text="hi")


async def test_full_redis_drops_prompts_keeps_every_voice_and_refuses_one_more(small_redis):
    store = RedisStore(small_redis, prompt_ttl_s=3600)
    try:
        for i in range(60):  # ~6 MB of prompts into 4 MB: the oldest are evicted, no write fails
            await store.put_prompt(f"p{i}", _prompt(i))
        kept = [i for i in range(60) if await store.get_prompt(f"p{i}") is not None]
        assert 59 in kept and len(kept) < 60  # approximate LRU: some of the older ones are gone
        created = []
        with pytest.raises(ResourceExhausted, match="voice store is full"):
            for i in range(40):  # 8 MB of voices: prompts make room until only voices are left
                await store.create_voice(_voice(i), overwrite=False)
                created.append(f"v{i}")
        assert len(created) >= 8
        assert sorted(v.name for v in await store.list_voices()) == sorted(created)
        for name in created:
            assert (await store.get_voice(name)).name == name
        # Refused only once no prompt was left to evict.
        assert [i for i in range(60) if await store.get_prompt(f"p{i}") is not None] == []
        # The refused voice left no half-written record behind.
        assert await store.count_voices() == len(created)
    finally:
        await store.close()
        await asyncio.sleep(0)
