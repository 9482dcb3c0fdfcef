"""The one audio output path (services/gateway/audio_output.py) over a fake stream of talker events."""

from __future__ import annotations

import asyncio

from qtts.request.vocabulary import AudioPiece, SynthesisSummary
from services.gateway.audio_output import AudioOutput

FRAME = 1920


class FakeStream:
    def __init__(self, events):
        self._events = events
        self.first_bytes = 0

    async def __aiter__(self):
        for event in self._events:
            yield event

    def first_byte_sent(self) -> None:
        self.first_bytes += 1


def events(frames: int = 3):
    pieces = [AudioPiece(b"\x01\x00" * FRAME, first_frame_index=i, num_frames=1) for i in range(frames)]
    return [*pieces, SynthesisSummary(finish_reason="stop", num_frames=frames, num_samples=frames * FRAME)]


async def chunks(output: AudioOutput, stream: FakeStream) -> list:
    return [chunk async for chunk in output.chunks(stream)]


def test_streaming_chunks_then_the_tail_with_the_summary():
    stream = FakeStream(events())
    out = asyncio.run(chunks(AudioOutput("pcm", 24000), stream))
    assert [(c.first_frame_index, c.num_frames, c.last) for c in out] == [
        (0, 1, False),
        (1, 1, False),
        (2, 1, False),
        (3, 0, True),
    ]
    assert out[-1].data == b"" and sum(c.num_samples for c in out) == 3 * FRAME
    assert all(c.talker_samples == FRAME for c in out[:-1]) and stream.first_bytes == 3


def test_resampled_output_counts_its_own_samples():
    output = AudioOutput("wav", 16000)
    out = asyncio.run(chunks(output, FakeStream(events())))
    assert out[0].data.startswith(b"RIFF") and abs(output.num_samples - 3 * FRAME * 2 // 3) <= 2


def test_a_whole_file_comes_at_the_end():
    stream = FakeStream(events())
    data = asyncio.run(AudioOutput("wav", 24000, streaming=False).collect(stream))
    assert data[:4] == b"RIFF" and len(data) == 44 + 3 * FRAME * 2 and stream.first_bytes == 1
