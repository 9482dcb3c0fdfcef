"""The talker re-checks every field's range (qtts.request.request_limits): a direct caller cannot put a
row into a batch that would fail the shared sampling step for everyone batched with it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from qtts.pb import talker_pb2, tts_pb2
from qtts.request.errors import InvalidArgument
from qtts.request.sampling_overrides import SamplingOverrides
from services.talker.request import GenerationRequest
from services.talker.validation import check_request
from tests.services.talker.fakes import FakeCode2Wav
from tests.services.talker.stack import generate_all, talker_stack

INFO = SimpleNamespace(name="tiny", model_type="custom_voice", languages=("english",), speakers=("ryan",))
POISON = [
    ({"temperature": 3.5e38}, "temperature"),
    ({"temperature": 1e-45}, "temperature"),
    ({"repetition_penalty": 1e-45}, "repetition_penalty"),
    ({"top_p": 1e-40}, "top_p"),
    ({"top_k": 2**32 - 1}, "top_k"),
    ({"min_new_frames": 2**32 - 1}, "min_new_tokens"),
]


@pytest.mark.parametrize(
    "fields, param",
    [
        *((dict(sampling=SamplingOverrides(**s)), p) for s, p in POISON),
        ({"text": "a" * 120_000}, "text"),
        ({"text": "\x00\x01\u200b"}, "text"),
        ({"instructions": "a" * 200_000}, "instructions"),
        ({"reference_text": "a" * 200_000}, "reference_text"),
        ({"voice": "a" * 200_000}, "voice"),
        ({"request_id": "a" * 200_000}, "request_id"),
        ({"text": "hi \ud800"}, "text"),
        ({"chunk_frames_ramp": (1,) * 1000}, "chunk_frames_ramp"),
        ({"chunk_frames_ramp": (0,)}, "chunk_frames_ramp"),
        ({"first_chunk_frames": 2**31}, "first_chunk_frames"),
        ({"max_new_frames": 2**31}, "max_new_frames"),
        ({"reference_pcm_f32": b"\x00\x00\xc0\x7f" * 4}, "reference_pcm_f32"),  # NaN samples
    ],
)
def test_out_of_range_fields_are_refused_naming_the_field(fields, param):
    req = GenerationRequest(**{"request_id": "r", "text": "Hello.", "voice": "ryan", **fields})
    with pytest.raises(InvalidArgument) as info:
        check_request(req, INFO)
    assert info.value.param == param


@pytest.fixture
def custom_voice_bundle(tiny_talker_bundle):
    return tiny_talker_bundle("custom_voice")


async def test_a_poisoned_request_next_to_good_streams_is_refused_and_theirs_are_unchanged(
    custom_voice_bundle,
):
    speaker = sorted(custom_voice_bundle.info.speakers)[0]
    c2w = FakeCode2Wav("c2w-a")

    def good(i: int) -> dict:
        return dict(
            request_id=f"good-{i}",
            text=f"Hello world number {i}.",
            voice=speaker,
            language="english",
            max_new_frames=4,
            sampling=tts_pb2.SamplingParams(greedy=True),
        )

    async with talker_stack([c2w], bundle=custom_voice_bundle, max_batch=8) as s:
        alone = await asyncio.gather(*(generate_all(s.stub, **good(i)) for i in range(3)))
        codes_alone = {log.request_id: list(log.frames) for log in c2w.logs}

        async def poisoned(i: int, sampling: dict):
            req = talker_pb2.GenerateRequest(
                request_id=f"bad-{i}",
                text="Hello.",
                voice=speaker,
                max_new_frames=4,
                sampling=tts_pb2.SamplingParams(**sampling),
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in s.stub.Generate(req):
                    pass
            return info.value

        c2w.logs.clear()
        results = await asyncio.gather(
            *(generate_all(s.stub, **good(i)) for i in range(3)),
            *(poisoned(i, sampling) for i, (sampling, _) in enumerate(POISON)),
        )
    for (_, summary), (_, alone_summary) in zip(results[:3], alone, strict=True):
        assert summary.num_frames == alone_summary.num_frames == 4
    for err, (_, param) in zip(results[3:], POISON, strict=True):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and param in err.details()
    assert {log.request_id: list(log.frames) for log in c2w.logs} == codes_alone
