"""Per-request sampling overrides as the public API carries them, shared by gateway and talker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qtts.pb import tts_pb2


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling fields the caller set; None keeps the model's generation_config.json default."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    greedy: bool = False
    # End of speech is not allowed before this many frames (benchmarks fix lengths with it).
    min_new_frames: int | None = None


# The optional fields (None: the model's default), and the public HTTP names that differ from
# them (the body takes vLLM-Omni's `min_new_tokens`): a new field is one line of the dataclass.
OPTIONAL_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingOverrides) if f.name != "greedy")
HTTP_NAMES = {"min_new_frames": "min_new_tokens"}


def http_name(field: str) -> str:
    """The HTTP/WebSocket body's name of a `SamplingOverrides` field."""
    return HTTP_NAMES.get(field, field)


def overrides_from_pb(s: tts_pb2.SamplingParams) -> SamplingOverrides:
    """The overrides set in a `tts.v1.SamplingParams` (unset optional fields stay None)."""
    values = {name: getattr(s, name) if s.HasField(name) else None for name in OPTIONAL_FIELDS}
    return SamplingOverrides(greedy=s.greedy, **values)


def overrides_to_pb(o: SamplingOverrides) -> tts_pb2.SamplingParams:
    """The `tts.v1.SamplingParams` carrying the set overrides."""
    values = {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
    return tts_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})
