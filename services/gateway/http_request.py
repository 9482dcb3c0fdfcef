"""The typed request bodies of the HTTP API: `POST /v1/audio/speech` (OpenAI's fields and
vLLM-Omni's) and the WebSocket `session.config` of `/v1/audio/speech/stream`.

These pydantic models are the one place where the request fields are declared, with their type,
default and range: the parser validates with them and `/openapi.json` and `/docs` are generated
from them. The optional sampling fields are the exception: they are generated from their
declarations in `qtts.request.sampling_overrides.SamplingOverrides` (`sampling_body_fields`), so a
new one needs no edit here. A validation failure becomes one `InvalidArgument` whose `param` names
the field at fault (OpenAI's error shape; `http_body`). The body becomes the one typed request (`SpeechFields`) that every
transport hands to `GatewayCore.validate`, whose one pass checks what depends on the served model
(task, voice, language) and on the server's limits (input length, frame cap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from qtts.request import request_limits as lim
from qtts.request.errors import InvalidArgument
from qtts.request.sampling_overrides import SamplingField, SamplingOverrides, sampling_fields
from qtts.request.vocabulary import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE

from .audio_encoding import G711_CODECS, G711_SAMPLE_RATE, MAX_SPEED, MIN_SPEED
from .http_body import decode_reference_audio, validate_body
from .job import SpeechFields

ResponseFormat = Literal["pcm", "wav", "mp3", "flac", "opus", "aac", "mulaw", "alaw"]
RESPONSE_FORMATS: tuple[str, ...] = get_args(ResponseFormat)
StreamFormat = Literal["audio", "sse"]
SplitGranularity = Literal["sentence", "clause", "none"]


def _integer(value: Any) -> Any:
    """JSON integers, and floats with an integral value (12.0); never booleans or strings."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("int_type", "must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise PydanticCustomError("int_from_float", "must be an integer, got {value}", {"value": value})
        return int(value)
    return value


def _finite(value: int | float) -> bool:
    """Finite, and (an integer) within a double's range: math.isfinite(10**500) raises OverflowError."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(value: Any) -> Any:
    """JSON numbers that are finite (integers too: within a double's range); never booleans or strings."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("float_type", "must be a number")
    if not _finite(value):
        raise PydanticCustomError("finite_number", "must be a finite number")
    return value


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _unicode_text(value: str) -> str:
    """Refuse lone UTF-16 surrogates (JSON's `"\\ud800"`): they have no UTF-8 encoding."""
    if lim.has_surrogate(value):
        raise PydanticCustomError(
            "unicode_surrogate", "contains a lone UTF-16 surrogate (not valid Unicode text)"
        )
    return value


# The validators wrap the whole optional type, so that a Field's range lands in the JSON schema.
Integer = Annotated[int | None, BeforeValidator(_integer)]
Number = Annotated[float | None, BeforeValidator(_number)]
Speed = Annotated[float, BeforeValidator(_number)]
Flag = Annotated[bool, Field(strict=True)]
Text = Annotated[str, Field(strict=True), AfterValidator(_unicode_text)]
VoiceName = Annotated[Text, Field(max_length=lim.VOICE_MAX_CHARS)]


def _zero_or_range(f: SamplingField) -> AfterValidator:
    """Refuse the gap between 0 (greedy) and the range of a field declared `zero_is_greedy`."""

    def check(value: float | None) -> float | None:
        if value is not None and 0 < value < f.spec.lo:
            raise PydanticCustomError(
                f"tts_{f.name}",
                "{name} must be 0 (greedy) or in {lo}..{hi}, got {value}",
                {"name": f.http_name, "lo": f.spec.lo, "hi": f.spec.hi, "value": value},
            )
        return value

    return AfterValidator(check)


def _body_field(f: SamplingField) -> tuple[Any, Any]:
    """The HTTP body field of an optional sampling field, from its declaration: the type, the range
    (0 too where it means greedy; down to -(hi + 1) where negative values wrap) and description."""
    kind: Any = Integer if f.type is int else Number
    lo = f.spec.lo
    if f.spec.zero_is_greedy:
        lo, kind = 0, Annotated[kind, _zero_or_range(f)]
    if f.spec.negative_wraps:
        lo = -(f.spec.hi + 1)
    return kind, Field(None, ge=lo, le=f.spec.hi, description=f.spec.description)


def sampling_body_fields(cls: type = SamplingOverrides) -> dict[str, tuple[Any, Any]]:
    """The HTTP body fields (for `pydantic.create_model`) of the optional sampling fields of `cls`,
    each under its HTTP name."""
    return {f.http_name: _body_field(f) for f in sampling_fields(cls)}


def sampling_from_body(body: BaseModel, cls: type = SamplingOverrides) -> Any:
    """The `cls` overrides of a validated body: each field from the body field of its HTTP name, a
    negative value of a field declared `negative_wraps` taken modulo hi + 1."""
    values = {}
    for f in sampling_fields(cls):
        value = getattr(body, f.http_name)
        if f.spec.negative_wraps and value is not None and value < 0:
            value %= f.spec.hi + 1  # vLLM-Omni takes any signed 64-bit seed; ours are 63-bit non-negative
        values[f.name] = value
    return cls(**values)


class VoiceId(BaseModel):
    """OpenAI's custom voice object: the id of a voice created through `POST /v1/audio/voices`."""

    model_config = ConfigDict(extra="forbid")
    id: VoiceName = Field(min_length=1, description="The voice id (this server's voice name).")


class _SpeechHead(BaseModel):
    """The synthesis fields before the sampling ones (`SpeechOptions` is the whole set)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: Text | None = Field(
        None,
        max_length=lim.MODEL_MAX_CHARS,
        description="Served model name; absent or empty: the served model.",
    )
    voice: VoiceName | VoiceId | None = Field(
        None,
        description="A preset speaker (CustomVoice), a stored voice's name (voice clone), or OpenAI's "
        'custom voice object `{"id": "<voice id>"}`. Ignored by VoiceDesign.',
    )
    speaker: VoiceName | None = Field(
        None, description="vLLM-Omni's name for `voice`; when both are sent they must name the same voice."
    )
    response_format: ResponseFormat = Field(
        "mp3", description="Audio encoding. `mulaw` / `alaw` are raw G.711 bytes at 8 kHz."
    )
    speed: Speed = Field(
        1.0,
        ge=MIN_SPEED,
        le=MAX_SPEED,
        description="Time-stretch with the pitch kept (libavfilter atempo): 2.0 speaks twice as fast.",
    )
    task_type: Text | None = Field(
        None,
        max_length=lim.TASK_MAX_CHARS,
        description="`voice_clone`, `custom_voice`, `voice_design`, or vLLM-Omni's `Base`, `CustomVoice`, "
        "`VoiceDesign` (any case). Absent: the task of the served variant; another task is a 400.",
        examples=["Base", "CustomVoice", "VoiceDesign", "voice_clone"],
    )
    language: Text | None = Field(
        None,
        max_length=lim.LANGUAGE_MAX_CHARS,
        description="A language name of the model (`English`, `Chinese`, ...), an ISO 639-1 code (`en`, "
        "`zh-CN`, ...), or `auto` (the default).",
    )
    instructions: Text | None = Field(
        None,
        max_length=lim.INSTRUCTIONS_MAX_CHARS,
        description="Voice or style instruction: required by VoiceDesign, optional for CustomVoice.",
    )
    ref_audio: Text | None = Field(
        None,
        description="Voice clone reference clip (wav, flac, mp3, ogg, ...) as base64 or a "
        "`data:audio/...;base64,` URL; URLs are not fetched.",
    )
    ref_text: Text | None = Field(
        None,
        max_length=lim.REF_TEXT_MAX_CHARS,
        description="Transcript of `ref_audio`; required with it unless `x_vector_only_mode`.",
    )
    x_vector_only_mode: Flag = Field(
        False,
        description="Clone from the clip's speaker embedding only (no transcript, no reference frames).",
    )
    max_new_tokens: Integer = Field(
        None,
        ge=1,
        le=lim.MAX_FRAMES,
        description="Cap on generated codec frames (12.5 per second of audio), at most the server's "
        "`--max-new-frames-limit`. Above the cap derived from the text length the request ends with finish "
        "reason `length`. Absent: derived from the text length.",
    )


# The optional sampling fields, generated from their declarations in `SamplingOverrides`.
_SpeechSampling = create_model("_SpeechSampling", __base__=_SpeechHead, **sampling_body_fields())


class SpeechOptions(_SpeechSampling):
    """The synthesis fields shared by `POST /v1/audio/speech` and the WebSocket `session.config`.
    A field sent as `null` counts as absent."""

    sample_rate: Integer = Field(
        None,
        ge=MIN_SAMPLE_RATE,
        le=MAX_SAMPLE_RATE,
        description="Output sample rate in Hz. Absent: 24000 (the model's), 8000 for mulaw/alaw (their only "
        "rate); opus takes 8000, 12000, 16000, 24000 or 48000.",
    )
    initial_codec_chunk_frames: Integer = Field(
        None,
        ge=0,
        le=lim.MAX_CHUNK_FRAMES,
        description="vLLM-Omni: frames in the first audio chunk; 0 or absent: the server's chunking "
        "(code2wav caps it at its credit window).",
    )
    non_streaming_mode: Flag | None = Field(
        None,
        description="vLLM-Omni: true feeds the model the whole text up front instead of one token per frame; "
        "absent: the variant's default. It does not change how the response streams.",
    )
    speaker_embedding: list[float] | list[list[float]] | None = Field(
        None,
        description="vLLM-Omni's precomputed x-vector. Checked (finite numbers), but has **no effect** here: "
        "a clone's speaker embedding is always computed from `ref_audio` or the stored voice.",
    )
    extra_params: dict[str, Any] | None = Field(
        None, description="vLLM-Omni's model-specific parameters: accepted, **no effect** here."
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("voice", mode="before")
    @classmethod
    def _voice(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        voice_id = value.get("id") if isinstance(value, dict) and set(value) == {"id"} else None
        if isinstance(voice_id, str) and voice_id.strip():
            return voice_id
        message = f'voice must be a voice name or an object {{"id": "<voice id>"}}, got {repr(value)[:100]}'
        raise PydanticCustomError("tts_voice", "{message}", {"message": message})

    @field_validator("speaker_embedding", mode="before")
    @classmethod
    def _speaker_embedding(cls, value: Any) -> Any:
        rows = value if isinstance(value, list) and value and isinstance(value[0], list) else [value]
        if sum(len(row) if isinstance(row, list) else 1 for row in rows) > lim.SPEAKER_EMBEDDING_MAX_VALUES:
            raise PydanticCustomError(
                "tts_speaker_embedding",
                "speaker_embedding has more than {limit} numbers",
                {"limit": lim.SPEAKER_EMBEDDING_MAX_VALUES},
            )
        for row in rows:
            if not isinstance(row, list) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and _finite(x) for x in row
            ):
                raise PydanticCustomError(
                    "tts_speaker_embedding",
                    "speaker_embedding must be a list of finite numbers (or of such lists)",
                )
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _format_any_case(cls, value: Any) -> Any:
        return _lower(value)

    def to_fields(self, text: str | None) -> SpeechFields:
        """The typed request (cross-field checks and base64 decoding included); `text` None: a
        WebSocket session's, whose text comes later."""
        voice = self.voice.id if isinstance(self.voice, VoiceId) else self.voice
        if (
            voice is not None
            and self.speaker is not None
            and voice.strip().lower() != self.speaker.strip().lower()
        ):
            raise InvalidArgument(
                f"voice {voice!r} and speaker {self.speaker!r} disagree; send one of them", param="speaker"
            )
        sample_rate = self.sample_rate
        if sample_rate is None and self.response_format in G711_CODECS:
            sample_rate = G711_SAMPLE_RATE  # G.711's only rate; another one is refused naming sample_rate
        return SpeechFields(
            text=text,
            model=self.model or "",
            task=self.task_type,
            voice=voice if voice is not None else self.speaker,
            language=self.language,
            instructions=self.instructions,
            reference_audio=decode_reference_audio(self.ref_audio) if self.ref_audio is not None else None,
            reference_text=self.ref_text,
            x_vector_only=self.x_vector_only_mode,
            max_new_frames=self.max_new_tokens,
            sampling=sampling_from_body(self),
            sample_rate=sample_rate,
            first_chunk_frames=self.initial_codec_chunk_frames or 0,
            streaming_text=None if self.non_streaming_mode is None else not self.non_streaming_mode,
        )


class SpeechRequest(SpeechOptions):
    """`POST /v1/audio/speech`: OpenAI's `audio.speech.create` body plus vLLM-Omni's speech fields.
    Any other field is a 400 naming it."""

    input: Text = Field(
        max_length=lim.TEXT_MAX_CHARS,
        description="The text to speak, at most the server's `--max-input-chars`; text made only of "
        "whitespace and control characters is refused.",
    )
    stream: Flag | None = Field(
        None,
        description="Absent or true: the body streams as audio is produced, as OpenAI's does (a `wav` "
        "stream has a header whose size fields are 0xFFFFFFFF). false: one complete file with exact sizes "
        "and the `x-tts-num-frames` / `x-tts-finish-reason` headers.",
    )
    stream_format: StreamFormat = Field(
        "audio",
        description="`audio`: the encoded audio bytes. `sse`: server-sent `speech.audio.delta` events "
        "(base64 audio) and a final `speech.audio.done` with usage; an error after the first byte is an "
        "`error` event.",
    )
    word_timestamps: Flag = Field(
        False,
        description="vLLM-Omni's forced-aligner word timestamps (needs a gateway started with `--aligner`; "
        "without one, true is a 400). With `stream_format` `audio` the answer is one JSON object: the "
        "whole file in `audio` (base64) and `timestamps`, a list of `{word, start_ms, end_ms}`; with "
        "`sse` a `speech.audio.timestamps` event comes after the audio deltas, before "
        "`speech.audio.done`.",
    )

    @field_validator("stream_format", mode="before")
    @classmethod
    def _stream_format_any_case(cls, value: Any) -> Any:
        return _lower(value)

    def output(self) -> OutputOptions:
        return OutputOptions(
            self.response_format, self.stream, self.stream_format, self.speed, self.word_timestamps
        )


class StreamingSessionConfig(SpeechOptions):
    """The first message of a `/v1/audio/speech/stream` WebSocket session (vLLM-Omni's
    `session.config`); it may be sent again between utterances to replace the configuration."""

    type: Literal["session.config"] = "session.config"
    response_format: ResponseFormat = Field(
        "wav", description="Audio encoding of each segment's audio (vLLM-Omni's default: wav)."
    )
    stream_audio: Flag = Field(
        False,
        description="true: binary frames as the audio is produced (a streaming encoder; raw PCM for `pcm`). "
        "false: one binary frame per segment, a complete file, once the segment is synthesised.",
    )
    split_granularity: SplitGranularity = Field(
        "none",
        description="Where the text is cut into segments, each one running request that takes its text as it "
        "arrives (audio starts before the text is complete): `none` (vLLM-Omni's default) one per utterance, "
        "cut only at `input.done`; `sentence` also after . ! ? and CJK marks; `clause` also after , ; and CJK "
        "commas.",
    )
    word_timestamps: Flag = Field(
        False,
        description="vLLM-Omni's forced-aligner word timestamps (needs a gateway started with `--aligner`; "
        "without one, true is refused): each segment's `audio.done` carries `timestamps`, a list of "
        "`{word, start_ms, end_ms}` in ms from the start of the utterance's audio (null when the aligner "
        "failed).",
    )


@dataclass(frozen=True)
class OutputOptions:
    """How the client wants the audio delivered.

    The body streams as audio is produced unless the client sends `"stream": false` (then it is one
    complete file with exact sizes and the `x-tts-*` result headers); OpenAI's API streams by default
    and its SDK's `with_streaming_response` relies on that. SSE always streams."""

    response_format: str = "mp3"
    stream: bool | None = None
    stream_format: str = "audio"
    # Time-stretch of the output (pitch kept): 2.0 speaks twice as fast.
    speed: float = 1.0
    # Word timestamps from the aligner stage; with stream_format "audio" the answer is one JSON
    # object (the audio bytes cannot carry them), so it does not stream.
    word_timestamps: bool = False

    @property
    def streaming(self) -> bool:
        if self.stream_format == "sse":
            return True
        return self.stream is not False and not self.word_timestamps


def parse_speech_body(body: Any) -> tuple[SpeechFields, OutputOptions]:
    """Turn the JSON body into request fields and output options; type errors are 400s."""
    request = validate_body(SpeechRequest, body)
    return request.to_fields(request.input), request.output()
