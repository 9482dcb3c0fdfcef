"""speaker_cache: LRU eviction, the Redis store against a real redis-server, the service over gRPC."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from qtts.pb import speaker_cache_pb2 as pb
from qtts.pb import speaker_cache_pb2_grpc
from qtts.request.errors import AlreadyExists, InvalidArgument, NotFound
from qtts.serving.metrics import SpeakerCacheMetrics
from services.speaker_cache.config import SpeakerCacheConfig, config_from_args
from services.speaker_cache.core import SpeakerCacheCore
from services.speaker_cache.lru_store import LruStore
from services.speaker_cache.records import PromptRecord, VoiceRecord
from services.speaker_cache.redis_store import RedisStore
from services.speaker_cache.server import SERVICE_NAME, SpeakerCacheServer


def _prompt(dim: int = 8, frames: int = 3, seed: int = 0) -> PromptRecord:
    rng = np.random.default_rng(seed)
    return PromptRecord(
        model_id="tiny-base",
        x_vector_f32=rng.standard_normal(dim).astype("<f4").tobytes(),
        x_vector_dim=dim,
        reference_codes_i16=rng.integers(0, 2048, (frames, 16)).astype("<i2").tobytes(),
        num_reference_frames=frames,
        num_codebooks=16,
        reference_text="hello there",
        x_vector_only=False,
    )


def _voice(name: str = "alice", samples: int = 2400) -> VoiceRecord:
    pcm = np.sin(np.arange(samples, dtype=np.float32) / 10).astype("<f4").tobytes()
    return VoiceRecord(name=name, reference_pcm_f32=pcm, sample_rate_hz=24000, reference_text="hi")


# ---------------------------------------------------------------------------- redis-server fixture


@pytest.fixture
def redis_url(tmp_path, free_tcp_port):
    """A real redis-server on a free port for this test only."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it: .ci/system-deps)")
    port = free_tcp_port
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
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
        for _ in range(200):
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail(f"redis-server exited with {proc.returncode}")
                import time

                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not answer PING")
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---------------------------------------------------------------------------- LRU store


async def test_lru_evicts_least_recently_used_by_entries():
    store = LruStore(max_entries=2, max_bytes=10**9)
    await store.put_prompt("a", _prompt(seed=1))
    await store.put_prompt("b", _prompt(seed=2))
    assert await store.get_prompt("a") == _prompt(seed=1)  # "a" is now the most recent
    await store.put_prompt("c", _prompt(seed=3))
    assert await store.get_prompt("b") is None
    assert await store.get_prompt("a") == _prompt(seed=1)
    assert await store.get_prompt("c") == _prompt(seed=3)
    assert store.num_prompts == 2


async def test_lru_evicts_by_bytes():
    one = _prompt(frames=10).nbytes
    store = LruStore(max_entries=100, max_bytes=int(2.5 * one))
    for i in range(5):
        await store.put_prompt(f"k{i}", _prompt(frames=10, seed=i))
    assert store.num_prompts == 2
    assert store.prompt_bytes <= store.max_bytes
    assert [await store.get_prompt(f"k{i}") is not None for i in range(5)] == [
        False,
        False,
        False,
        True,
        True,
    ]
    # Replacing an entry does not count its old size twice.
    await store.put_prompt("k4", _prompt(frames=10, seed=9))
    assert store.prompt_bytes == 2 * one


async def test_lru_voices_crud():
    store = LruStore()
    await store.create_voice(_voice("a"), overwrite=False)
    with pytest.raises(AlreadyExists):
        await store.create_voice(_voice("a"), overwrite=False)
    await store.create_voice(_voice("a", samples=100), overwrite=True)
    assert len((await store.get_voice("a")).reference_pcm_f32) == 400
    assert [(v.reference_pcm_f32, v.num_samples) for v in await store.list_voices()] == [(b"", 100)]
    await store.delete_voice("a")
    with pytest.raises(NotFound):
        await store.get_voice("a")
    with pytest.raises(NotFound):
        await store.delete_voice("a")


async def test_cache_validates_names_and_shapes():
    cache = SpeakerCacheCore(LruStore(), SpeakerCacheMetrics(CollectorRegistry()))
    for bad in ("", "has space", "../etc", "x" * 65, "-lead"):
        with pytest.raises(InvalidArgument, match="invalid voice name"):
            await cache.create_voice(_voice(bad))
    with pytest.raises(InvalidArgument, match="x_vector_f32"):
        await cache.put_prompt("k", PromptRecord(model_id="m", x_vector_f32=b"123", x_vector_dim=1))
    with pytest.raises(InvalidArgument, match="reference_codes_i16"):
        await cache.put_prompt(
            "k",
            PromptRecord(
                model_id="m", x_vector_f32=b"1234", x_vector_dim=1, num_reference_frames=2, num_codebooks=16
            ),
        )
    with pytest.raises(InvalidArgument, match="reference_text"):
        await cache.create_voice(VoiceRecord("v", b"\0" * 8, 24000, reference_text=""))


def test_config_validation_and_env_fallback(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    assert config_from_args([]).redis_url == "redis://example:6379/0"
    with pytest.raises(InvalidArgument, match="--redis-url"):
        config_from_args(["--redis-url", "http://nope"])
    with pytest.raises(InvalidArgument, match="--lru-entries"):
        config_from_args(["--lru-entries", "0"])


# ---------------------------------------------------------------------------- Redis store


async def test_redis_store_round_trip_and_key_layout(redis_url):
    store = RedisStore(redis_url)
    try:
        assert await store.get_prompt("k1") is None
        await store.put_prompt("k1", _prompt())
        assert await store.get_prompt("k1") == _prompt()
        await store.create_voice(_voice("bob"), overwrite=False)
        with pytest.raises(AlreadyExists):
            await store.create_voice(_voice("bob"), overwrite=False)
        await store.create_voice(_voice("amy", samples=10), overwrite=False)
        assert await store.get_voice("bob") == _voice("bob")
        listed = await store.list_voices()
        assert [v.name for v in listed] == ["amy", "bob"]
        assert all(v.reference_pcm_f32 == b"" for v in listed)
        assert [v.num_samples for v in listed] == [10, 2400]  # from the stored clip's length
        assert await store.count_voices() == 2

        raw = aioredis.from_url(redis_url)
        assert await raw.exists("tts:prompt:k1", "tts:voice:bob", "tts:voice:amy") == 3
        assert await raw.smembers("tts:voices") == {b"amy", b"bob"}
        assert await raw.ttl("tts:prompt:k1") == -1  # no TTL configured here
        await raw.aclose()

        await store.delete_voice("bob")
        with pytest.raises(NotFound):
            await store.get_voice("bob")
        with pytest.raises(NotFound):
            await store.delete_voice("bob")
        assert await store.count_voices() == 1
    finally:
        await store.close()


async def test_redis_voices_persist_across_store_restart(redis_url):
    first = RedisStore(redis_url)
    await first.create_voice(_voice("keep"), overwrite=False)
    await first.put_prompt("pk", _prompt(seed=5))
    await first.close()

    second = RedisStore(redis_url)
    try:
        assert await second.get_voice("keep") == _voice("keep")
        assert await second.get_prompt("pk") == _prompt(seed=5)
    finally:
        await second.close()


# ---------------------------------------------------------------------------- service over gRPC


async def _start(config: SpeakerCacheConfig) -> tuple[SpeakerCacheServer, grpc.aio.Channel]:
    server = SpeakerCacheServer(config, health_interval_s=0.05)
    port = await server.start()
    await server.wait_serving(timeout=10)
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def _config(redis_url: str = "") -> SpeakerCacheConfig:
    return SpeakerCacheConfig(port=0, metrics_port=0, redis_url=redis_url, drain_seconds=0.5).validate()


@pytest.fixture(params=["lru", "redis"])
def store_url(request):
    return "" if request.param == "lru" else request.getfixturevalue("redis_url")


async def test_service_over_grpc(store_url):
    server, channel = await _start(_config(store_url))
    try:
        stub = speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

        miss = await stub.GetVoicePrompt(pb.GetVoicePromptRequest(key="abc"))
        assert not miss.found
        p = _prompt()
        prompt_pb = pb.VoicePrompt(
            model_id=p.model_id,
            x_vector_f32=p.x_vector_f32,
            x_vector_dim=p.x_vector_dim,
            reference_codes_i16=p.reference_codes_i16,
            num_reference_frames=p.num_reference_frames,
            num_codebooks=16,
            reference_text=p.reference_text,
        )
        await stub.PutVoicePrompt(pb.PutVoicePromptRequest(key="abc", prompt=prompt_pb))
        hit = await stub.GetVoicePrompt(pb.GetVoicePromptRequest(key="abc"))
        assert hit.found and hit.prompt == prompt_pb

        v = _voice("carol")
        voice_pb = pb.StoredVoice(
            name="carol", reference_pcm_f32=v.reference_pcm_f32, sample_rate_hz=24000, reference_text="hi"
        )
        created = await stub.CreateVoice(pb.CreateVoiceRequest(voice=voice_pb))
        assert created.voice.name == "carol" and created.voice.created_unix_s > 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CreateVoice(pb.CreateVoiceRequest(voice=voice_pb))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        await stub.CreateVoice(pb.CreateVoiceRequest(voice=voice_pb, overwrite=True))

        got = await stub.GetVoice(pb.GetVoiceRequest(name="carol"))
        assert got.voice.reference_pcm_f32 == v.reference_pcm_f32 and got.voice.reference_text == "hi"
        listed = await stub.ListVoices(pb.ListVoicesRequest())
        assert [x.name for x in listed.voices] == ["carol"] and listed.voices[0].reference_pcm_f32 == b""
        assert listed.voices[0].num_samples == created.voice.num_samples == 2400

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CreateVoice(pb.CreateVoiceRequest(voice=pb.StoredVoice(name="bad name!")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invalid voice name" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetVoice(pb.GetVoiceRequest(name="nobody"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        reg = server.metrics.registry
        assert reg.get_sample_value("tts_speaker_cache_voices") == 1
        await stub.DeleteVoice(pb.DeleteVoiceRequest(name="carol"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.DeleteVoice(pb.DeleteVoiceRequest(name="carol"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        assert reg.get_sample_value("tts_speaker_cache_hits_total") == 1
        assert reg.get_sample_value("tts_speaker_cache_misses_total") == 1
        assert reg.get_sample_value("tts_speaker_cache_voices") == 0
        assert (
            reg.get_sample_value("tts_errors_total", {"service": "speaker_cache", "code": "NOT_FOUND"}) == 2
        )
    finally:
        await channel.close()
        await server.stop(0.5)


async def test_voices_persist_across_service_restart_with_redis(redis_url):
    server, channel = await _start(_config(redis_url))
    v = _voice("dave")
    try:
        stub = speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel)
        await stub.CreateVoice(
            pb.CreateVoiceRequest(
                voice=pb.StoredVoice(
                    name="dave",
                    reference_pcm_f32=v.reference_pcm_f32,
                    sample_rate_hz=24000,
                    reference_text="hi",
                )
            )
        )
    finally:
        await channel.close()
        await server.stop(0.5)

    server, channel = await _start(_config(redis_url))
    try:
        stub = speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel)
        got = await stub.GetVoice(pb.GetVoiceRequest(name="dave"))
        assert got.voice.reference_pcm_f32 == v.reference_pcm_f32
        # The voice gauge is loaded from the store at start.
        assert server.metrics.registry.get_sample_value("tts_speaker_cache_voices") == 1
    finally:
        await channel.close()
        await server.stop(0.5)


async def test_not_serving_while_redis_does_not_answer(free_tcp_port):
    # Nothing listens on this port: PING fails, health stays NOT_SERVING, RPCs say UNAVAILABLE.
    server = SpeakerCacheServer(_config(f"redis://127.0.0.1:{free_tcp_port}/0"), health_interval_s=0.05)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        await asyncio.sleep(0.2)
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetVoicePrompt(pb.GetVoicePromptRequest(key="abc"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
        await server.stop(0.5)
