"""A typed wrapper of `tts.v1.TextToSpeechService` (Synthesize and StreamingSynthesize)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import grpc

from ._proto import tts_pb2, tts_pb2_grpc

Encoding = Literal["pcm", "wav"]
TextSplit = Literal["sentence", "clause", "none"]
TaskType = Literal["voice_clone", "custom_voice", "voice_design"]

_ENCODINGS = {"pcm": tts_pb2.AUDIO_ENCODING_PCM_S16LE, "wav": tts_pb2.AUDIO_ENCODING_WAV}
_SPLITS = {
    "sentence": tts_pb2.TEXT_SPLIT_SENTENCE,
    "clause": tts_pb2.TEXT_SPLIT_CLAUSE,
    "none": tts_pb2.TEXT_SPLIT_NONE,
}
_TASKS = {
    None: tts_pb2.TASK_TYPE_UNSPECIFIED,
    "voice_clone": tts_pb2.TASK_TYPE_VOICE_CLONE,
    "custom_voice": tts_pb2.TASK_TYPE_CUSTOM_VOICE,
    "voice_design": tts_pb2.TASK_TYPE_VOICE_DESIGN,
}
_FINISH = {tts_pb2.FINISH_REASON_STOP: "stop", tts_pb2.FINISH_REASON_LENGTH: "length"}


class TTSError(Exception):
    """A call ended with a gRPC status other than OK."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class SynthesisOptions:
    """Everything of a request but its text; None and empty values take the server's defaults."""

    voice: str = ""
    task_type: TaskType | None = None
    language: str = ""
    instructions: str = ""
    reference_audio: bytes = b""  # an encoded clip (wav, flac, mp3, ...)
    reference_text: str = ""
    x_vector_only: bool = False
    encoding: Encoding = "pcm"
    sample_rate_hz: int = 0  # 0: 24000
    max_new_frames: int = 0  # 0: from the text length; 12.5 frames a second
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    greedy: bool = False
    first_chunk_frames: int = 0
    model: str = ""
    request_id: str = ""
    # Word timestamps in each Summary (the server needs an aligner stage: else INVALID_ARGUMENT).
    word_timestamps: bool = False

    def to_pb(self, text: str = "") -> tts_pb2.SynthesizeRequest:
        sampling = {
            k: v
            for k, v in (
                ("temperature", self.temperature),
                ("top_k", self.top_k),
                ("top_p", self.top_p),
                ("repetition_penalty", self.repetition_penalty),
                ("seed", self.seed),
            )
            if v is not None
        }
        return tts_pb2.SynthesizeRequest(
            request_id=self.request_id,
            model=self.model,
            text=text,
            task_type=_TASKS[self.task_type],
            voice=self.voice,
            language=self.language,
            instructions=self.instructions,
            reference_audio=self.reference_audio,
            reference_text=self.reference_text,
            x_vector_only=self.x_vector_only,
            audio_encoding=_ENCODINGS[self.encoding],
            sample_rate_hz=self.sample_rate_hz,
            max_new_frames=self.max_new_frames,
            sampling=tts_pb2.SamplingParams(greedy=self.greedy, **sampling),
            streaming=tts_pb2.StreamingOptions(first_chunk_frames=self.first_chunk_frames),
            word_timestamps=self.word_timestamps,
        )


@dataclass(frozen=True)
class Audio:
    """Encoded audio of one chunk (PCM s16le mono, or WAV with a streaming header first)."""

    data: bytes
    num_samples: int
    sample_rate_hz: int
    segment_index: int = 0


@dataclass(frozen=True)
class WordTimestamp:
    """A word of the text and when it is heard, in ms of the call's audio."""

    word: str
    start_ms: int
    end_ms: int


@dataclass(frozen=True)
class Summary:
    """How a request (or a segment of a streamed one) ended; with `word_timestamps`, its words
    (`word_timestamps_failed`: the server's aligner failed, the audio is whole)."""

    finish_reason: str  # "stop" (end of speech) or "length" (max_new_frames reached)
    num_frames: int
    num_samples: int
    sample_rate_hz: int
    num_input_tokens: int
    total_ms: float
    segment_index: int = 0
    word_timestamps: tuple[WordTimestamp, ...] = ()
    word_timestamps_failed: bool = False


@dataclass(frozen=True)
class SegmentStart:
    """A segment of streamed text, before its audio."""

    segment_index: int
    text: str


def _audio(chunk, segment: int = 0) -> Audio:
    return Audio(chunk.audio, chunk.num_samples, chunk.sample_rate_hz, segment)


def _summary(s, segment: int = 0) -> Summary:
    return Summary(
        _FINISH.get(s.finish_reason, "unspecified"),
        s.num_frames,
        s.num_samples,
        s.sample_rate_hz,
        s.num_input_tokens,
        s.timings.total_ns / 1e6,
        segment,
        tuple(WordTimestamp(w.word, w.start_ms, w.end_ms) for w in s.word_timestamps),
        s.word_timestamps_failed,
    )


class TTSClient:
    """A blocking client of one gateway's gRPC API; use as a context manager or call `close()`."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        timeout_s: float | None = 300.0,
        channel: grpc.Channel | None = None,
    ):
        self._own = channel is None
        self._channel = channel or grpc.insecure_channel(address)
        self._stub = tts_pb2_grpc.TextToSpeechServiceStub(self._channel)
        self._timeout = timeout_s

    def __enter__(self) -> TTSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self._channel.close()

    def synthesize(
        self, text: str, options: SynthesisOptions = SynthesisOptions()
    ) -> Iterator[Audio | Summary]:
        """Audio chunks as they are produced, then the Summary."""
        try:
            for msg in self._stub.Synthesize(options.to_pb(text), timeout=self._timeout):
                yield _audio(msg.audio) if msg.HasField("audio") else _summary(msg.summary)
        except grpc.RpcError as exc:
            raise TTSError(exc.code(), exc.details()) from None

    def streaming_synthesize(
        self,
        texts: Iterable[str],
        options: SynthesisOptions = SynthesisOptions(),
        *,
        text_split: TextSplit = "none",
    ) -> Iterator[SegmentStart | Audio | Summary]:
        """Send `texts` (an LLM's tokens, say) as they come; yield each segment's start, audio chunks
        and summary while more text is still being sent. A segment is one running synthesis that
        takes its text as it arrives: all of `texts` by default, or each sentence / clause with
        `text_split`. `max_new_frames` applies to each segment."""

        def requests():
            config = tts_pb2.StreamingSynthesizeConfig(
                synthesis=options.to_pb(), text_split=_SPLITS[text_split]
            )
            yield tts_pb2.StreamingSynthesizeRequest(streaming_config=config)
            for piece in texts:
                yield tts_pb2.StreamingSynthesizeRequest(input=tts_pb2.StreamingSynthesisInput(text=piece))

        try:
            for msg in self._stub.StreamingSynthesize(requests(), timeout=self._timeout):
                i = msg.segment_index
                if msg.HasField("segment_start"):
                    yield SegmentStart(i, msg.segment_start.text)
                elif msg.HasField("audio"):
                    yield _audio(msg.audio, i)
                else:
                    yield _summary(msg.segment_summary, i)
        except grpc.RpcError as exc:
            raise TTSError(exc.code(), exc.details()) from None

    def synthesize_bytes(
        self, text: str, options: SynthesisOptions = SynthesisOptions()
    ) -> tuple[bytes, Summary]:
        """The whole clip's encoded audio and its summary."""
        audio, summary = b"", None
        for event in self.synthesize(text, options):
            if isinstance(event, Audio):
                audio += event.data
            else:
                summary = event
        assert summary is not None, "the server ended the call without a summary"
        return audio, summary
