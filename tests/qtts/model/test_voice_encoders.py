"""The voice encoders on their own (tiny Base model): the weights and prompts of the bundle's,
clips of one length through each encoder together, and every clip's error its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qtts.model.voice_encoders import VoiceClip, load_voice_encoders
from qtts.request.errors import InvalidArgument


def pcm(seed: int, samples: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / 24000
    return (0.3 * np.sin(2 * np.pi * (100 + 30 * seed) * t) + 0.02 * rng.standard_normal(samples)).astype(
        np.float32
    )


@pytest.fixture(scope="module")
def encoders(tiny_snapshot_factory):
    return load_voice_encoders(tiny_snapshot_factory("base"))


def test_the_encoders_alone_are_the_bundles(encoders, bundle_factory):
    bundle = bundle_factory("base")
    assert encoders.fingerprint() == bundle.voice_encoder_fingerprint() != ""
    clip = VoiceClip(pcm(1, 30000), "words", False)
    got, want = encoders.compute(clip), bundle.compute_voice_prompt(clip.pcm, "words", False)
    assert torch.equal(got.x_vector, want.x_vector) and torch.equal(got.ref_codes, want.ref_codes)


def test_clips_of_one_length_go_together_and_give_each_clip_its_own_prompt(encoders, monkeypatch):
    calls = []
    encode_batch = encoders.codec_encoder.encode_batch
    monkeypatch.setattr(
        encoders.codec_encoder, "encode_batch", lambda w: calls.append(tuple(w.shape)) or encode_batch(w)
    )
    clips = [VoiceClip(pcm(s, 26000), f"text {s}", s == 2) for s in range(4)]
    clips.append(VoiceClip(pcm(9, 31000), "longer", False))
    results = encoders.compute_many(clips)
    # One codec call for the three ICL clips of 26000 samples, one for the other length.
    assert sorted(calls) == [(1, 31000), (3, 26000)]
    for clip, got in zip(clips, results, strict=True):
        want = encoders.compute(clip)
        torch.testing.assert_close(got.x_vector, want.x_vector, rtol=1e-5, atol=1e-5)
        if clip.x_vector_only:
            assert got.ref_codes is None and got.ref_text is None
        else:
            assert torch.equal(got.ref_codes, want.ref_codes) and got.ref_text == clip.ref_text


def test_a_bad_clip_gets_its_own_error_and_a_failing_batch_goes_one_by_one(encoders, monkeypatch):
    def refuse(wavs):
        raise RuntimeError("no batches today")

    monkeypatch.setattr(encoders.speaker_encoder, "embed_batch", refuse)
    monkeypatch.setattr(encoders.speaker_encoder, "embed", lambda w: torch.full((8,), float(w[0])))
    clips = [
        VoiceClip(pcm(1, 20000), "a", False),
        VoiceClip(np.zeros(0, np.float32), "empty", False),
        VoiceClip(pcm(2, 20000), None, False),  # ICL without its transcript
        VoiceClip(pcm(3, 20000), "c", False),
    ]
    results = encoders.compute_many(clips)
    assert isinstance(results[1], InvalidArgument) and "empty" in results[1].message
    assert isinstance(results[2], InvalidArgument) and "reference text" in results[2].message
    for i in (0, 3):  # the batch of two failed: each computed alone
        assert torch.equal(results[i].x_vector, torch.full((8,), float(clips[i].pcm[0])))
        assert torch.equal(results[i].ref_codes, encoders.compute(clips[i]).ref_codes)
