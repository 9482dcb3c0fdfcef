"""The sampling fields' declarations (qtts.request.sampling_overrides): the range check and the
temperature-0 rule read them, and the pure request modules load no protobuf."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from qtts.request import request_limits as lim
from qtts.request.errors import InvalidArgument
from qtts.request.sampling_overrides import (
    OPTIONAL_FIELDS,
    SamplingOverrides,
    check_sampling,
    http_name,
    sampling_field,
    sampling_fields,
    zero_means_greedy,
)

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class WithMinP(SamplingOverrides):
    """The overrides plus one field, declared as a new field of `SamplingOverrides` would be."""

    min_p: float | None = sampling_field(lo=0.0, hi=1.0, http_name="min_prob", description="Min-p threshold.")


def test_every_field_but_greedy_is_declared():
    # A field added without `sampling_field` would be missed by the HTTP model and the range check.
    assert set(OPTIONAL_FIELDS) == {f.name for f in dataclasses.fields(SamplingOverrides)} - {"greedy"}
    assert {f.name: f.type for f in sampling_fields()}["top_k"] is int  # from the annotation
    assert http_name("min_new_frames") == "min_new_tokens" and http_name("top_k") == "top_k"
    assert {f.name: f.model_name for f in sampling_fields()}["min_new_frames"] == "min_new_tokens"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (SamplingOverrides(temperature=1e-45), "temperature must be 0 (greedy) or in 0.001..10.0, got 1e-45"),
        (
            SamplingOverrides(temperature=3.5e38),
            "temperature must be 0 (greedy) or in 0.001..10.0, got 3.5e+38",
        ),
        (SamplingOverrides(top_k=lim.TOP_K_MAX + 1), "top_k must be in 0..100000, got 100001"),
        (SamplingOverrides(top_p=0.0), "top_p must be in 0.001..1.0, got 0.0"),
        (SamplingOverrides(repetition_penalty=11.0), "repetition_penalty must be in 0.1..10.0, got 11.0"),
        (SamplingOverrides(seed=2**63), f"seed must be in 0..{2**63 - 1}, got {2**63}"),
        (SamplingOverrides(min_new_frames=65_537), "min_new_tokens must be in 0..65536, got 65537"),
    ],
)
def test_out_of_range_is_refused_naming_the_http_field(overrides, message):
    with pytest.raises(InvalidArgument) as info:
        check_sampling(overrides)
    assert info.value.message == message and info.value.param == message.split()[0]


def test_the_edges_of_every_declared_range_are_served():
    for f in sampling_fields():
        for value in (f.spec.lo, f.spec.hi):
            check_sampling(SamplingOverrides(**{f.name: f.type(value)}))
    check_sampling(SamplingOverrides(temperature=0.0))  # greedy


def test_a_field_declared_like_the_others_is_checked_too():
    assert [f.name for f in sampling_fields(WithMinP)][-1] == "min_p"
    check_sampling(WithMinP(min_p=0.5))
    with pytest.raises(InvalidArgument) as info:
        check_sampling(WithMinP(min_p=1.5))
    assert (info.value.param, info.value.message) == ("min_prob", "min_prob must be in 0.0..1.0, got 1.5")


def test_temperature_zero_means_greedy():
    assert zero_means_greedy(SamplingOverrides(temperature=0.0, seed=3)) == SamplingOverrides(
        greedy=True, seed=3
    )
    kept = SamplingOverrides(temperature=0.5)
    assert zero_means_greedy(kept) is kept


def test_the_pure_request_modules_load_no_protobuf():
    code = (
        "import sys\n"
        "import qtts.request.vocabulary, qtts.request.sampling_overrides, qtts.request.request_limits\n"
        "print(sorted(m for m in sys.modules if m.startswith(('google.protobuf', 'qtts.pb', 'qtts._gen'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
