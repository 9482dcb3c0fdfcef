"""ICL voice clone on the tiny real Base model through real speaker_cache, talker and code2wav."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from qtts.pb import tts_pb2
from services.code2wav.config import Code2WavConfig
from services.code2wav.server import Code2WavServer
from tests.services.talker.stack import eventually, generate_all, speaker_cache, talker_stack

REF = (np.sin(np.arange(24000) / 9.0) * 0.3).astype("<f4")
N = 4


async def test_icl_clone_streams_the_decoded_frames_after_the_reference_and_reuses_the_cached_prompt(
    tiny_talker_bundle, tiny_snapshot, monkeypatch
):
    from qtts.model import EagerGenerator, SynthesisSpec, load_codec_decoder

    bundle = tiny_talker_bundle("base")
    calls = []
    compute = bundle.compute_voice_prompt
    compute_many = bundle.compute_voice_prompts
    monkeypatch.setattr(
        bundle, "compute_voice_prompts", lambda clips: calls.extend(clips) or compute_many(clips)
    )
    code2wav = Code2WavServer(
        Code2WavConfig(port=0, metrics_port=0, model=str(tiny_snapshot("base")), drain_seconds=0.5)
    )
    c2w_port = await code2wav.start()
    request = dict(
        text="Hello world.",
        task_type=tts_pb2.TASK_TYPE_VOICE_CLONE,
        reference_pcm_f32=REF.tobytes(),
        reference_text="a reference clip",
        max_new_frames=N,
        sampling=tts_pb2.SamplingParams(greedy=True),
    )
    pcms = []
    try:
        async with speaker_cache() as (cache_address, _):
            for _ in range(2):  # two talker replicas in turn: the second finds the prompt in speaker_cache
                async with talker_stack(
                    [],
                    bundle=bundle,
                    code2wav_addresses=[f"127.0.0.1:{c2w_port}"],
                    speaker_cache=cache_address,
                ) as s:
                    chunks, summary = await generate_all(s.stub, **request)
                    assert summary.num_frames == N and summary.num_samples == N * 1920
                    pcms.append(np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2"))
                    await eventually(lambda s=s: s.generator.num_active == 0)
    finally:
        await code2wav.stop(0.5)
    assert len(calls) == 1
    np.testing.assert_array_equal(pcms[0], pcms[1])
    # Reference: the same greedy generation alone, decoded with the reference frames as prefix and
    # the prefix's samples cut: the stream carries no reference audio.
    vp = compute(REF, "a reference clip", False)
    prompt = bundle.build_prompt(SynthesisSpec(text="Hello world.", task="voice_clone", voice_prompt=vp))
    gen = EagerGenerator(bundle, max_batch=1)
    gen.add(
        "x", prompt, dataclasses.replace(bundle.generation_defaults, greedy=True, subtalker_greedy=True), N
    )
    frames = []
    while gen.num_active:
        frames += [o.codes for o in gen.step() if o.codes is not None]
    ref_codes = vp.ref_codes.to(torch.long)
    with torch.inference_mode():
        wav = load_codec_decoder(tiny_snapshot("base")).decode(
            torch.cat([ref_codes, torch.stack(frames)])[None]
        )[0]
    expected = np.round(np.clip(wav.float().numpy(), -1, 1) * 32767).astype(np.int32)[
        ref_codes.shape[0] * 1920 :
    ]
    assert np.abs(pcms[0].astype(np.int32) - expected).max() <= 2
