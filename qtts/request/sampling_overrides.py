"""Per-request sampling overrides as the public API carries them, shared by gateway and talker.

Each optional field is declared once, here, with `sampling_field`: its type, its range, its one-line
description and (where they differ) its HTTP name and its model name. Everything else follows the
declaration: the gateway's HTTP/WebSocket body fields and OpenAPI schema
(`services.gateway.http_request`), the range check of the one request pass that the gateway (every
transport) and the talker run (`check_sampling`), the protobuf converters
(`qtts.request.sampling_pb`), gRPC's error paths and the talker's merge over the model's defaults. A new field is one `sampling_field` line here, one
`optional` field of `tts.v1.SamplingParams` and one row of docs/api.md.

Pure (no torch, no protobuf).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any

from qtts.request import request_limits as lim
from qtts.request.errors import InvalidArgument

# The `dataclasses.field` metadata key of a field's `FieldSpec`.
SPEC_KEY = "qtts.sampling"


@dataclass(frozen=True)
class FieldSpec:
    """The public declaration of an optional sampling field (None: the model's default).

    `lo`..`hi`: the range every edge enforces (sampling runs batched: one row out of it would spoil
    its whole batch). `description`: the HTTP schema's one line. `http_name`: the HTTP/WebSocket
    body's name, where it differs from the field's (also the `param` errors name). `model_name`: the
    name in `qtts.model.SamplingParams` (generation_config.json), where it differs.
    `zero_is_greedy`: 0 is accepted too and means greedy decoding (temperature).
    `negative_wraps`: HTTP also takes negative values, down to -(hi + 1), modulo hi + 1 (vLLM-Omni's
    signed 64-bit seeds)."""

    lo: float
    hi: float
    description: str
    http_name: str = ""
    model_name: str = ""
    zero_is_greedy: bool = False
    negative_wraps: bool = False


@dataclass(frozen=True)
class SamplingField:
    """One optional field of a `SamplingOverrides` dataclass: name, value type, declaration."""

    name: str
    type: type  # int or float
    spec: FieldSpec

    @property
    def http_name(self) -> str:
        return self.spec.http_name or self.name

    @property
    def model_name(self) -> str:
        return self.spec.model_name or self.name


def sampling_field(
    *,
    lo: float,
    hi: float,
    description: str,
    http_name: str = "",
    model_name: str = "",
    zero_is_greedy: bool = False,
    negative_wraps: bool = False,
) -> Any:
    """A `SamplingOverrides` field (default None) declared with its range and API names."""
    spec = FieldSpec(lo, hi, description, http_name, model_name, zero_is_greedy, negative_wraps)
    return dataclasses.field(default=None, metadata={SPEC_KEY: spec})


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling fields the caller set; None keeps the model's generation_config.json default."""

    temperature: float | None = sampling_field(
        lo=lim.TEMPERATURE_MIN,
        hi=lim.TEMPERATURE_MAX,
        zero_is_greedy=True,
        description=f"Sampling temperature: 0 is greedy decoding, otherwise in {lim.TEMPERATURE_MIN}.."
        f"{lim.TEMPERATURE_MAX}. Absent: the model's default.",
    )
    top_k: int | None = sampling_field(lo=0, hi=lim.TOP_K_MAX, description="Top-k sampling; 0 disables it.")
    top_p: float | None = sampling_field(
        lo=lim.TOP_P_MIN, hi=lim.TOP_P_MAX, description="Nucleus sampling threshold."
    )
    repetition_penalty: float | None = sampling_field(
        lo=lim.REPETITION_PENALTY_MIN,
        hi=lim.REPETITION_PENALTY_MAX,
        description="Penalty on repeated codebook-0 tokens (the model's default is 1.05).",
    )
    seed: int | None = sampling_field(
        lo=0,
        hi=lim.SEED_MAX,
        negative_wraps=True,
        description="Sampling seed for reproducible output; a negative seed is taken modulo 2^63.",
    )
    greedy: bool = False
    # End of speech is not allowed before this many frames (benchmarks fix lengths with it).
    min_new_frames: int | None = sampling_field(
        lo=0,
        hi=lim.MAX_FRAMES,
        http_name="min_new_tokens",
        model_name="min_new_tokens",
        description="End of speech is not allowed before this many frames (default 2).",
    )


@functools.cache
def sampling_fields(cls: type = SamplingOverrides) -> tuple[SamplingField, ...]:
    """The optional fields of `cls` (a `SamplingOverrides` or a dataclass declared like it), in
    declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(SPEC_KEY)
        if spec is None:
            continue
        kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        if len(kinds) != 1 or kinds[0] not in (int, float):
            raise TypeError(f"sampling field {f.name} must be `int | None` or `float | None`")
        out.append(SamplingField(f.name, kinds[0], spec))
    return tuple(out)


# The optional fields (None: the model's default) of `SamplingOverrides`; `greedy` is the one other.
OPTIONAL_FIELDS = tuple(f.name for f in sampling_fields())


def http_name(field: str, cls: type = SamplingOverrides) -> str:
    """The HTTP/WebSocket body's name of a `SamplingOverrides` field."""
    return next((f.http_name for f in sampling_fields(cls) if f.name == field), field)


def check_sampling(s: Any) -> None:
    """Raise InvalidArgument (naming the field as HTTP does) unless every set field is in range."""
    for f in sampling_fields(type(s)):
        value = getattr(s, f.name)
        if value is None:
            continue
        lo, hi = f.spec.lo, f.spec.hi
        if f.spec.zero_is_greedy and not (value == 0 or lo <= value <= hi):
            raise InvalidArgument(
                f"{f.http_name} must be 0 (greedy) or in {lo}..{hi}, got {value}", param=f.http_name
            )
        if not f.spec.zero_is_greedy and not lo <= value <= hi:
            raise InvalidArgument(f"{f.http_name} must be in {lo}..{hi}, got {value}", param=f.http_name)


def zero_means_greedy(s: Any) -> Any:
    """`s` with a field declared `zero_is_greedy` at 0 (temperature 0, as in the OpenAI sampling
    APIs) turned into greedy decoding (the field unset, `greedy` set)."""
    zeros = {
        f.name: None for f in sampling_fields(type(s)) if f.spec.zero_is_greedy and getattr(s, f.name) == 0
    }
    if zeros and not s.greedy:
        return dataclasses.replace(s, greedy=True, **zeros)
    return s
