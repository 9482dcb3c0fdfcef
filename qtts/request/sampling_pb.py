"""`SamplingOverrides` <-> `tts.v1.SamplingParams`, for the gRPC edges only (the gateway's servicer
and talker client, the talker's servicer): the pure request modules never import protobuf."""

from __future__ import annotations

import dataclasses

from qtts.pb import tts_pb2
from qtts.request.sampling_overrides import OPTIONAL_FIELDS, SamplingOverrides


def overrides_from_pb(s: tts_pb2.SamplingParams) -> SamplingOverrides:
    """The overrides set in a `tts.v1.SamplingParams` (unset optional fields stay None)."""
    values = {name: getattr(s, name) if s.HasField(name) else None for name in OPTIONAL_FIELDS}
    return SamplingOverrides(greedy=s.greedy, **values)


def overrides_to_pb(o: SamplingOverrides) -> tts_pb2.SamplingParams:
    """The `tts.v1.SamplingParams` carrying the set overrides."""
    values = {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
    return tts_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})
