"""Greedy codes of our talker + code predictor + EagerGenerator equal the official package's,
for every prompt mode, alone and batched (tiny random snapshots, CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from qtts.model import EagerGenerator, SamplingParams, SynthesisSpec, VoicePrompt
from tests.qtts.model.reference import official_codes, voice_clone_item

pytestmark = pytest.mark.reference

TEXTS = [
    "Hello world, it's a test.",
    "你好，世界。今天天气很好！",
    "Speak slowly and clearly, with a warm voice, please.",
]
FRAMES = 9
_ALONE: dict[tuple[str, int], torch.Tensor] = {}


def _voice(hidden: int, icl: bool, seed: int) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(hidden, generator=g)
    codes = torch.randint(0, 2048, (5 + 4 * seed, 16), generator=g) if icl else None
    return VoicePrompt(x, codes, "The quick brown fox." if icl else None, not icl)


def _cases(mode: str, hidden: int):
    """(official kwargs, our SynthesisSpec) per text for a mode."""
    out = []
    for i, text in enumerate(TEXTS):
        if mode == "custom_voice":
            speaker, lang = ["vivian", "eric", "ryan"][i], ["English", "Chinese", "Auto"][i]
            instruct = "Happy and bright." if i == 2 else None
            out.append(
                (
                    dict(text=text, speaker=speaker, language=lang, instruct=instruct),
                    SynthesisSpec(
                        text=text, task="custom_voice", speaker=speaker, language=lang, instruct=instruct
                    ),
                )
            )
        elif mode == "voice_design":
            instruct = ["A deep male voice.", "Gentle whisper.", "An excited child."][i]
            out.append(
                (
                    dict(text=text, instruct=instruct, language="Auto"),
                    SynthesisSpec(text=text, task="voice_design", instruct=instruct),
                )
            )
        else:
            voice = _voice(hidden, icl=mode == "icl", seed=i)
            out.append(
                (
                    dict(
                        text=text,
                        language="Auto",
                        voice_clone_prompt=[
                            voice_clone_item(voice.x_vector, voice.ref_codes, voice.ref_text)
                        ],
                    ),
                    SynthesisSpec(text=text, task="voice_clone", voice_prompt=voice),
                )
            )
    return out


MODEL_TYPE = {"custom_voice": "custom_voice", "voice_design": "voice_design", "icl": "base", "xvec": "base"}
TASK = {
    "custom_voice": "custom_voice",
    "voice_design": "voice_design",
    "icl": "voice_clone",
    "xvec": "voice_clone",
}
MODES = list(MODEL_TYPE)


def _run_alone(bundle, prompt, sampling, max_new_frames):
    gen = EagerGenerator(bundle, max_batch=1)
    gen.add("r", prompt, sampling, max_new_frames=max_new_frames)
    frames, last = [], None
    while gen.num_active:
        for o in gen.step():
            if o.codes is not None:
                frames.append(o.codes)
            last = o
    return (torch.stack(frames) if frames else torch.zeros(0, 16, dtype=torch.long)), last


def _official_alone(official, mode: str, idx: int, kw) -> torch.Tensor:
    """The official greedy codes of one request alone, FRAMES long (cached for the batched test)."""
    if (mode, idx) not in _ALONE:
        _ALONE[(mode, idx)] = official_codes(official, TASK[mode], frames=FRAMES, **kw)[0]
    return _ALONE[(mode, idx)]


@pytest.mark.parametrize("mode", MODES)
def test_unbatched_forced_length_equals_official(official_factory, bundle_factory, mode):
    official, bundle = official_factory(MODEL_TYPE[mode]), bundle_factory(MODEL_TYPE[mode])
    for idx, (kw, spec) in enumerate(_cases(mode, bundle.talker.hidden_size)):
        expected = _official_alone(official, mode, idx, kw)
        ours, last = _run_alone(
            bundle, bundle.build_prompt(spec), SamplingParams(greedy=True, min_new_tokens=10**6), FRAMES
        )
        assert last.finish_reason == "length"
        assert torch.equal(ours, expected), f"{mode}: {spec.text!r}"


@pytest.mark.parametrize("mode", ["custom_voice", "icl"])
@pytest.mark.parametrize("streaming", [True, False])
def test_non_default_text_feeding_equals_official(official_factory, bundle_factory, mode, streaming):
    official, bundle = official_factory(MODEL_TYPE[mode]), bundle_factory(MODEL_TYPE[mode])
    kw, spec = _cases(mode, bundle.talker.hidden_size)[0]
    spec.streaming_text = streaming
    expected = official_codes(official, TASK[mode], frames=FRAMES, non_streaming_mode=not streaming, **kw)[0]
    ours, _ = _run_alone(
        bundle, bundle.build_prompt(spec), SamplingParams(greedy=True, min_new_tokens=10**6), FRAMES
    )
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("mode", ["custom_voice", "xvec"])
def test_unforced_greedy_equals_official(official_factory, bundle_factory, mode):
    """Official rules only (EOS masked for the first 2 steps): same frames, same end."""
    official, bundle = official_factory(MODEL_TYPE[mode]), bundle_factory(MODEL_TYPE[mode])
    kw, spec = _cases(mode, bundle.talker.hidden_size)[1]
    expected = official_codes(official, TASK[mode], max_new_tokens=17, **kw)[0]
    ours, last = _run_alone(bundle, bundle.build_prompt(spec), SamplingParams(greedy=True), 16)
    assert torch.equal(ours, expected)
    assert last.finish_reason == ("stop" if len(expected) < 16 else "length")


@pytest.mark.parametrize("mode", MODES)
def test_batched_generator_equals_official(official_factory, bundle_factory, mode):
    """Requests of different lengths join at different steps and leave at different steps; each
    one's codes equal the official batched call and the official call alone."""
    official, bundle = official_factory(MODEL_TYPE[mode]), bundle_factory(MODEL_TYPE[mode])
    cases = _cases(mode, bundle.talker.hidden_size)
    keys = cases[0][0].keys()
    batch_kw = {k: [c[0][k] for c in cases] for k in keys}
    if "voice_clone_prompt" in batch_kw:
        batch_kw["voice_clone_prompt"] = [p[0] for p in batch_kw["voice_clone_prompt"]]
    expected_batched = official_codes(official, TASK[mode], frames=FRAMES, **batch_kw)
    expected_alone = [_official_alone(official, mode, i, kw) for i, (kw, _) in enumerate(cases)]
    for a, b in zip(expected_batched, expected_alone, strict=True):
        assert torch.equal(a, b)

    gen = EagerGenerator(bundle, max_batch=2)  # the third request waits for a free slot
    forced = SamplingParams(greedy=True, min_new_tokens=10**6)
    lengths = {"r0": FRAMES, "r1": FRAMES - 4, "r2": FRAMES - 2}
    got = {rid: [] for rid in lengths}
    reasons = {}
    join_at = {0: ["r0"], 2: ["r1", "r2"]}
    step = 0
    while step == 0 or gen.num_active:
        for rid in join_at.get(step, []):
            idx = int(rid[1])
            gen.add(rid, bundle.build_prompt(cases[idx][1]), forced, max_new_frames=lengths[rid])
        for o in gen.step():
            got[o.request_id].append(o.codes)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        step += 1
    for rid, n in lengths.items():
        idx = int(rid[1])
        assert reasons[rid] == "length"
        assert torch.equal(torch.stack(got[rid]), expected_alone[idx][:n]), rid
