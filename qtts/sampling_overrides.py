"""Per-request sampling overrides as the public API carries them, shared by gateway and talker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qtts.pb import tts_pb2

_OPTIONAL = ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "min_new_frames")


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


def overrides_from_pb(s: tts_pb2.SamplingParams) -> SamplingOverrides:
    """The overrides set in a `tts.v1.SamplingParams` (unset optional fields stay None)."""
    values = {name: getattr(s, name) if s.HasField(name) else None for name in _OPTIONAL}
    return SamplingOverrides(greedy=s.greedy, **values)


def overrides_to_pb(o: SamplingOverrides) -> tts_pb2.SamplingParams:
    """The `tts.v1.SamplingParams` carrying the set overrides."""
    values = {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
    return tts_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})
