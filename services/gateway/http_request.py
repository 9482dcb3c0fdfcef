"""Parsing of the OpenAI-shaped `POST /v1/audio/speech` JSON body into protocol-neutral fields."""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any

from qtts.errors import InvalidArgument

from .audio_encoding import G711_CODECS, G711_SAMPLE_RATE, check_speed
from .job import SamplingOptions, SpeechFields

RESPONSE_FORMATS = ("pcm", "wav", "mp3", "flac", "opus", "aac", "mulaw", "alaw")
STREAM_FORMATS = ("audio", "sse")
# Larger values are capped by the code2wav replica (its credit window) anyway.
MAX_INITIAL_CHUNK_FRAMES = 4096
_KNOWN_FIELDS = {
    "model",
    "input",
    "voice",
    "speaker",
    "response_format",
    "speed",
    "stream",
    "stream_format",
    "task_type",
    "language",
    "instructions",
    "ref_audio",
    "ref_text",
    "x_vector_only_mode",
    "max_new_tokens",
    "seed",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "min_new_tokens",
    "sample_rate",
    # vLLM-Omni's speech API: initial_codec_chunk_frames and non_streaming_mode map onto the
    # talker's chunking and text feeding; speaker_embedding and extra_params are accepted and have
    # no effect here.
    "speaker_embedding",
    "initial_codec_chunk_frames",
    "non_streaming_mode",
    "extra_params",
}


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

    @property
    def streaming(self) -> bool:
        return self.stream is not False or self.stream_format == "sse"


def _get(body: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int subclass: never accept true/false where a number is expected.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise InvalidArgument(f"{key} must be {what}, got {value!r}", param=key)
    if not isinstance(value, kind):
        raise InvalidArgument(f"{key} must be {what}, got {type(value).__name__}", param=key)
    return value


def _number(body: dict, key: str) -> float | None:
    value = _get(body, key, (int, float), "a number")
    if value is not None and not math.isfinite(value):
        raise InvalidArgument(f"{key} must be a finite number", param=key)
    return None if value is None else float(value)


def _integer(body: dict, key: str) -> int | None:
    value = _get(body, key, (int, float), "an integer")
    if value is None:
        return None
    if isinstance(value, float):
        if not value.is_integer():
            raise InvalidArgument(f"{key} must be an integer, got {value}", param=key)
        value = int(value)
    return value


def _voice(body: dict) -> str | None:
    """A voice name, or OpenAI's custom voice object `{"id": "<voice id>"}` (the id is the name)."""
    value = body.get("voice")
    if value is None or isinstance(value, str):
        return value
    voice_id = value.get("id") if isinstance(value, dict) and set(value) == {"id"} else None
    if isinstance(voice_id, str) and voice_id.strip():
        return voice_id
    shown = repr(value)[:100]
    raise InvalidArgument(
        f'voice must be a voice name or an object {{"id": "<voice id>"}}, got {shown}', param="voice"
    )


def _voice_or_speaker(body: dict) -> str | None:
    """`voice`, or vLLM-Omni's `speaker` (its CustomVoice field) as another name for it."""
    voice, speaker = _voice(body), _get(body, "speaker", str, "a string")
    if voice is not None and speaker is not None and voice.strip().lower() != speaker.strip().lower():
        raise InvalidArgument(
            f"voice {voice!r} and speaker {speaker!r} disagree; send one of them", param="speaker"
        )
    return voice if voice is not None else speaker


def _speaker_embedding(body: dict) -> None:
    """vLLM-Omni's precomputed x-vector: checked (numbers, or lists of numbers), then not used."""
    value = body.get("speaker_embedding")
    if value is None:
        return
    rows = value if isinstance(value, list) and value and isinstance(value[0], list) else [value]
    for row in rows:
        if not isinstance(row, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in row
        ):
            raise InvalidArgument(
                "speaker_embedding must be a list of finite numbers (or of such lists)",
                param="speaker_embedding",
            )


def _streaming_text(body: dict) -> bool | None:
    """vLLM-Omni's `non_streaming_mode`: true feeds the whole text up front, false one token per frame."""
    value = _get(body, "non_streaming_mode", bool, "a boolean")
    return None if value is None else not value


def decode_base64_audio(value: str, field_name: str = "ref_audio") -> bytes:
    """Decode plain base64 or a `data:audio/...;base64,` URL; raise InvalidArgument otherwise."""
    data = value.strip()
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidArgument(
                f"{field_name} data URL must be base64 encoded (data:audio/...;base64,...)", param=field_name
            )
    elif data.startswith(("http://", "https://", "file:")):
        raise InvalidArgument(
            f"{field_name} must be base64 audio or a data URL; URLs are not fetched", param=field_name
        )
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"{field_name} is not valid base64: {exc}", param=field_name) from None
    if not raw:
        raise InvalidArgument(f"{field_name} is empty", param=field_name)
    return raw


def parse_speech_body(body: Any) -> tuple[SpeechFields, OutputOptions]:
    """Turn the JSON body into request fields and output options; type errors are 400s."""
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise InvalidArgument(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    text = _get(body, "input", str, "a string")
    if text is None:
        raise InvalidArgument("input is required", param="input")
    fmt = (_get(body, "response_format", str, "a string") or "mp3").lower()
    if fmt not in RESPONSE_FORMATS:
        raise InvalidArgument(
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt!r}",
            param="response_format",
        )
    stream_format = (_get(body, "stream_format", str, "a string") or "audio").lower()
    if stream_format not in STREAM_FORMATS:
        raise InvalidArgument(
            f"stream_format must be 'audio' or 'sse', got {stream_format!r}", param="stream_format"
        )
    speed = _number(body, "speed")
    if speed is not None:
        check_speed(speed)
    sample_rate = _integer(body, "sample_rate")
    if sample_rate is None and fmt in G711_CODECS:
        sample_rate = G711_SAMPLE_RATE  # G.711's only rate; another one is refused naming sample_rate
    stream = _get(body, "stream", bool, "a boolean")
    ref_audio = _get(body, "ref_audio", str, "a base64 string or data URL")
    seed = _integer(body, "seed")
    if seed is not None and -(2**63) <= seed < 0:
        seed %= 2**63  # vLLM-Omni takes any signed 64-bit seed; ours are 63-bit non-negative
    top_k = _integer(body, "top_k")
    first_chunk = _integer(body, "initial_codec_chunk_frames")
    if first_chunk is not None and not (0 <= first_chunk <= MAX_INITIAL_CHUNK_FRAMES):
        raise InvalidArgument(
            f"initial_codec_chunk_frames must be in 0..{MAX_INITIAL_CHUNK_FRAMES}, got {first_chunk}",
            param="initial_codec_chunk_frames",
        )
    _get(body, "extra_params", dict, "an object")
    _speaker_embedding(body)
    fields = SpeechFields(
        text=text,
        model=_get(body, "model", str, "a string") or "",
        task=_get(body, "task_type", str, "a string"),
        voice=_voice_or_speaker(body),
        language=_get(body, "language", str, "a string"),
        instructions=_get(body, "instructions", str, "a string"),
        reference_audio=decode_base64_audio(ref_audio) if ref_audio is not None else None,
        reference_text=_get(body, "ref_text", str, "a string"),
        x_vector_only=bool(_get(body, "x_vector_only_mode", bool, "a boolean")),
        max_new_frames=_integer(body, "max_new_tokens"),
        sampling=SamplingOptions(
            temperature=_number(body, "temperature"),
            top_k=top_k,
            top_p=_number(body, "top_p"),
            repetition_penalty=_number(body, "repetition_penalty"),
            seed=seed,
            min_new_frames=_integer(body, "min_new_tokens"),
        ),
        sample_rate=sample_rate,
        first_chunk_frames=first_chunk or 0,
        streaming_text=_streaming_text(body),
    )
    return fields, OutputOptions(
        response_format=fmt, stream=stream, stream_format=stream_format, speed=1.0 if speed is None else speed
    )
