"""Fakes and a real uvicorn/grpc.aio server around the gateway's front ends, with a fake talker."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import wave
from dataclasses import dataclass, field

import numpy as np
import uvicorn
from prometheus_client import CollectorRegistry

from qtts.request.errors import NotFound
from qtts.request.vocabulary import AudioPiece, SynthesisSummary
from qtts.serving.metrics import GatewayMetrics
from services.gateway.core import GatewayCore
from services.gateway.http_app import HttpDeps, create_app
from services.gateway.job import ModelCatalog, SynthesisJob
from services.gateway.server import _UvicornServer
from services.gateway.stream_limits import StreamLimits
from services.gateway.validation import RequestLimits
from services.gateway.voice_client import VoiceInfo
from services.gateway.voices import VoiceService
from services.launcher import free_port

FRAME = 1920

BASE = ModelCatalog(name="tiny-base", model_type="base", languages=("english", "chinese"))
CUSTOM = ModelCatalog(
    name="tiny-custom",
    model_type="custom_voice",
    speakers=("vivian", "ryan"),
    languages=("english", "chinese"),
)
DESIGN = ModelCatalog(name="tiny-design", model_type="voice_design", languages=("english",))


def frame_pcm(index: int, frames: int = 1) -> bytes:
    """Deterministic s16le audio for frames [index, index + frames)."""
    n = np.arange(index * FRAME, (index + frames) * FRAME)
    return (np.sin(n / 7.0) * 8000).astype("<i2").tobytes()


def wav_bytes(seconds: float = 1.0, rate: int = 16000) -> bytes:
    pcm = (np.sin(np.arange(int(seconds * rate)) / 5.0) * 9000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def clone_body(**overrides) -> dict:
    """An x-vector voice-clone /v1/audio/speech body of the tiny Base model (0.2 s reference), with
    `overrides` on top."""
    return {
        "model": "tiny-base",
        "input": "Hello there.",
        "ref_audio": base64.b64encode(wav_bytes(0.2)).decode(),
        "x_vector_only_mode": True,
        "response_format": "pcm",
        **overrides,
    }


@dataclass
class FakeTalker:
    """Yields `frames` frames in chunks of `chunk`, then a "length" summary; records what happened."""

    frames: int = 5
    chunk: int = 2
    delay_s: float = 0.0
    error_before: Exception | None = None
    error_after_first: Exception | None = None
    jobs: list[SynthesisJob] = field(default_factory=list)
    active: int = 0
    closed: int = 0
    completed: int = 0
    # The whole text of each job: its own, plus what was appended while it ran (text streamed in).
    texts: list[str] = field(default_factory=list)
    streamed: list[bool] = field(default_factory=list)

    async def generate(self, job: SynthesisJob, text=None):
        self.jobs.append(job)
        self.texts.append(job.text)
        self.streamed.append(text is not None)
        index = len(self.texts) - 1
        self.active += 1
        reader = None
        if text is not None:

            async def read() -> None:
                async for piece, _ in text:
                    self.texts[index] += piece

            reader = asyncio.create_task(read())
        try:
            if self.error_before is not None:
                raise self.error_before
            n = job.max_new_frames or self.frames
            for i in range(0, n, self.chunk):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                k = min(self.chunk, n - i)
                yield AudioPiece(frame_pcm(i, k), i, k)
                if self.error_after_first is not None:
                    raise self.error_after_first
            if reader is not None:  # a running request ends only once its text is complete
                await reader
            # The talker reports the input's text tokens; here one per word of the input.
            yield SynthesisSummary(
                "length", n, n * FRAME, "fake-replica", num_input_tokens=len(self.texts[index].split())
            )
            self.completed += 1
        finally:
            if reader is not None:
                reader.cancel()
            self.active -= 1
            self.closed += 1


class FakeVoiceStore:
    def __init__(self):
        self.voices: dict[str, VoiceInfo] = {}

    async def list(self) -> list[VoiceInfo]:
        return list(self.voices.values())

    async def get(self, name) -> VoiceInfo:
        if name not in self.voices:
            raise NotFound(f"voice {name!r} does not exist")
        return self.voices[name]

    async def create(self, name, pcm_24k, reference_text, x_vector_only) -> VoiceInfo:
        from qtts.request.errors import AlreadyExists

        if name in self.voices:
            raise AlreadyExists(f"voice {name!r} already exists")
        v = VoiceInfo(name, "cloned", reference_text, x_vector_only, len(pcm_24k) / 24000, 1)
        self.voices[name] = v
        return v

    async def delete(self, name) -> None:
        if self.voices.pop(name, None) is None:
            raise NotFound(f"voice {name!r} does not exist")


def fake_decode(data: bytes) -> np.ndarray:
    """Stands in for qtts.audio.load_reference_audio: accepts RIFF files only."""
    from qtts.request.errors import InvalidArgument

    if not data.startswith(b"RIFF"):
        raise InvalidArgument("could not decode the reference audio")
    return np.zeros(24000, dtype=np.float32)


@dataclass
class GatewayUnderTest:
    talker: FakeTalker
    voices: FakeVoiceStore
    synth: GatewayCore
    metrics: GatewayMetrics
    voice_service: VoiceService
    url: str = ""


def build_gateway(
    catalog: ModelCatalog = BASE, max_streams: int = 4, unsupported_instructions: str = "reject", **talker_kw
) -> GatewayUnderTest:
    talker = FakeTalker(**talker_kw)
    metrics = GatewayMetrics(CollectorRegistry())
    synth = GatewayCore(
        talker,
        lambda: catalog,
        RequestLimits(max_input_chars=200, max_new_frames_limit=100),
        StreamLimits(max_streams),
        metrics,
        decode=fake_decode,
        unsupported_instructions=unsupported_instructions,
    )
    store = FakeVoiceStore()
    voices = VoiceService(store, fake_decode, lambda: catalog, max_audio_bytes=1 << 20)
    return GatewayUnderTest(talker, store, synth, metrics, voices)


@contextlib.asynccontextmanager
async def serve_http(gw: GatewayUnderTest, stages: dict[str, str] | None = None, aligner=None):
    """Run the HTTP app on a real uvicorn server in this event loop (`aligner`: an AlignerClient)."""

    async def stage_health():
        return stages if stages is not None else {"talker": "SERVING", "speaker_cache": "SERVING"}

    app = create_app(HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, aligner=aligner))
    port = free_port()
    server = _UvicornServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    gw.url = f"http://127.0.0.1:{port}"
    try:
        yield gw
    finally:
        server.should_exit = True
        await task
