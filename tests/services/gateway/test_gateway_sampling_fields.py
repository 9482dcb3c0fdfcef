"""A sampling field is declared once, on `SamplingOverrides` (`sampling_field`), and the public API
follows it: a new field touches `protos/tts/v1/tts.proto`, `qtts/request/sampling_overrides.py` and
`docs/api.md`, nothing else. These tests fail when a declared field is missing from one of them
(the HTTP model, its OpenAPI schema, the tts.v1 message, the gRPC path's check, the docs), and show a
field declared the same way on a variant dataclass picked up with no edit of the gateway."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from gateway_fakes import BASE
from pydantic import BaseModel, ConfigDict, create_model

from qtts.pb import tts_pb2
from qtts.request.errors import InvalidArgument
from qtts.request.sampling_overrides import SamplingOverrides, check_sampling, sampling_field, sampling_fields
from qtts.request.sampling_pb import overrides_from_pb, overrides_to_pb
from services.gateway.grpc_servicer import _grpc_field, fields_from_pb
from services.gateway.http_body import validate_body
from services.gateway.http_request import (
    SpeechRequest,
    StreamingSessionConfig,
    parse_speech_body,
    sampling_body_fields,
    sampling_from_body,
)
from services.gateway.validation import RequestLimits, build_job

ROOT = Path(__file__).resolve().parents[3]
FIELDS = sampling_fields()
IDS = [f.name for f in FIELDS]


@dataclass(frozen=True)
class WithMinP(SamplingOverrides):
    """The overrides plus one field, declared as a new field of `SamplingOverrides` would be."""

    min_p: float | None = sampling_field(lo=0.0, hi=1.0, http_name="min_prob", description="Min-p threshold.")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def test_a_new_declared_field_reaches_the_http_model_and_the_range_check():
    body_model = create_model("Body", __base__=_Strict, **sampling_body_fields(WithMinP))
    assert list(body_model.model_fields) == [*(f.http_name for f in FIELDS), "min_prob"]
    schema = body_model.model_json_schema()["properties"]["min_prob"]
    assert schema["description"] == "Min-p threshold."
    assert (schema["anyOf"][0]["minimum"], schema["anyOf"][0]["maximum"]) == (0.0, 1.0)

    body = validate_body(body_model, {"min_prob": 0.25, "min_new_tokens": 4, "seed": -1})
    assert sampling_from_body(body, WithMinP) == WithMinP(min_p=0.25, min_new_frames=4, seed=2**63 - 1)
    with pytest.raises(InvalidArgument) as http:
        validate_body(body_model, {"min_prob": 1.5})
    assert (http.value.param, http.value.message) == ("min_prob", "min_prob must be in 0.0..1.0, got 1.5")
    with pytest.raises(InvalidArgument) as grpc_path:
        check_sampling(WithMinP(min_p=1.5))
    assert (grpc_path.value.param, grpc_path.value.message) == (http.value.param, http.value.message)


@pytest.mark.parametrize("f", FIELDS, ids=IDS)
def test_every_declared_field_is_an_http_body_field_as_declared(f):
    for model in (SpeechRequest, StreamingSessionConfig):
        info = model.model_fields[f.http_name]
        assert info.description == f.spec.description and info.default is None
    prop = SpeechRequest.model_json_schema()["properties"][f.http_name]
    lo = 0 if f.spec.zero_is_greedy else -(f.spec.hi + 1) if f.spec.negative_wraps else f.spec.lo
    assert (prop["anyOf"][0]["minimum"], prop["anyOf"][0]["maximum"]) == (lo, f.spec.hi)
    assert prop["anyOf"][0]["type"] == ("integer" if f.type is int else "number")
    fields, _ = parse_speech_body({"input": "hi", f.http_name: f.type(f.spec.hi)})
    assert getattr(fields.sampling, f.name) == f.spec.hi


@pytest.mark.parametrize("f", FIELDS, ids=IDS)
def test_every_declared_field_is_an_optional_tts_v1_sampling_field(f):
    pb = tts_pb2.SamplingParams.DESCRIPTOR.fields_by_name[f.name]
    assert pb.has_presence  # `optional`: unset is None, the model's default
    sent = SamplingOverrides(**{f.name: f.type(f.spec.hi)})
    assert overrides_from_pb(overrides_to_pb(sent)) == sent
    assert overrides_from_pb(tts_pb2.SamplingParams()) == SamplingOverrides()


def _out_of_range(f) -> list:
    """Values past the declared range that the tts.v1 field can carry (its unsigned ints end at 0)."""
    values = [f.spec.hi * 2 if f.type is float else f.spec.hi + 1]
    if f.type is float and f.spec.lo > 0:
        values.append(f.spec.lo / 2)
    return values


@pytest.mark.parametrize("f", FIELDS, ids=IDS)
def test_every_declared_range_is_checked_on_the_grpc_path(f):
    for value in _out_of_range(f):
        req = tts_pb2.SynthesizeRequest(text="Hello.", voice="a")
        setattr(req.sampling, f.name, value)
        with pytest.raises(InvalidArgument) as info:
            build_job(fields_from_pb(req), BASE, RequestLimits())
        assert info.value.param == f.http_name and "must be" in info.value.message
        assert _grpc_field(info.value.param) == f"sampling.{f.name}"
    req = tts_pb2.SynthesizeRequest(text="Hello.", voice="a")
    setattr(req.sampling, f.name, f.type(f.spec.hi))
    assert build_job(fields_from_pb(req), BASE, RequestLimits()).sampling == fields_from_pb(req).sampling


def test_every_declared_field_is_in_the_docs():
    doc = (ROOT / "docs" / "api.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", doc, re.M))
    grpc_list = re.search(r"`sampling` \(([^;]*);", doc)
    assert grpc_list, "docs/api.md lists the gRPC sampling fields as `sampling` (`a`, `b`, ...; ...)"
    listed = set(re.findall(r"`(\w+)`", grpc_list.group(1)))
    missing = [f.name for f in FIELDS if f.http_name not in rows or f.name not in listed]
    assert not missing, f"sampling fields missing from docs/api.md: {missing}"
