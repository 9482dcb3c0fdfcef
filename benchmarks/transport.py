"""Request recorders: send one synthesis request and time every audio chunk as it arrives.

HTTP drives `POST /v1/audio/speech` (streamed raw PCM s16le 24 kHz) through httpx; gRPC drives
`tts.v1.TextToSpeechService/Synthesize` through grpc.aio. Both return a `RequestRecord`; a failed
request is a record with `ok=False`, never an exception.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from benchmarks.metrics import DEFAULT_AUDIBLE_DBFS, AudibleDetector, RequestRecord, build_record
from benchmarks.reference_audio import audio_data_url

SPEECH_PATH = "/v1/audio/speech"
# Request indices from here on send pool clip (index - POOL_WARM_INDEX): the warm-up's one
# request per voice of the pool (benchmarks.client --voice-pool-warm).
POOL_WARM_INDEX = 2_000_000_000
HEALTH_PATH = "/health"

# Task names as this API spells them, plus vLLM-Omni's spellings (Base, CustomVoice, VoiceDesign).
_TASK_ALIASES = {
    "voiceclone": "voice_clone",
    "base": "voice_clone",
    "customvoice": "custom_voice",
    "voicedesign": "voice_design",
}


def canonical_task(task_type: str) -> str:
    """voice_clone, custom_voice or voice_design, from a task name in either spelling."""
    key = task_type.lower().replace("_", "").replace("-", "")
    if key not in _TASK_ALIASES:
        raise ValueError(
            f"unknown task type {task_type!r}; use voice_clone (Base), custom_voice (CustomVoice) "
            "or voice_design (VoiceDesign)"
        )
    return _TASK_ALIASES[key]


def grpc_task_name(task_type: str) -> str:
    """The `tts.v1.TaskType` enum name (e.g. TASK_TYPE_VOICE_CLONE) of a task name."""
    return f"TASK_TYPE_{canonical_task(task_type).upper()}"


@dataclass(frozen=True)
class SynthesisOptions:
    """Request fields shared by every request of a run (the text varies per request)."""

    task_type: str = "voice_clone"
    model: str | None = None
    voice: str | None = None
    language: str | None = None
    instructions: str | None = None
    ref_audio: bytes | None = None
    ref_audio_name: str = "ref.wav"
    ref_text: str | None = None
    x_vector_only: bool = False
    max_new_tokens: int | None = None
    # Random weights end speech at random: a fixed length makes rows comparable.
    fixed_length: bool = False
    seed: int | None = None
    audible_dbfs: float = DEFAULT_AUDIBLE_DBFS
    request_timeout_s: float = 300.0
    # A voice mix: request i sends clip `voice_for(i)` of this pool instead of `ref_audio`, drawn
    # Zipf(`ref_pool_zipf`) over the pool, so the GPU prefix cache sees repeats and new voices.
    ref_pool: tuple[bytes, ...] = ()
    ref_pool_zipf: float = 1.0
    # Ask for word timestamps (the aligner stage) on every request.
    word_timestamps: bool = False

    def __post_init__(self) -> None:
        # Normalised once, so a misspelt task fails before any request is sent.
        object.__setattr__(self, "task_type", canonical_task(self.task_type))
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")
        if self.ref_pool_zipf < 0:
            raise ValueError("ref_pool_zipf must be >= 0")
        weights = [(k + 1) ** -self.ref_pool_zipf for k in range(len(self.ref_pool))]
        total = sum(weights)
        cdf, acc = [], 0.0
        for w in weights:
            acc += w / total
            cdf.append(acc)
        object.__setattr__(self, "_pool_cdf", tuple(cdf))

    def voice_for(self, index: int) -> int | None:
        """The pool clip request `index` sends (None: no pool): a seeded draw per request, the
        same in every client process, so a record's voice is known without asking the sender."""
        if not self.ref_pool:
            return None
        if index >= POOL_WARM_INDEX:  # the warm-up's pass over the pool: clip k for request k
            return (index - POOL_WARM_INDEX) % len(self.ref_pool)
        u = random.Random(f"{self.seed}:{index}").random()
        return min(bisect.bisect_right(self._pool_cdf, u), len(self.ref_pool) - 1)

    def ref_for(self, index: int) -> bytes | None:
        """The reference clip of request `index`."""
        voice = self.voice_for(index)
        return self.ref_audio if voice is None else self.ref_pool[voice]

    def seed_for(self, index: int) -> int | None:
        # Distinct but reproducible per request, so identical prompts do not sample identically.
        return None if self.seed is None else self.seed + index


class Synthesizer(Protocol):
    """Sends one request and records its stream.

    `max_new_tokens`, when given, replaces the shared option for this request only (mixed lengths;
    with `fixed_length` it is also the request's minimum).
    """

    async def synthesize(
        self, index: int, prompt_index: int, text: str, *, max_new_tokens: int | None = None
    ) -> RequestRecord: ...

    async def warm(self) -> None:
        """Open the connection(s) and run the client code paths once, without synthesis (a failure
        raises; callers log it and go on)."""
        ...

    async def aclose(self) -> None: ...


async def warm_or_log(warm: Callable[[], Awaitable[None]], timeout_s: float | None, who: str) -> bool:
    """Await `warm()` for at most `timeout_s` seconds (None: no limit); a failure or a timeout is one
    line on stderr, never an exception: a cold client only costs its first request some time."""
    try:
        async with asyncio.timeout(timeout_s):
            await warm()
    except Exception as exc:  # noqa: BLE001 - best effort: any failure is told and the run goes on
        timed_out = isinstance(exc, TimeoutError) and timeout_s is not None
        reason = f"no answer within {timeout_s:.2f} s" if timed_out else repr(exc)
        print(f"tts-bench: {who}: warming the client failed ({reason}); going on", file=sys.stderr)
        return False
    return True


class _Trace:
    """Arrival times and sizes of one stream's audio chunks, relative to the send time."""

    def __init__(self, audible_dbfs: float):
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.first_audible_s: float | None = None
        self._detector = AudibleDetector(audible_dbfs)

    def chunk(self, data: bytes) -> None:
        if not data:
            return
        now = time.perf_counter() - self.start
        self.times.append(now)
        self.sizes.append(len(data))
        if self._detector.feed(data):
            self.first_audible_s = now

    def record(
        self,
        index: int,
        prompt_index: int,
        *,
        ok: bool,
        status: str,
        error: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> RequestRecord:
        return build_record(
            index=index,
            prompt_index=prompt_index,
            start_s=self.start,
            chunk_times_s=self.times,
            chunk_bytes=self.sizes,
            e2e_s=time.perf_counter() - self.start,
            ok=ok,
            status=status,
            error=error,
            first_audible_s=self.first_audible_s,
            extra=extra,
        )


def http_payload(
    options: SynthesisOptions,
    text: str,
    index: int,
    ref_audio_url: str | None = None,
    max_new_tokens: int | None = None,
) -> dict[str, Any]:
    """The JSON body of one streaming PCM request; unset options are left out.

    `ref_audio_url` is the reference clip already encoded as a data URL (encoded once per run);
    `max_new_tokens` overrides `options.max_new_tokens` for this request.
    """
    frames = options.max_new_tokens if max_new_tokens is None else max_new_tokens
    payload: dict[str, Any] = {
        "input": text,
        "response_format": "pcm",
        "stream": True,
        "task_type": options.task_type,
        "model": options.model,
        "voice": options.voice,
        "language": options.language,
        "instructions": options.instructions,
        "ref_text": options.ref_text,
        "max_new_tokens": frames,
        "min_new_tokens": frames if options.fixed_length else None,
        "seed": options.seed_for(index),
    }
    ref = options.ref_for(index)
    if ref is not None:
        payload["ref_audio"] = ref_audio_url or audio_data_url(ref, options.ref_audio_name)
    if options.x_vector_only:
        payload["x_vector_only_mode"] = True
    if options.word_timestamps:
        payload["word_timestamps"] = True
    return {k: v for k, v in payload.items() if v is not None}


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error", {})
        return str(err.get("message") or text) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:500]


# Connection pools per HttpSynthesizer (request i uses pool i mod POOLS). httpcore scans every
# connection of a pool, and counts the idle ones once per idle one, each time a request starts or
# ends: one pool of 256 connections made that scan most of a client process's CPU in a refusal
# storm, and every refusal's and first chunk's time waited on it (benchmarks/refusal_latency.py).
POOLS = 32


def _retry_after(headers: Any) -> dict[str, Any]:
    """A refusal's retry hint (seconds) as a record's extra, from `retry-after-ms` first, then
    `Retry-After`, as the OpenAI SDK reads them; nothing when absent or not a number."""
    for key, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(key)
        if value is None:
            continue
        try:
            return {"retry_after_s": float(value) / divisor}
        except ValueError:
            continue
    return {}


class HttpSynthesizer:
    """Streams `POST /v1/audio/speech` responses over pooled HTTP/1.1 connections."""

    def __init__(
        self,
        base_url: str,
        options: SynthesisOptions,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        pools: int = POOLS,
    ):
        self.options = options
        self.url = base_url.rstrip("/") + SPEECH_PATH
        self.health_url = base_url.rstrip("/") + HEALTH_PATH
        timeout = httpx.Timeout(options.request_timeout_s, connect=min(30.0, options.request_timeout_s))
        # No pool cap: the load generator, not the pool, decides how many streams are open.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._clients = [
            httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)
            for _ in range(max(1, pools))
        ]
        self._ref_audio_url = (
            None if options.ref_audio is None else audio_data_url(options.ref_audio, options.ref_audio_name)
        )
        # The clip's JSON string literal, encoded once: at hundreds of streams, JSON-encoding the
        # same base64 clip for every request took a large share of the client's one core.
        self._ref_audio_json = None if self._ref_audio_url is None else json.dumps(self._ref_audio_url)
        # The voice pool's clips, encoded once each (data URL, JSON literal), as the single clip is.
        self._pool_urls = [audio_data_url(clip, options.ref_audio_name) for clip in options.ref_pool]
        self._pool_json = [json.dumps(url) for url in self._pool_urls]

    def body(self, payload: dict[str, Any], ref_json: str | None = None) -> bytes:
        """`payload` as JSON bytes, splicing in the pre-encoded reference clip (`ref_json`: a
        pool clip's literal, whose data URL is `payload["ref_audio"]`)."""
        if ref_json is None:
            if self._ref_audio_json is None or payload.get("ref_audio") is not self._ref_audio_url:
                return json.dumps(payload).encode()
            ref_json = self._ref_audio_json
        rest = json.dumps({k: v for k, v in payload.items() if k != "ref_audio"})
        return (rest[:-1] + (", " if rest != "{}" else "") + '"ref_audio": ' + ref_json + "}").encode()

    async def synthesize(
        self, index: int, prompt_index: int, text: str, *, max_new_tokens: int | None = None
    ) -> RequestRecord:
        voice = self.options.voice_for(index)
        ref_url = self._ref_audio_url if voice is None else self._pool_urls[voice]
        ref_json = None if voice is None else self._pool_json[voice]
        payload = http_payload(self.options, text, index, ref_url, max_new_tokens)
        client = self._clients[index % len(self._clients)]
        trace = _Trace(self.options.audible_dbfs)
        try:
            async with asyncio.timeout(self.options.request_timeout_s):
                async with client.stream(
                    "POST",
                    self.url,
                    content=self.body(payload, ref_json),
                    headers={"content-type": "application/json"},
                ) as response:
                    if response.status_code != 200:
                        body = await response.aread()
                        status, error = str(response.status_code), _error_message(body)
                        extra = _retry_after(response.headers)
                        return trace.record(
                            index, prompt_index, ok=False, status=status, error=error, extra=extra
                        )
                    async for data in response.aiter_raw():
                        trace.chunk(data)
        except TimeoutError:
            error = f"no end of stream after {self.options.request_timeout_s:g} s"
            return trace.record(index, prompt_index, ok=False, status="TIMEOUT", error=error)
        except httpx.HTTPError as exc:
            # A stream cut after the first byte (the status is already 200) lands here.
            return trace.record(
                index, prompt_index, ok=False, status="TRANSPORT", error=f"{type(exc).__name__}: {exc}"
            )
        return trace.record(index, prompt_index, ok=True, status="200")

    async def warm(self) -> None:
        """`GET /health` through each request pool: the first request of a fresh client otherwise
        pays the TCP connect and httpx's first-use paths in its first-audio time. Any status counts
        (the connection is what is warmed); `get` reads the body, so the connection stays pooled."""
        await asyncio.gather(*(client.get(self.health_url) for client in self._clients))

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()


class GrpcSynthesizer:
    """Streams `tts.v1.TextToSpeechService/Synthesize` over one or more channels (round robin)."""

    def __init__(
        self, target: str, options: SynthesisOptions, *, channels: int = 1, request_id_prefix: str = "bench"
    ):
        import grpc

        from qtts.pb import tts_pb2, tts_pb2_grpc

        self._grpc = grpc
        self._pb = tts_pb2
        self.options = options
        self._prefix = request_id_prefix
        self._channels = [grpc.aio.insecure_channel(target) for _ in range(max(1, channels))]
        self._stubs = [tts_pb2_grpc.TextToSpeechServiceStub(c) for c in self._channels]

    def request(self, text: str, index: int, max_new_tokens: int | None = None) -> Any:
        """The `SynthesizeRequest` of request `index` (`max_new_tokens` overrides the option)."""
        pb, o = self._pb, self.options
        frames = o.max_new_tokens if max_new_tokens is None else max_new_tokens
        sampling = pb.SamplingParams()
        seed = o.seed_for(index)
        if seed is not None:
            sampling.seed = seed
        if o.fixed_length and frames:
            sampling.min_new_frames = frames
        return pb.SynthesizeRequest(
            request_id=f"{self._prefix}-{index}",
            model=o.model or "",
            text=text,
            task_type=pb.TaskType.Value(grpc_task_name(o.task_type)),
            voice=o.voice or "",
            language=o.language or "",
            instructions=o.instructions or "",
            reference_audio=o.ref_for(index) or b"",
            reference_text=o.ref_text or "",
            x_vector_only=o.x_vector_only,
            audio_encoding=pb.AUDIO_ENCODING_PCM_S16LE,
            max_new_frames=frames or 0,
            sampling=sampling,
            word_timestamps=o.word_timestamps,
        )

    async def synthesize(
        self, index: int, prompt_index: int, text: str, *, max_new_tokens: int | None = None
    ) -> RequestRecord:
        stub = self._stubs[index % len(self._stubs)]
        request = self.request(text, index, max_new_tokens)
        trace = _Trace(self.options.audible_dbfs)
        extra: dict[str, Any] = {}
        try:
            call = stub.Synthesize(request, timeout=self.options.request_timeout_s)
            async for message in call:
                kind = message.WhichOneof("event")
                if kind == "audio":
                    trace.chunk(message.audio.audio)
                elif kind == "summary":
                    s = message.summary
                    extra = {
                        "finish_reason": self._pb.FinishReason.Name(s.finish_reason),
                        "num_frames": s.num_frames,
                        "server_queue_s": s.timings.queue_ns / 1e9,
                        "server_prefill_s": s.timings.prefill_ns / 1e9,
                        "server_first_audio_s": s.timings.first_audio_ns / 1e9,
                        "server_total_s": s.timings.total_ns / 1e9,
                    }
                    if self.options.word_timestamps:
                        extra["words"] = len(s.word_timestamps)
                        extra["word_timestamps_failed"] = s.word_timestamps_failed
        except self._grpc.aio.AioRpcError as exc:
            return trace.record(
                index,
                prompt_index,
                ok=False,
                status=exc.code().name,
                error=exc.details(),
                extra=_retry_after(dict(exc.trailing_metadata() or ())),
            )
        if not extra:
            return trace.record(
                index, prompt_index, ok=False, status="INCOMPLETE", error="stream ended without a summary"
            )
        return trace.record(index, prompt_index, ok=True, status="OK", extra=extra)

    async def warm(self) -> None:
        """Connect every channel and send one `grpc.health.v1.Health/Check` on each, so the first
        stream of each channel pays no connect or first-call cost. Any health answer counts, even
        UNIMPLEMENTED (a server without the health service): the round trip happened."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        timeout = min(30.0, self.options.request_timeout_s)
        for channel in self._channels:
            await asyncio.wait_for(channel.channel_ready(), timeout)
            try:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=timeout
                )
            except self._grpc.aio.AioRpcError as exc:
                if exc.code() != self._grpc.StatusCode.UNIMPLEMENTED:
                    raise

    async def aclose(self) -> None:
        for channel in self._channels:
            await channel.close()
