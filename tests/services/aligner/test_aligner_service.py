"""The aligner service over gRPC on the tiny random aligner: answers, batching, refusals, health."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qtts.pb import aligner_pb2 as pb
from qtts.pb import aligner_pb2_grpc
from qtts.request.errors import InvalidArgument
from services.aligner.config import AlignerConfig, config_from_args
from services.aligner.core import splitting_language
from services.aligner.server import SERVICE_NAME, AlignerServer

TEXTS = [
    ("Hello world, this is a test.", "english"),
    ("你好，世界。今天天气很好", "chinese"),
    ("今日はいい天気ですね。", "auto"),
    ("One two three four five six seven.", "auto"),
]


def _pcm(seconds: float, seed: int, sr: int = 24000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * (180 + 40 * seed) * t) + 0.05 * rng.standard_normal(t.shape)).astype(
        "<f4"
    )


@pytest.fixture
async def aligner_stub(tiny_aligner):
    server = AlignerServer(
        AlignerConfig(port=0, metrics_port=0, max_batch=8, max_audio_s=20), aligner=tiny_aligner
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, channel, aligner_pb2_grpc.AlignerServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=0.5)


def _request(i: int, offset_s: float = 0.0) -> pb.AlignRequest:
    text, lang = TEXTS[i % len(TEXTS)]
    pcm = _pcm(1.0 + 0.4 * i, seed=i)
    return pb.AlignRequest(
        request_id=f"r{i}",
        text=text,
        language=lang,
        pcm_f32=pcm.tobytes(),
        sample_rate_hz=24000,
        offset_s=offset_s,
    )


def _expected(tiny_aligner, i: int, offset_s: float = 0.0) -> list[tuple[str, float, float]]:
    text, lang = TEXTS[i % len(TEXTS)]
    words = tiny_aligner.align(_pcm(1.0 + 0.4 * i, seed=i), 24000, text, splitting_language(lang, text))
    return [(w.word, round(w.start_s + offset_s, 3), round(w.end_s + offset_s, 3)) for w in words]


def _words(resp: pb.AlignResponse) -> list[tuple[str, float, float]]:
    return [(w.word, round(w.start_s, 3), round(w.end_s, 3)) for w in resp.words]


async def test_health_serving_and_an_answer_equal_to_the_model(aligner_stub, tiny_aligner):
    _, channel, stub = aligner_stub
    health = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    resp = await stub.Align(_request(0, offset_s=2.5))
    assert resp.request_id == "r0"
    assert [w[0] for w in _words(resp)] == ["Hello", "world", "this", "is", "a", "test"]
    assert _words(resp) == _expected(tiny_aligner, 0, offset_s=2.5)
    assert resp.batch_size >= 1 and resp.forward_ns > 0


async def test_auto_language_splits_japanese_by_kana():
    assert splitting_language("auto", "今日はいい天気") == "japanese"
    assert splitting_language("", "Hello") == "english"
    assert splitting_language("Chinese", "你好") == "chinese"


async def test_concurrent_requests_share_forward_passes_and_keep_their_answers(aligner_stub, tiny_aligner):
    server, _, stub = aligner_stub
    responses = await asyncio.gather(*(stub.Align(_request(i)) for i in range(12)))
    for i, resp in enumerate(responses):
        assert resp.request_id == f"r{i}"
        assert _words(resp) == _expected(tiny_aligner, i)
    assert max(r.batch_size for r in responses) > 1
    assert max(r.batch_size for r in responses) <= 8
    assert server.metrics.batch_size._sum.get() >= 12  # every request was counted in some batch


async def test_requests_that_arrive_one_by_one_wait_for_company_and_share_a_pass(tiny_aligner):
    """Segments end one at a time: with a gather window, requests sent apart still share one
    forward pass (each waits at most the window for company), and each keeps its own answer."""
    server = AlignerServer(
        AlignerConfig(port=0, metrics_port=0, max_batch=8, max_audio_s=20, gather_ms=1000),
        aligner=tiny_aligner,
    )
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = aligner_pb2_grpc.AlignerServiceStub(channel)
            english = (0, 3, 4, 7)  # quick to featurise, so only the window decides the batching
            calls = []
            for i in english:
                calls.append(asyncio.ensure_future(stub.Align(_request(i))))
                await asyncio.sleep(0.15)
            responses = await asyncio.gather(*calls)
        assert [r.batch_size for r in responses] == [4, 4, 4, 4]
        for i, resp in zip(english, responses, strict=True):
            assert _words(resp) == _expected(tiny_aligner, i)
    finally:
        await server.stop(grace=0.5)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(pcm_f32=b""), "the audio is empty"),
        (dict(pcm_f32=b"\x00\x00\x00"), "whole float32 samples"),
        (dict(pcm_f32=b"", pcm_s16le=b"\x00\x00\x00"), "whole 16-bit samples"),
        (dict(pcm_s16le=b"\x00\x00"), "not both"),
        (dict(text=" ... !? "), "no word to align"),
        (dict(text="안녕하세요 세계", language="korean"), "Korean"),
        (dict(sample_rate_hz=100), "sample_rate_hz must be in"),
        (dict(pcm_f32=np.zeros(24000 * 21, "<f4").tobytes()), "at most 20 s"),
        (dict(pcm_f32=np.full(2400, np.nan, "<f4").tobytes()), "NaN"),
        (dict(offset_s=-1.0), "offset_s"),
    ],
)
async def test_bad_requests_are_invalid_argument_naming_the_problem(aligner_stub, change, message):
    _, _, stub = aligner_stub
    req = _request(0)
    for k, v in change.items():
        setattr(req, k, v)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Align(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_config_flags_and_refusals():
    cfg = config_from_args(["--port", "0", "--max-batch", "4", "--load-format", "dummy"])
    assert (cfg.max_batch, cfg.load_format, cfg.gather_ms) == (4, "dummy", 50.0)
    assert config_from_args(["--gather-ms", "0"]).gather_ms == 0.0
    assert (cfg.gpu_share, config_from_args(["--gpu-share", "1"]).gpu_share) == (0.5, 1.0)
    assert (cfg.share_max_wait_ms, config_from_args(["--share-max-wait-ms", "0"]).share_max_wait_ms) == (
        3000.0,
        0.0,
    )
    assert (cfg.cuda_graphs, cfg.max_graphs, cfg.graph_max_length) == (True, 48, 1024)
    cfg = config_from_args(["--cuda-graphs", "false", "--max-graphs", "0", "--graph-max-length", "256"])
    assert (cfg.cuda_graphs, cfg.max_graphs, cfg.graph_max_length) == (False, 0, 256)
    assert AlignerConfig().warmup_seconds() == [2.0, 5.0, 10.0]
    assert config_from_args(["--graph-warmup-s", ""]).warmup_seconds() == []
    for bad, msg in [
        (dict(max_batch=0), "--max-batch"),
        (dict(max_graphs=-1), "--max-graphs"),
        (dict(graph_max_length=0), "--graph-max-length"),
        (dict(graph_warmup_s="2,x"), "--graph-warmup-s"),
        (dict(graph_warmup_s="0"), "--graph-warmup-s"),
        (dict(graph_warmup_s="301"), "--graph-warmup-s"),
        (dict(max_audio_s=500.0), "--max-audio-s"),
        (dict(gather_ms=-1.0), "--gather-ms"),
        (dict(gather_ms=1001.0), "--gather-ms"),
        (dict(gpu_share=0.0), "--gpu-share"),
        (dict(gpu_share=1.5), "--gpu-share"),
        (dict(share_max_wait_ms=-1.0), "--share-max-wait-ms"),
        (dict(dtype="int8"), "--dtype"),
    ]:
        with pytest.raises(InvalidArgument, match=msg):
            dataclasses.replace(AlignerConfig(), **bad).validate()


async def test_16_bit_audio_is_aligned_as_its_float32_scaling(aligner_stub, tiny_aligner):
    """The gateway sends the talker's 16-bit PCM as is: the answer equals the model's on the
    samples scaled by 1/32768, and the same audio sent as float32."""
    _, _, stub = aligner_stub
    pcm16 = np.round(_pcm(1.4, seed=1) * 32767).astype("<i2")
    scaled = pcm16.astype(np.float32) / 32768.0
    text, lang = TEXTS[0]
    as16 = _request(0)
    as16.ClearField("pcm_f32")
    as16.pcm_s16le = pcm16.tobytes()
    as32 = _request(0)
    as32.pcm_f32 = scaled.astype("<f4").tobytes()
    r16, r32 = await stub.Align(as16), await stub.Align(as32)
    want = tiny_aligner.align(scaled, 24000, text, splitting_language(lang, text))
    assert _words(r16) == _words(r32) == [(w.word, round(w.start_s, 3), round(w.end_s, 3)) for w in want]
    assert len(r16.words) == 6


async def _one_by_one_passes(tiny_aligner, **config) -> tuple[AlignerServer, list[tuple[float, float]]]:
    """English requests 0, 3 and 4 sent at once to an aligner of one request a pass, each answered
    with its own words; returns the server's metrics holder and every pass's (start, end)."""
    server = AlignerServer(
        AlignerConfig(port=0, metrics_port=0, max_batch=1, max_audio_s=20, gather_ms=0, **config),
        aligner=tiny_aligner,
    )
    port = await server.start()
    passes: list[tuple[float, float]] = []
    run = server.core.runner.run

    def timed(batch):
        start = time.monotonic()
        try:
            return run(batch)
        finally:
            passes.append((start, time.monotonic()))

    server.core.runner.run = timed
    english = (0, 3, 4)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = aligner_pb2_grpc.AlignerServiceStub(channel)
            calls = asyncio.gather(*(stub.Align(_request(i)) for i in english))
            responses = await asyncio.wait_for(calls, 30)
    finally:
        await server.stop(grace=0.5)
    assert [_words(r) for r in responses] == [_expected(tiny_aligner, i) for i in english]
    assert len(passes) == 3
    return server, passes


async def test_forward_passes_keep_within_their_gpu_share(tiny_aligner):
    """With --gpu-share 0.25 a pass of t seconds is followed by at least 3t without one, so a burst
    of segments does not hold a GPU that the talker and code2wav share; every request is still
    answered, each with its own words."""
    server, passes = await _one_by_one_passes(tiny_aligner, gpu_share=0.25)
    for (start, end), (next_start, _) in zip(passes[:-1], passes[1:], strict=True):
        assert next_start - end >= 3 * (end - start) * 0.99, passes
    assert server.metrics.rest_seconds_total._value.get() > 0


async def test_the_gpu_share_gives_way_to_requests_waiting_past_the_bound(tiny_aligner):
    """A share far below what the requests need would hold each pass back for ten thousand times its
    length; once the oldest queued request has waited --share-max-wait-ms the next pass runs."""
    _, passes = await _one_by_one_passes(tiny_aligner, gpu_share=0.0001, share_max_wait_ms=200)
    for (start, end), (next_start, _) in zip(passes[:-1], passes[1:], strict=True):
        # Without the bound the rest would be 9999 times the pass (seconds at least).
        assert next_start - end < 3.0 < 9999 * (end - start), passes
