"""The one request check (qtts.request.vocabulary): the gateway's and the talker's spellings, one logic."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from qtts.request.errors import InvalidArgument, NotFound
from qtts.request.sampling_overrides import SamplingOverrides
from qtts.request.vocabulary import (
    HTTP_FIELDS,
    TALKER_FIELDS,
    TASK_OF_MODEL_TYPE,
    TASKS,
    Task,
    check_request,
    language_name,
)


@dataclass(frozen=True)
class Model:
    name: str = "tiny"
    model_type: str = "custom_voice"
    speakers: tuple[str, ...] = ("ryan", "Vivian")
    languages: tuple[str, ...] = ("English", "chinese")


@dataclass(frozen=True)
class Req:
    text: str = "Hello."
    task: str | None = None
    voice: str | None = None
    language: str | None = None
    instructions: str | None = None
    reference_text: str | None = None
    x_vector_only: bool = False
    request_id: str = ""
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    first_chunk_frames: int = 0
    chunk_frames_ramp: tuple[int, ...] = ()


def test_every_model_type_serves_one_task():
    assert set(TASK_OF_MODEL_TYPE.values()) == set(TASKS) == {t.value for t in Task}


def test_language_names_and_codes():
    assert [language_name(x) for x in (None, " AUTO ", "en-US", "pt_BR", "German")] == [
        "auto",
        "auto",
        "english",
        "portuguese",
        "german",
    ]


def test_custom_voice_resolves_the_models_spelling_and_language():
    checked = check_request(Req(voice=" VIVIAN ", language="en"), Model(), has_reference=False)
    assert (checked.task, checked.voice, checked.speaker, checked.language) == (
        "custom_voice",
        "Vivian",
        "Vivian",
        "english",
    )


def test_task_spellings_and_the_served_task():
    assert (
        check_request(Req(task="CustomVoice", voice="ryan"), Model(), has_reference=False).task
        == "custom_voice"
    )
    with pytest.raises(InvalidArgument, match="a custom_voice model") as info:
        check_request(Req(task="voice_design"), Model(), has_reference=False)
    assert info.value.param == "task_type"


@pytest.mark.parametrize(
    ("names", "params"),
    [
        (HTTP_FIELDS, ("input", "ref_text", "ref_audio")),
        (TALKER_FIELDS, ("text", "reference_text", "reference_pcm_f32")),
    ],
)
def test_errors_name_the_field_as_the_callers_api_spells_it(names, params):
    text, ref_text, ref_audio = params
    with pytest.raises(InvalidArgument) as info:
        check_request(Req(text="\x00 "), Model(), has_reference=False, names=names)
    assert info.value.param == text
    clone = Model(model_type="base")
    with pytest.raises(InvalidArgument) as info:
        check_request(Req(), clone, has_reference=True, names=names)
    assert info.value.param == ref_text and ref_audio in info.value.message
    with pytest.raises(InvalidArgument) as info:
        check_request(Req(voice="ryan"), Model(), has_reference=True, names=names)
    assert info.value.param == ref_audio


def test_voice_and_language_rejections():
    with pytest.raises(NotFound, match="unknown speaker"):
        check_request(Req(voice="nobody"), Model(), has_reference=False)
    with pytest.raises(InvalidArgument, match="unsupported language") as info:
        check_request(Req(voice="ryan", language="klingon"), Model(), has_reference=False)
    assert info.value.param == "language"
    with pytest.raises(InvalidArgument, match="instructions"):
        check_request(Req(), Model(model_type="voice_design"), has_reference=False)


def test_the_reference_is_checked_where_a_clone_takes_it():
    seen = []
    check_request(
        Req(x_vector_only=True),
        Model(model_type="base"),
        has_reference=True,
        check_reference=lambda: seen.append(1),
    )
    assert seen == [1]
