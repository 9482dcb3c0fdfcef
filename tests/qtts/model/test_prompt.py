"""Prompt builder and text tokenizer against the official package on tiny random snapshots."""

from __future__ import annotations

import pytest
import torch

from qtts.model import SynthesisSpec, VoicePrompt
from qtts.model.prompt import assistant_text, frame_cap, instruct_text, ref_text_block
from qtts.model.tokenizer import encode
from qtts.request.errors import InvalidArgument
from tests.qtts.model.reference import official_prompt, voice_clone_item

TEXTS = [
    "Hello world, it's 12:30 and we're 100% sure!",
    "你好，世界。今天天气很好！",
    "Hi",
    "  spaces\tand\nnew lines 1234567890 don't  ",
]

pytestmark = pytest.mark.reference


def _same(ours, official, row: int = 0):
    mask = official.attention_mask[row].bool()
    emb = official.embeds[row][mask]
    assert ours.embeds.shape == emb.shape
    torch.testing.assert_close(ours.embeds, emb, atol=1e-5, rtol=0)
    n = ours.trailing.shape[0]
    off_trailing = official.trailing[row]
    # The official batch pads trailing text with tts_pad; ours stops and uses pad_embed.
    torch.testing.assert_close(ours.trailing, off_trailing[:n], atol=1e-5, rtol=0)
    for extra in off_trailing[n:]:
        torch.testing.assert_close(extra, ours.pad_embed, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.pad_embed, official.pad_embed, atol=1e-5, rtol=0)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("wrap", [assistant_text, ref_text_block, instruct_text])
def test_token_ids_equal_official_processor(official_factory, bundle_factory, text, wrap):
    official = official_factory("custom_voice")
    bundle = bundle_factory("custom_voice")
    s = wrap(text)
    expected = official.processor(text=s, return_tensors="pt", padding=True)["input_ids"][0].tolist()
    assert encode(bundle.tokenizer, s) == expected


def test_tokenizer_applies_the_official_regex_swap(bundle_factory):
    # The tiny snapshot says transformers_version 4.57.3, as the real ones, so the official loader
    # swaps Qwen2's split regex for the "fixed Mistral" one; ours must have swapped it too.
    pre = bundle_factory("custom_voice").tokenizer.backend_tokenizer.pre_tokenizer
    assert "p{Lu}" in str(pre)


@pytest.mark.parametrize(
    "speaker,language,instruct",
    [
        ("Vivian", "English", None),
        ("ryan", "Auto", "Speak warmly and slowly."),
        ("Eric", "Chinese", None),  # dialect speaker: sichuan dialect id replaces chinese
        ("Dylan", "Auto", None),  # dialect speaker: beijing dialect with auto
        ("Dylan", "English", None),  # no dialect for a non-chinese language
    ],
)
@pytest.mark.parametrize("streaming", [None, True])
def test_custom_voice_prompt(official_factory, bundle_factory, speaker, language, instruct, streaming):
    official = official_factory("custom_voice")
    bundle = bundle_factory("custom_voice")
    text = TEXTS[0]
    kw = dict(text=text, speaker=speaker, language=language, instruct=instruct)
    off = official_prompt(official, "custom_voice", non_streaming_mode=not streaming, **kw)
    ours = bundle.build_prompt(SynthesisSpec(task="custom_voice", streaming_text=streaming, **kw))
    _same(ours, off)
    assert ours.num_text_tokens == len(encode(bundle.tokenizer, assistant_text(text))) - 8
    assert ours.max_frames == frame_cap(ours.num_text_tokens, 8192)
    assert ours.ref_codes is None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("streaming", [None, True])
def test_voice_design_prompt(official_factory, bundle_factory, text, streaming):
    official = official_factory("voice_design")
    bundle = bundle_factory("voice_design")
    kw = dict(text=text, language="Japanese", instruct="A calm, low female voice.")
    off = official_prompt(official, "voice_design", non_streaming_mode=not streaming, **kw)
    ours = bundle.build_prompt(SynthesisSpec(task="voice_design", streaming_text=streaming, **kw))
    _same(ours, off)


def _voice(hidden: int, ref_frames: int | None, seed: int = 0) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(hidden, generator=g)
    codes = None if ref_frames is None else torch.randint(0, 2048, (ref_frames, 16), generator=g)
    return VoicePrompt(
        x_vector=x,
        ref_codes=codes,
        ref_text=None if codes is None else "Hello world.",
        x_vector_only=codes is None,
    )


@pytest.mark.parametrize("ref_frames", [None, 3, 40])  # x-vector only; ICL text longer / shorter than ref
@pytest.mark.parametrize("streaming", [None, False])
@pytest.mark.parametrize("language", ["Auto", "German"])
def test_voice_clone_prompt(official_factory, bundle_factory, ref_frames, streaming, language):
    official = official_factory("base")
    bundle = bundle_factory("base")
    voice = _voice(bundle.talker.hidden_size, ref_frames)
    item = voice_clone_item(voice.x_vector, voice.ref_codes, voice.ref_text)
    text = TEXTS[0]
    off = official_prompt(
        official,
        "voice_clone",
        text=text,
        language=language,
        voice_clone_prompt=[item],
        non_streaming_mode=streaming is False,
    )
    ours = bundle.build_prompt(
        SynthesisSpec(
            text=text, task="voice_clone", language=language, voice_prompt=voice, streaming_text=streaming
        )
    )
    _same(ours, off)
    if ref_frames is None:
        assert ours.ref_codes is None
    else:
        assert torch.equal(ours.ref_codes, voice.ref_codes)


def test_batched_official_prompts_match_each_row(official_factory, bundle_factory):
    official = official_factory("custom_voice")
    bundle = bundle_factory("custom_voice")
    texts = TEXTS[:3]
    off = official_prompt(
        official,
        "custom_voice",
        text=texts,
        speaker=["vivian", "eric", "aiden"],
        language=["English", "Chinese", "Auto"],
        non_streaming_mode=False,
    )
    for row, (t, s, lang) in enumerate(
        zip(texts, ["vivian", "eric", "aiden"], ["English", "Chinese", "Auto"], strict=True)
    ):
        ours = bundle.build_prompt(
            SynthesisSpec(text=t, task="custom_voice", speaker=s, language=lang, streaming_text=True)
        )
        _same(ours, off, row)


def test_prompt_rejects_bad_requests(bundle_factory):
    cv = bundle_factory("custom_voice")
    with pytest.raises(InvalidArgument, match="unknown speaker"):
        cv.build_prompt(SynthesisSpec(text="hi", task="custom_voice", speaker="nobody"))
    with pytest.raises(InvalidArgument, match="unsupported language"):
        cv.build_prompt(SynthesisSpec(text="hi", task="custom_voice", speaker="ryan", language="klingon"))
    with pytest.raises(InvalidArgument, match="dialect|unsupported language"):
        cv.build_prompt(
            SynthesisSpec(text="hi", task="custom_voice", speaker="ryan", language="sichuan_dialect")
        )
    with pytest.raises(InvalidArgument, match="not served"):
        cv.build_prompt(SynthesisSpec(text="hi", task="voice_design", instruct="x"))
    base = bundle_factory("base")
    with pytest.raises(InvalidArgument, match="voice prompt"):
        base.build_prompt(SynthesisSpec(text="hi", task="voice_clone"))
    icl_no_text = VoicePrompt(
        torch.zeros(base.talker.hidden_size), torch.zeros(2, 16, dtype=torch.long), None, False
    )
    with pytest.raises(InvalidArgument, match="transcript"):
        base.build_prompt(SynthesisSpec(text="hi", task="voice_clone", voice_prompt=icl_no_text))


def test_compute_voice_prompt_equals_official(official_factory, bundle_factory):
    """The bundle's x-vector and ICL reference codes equal `create_voice_clone_prompt`'s."""
    import numpy as np

    official = official_factory("base")
    bundle = bundle_factory("base")
    assert bundle.speaker_encoder is not None and bundle.codec_encoder is not None
    rng = np.random.default_rng(0)
    wav = (0.1 * rng.standard_normal(24000 * 2 + 700)).astype(np.float32)
    item = official.create_voice_clone_prompt(ref_audio=(wav, 24000), ref_text="Hello world.")[0]
    voice = bundle.compute_voice_prompt(wav, "Hello world.", x_vector_only=False)
    torch.testing.assert_close(voice.x_vector, item.ref_spk_embedding.float(), atol=1e-4, rtol=1e-4)
    assert torch.equal(voice.ref_codes, item.ref_code.long().cpu())
    assert voice.ref_codes.shape == (26, 16) and voice.ref_text == "Hello world." and not voice.x_vector_only
    xonly = bundle.compute_voice_prompt(wav, None, x_vector_only=True)
    assert xonly.ref_codes is None and xonly.x_vector_only and torch.equal(xonly.x_vector, voice.x_vector)
    with pytest.raises(InvalidArgument, match="reference text"):
        bundle.compute_voice_prompt(wav, None, x_vector_only=False)
    with pytest.raises(InvalidArgument, match="not a voice-clone"):
        bundle_factory("custom_voice").compute_voice_prompt(wav, None, x_vector_only=True)


def test_a_voice_s_embeddings_are_computed_once_and_never_shared_with_another(bundle_factory, monkeypatch):
    """The prompt thread builds every prompt: a voice's reference-frame embeddings are kept, so a
    second request with the voice costs no codebook lookups, and another voice gets its own."""
    bundle = bundle_factory("base")
    builder = bundle.prompt_builder
    calls = []
    real = builder.embed.frames
    monkeypatch.setattr(builder.embed, "frames", lambda codes: calls.append(codes.shape) or real(codes))
    voice_a = _voice(bundle.talker.hidden_size, 40, seed=101)  # seeds no other test uses
    voice_b = _voice(bundle.talker.hidden_size, 40, seed=102)
    assert not torch.equal(voice_a.ref_codes, voice_b.ref_codes)

    def build(voice, text=TEXTS[0]):
        return bundle.build_prompt(SynthesisSpec(text=text, task="voice_clone", voice_prompt=voice))

    first = build(voice_a)
    again = build(voice_a)
    assert len(calls) == 1 and torch.equal(first.embeds, again.embeds)
    other = build(voice_b)
    assert len(calls) == 2 and not torch.equal(other.embeds, first.embeds)
    longer = build(voice_a, TEXTS[0] + " And a little more.")
    assert len(calls) == 2 and longer.embeds.shape[0] >= first.embeds.shape[0]
