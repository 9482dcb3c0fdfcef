"""The one path from the talker's audio to a client's bytes, shared by HTTP, SSE, WebSocket and gRPC:
time-stretch by `speed`, resample to the requested rate, encode to the requested format."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtts.request.vocabulary import NATIVE_SAMPLE_RATE, AudioPiece, SynthesisSummary

from .audio_encoding import Resampler, make_encoder

if TYPE_CHECKING:
    from .core import SynthesisStream


@dataclass(frozen=True)
class OutputChunk:
    """Encoded bytes ready to send, and what they cover.

    `num_samples`: output samples pushed with this chunk (an encoder may hold some back);
    `talker_samples`: talker samples that went in since the chunk before; `last`: the tail, when
    the talker's summary came (`num_frames` 0; its `data` may be empty, no other chunk's is)."""

    data: bytes
    num_samples: int
    first_frame_index: int
    num_frames: int
    talker_samples: int
    last: bool = False


class AudioOutput:
    """One request's output: `streaming` hands out bytes as they are produced; otherwise one
    complete file comes with the tail."""

    def __init__(
        self,
        response_format: str,
        sample_rate: int,
        speed: float = 1.0,
        streaming: bool = True,
        keep_native: bool = False,
    ):
        self.response_format = response_format
        # The talker's own 24 kHz PCM, kept when the aligner needs it (word timestamps).
        self.native_pcm: list[bytes] | None = [] if keep_native else None
        self.sample_rate = sample_rate
        self._encoder = make_encoder(response_format, sample_rate, streaming=streaming)
        self._resampler = Resampler(NATIVE_SAMPLE_RATE, sample_rate, speed)
        self.num_samples = 0  # output samples so far

    async def chunks(self, stream: SynthesisStream) -> AsyncIterator[OutputChunk]:
        """The stream's audio, encoded; each chunk counts as sent (first byte) once the consumer
        asks for the next. The caller closes `stream`."""
        talker_samples = next_frame = 0
        async for event in stream:
            if isinstance(event, AudioPiece):
                if self.native_pcm is not None:
                    self.native_pcm.append(event.pcm_s16le)
                pcm = self._resampler.push(event.pcm_s16le)
                data = self._encoder.push(pcm)
                self.num_samples += len(pcm) // 2
                talker_samples += event.num_samples
                next_frame = event.first_frame_index + event.num_frames
                if data:
                    yield OutputChunk(
                        data, len(pcm) // 2, event.first_frame_index, event.num_frames, talker_samples
                    )
                    talker_samples = 0
                    stream.first_byte_sent()
            elif isinstance(event, SynthesisSummary):
                pcm = self._resampler.flush()
                data = self._encoder.push(pcm) + self._encoder.finish()
                self.num_samples += len(pcm) // 2
                # Always yielded: a gRPC caller sends its summary right after, before the stream ends.
                yield OutputChunk(data, len(pcm) // 2, next_frame, 0, talker_samples, last=True)
                if data:
                    stream.first_byte_sent()

    async def collect(self, stream: SynthesisStream) -> bytes:
        """All of the stream's audio as one piece (with `streaming` false: one file)."""
        return b"".join([chunk.data async for chunk in self.chunks(stream)])
