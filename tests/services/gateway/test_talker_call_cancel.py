"""Closing the gateway's talker stream early (its client went away) cancels the talker call at once,
on every path through `TalkerClient.generate`: the call's `finally` runs within the close, not when
the garbage collector finds the inner generator (a reference cycle held a talker slot for seconds)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from qtts.pb import talker_pb2, tts_pb2
from services.gateway.talker_client import TalkerClient
from tests.synthesis_jobs import talker_job

PCM = (np.sin(np.arange(4800) / 9) * 0.3).astype(np.float32)


class EndlessCall:
    """A Generate call that yields audio until cancelled, and records the cancel."""

    def __init__(self):
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __aiter__(self):
        return self

    async def __anext__(self) -> talker_pb2.GenerateResponse:
        await asyncio.sleep(0)
        return talker_pb2.GenerateResponse(
            audio=tts_pb2.AudioChunk(audio=b"\0" * 3840, num_samples=1920, first_frame_index=0, num_frames=1)
        )


class EndlessStub:
    def __init__(self):
        self.calls: list[EndlessCall] = []

    def Generate(self, request, metadata=()):  # noqa: N802 - gRPC method name
        self.calls.append(EndlessCall())
        return self.calls[-1]


@pytest.mark.parametrize("path", ["no clip", "clip sent", "digest only"])
async def test_closing_the_stream_cancels_the_talker_call_within_the_close(path):
    client = TalkerClient("127.0.0.1:1", sessions=False)  # Generate calls (Session: test_talker_session)
    stub = client._stub = EndlessStub()
    try:
        if path == "no clip":
            job = talker_job("r-1")
        else:
            job = talker_job("r-1", task="voice_clone", voice="", reference_audio=b"RIFF", reference_pcm=PCM)
        if path == "digest only":  # the talkers hold this clip: the call carries its digest alone
            first = client.generate(job)
            await anext(first)
            await first.aclose()
        events = client.generate(job)
        assert (await anext(events)).num_frames == 1
        await events.aclose()  # no loop turn after it: a finalizer-run cancel would not have run yet
        assert stub.calls[-1].cancelled
        assert all(call.cancelled for call in stub.calls)
    finally:
        await client.close()
