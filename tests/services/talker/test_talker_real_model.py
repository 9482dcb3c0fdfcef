"""The talker service on the tiny real model (EagerGenerator), through real gRPC servers."""

from __future__ import annotations

import grpc
import pytest

from qtts.pb import talker_pb2, tts_pb2
from tests.services.talker.fakes import FakeCode2Wav
from tests.services.talker.stack import eventually, generate_all, talker_stack


@pytest.fixture
def custom_voice_bundle(tiny_talker_bundle):
    return tiny_talker_bundle("custom_voice")


def real_stack(bundle, replicas=None, **kw):
    return talker_stack(replicas or [FakeCode2Wav("c2w-a")], bundle=bundle, **kw)


async def test_real_model_audio_is_frames_times_1920(custom_voice_bundle):
    speaker = sorted(custom_voice_bundle.info.speakers)[0]
    async with real_stack(custom_voice_bundle, credit_window_frames=2) as s:
        chunks, summary = await generate_all(
            s.stub,
            request_id="real",
            text="Hello world.",
            voice=speaker,
            language="english",
            max_new_frames=3,
            sampling=tts_pb2.SamplingParams(seed=7),
        )
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH and summary.num_frames == 3
        assert sum(c.num_samples for c in chunks) == 3 * 1920 == summary.num_samples
        assert len(b"".join(c.audio for c in chunks)) == 3 * 1920 * 2
        log = s.replicas[0].servicer.logs[0]
        assert log.violations == [] and len(log.frames) == 3 and log.prefix_frames == 0
        assert all(0 <= f < 2048 for f in log.frames)  # real codebook-0 codes
        await eventually(lambda: s.generator.num_active == 0)
        # The prompt was built on the prompt thread, timed with its wait for that thread.
        registry = s.talker.metrics.registry
        for stage in ("prompt_queue", "build_prompt"):
            labels = {"service": "talker", "stage": stage}
            assert registry.get_sample_value("tts_stage_latency_seconds_count", labels) == 1


async def test_real_model_cancel_frees_the_slot(custom_voice_bundle):
    speaker = sorted(custom_voice_bundle.info.speakers)[0]
    c2w = FakeCode2Wav("c2w-a")
    async with real_stack(custom_voice_bundle, [c2w]) as s:
        call = s.stub.Generate(
            talker_pb2.GenerateRequest(
                request_id="bye",
                text="Hello world, this is long.",
                voice=speaker,
                max_new_frames=500,
            )
        )
        assert (await call.read()).WhichOneof("event") == "audio"
        call.cancel()
        await eventually(lambda: s.generator.num_active == 0, timeout=30)
        await eventually(lambda: c2w.live == 0 and s.gauge("tts_talker_active_streams") == 0, timeout=30)
        assert s.talker.engine.counts() == (0, 0)


async def test_real_model_rejects_unknown_speaker_and_reports_model_info(custom_voice_bundle):
    async with real_stack(custom_voice_bundle) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, text="hi", voice="nobody-here")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nobody-here" in err.value.details()
        info = await s.stub.GetModelInfo(talker_pb2.GetModelInfoRequest())
        assert info.model_type == "custom_voice" and set(info.speakers) == set(
            custom_voice_bundle.info.speakers
        )
        assert (info.sample_rate_hz, info.samples_per_frame, info.num_codebooks) == (24000, 1920, 16)


async def test_real_talker_and_real_code2wav_give_the_decoded_audio_of_the_generated_frames(
    custom_voice_bundle, tiny_snapshot
):
    import dataclasses

    import numpy as np
    import torch

    from qtts.model import EagerGenerator, SynthesisSpec, load_codec_decoder
    from services.code2wav.config import Code2WavConfig
    from services.code2wav.server import Code2WavServer

    snapshot = tiny_snapshot("custom_voice")
    code2wav = Code2WavServer(
        Code2WavConfig(
            port=0, metrics_port=0, model=str(snapshot), drain_seconds=0.5, replica_name="c2w-real"
        )
    )
    port = await code2wav.start()
    speaker = sorted(custom_voice_bundle.info.speakers)[0]
    n = 5
    try:
        cfg_replicas = [f"127.0.0.1:{port}"]
        async with talker_stack([], bundle=custom_voice_bundle, code2wav_addresses=cfg_replicas) as s:
            chunks, summary = await generate_all(
                s.stub,
                request_id="e2e",
                text="Hello world.",
                voice=speaker,
                language="english",
                max_new_frames=n,
                sampling=tts_pb2.SamplingParams(greedy=True),
                streaming=tts_pb2.StreamingOptions(first_chunk_frames=1, chunk_frames_ramp=[2]),
            )
            assert summary.num_frames == n and summary.code2wav_replica == "c2w-real"
            pcm = np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2")
            assert pcm.size == n * 1920 == summary.num_samples
            await eventually(lambda: s.generator.num_active == 0)
            await eventually(
                lambda: code2wav.metrics.registry.get_sample_value("tts_code2wav_live_states") == 0
            )
    finally:
        await code2wav.stop(0.5)
    # The same greedy request run alone, decoded in one piece, gives the same audio.
    b = custom_voice_bundle
    gen = EagerGenerator(b, max_batch=1)
    prompt = b.build_prompt(
        SynthesisSpec(text="Hello world.", task="custom_voice", speaker=speaker, language="english")
    )
    gen.add("x", prompt, dataclasses.replace(b.generation_defaults, greedy=True, subtalker_greedy=True), n)
    frames = []
    while gen.num_active:
        frames += [o.codes for o in gen.step() if o.codes is not None]
    decoder = load_codec_decoder(snapshot)
    with torch.inference_mode():
        wav = decoder.decode(torch.stack(frames)[None])[0]
    expected = np.round(np.clip(wav.float().numpy(), -1, 1) * 32767).astype(np.int16)
    assert np.abs(pcm.astype(np.int32) - expected.astype(np.int32)).max() <= 2


@pytest.mark.parametrize("model_type", ["custom_voice", "base"])
def test_warm_up_runs_on_the_real_model_and_leaves_the_generator_empty(tiny_talker_bundle, model_type):
    from qtts.model import EagerGenerator
    from services.talker.warmup import warm_up

    bundle = tiny_talker_bundle(model_type)
    gen = EagerGenerator(bundle, max_batch=2)
    assert warm_up(bundle, gen, frames=2)
    assert gen.num_active == 0


async def test_graph_engine_serves_the_same_greedy_frames_as_the_eager_generator(custom_voice_bundle):
    """`--engine graph` (GraphEngine; eager on a CPU) is a drop-in for the reference generator."""
    speaker = sorted(custom_voice_bundle.info.speakers)[0]
    frames = {}
    for engine in ("eager", "graph"):
        c2w = FakeCode2Wav("c2w-a")
        async with real_stack(custom_voice_bundle, [c2w], engine=engine) as s:
            chunks, summary = await generate_all(
                s.stub,
                request_id=f"req-{engine}",
                text="Hello world.",
                voice=speaker,
                language="english",
                max_new_frames=4,
                sampling=tts_pb2.SamplingParams(greedy=True),
            )
            assert summary.num_frames == 4 and sum(c.num_samples for c in chunks) == 4 * 1920
            frames[engine] = list(c2w.logs[0].frames)
            await eventually(lambda: s.generator.num_active == 0)
    assert len(frames["graph"]) == 4 and frames["graph"] == frames["eager"]
