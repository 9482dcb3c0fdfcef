"""GenerateStream on the tiny real model: text appended to one running request, the stream waiting
(skipped, not ended) while its text runs dry, and the codes equal to the whole text's."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re

import grpc
import pytest

from qtts.pb import talker_pb2, tts_pb2
from qtts.streams.chunk_plan import ChunkPlan
from tests.services.talker.fakes import FakeCode2Wav
from tests.services.talker.stack import eventually, generate_all, talker_stack

TEXT = "Hello there, this is a streamed text that keeps going for a while. Then it ends."
GREEDY = tts_pb2.SamplingParams(greedy=True, seed=3)


@pytest.fixture
def bundle(tiny_talker_bundle):
    return tiny_talker_bundle("custom_voice")


def start(bundle, text: str, **kw) -> talker_pb2.GenerateStreamRequest:
    speaker = sorted(bundle.info.speakers)[0]
    req = talker_pb2.GenerateRequest(text=text, voice=speaker, language="english", sampling=GREEDY, **kw)
    return talker_pb2.GenerateStreamRequest(start=req)


def append(text: str, final: bool = False) -> talker_pb2.GenerateStreamRequest:
    return talker_pb2.GenerateStreamRequest(append=talker_pb2.TextAppend(text=text, final=final))


async def read_all(call) -> tuple[int, object]:
    samples, summary = 0, None
    while (msg := await call.read()) != grpc.aio.EOF:
        if msg.WhichOneof("event") == "audio":
            samples += msg.audio.num_samples
        else:
            summary = msg.summary
    return samples, summary


def rpc_count(s, method: str) -> float:
    labels = {"service": "talker", "method": f"/talker.v1.TalkerService/{method}", "code": "OK"}
    return s.talker.metrics.registry.get_sample_value("tts_rpc_requests_total", labels) or 0.0


async def whole_text_frames(bundle, **kw) -> list[int]:
    c2w = FakeCode2Wav("c2w-a")
    async with talker_stack([c2w], bundle=bundle) as s:
        speaker = sorted(bundle.info.speakers)[0]
        _, summary = await generate_all(
            s.stub, text=TEXT, voice=speaker, language="english", sampling=GREEDY, streaming_text=True, **kw
        )
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
    return c2w.logs[0].frames


async def text_then_rest(bundle, first: str, request_id: str, more: asyncio.Event):
    """GenerateStream's requests: `first` (the start of TEXT), then, once `more` is set, the rest
    of TEXT as the final piece."""
    yield start(bundle, first, request_id=request_id)
    await more.wait()
    yield append(TEXT[len(first) :], final=True)


async def test_text_in_pieces_is_one_request_with_the_whole_texts_codes(bundle):
    want = await whole_text_frames(bundle)
    c2w = FakeCode2Wav("c2w-a")
    async with talker_stack([c2w], bundle=bundle) as s:
        words = TEXT.split(" ")
        pieces = [words[0]] + [" " + w for w in words[1:]]

        async def requests():
            yield start(bundle, pieces[0], request_id="pieces")
            for i, piece in enumerate(pieces[1:]):
                yield append(piece, final=i == len(pieces) - 2)

        samples, summary = await read_all(s.stub.GenerateStream(requests()))
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
        assert samples == summary.num_frames * 1920 and summary.num_input_tokens > len(words)
        assert c2w.logs[0].frames == want  # however the pieces met the steps
        assert rpc_count(s, "GenerateStream") == 1 and rpc_count(s, "Generate") == 0
        await eventually(lambda: s.generator.num_active == 0 and c2w.live == 0)


async def test_a_stream_whose_text_ran_dry_waits_then_continues(bundle, caplog):
    caplog.set_level(logging.INFO, logger="services.talker.stream")
    want = await whole_text_frames(bundle)
    c2w = FakeCode2Wav("c2w-a", window=64)
    async with talker_stack([c2w], bundle=bundle) as s:
        more = asyncio.Event()

        call = s.stub.GenerateStream(text_then_rest(bundle, "Hello there, this is a ", "dry", more))
        assert (await call.read()).WhichOneof("event") == "audio"  # audio before the text is complete
        await eventually(lambda: s.gauge("tts_talker_text_waiting_streams") == 1)
        frames = s.generator.active["dry"].frames
        # Long enough for the listener to play out everything it got and wait for the text.
        await asyncio.sleep(frames * 0.08 + 0.3)
        # Waiting: no frame made, nothing ended, the slot kept.
        assert s.generator.active["dry"].frames == frames and s.generator.num_active == 1
        assert len(c2w.logs[0].frames) == frames
        more.set()
        _, summary = await read_all(call)
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
        assert c2w.logs[0].frames == want  # no tts_pad was fed while it waited
        assert s.gauge("tts_talker_text_waiting_streams") == 0
        # The gap was the text's: the playback clock paused, so no chunk counts that long wait as
        # lateness (a slow CPU step may still make one a few tens of milliseconds late).
        late_ms = [int(m) for m in re.findall(r"handed on (\d+) ms late", caplog.text)]
        assert all(ms < 500 for ms in late_ms), late_ms


async def test_a_stream_waiting_for_text_short_of_its_chunk_sends_what_it_has_flushed(bundle):
    """A 16-frame first chunk, and a first piece of text that makes fewer frames: the frames made
    before the text ran dry go to code2wav flushed (decoded though their chunk is short), so the
    listener hears them before more text comes; the chunks after follow the plan from the cut
    (`ChunkPlan.flushed`), and the codes are the whole text's."""
    want = await whole_text_frames(bundle)
    c2w = FakeCode2Wav("c2w-a", window=64, plan=(16, (16,)))
    async with talker_stack([c2w], bundle=bundle) as s:
        more = asyncio.Event()

        call = s.stub.GenerateStream(text_then_rest(bundle, "Hello there, ", "short", more))
        first = await asyncio.wait_for(call.read(), 30)  # without the flush: nothing until `more`
        assert first.WhichOneof("event") == "audio" and 0 < first.audio.num_frames < 16
        await eventually(lambda: s.gauge("tts_talker_text_waiting_streams") == 1)
        log = c2w.logs[0]
        assert log.flushes == [len(log.frames)] == [first.audio.num_frames]
        more.set()
        samples, summary = await read_all(call)
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
        assert samples + first.audio.num_samples == summary.num_frames * 1920
        assert log.frames == want and log.violations == [] and log.ended
        # After the cut every delta but the last ends on a boundary of the plan from there.
        plan = ChunkPlan(16, (16,)).flushed(log.flushes[0])
        ends = list(itertools.accumulate(log.delta_sizes))
        assert ends[0] == log.flushes[0]
        assert all(plan.end_at_or_below(end) == end for end in ends[1:-1]), (plan, ends)
        await eventually(lambda: s.generator.num_active == 0 and c2w.live == 0)


async def test_a_replica_that_does_not_cut_at_a_flush_is_sent_whole_chunks(bundle):
    """An older code2wav (no CreditGrant.cuts_at_flush, as in a rolling upgrade) decodes at its
    plan's boundaries alone: the talker sends it no flush, so both count the same chunks. The
    first piece's frames, short of the 16-frame chunk, wait for the rest of the text."""
    want = await whole_text_frames(bundle)
    c2w = FakeCode2Wav("c2w-a", window=64, plan=(16, (16,)), cuts_at_flush=False)
    async with talker_stack([c2w], bundle=bundle) as s:
        more = asyncio.Event()

        call = s.stub.GenerateStream(text_then_rest(bundle, "Hello there, ", "old-replica", more))
        await eventually(lambda: s.gauge("tts_talker_text_waiting_streams") == 1)
        log = c2w.logs[0]
        assert 0 < s.generator.active["old-replica"].frames < 16
        assert log.frames == [] and log.flushes == []  # held for the chunk
        more.set()
        samples, summary = await read_all(call)
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
        assert samples == summary.num_frames * 1920
        assert log.frames == want and log.violations == [] and log.flushes == [] and log.ended
        ends = list(itertools.accumulate(log.delta_sizes))
        assert all(ChunkPlan(16, (16,)).end_at_or_below(end) == end for end in ends[:-1]), ends
        await eventually(lambda: s.generator.num_active == 0 and c2w.live == 0)


async def test_cancel_while_waiting_for_text_frees_the_slot_and_the_decoder(bundle):
    c2w = FakeCode2Wav("c2w-a")
    async with talker_stack([c2w], bundle=bundle) as s:
        never = asyncio.Event()

        async def requests():
            yield start(bundle, "Hello there, this is a ", request_id="gone")
            await never.wait()

        call = s.stub.GenerateStream(requests())
        assert (await call.read()).WhichOneof("event") == "audio"
        await eventually(lambda: s.gauge("tts_talker_text_waiting_streams") == 1)
        call.cancel()
        await eventually(lambda: s.generator.num_active == 0 and c2w.live == 0, timeout=30)
        assert s.gauge("tts_talker_active_streams") == 0 and s.talker.engine.counts() == (0, 0)


async def test_the_end_of_the_request_stream_completes_the_text(bundle):
    want = await whole_text_frames(bundle)
    c2w = FakeCode2Wav("c2w-a")
    async with talker_stack([c2w], bundle=bundle) as s:
        half = len(TEXT) // 2
        requests = [start(bundle, TEXT[:half], request_id="ends"), append(TEXT[half:])]
        _, summary = await read_all(s.stub.GenerateStream(iter(requests)))
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH and c2w.logs[0].frames == want


@pytest.mark.parametrize(
    "requests, words",
    [
        (lambda b: [append("hi")], "must carry start"),
        (lambda b: [start(b, "Hello there "), start(b, "again")], "only allowed in the first"),
        (lambda b: [start(b, "Hello there ", streaming_text=False)], "streaming-text"),
    ],
)
async def test_protocol_errors_are_invalid_argument(bundle, requests, words):
    async with talker_stack([FakeCode2Wav("c2w-a")], bundle=bundle) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all(s.stub.GenerateStream(iter(requests(bundle))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
        await eventually(lambda: s.generator.num_active == 0)
