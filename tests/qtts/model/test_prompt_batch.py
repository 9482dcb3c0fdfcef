"""Prompts built together (`PromptBuilder.build_many`) equal the official package's and each
prompt built alone, bit for bit, whatever shares their batch; a bad spec fails only itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qtts.model import SynthesisSpec
from qtts.request.errors import InvalidArgument
from tests.qtts.model.reference import official_prompt, voice_clone_item
from tests.qtts.model.test_prompt import TEXTS, _same, _voice

pytestmark = pytest.mark.reference


def _specs(hidden: int) -> list[SynthesisSpec]:
    icl_a = _voice(hidden, 40, seed=201)
    icl_b = _voice(hidden, 3, seed=202)
    xvec = _voice(hidden, None, seed=203)
    return [
        SynthesisSpec(text=TEXTS[0], task="voice_clone", language="English", voice_prompt=icl_a),
        SynthesisSpec(text=TEXTS[1], task="voice_clone", voice_prompt=icl_b, streaming_text=False),
        SynthesisSpec(text=TEXTS[2], task="voice_clone", language="German", voice_prompt=xvec),
        SynthesisSpec(text=TEXTS[3], task="voice_clone", voice_prompt=icl_a),  # the same voice again
        SynthesisSpec(text=TEXTS[2], task="voice_clone", voice_prompt=icl_b, streaming_text=False),
    ]


def _equal(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and torch.equal(x, y), f.name
        elif f.name != "text_feed":
            assert x == y, f.name


def test_a_batch_equals_the_official_prompts(official_factory, bundle_factory):
    official = official_factory("base")
    bundle = bundle_factory("base")
    specs = _specs(bundle.talker.hidden_size)
    built = bundle.prompt_builder.build_many(specs)
    for spec, ours in zip(specs, built, strict=True):
        voice = spec.voice_prompt
        off = official_prompt(
            official,
            "voice_clone",
            text=spec.text,
            language=spec.language if spec.language != "auto" else "Auto",
            voice_clone_prompt=[voice_clone_item(voice.x_vector, voice.ref_codes, voice.ref_text)],
            non_streaming_mode=spec.streaming_text is False,
        )
        _same(ours, off)


def test_a_batch_equals_each_prompt_built_alone_and_errors_stay_with_their_spec(bundle_factory):
    bundle = bundle_factory("base")
    builder = bundle.prompt_builder
    specs = _specs(bundle.talker.hidden_size)
    bad = [
        dataclasses.replace(specs[0], text=""),
        dataclasses.replace(specs[0], language="klingon"),
        dataclasses.replace(specs[0], task="custom_voice"),
        dataclasses.replace(specs[0], voice_prompt=None),
    ]
    mixed = [specs[0], bad[0], specs[1], bad[1], specs[2], bad[2], specs[3], bad[3], specs[4]]
    built = builder.build_many(mixed)
    assert [type(b).__name__ for b in built[1::2]] == ["InvalidArgument"] * 4
    assert all(isinstance(b, InvalidArgument) for b in built[1::2])
    for spec, together in zip(specs, built[0::2], strict=True):
        _equal(together, builder.build(spec))
    # Built again in other company (reversed, in pairs), every prompt is the same bits.
    again = [
        p for i in range(len(specs) - 1, -1, -2) for p in builder.build_many(specs[max(0, i - 1) : i + 1])
    ]
    order = [i for i in range(len(specs) - 1, -1, -2) for i in range(max(0, i - 1), i + 1)]
    for i, prompt in zip(order, again, strict=True):
        _equal(prompt, built[2 * i])
    # Trailing text is a tensor of its own: it does not keep the batch's embeddings alive.
    assert built[0].trailing.untyped_storage().data_ptr() != built[0].embeds.untyped_storage().data_ptr()


def test_a_text_open_spec_that_needs_more_text_fails_alone(bundle_factory):
    from qtts.model.prompt import NeedMoreText

    bundle = bundle_factory("base")
    specs = _specs(bundle.talker.hidden_size)
    short = dataclasses.replace(specs[0], text="Hi", text_open=True)  # 40 reference frames
    built = bundle.prompt_builder.build_many([short, specs[2]])
    assert isinstance(built[0], NeedMoreText)
    _equal(built[1], bundle.prompt_builder.build(specs[2]))
