"""The one pass of `check_request` at the edge (the gateway's bounds) and behind it (the talker)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from test_vocabulary import Model, Req

from qtts.request.errors import InvalidArgument, NotFound
from qtts.request.sampling_overrides import SamplingOverrides
from qtts.request.vocabulary import check_request


@dataclass(frozen=True)
class EdgeReq(Req):
    model: str = ""
    reference_audio: bytes | None = None
    max_new_frames: int | None = None
    sample_rate: int | None = None


@dataclass(frozen=True)
class EdgeModel(Model):
    model_size: str = "0b6"


@dataclass(frozen=True)
class Limits:
    max_input_chars: int = 20
    max_new_frames_limit: int = 50
    max_ref_audio_bytes: int = 10
    default_sample_rate: int = 16000


def edge(req: EdgeReq, model: EdgeModel = EdgeModel(), **kw):
    has_reference = req.reference_audio is not None
    return check_request(req, model, has_reference=has_reference, edge=Limits(), **kw)


def test_the_edge_resolves_every_field_in_one_result():
    checked = edge(
        EdgeReq(
            text="  Hello.  ",
            voice="ryan",
            language="en",
            max_new_frames=7,
            sampling=SamplingOverrides(temperature=0.0, seed=4),
        )
    )
    assert (checked.text, checked.voice, checked.language) == ("Hello.", "ryan", "english")
    assert (checked.max_new_frames, checked.sample_rate, checked.ignored_fields) == (7, 16000, ())
    assert checked.sampling == SamplingOverrides(greedy=True, seed=4)


def test_the_model_name_comes_first_and_the_edge_bounds_last():
    with pytest.raises(NotFound) as info:  # before the empty text
        edge(EdgeReq(text="", model="other"))
    assert info.value.param == "model"
    with pytest.raises(InvalidArgument, match="limit is 20") as info:
        edge(EdgeReq(text="x" * 21, voice="ryan"))
    assert info.value.param == "input"
    with pytest.raises(NotFound, match="unknown speaker"):  # the voice before the frame cap
        edge(EdgeReq(voice="nobody", max_new_frames=51))
    with pytest.raises(InvalidArgument, match="max_new_tokens must be in 1..50") as info:
        edge(EdgeReq(voice="ryan", max_new_frames=51))
    assert info.value.param == "max_new_tokens"
    with pytest.raises(InvalidArgument, match="sample_rate") as info:
        edge(EdgeReq(voice="ryan", sample_rate=4000))
    assert info.value.param == "sample_rate"


def test_the_reference_size_is_checked_where_a_clone_takes_it():
    base = EdgeModel(model_type="base")
    with pytest.raises(InvalidArgument, match="ref_audio is 11 bytes; the limit is 10") as info:
        edge(EdgeReq(reference_audio=b"x" * 11, x_vector_only=True), base)
    assert info.value.param == "ref_audio"
    checked = edge(EdgeReq(reference_audio=b"x" * 10, x_vector_only=True, reference_text="t"), base)
    assert (checked.x_vector_only, checked.reference_text) == (True, "")
    stored = edge(EdgeReq(voice="mine", x_vector_only=True, reference_text="t"), base)
    assert (stored.voice, stored.x_vector_only, stored.reference_text) == ("mine", False, "")


def test_instructions_the_variant_cannot_take_are_refused_or_ignored():
    small = EdgeModel()  # 0.6B CustomVoice: no instruct block
    with pytest.raises(InvalidArgument, match="not supported by tiny") as info:
        edge(EdgeReq(voice="ryan", instructions="calm"), small)
    assert info.value.param == "instructions"
    ignored = edge(EdgeReq(voice="ryan", instructions="calm"), small, unsupported_instructions="ignore")
    assert (ignored.instructions, ignored.ignored_fields) == ("", ("instructions",))
    large = edge(EdgeReq(voice="ryan", instructions=" calm "), EdgeModel(model_size="1b7"))
    assert (large.instructions, large.ignored_fields) == ("calm", ())
    # Behind the edge (the talker) the prompt builder drops them: no policy there.
    assert (
        check_request(Req(voice="ryan", instructions="calm"), small, has_reference=False).instructions
        == "calm"
    )


def test_a_session_without_text_is_checked_but_for_its_text():
    checked = edge(EdgeReq(text=None, voice="ryan"))
    assert (checked.text, checked.voice) == ("", "ryan")
    with pytest.raises(NotFound, match="unknown speaker"):
        edge(EdgeReq(text=None, voice="nobody"))
