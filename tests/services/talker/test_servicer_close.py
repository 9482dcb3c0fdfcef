"""A talker call that ends early (the gateway cancelled it) frees its stream within the close of
the handler: Generate and GenerateStream close the core's stream at once, not when the garbage
collector finds the inner generator."""

from __future__ import annotations

import asyncio

from qtts.pb import talker_pb2
from qtts.request.vocabulary import AudioPiece
from services.talker.servicer import TalkerServicer


class EndlessCore:
    """The core's `generate`: audio until closed; records the close."""

    def __init__(self):
        self.closed: list[str] = []

    async def generate(self, req, text=None):
        try:
            while True:
                await asyncio.sleep(0)
                yield AudioPiece(b"\0" * 3840, 0, 1)
        finally:
            self.closed.append(req.request_id)


class Context:
    def invocation_metadata(self):
        return ()


async def _start_pieces():
    yield talker_pb2.GenerateStreamRequest(start=talker_pb2.GenerateRequest(request_id="s-1", text="Hi"))
    await asyncio.Event().wait()  # the text stays open


async def test_closing_generate_closes_the_core_stream_within_the_close():
    core = EndlessCore()
    servicer = TalkerServicer(core)
    calls = servicer.Generate(talker_pb2.GenerateRequest(request_id="g-1", text="Hi"), Context())
    assert (await anext(calls)).audio.num_frames == 1
    await calls.aclose()  # no loop turn after it: a finalizer-run close would not have run yet
    assert core.closed == ["g-1"]


async def test_closing_generate_stream_closes_the_core_stream_within_the_close():
    core = EndlessCore()
    servicer = TalkerServicer(core)
    calls = servicer.GenerateStream(_start_pieces(), Context())
    assert (await anext(calls)).audio.num_frames == 1
    await calls.aclose()
    assert core.closed == ["s-1"]
