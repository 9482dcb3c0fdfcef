"""A corpus of bad input for the gateway's public APIs: HTTP requests and tts.v1 calls, each with
the status it must get and the field it must name.

Shared by the in-process run (tests/services/gateway/test_gateway_bad_input_corpus.py, fake talker) and
the run against the real processes (tests/e2e/test_e2e_hostile.py). Both serve it with the
limits below, so every case fails the same way on either; none of them depends on a limit a
server may configure differently (text length, frame cap).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import wave
from dataclasses import dataclass

import grpc
import h11
import numpy as np
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from qtts.pb import tts_pb2
from qtts.request import request_limits as lim

# The limits a gateway serving this corpus runs with (flags --max-ref-audio-bytes,
# --max-body-bytes, --max-ref-audio-seconds).
MAX_REF_AUDIO_BYTES = 256 * 1024
MAX_BODY_BYTES = 1 << 20
MAX_REF_AUDIO_SECONDS = 10.0

LONG = 200_000  # characters: far above every string limit


def wav(seconds: float, rate: int = 16000) -> bytes:
    """A voiced-sounding mono 16-bit clip (harmonics with vibrato)."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(140 + 20 * np.sin(2 * np.pi * 3 * t)) / rate
    x = sum(np.sin(k * phase) / k for k in range(1, 6)) * 0.2
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


REF_WAV = wav(1.0)
REF = base64.b64encode(REF_WAV).decode()
TOO_LONG_WAV = wav(MAX_REF_AUDIO_SECONDS + 1, rate=8000)  # under the size cap, over the length cap
TOO_BIG_CLIP = b"RIFF" + bytes(MAX_REF_AUDIO_BYTES + 4096)
UNDECODABLE = b"this is not audio at all" * 10

# A good request: the corpus's bad ones are this with one thing wrong.
GOOD_SPEECH = {
    "input": "Hello there.",
    "ref_audio": REF,
    "x_vector_only_mode": True,
    "response_format": "pcm",
    "stream": False,
}


@dataclass(frozen=True)
class HttpCase:
    """One bad HTTP request and its answer: `status` and the error's `param` (None: the body as a
    whole). `closes`: the server ends the connection (a body refused before it is read)."""

    id: str
    body: bytes
    status: int = 400
    param: str | None = None
    path: str = "/v1/audio/speech"
    method: str = "POST"
    content_type: str = "application/json"
    closes: bool = False


def speech(**fields) -> bytes:
    return json.dumps({**GOOD_SPEECH, **fields}).encode()


def spliced(field: str, literal: str, base=speech) -> bytes:
    """A body whose `field` is a JSON literal json.dumps does not write as such (a lone surrogate
    escape, NaN, a 5,000-digit number)."""
    return base(**{field: "@@"}).replace(b'"@@"', literal.encode())


def voice_json(**fields) -> bytes:
    return json.dumps(
        {"name": "corpus-voice", "audio_sample": REF, "x_vector_only_mode": True, **fields}
    ).encode()


BOUNDARY = "corpusboundary0123456789"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


def multipart(*parts: tuple[str, bytes, bool], close: bool = True) -> bytes:
    """(name, value, is_file) parts of a multipart/form-data body."""
    out = b""
    for name, value, is_file in parts:
        disposition = f'form-data; name="{name}"' + ('; filename="clip.wav"' if is_file else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n".encode()
        out += b"Content-Type: audio/wav\r\n" if is_file else b""
        out += b"\r\n" + value + b"\r\n"
    return out + (f"--{BOUNDARY}--\r\n".encode() if close else b"")


def _speech_cases() -> list[HttpCase]:
    c = HttpCase
    return [
        # Sampling: every field outside its finite range, and not numbers at all.
        c("temperature-3.5e38", speech(temperature=3.5e38), param="temperature"),
        c("temperature-1e-45", speech(temperature=1e-45), param="temperature"),
        c("temperature-below-min", speech(temperature=lim.TEMPERATURE_MIN / 10), param="temperature"),
        c("temperature-above-max", speech(temperature=lim.TEMPERATURE_MAX * 2), param="temperature"),
        c("temperature-negative", speech(temperature=-1), param="temperature"),
        c("temperature-inf", spliced("temperature", "1e999"), param="temperature"),
        c("temperature-minus-infinity", spliced("temperature", "-Infinity"), param="temperature"),
        c("temperature-nan", spliced("temperature", "NaN"), param="temperature"),
        c("temperature-string", speech(temperature="hot"), param="temperature"),
        c("temperature-bool", speech(temperature=True), param="temperature"),
        c("repetition_penalty-1e-45", speech(repetition_penalty=1e-45), param="repetition_penalty"),
        c("repetition_penalty-1e30", speech(repetition_penalty=1e30), param="repetition_penalty"),
        c("repetition_penalty-zero", speech(repetition_penalty=0), param="repetition_penalty"),
        c("repetition_penalty-negative", speech(repetition_penalty=-1.05), param="repetition_penalty"),
        c("repetition_penalty-infinity", spliced("repetition_penalty", "Infinity"), param="repetition_penalty"),
        c("top_p-underflows-float32", speech(top_p=1e-46), param="top_p"),
        c("top_p-above-1", speech(top_p=1.5), param="top_p"),
        c("top_p-zero", speech(top_p=0), param="top_p"),
        c("top_p-nan", spliced("top_p", "NaN"), param="top_p"),
        c("top_k-above-uint32", speech(top_k=2**33), param="top_k"),
        c("top_k-2^64", speech(top_k=2**64), param="top_k"),
        c("top_k-negative", speech(top_k=-1), param="top_k"),
        c("top_k-fraction", speech(top_k=1.5), param="top_k"),
        c("top_k-string", speech(top_k="50"), param="top_k"),
        c("seed-above-int64", speech(seed=2**64), param="seed"),
        c("seed-below-int64", speech(seed=-(2**64)), param="seed"),
        c("seed-fraction", speech(seed=0.5), param="seed"),
        # Python refuses to convert integers of more than 4,300 digits: a 400 for the body.
        c("seed-5000-digits", spliced("seed", "9" * 5000)),
        c("top_k-4301-digits", spliced("top_k", "1" * 4301)),
        c("min_new_tokens-above-uint32", speech(min_new_tokens=2**33), param="min_new_tokens"),
        c("min_new_tokens-negative", speech(min_new_tokens=-1), param="min_new_tokens"),
        c("max_new_tokens-1e30", speech(max_new_tokens=10**30), param="max_new_tokens"),
        c("max_new_tokens-zero", speech(max_new_tokens=0), param="max_new_tokens"),
        c("max_new_tokens-negative", speech(max_new_tokens=-5), param="max_new_tokens"),
        c("initial_codec_chunk_frames-1e12", speech(initial_codec_chunk_frames=10**12),
          param="initial_codec_chunk_frames"),
        c("initial_codec_chunk_frames-negative", speech(initial_codec_chunk_frames=-1),
          param="initial_codec_chunk_frames"),
        c("speed-zero", speech(speed=0), param="speed"),
        c("speed-100", speech(speed=100), param="speed"),
        c("speed-nan", spliced("speed", "NaN"), param="speed"),
        c("sample_rate-1", speech(sample_rate=1), param="sample_rate"),
        c("sample_rate-1e9", speech(sample_rate=10**9), param="sample_rate"),
        c("response_format-exe", speech(response_format="exe"), param="response_format"),
        c("stream_format-json", speech(stream_format="json"), param="stream_format"),
        c("stream-string", speech(stream="yes"), param="stream"),
        c("x_vector_only_mode-string", speech(x_vector_only_mode="true"), param="x_vector_only_mode"),
        c("non_streaming_mode-int", speech(non_streaming_mode=1), param="non_streaming_mode"),
        c("speaker_embedding-100k-values", speech(speaker_embedding=[[0.5] * 100] * 1000), param="speaker_embedding"),
        c("speaker_embedding-nan", spliced("speaker_embedding", "[0.1, NaN]"), param="speaker_embedding"),
        c("speaker_embedding-string", speech(speaker_embedding="abc"), param="speaker_embedding"),
        c("extra_params-string", speech(extra_params="x"), param="extra_params"),
        # The body as a whole.
        c("nested-array-100k", b'{"input":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        c("nested-object-5000", b'{"extra_params":' + b'{"a":' * 5000 + b"1" + b"}" * 5001),
        c("bad-utf8", b'{"input": "\xff\xfe"}'),
        c("not-an-object", b"[1, 2]"),
        c("json-string", b'"Hello there."'),
        c("json-null", b"null"),
        c("empty-body", b""),
        c("truncated-json", b'{"input": "Hello'),
        c("trailing-garbage", speech() + b" x"),
        c("unknown-field", speech(voice_name="x"), param="voice_name"),
        c("unknown-field-proto", speech(__proto__={"admin": True}), param="__proto__"),
        # Strings: lone surrogates, nothing to say, too long.
        c("surrogate-input", spliced("input", '"hi \\ud800 there"'), param="input"),
        c("surrogate-voice", spliced("voice", '"\\udc00"'), param="voice"),
        c("surrogate-ref_text", spliced("ref_text", '"a\\ud83d"'), param="ref_text"),
        c("surrogate-instructions", spliced("instructions", '"\\udfff"'), param="instructions"),
        c("surrogate-language", spliced("language", '"en\\ud800"'), param="language"),
        c("surrogate-model", spliced("model", '"\\ud800"'), param="model"),
        c("control-only-input", speech(input="\x00\x01\x02\x7f\u200b\n\t"), param="input"),
        c("whitespace-only-input", speech(input="   \n\t  "), param="input"),
        c("empty-input", speech(input=""), param="input"),
        c("missing-input", json.dumps({k: v for k, v in GOOD_SPEECH.items() if k != "input"}).encode(),
          param="input"),
        c("input-number", speech(input=5), param="input"),
        c("input-list", speech(input=["Hello."]), param="input"),
        c("input-too-long", speech(input="a" * (lim.TEXT_MAX_CHARS + 1)), param="input"),
        c("ref_text-200k", speech(ref_text="a" * LONG, x_vector_only_mode=False), param="ref_text"),
        c("instructions-200k", speech(instructions="a" * LONG), param="instructions"),
        c("voice-200k", speech(voice="a" * LONG), param="voice"),
        c("voice-id-200k", speech(voice={"id": "a" * LONG}), param="voice"),
        c("speaker-200k", speech(speaker="a" * LONG), param="speaker"),
        c("model-200k", speech(model="a" * LONG), param="model"),
        c("language-200k", speech(language="a" * LONG), param="language"),
        c("task_type-200k", speech(task_type="a" * LONG), param="task_type"),
        c("voice-id-empty", speech(voice={"id": ""}), param="voice"),
        c("voice-object-extra-key", speech(voice={"id": "a", "x": 1}), param="voice"),
        c("voice-and-speaker-disagree", speech(voice="alice", speaker="bob"), param="speaker"),
        # What the served model or the server cannot do.
        c("model-unknown", speech(model="no-such-model"), status=404, param="model"),
        c("task_type-unknown", speech(task_type="nope"), param="task_type"),
        c("task_type-not-served", speech(task_type="CustomVoice"), param="task_type"),
        c("language-unknown", speech(language="klingon"), param="language"),
        c("instructions-on-base", speech(instructions="Speak softly."), param="instructions"),
        c("ref_text-missing", speech(x_vector_only_mode=False), param="ref_text"),
        c("ref_audio-not-base64", speech(ref_audio="!!not base64!!"), param="ref_audio"),
        c("ref_audio-url", speech(ref_audio="http://169.254.169.254/latest/meta-data"), param="ref_audio"),
        c("ref_audio-data-url-not-base64", speech(ref_audio="data:audio/wav,RIFF"), param="ref_audio"),
        c("ref_audio-empty", speech(ref_audio=""), param="ref_audio"),
        c("ref_audio-undecodable", speech(ref_audio=base64.b64encode(UNDECODABLE).decode()), param="ref_audio"),
        c("ref_audio-too-big", speech(ref_audio=base64.b64encode(TOO_BIG_CLIP).decode()), param="ref_audio"),
        c("ref_audio-too-long", speech(ref_audio=base64.b64encode(TOO_LONG_WAV).decode()), param="ref_audio"),
        c("body-over-the-limit", speech(input="Hello.", extra_params={"pad": "x" * (MAX_BODY_BYTES + 1)}),
          status=413, closes=True),
        c("speech-get", b"", status=405, method="GET"),
    ]  # fmt: skip


def _voice_cases() -> list[HttpCase]:
    def c(case_id: str, body: bytes, **kw) -> HttpCase:
        return HttpCase(case_id, body, path="/v1/audio/voices", **kw)

    def form(case_id: str, body: bytes, **kw) -> HttpCase:
        return HttpCase(case_id, body, path="/v1/audio/voices", content_type=MULTIPART, **kw)

    return [
        c("voices-not-an-object", b"[1]"),
        c("voices-name-missing", json.dumps({"audio_sample": REF}).encode(), param="name"),
        c("voices-name-path", voice_json(name="../../etc/passwd"), param="name"),
        c("voices-name-200k", voice_json(name="a" * LONG), param="name"),
        c("voices-name-surrogate", spliced("name", '"v\\ud800"', voice_json), param="name"),
        c("voices-audio-missing", json.dumps({"name": "corpus-voice"}).encode(), param="audio_sample"),
        c("voices-audio-not-base64", voice_json(audio_sample="%%%"), param="audio_sample"),
        c("voices-audio-undecodable", voice_json(audio_sample=base64.b64encode(UNDECODABLE).decode()),
          param="audio_sample"),
        c("voices-audio-too-big", voice_json(audio_sample=base64.b64encode(TOO_BIG_CLIP).decode()),
          param="audio_sample"),
        c("voices-audio-too-long", voice_json(audio_sample=base64.b64encode(TOO_LONG_WAV).decode()),
          param="audio_sample"),
        c("voices-ref_text-200k", voice_json(ref_text="a" * LONG, x_vector_only_mode=False), param="ref_text"),
        c("voices-ref_text-number", voice_json(ref_text=5), param="ref_text"),
        c("voices-x_vector_only_mode-string", voice_json(x_vector_only_mode="yes"), param="x_vector_only_mode"),
        c("voices-type-music", voice_json(type="music"), param="type"),
        c("voices-consent-number", voice_json(consent=5), param="consent"),
        c("voices-consent-unknown", voice_json(consent="cons_nope"), status=404, param="consent"),
        form("voices-multipart-no-file", multipart(("name", b"corpus-voice", False)), param="audio_sample"),
        form("voices-multipart-name-is-a-file", multipart(("name", b"x", True), ("audio_sample", REF_WAV, True)),
             param="name"),
        form("voices-multipart-ref_text-200k",
             multipart(("name", b"corpus-voice", False), ("ref_text", b"a" * LONG, False),
                       ("audio_sample", REF_WAV, True)), param="ref_text"),
        form("voices-multipart-bad-name", multipart(("name", b"no spaces allowed", False),
                                                    ("audio_sample", REF_WAV, True)), param="name"),
        form("voices-multipart-unterminated", multipart(("name", b"corpus-voice", False), close=False)[:-9],
             param="audio_sample"),
        HttpCase("voices-get-bad-name", b"", path="/v1/audio/voices/bad%20name!", method="GET", param="name"),
        HttpCase("voices-delete-bad-name", b"", path="/v1/audio/voices/x%20y", method="DELETE", param="name"),
        HttpCase("models-unknown", b"", path="/v1/models/no-such-model", method="GET", status=404),
    ]  # fmt: skip


HTTP_CASES: list[HttpCase] = _speech_cases() + _voice_cases()

# Every bad input the issue names is in the corpus (tests check these ids exist).
ISSUE_HTTP_CASES = (
    "nested-array-100k", "nested-object-5000", "surrogate-input", "seed-5000-digits", "top_k-4301-digits",
    "top_k-above-uint32", "top_p-underflows-float32", "repetition_penalty-1e-45", "ref_text-200k",
    "instructions-200k", "voice-200k", "control-only-input", "temperature-3.5e38", "temperature-1e-45",
    "body-over-the-limit", "ref_audio-too-big", "ref_audio-too-long",
)  # fmt: skip


class Http11:
    """One HTTP/1.1 connection, kept: the corpus checks that this very connection goes on serving."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int, host: str = "127.0.0.1") -> Http11:
        return cls(*await asyncio.open_connection(host, port))

    async def request(
        self, method: str, path: str, body: bytes = b"", content_type: str = "application/json"
    ):
        """(status, headers, body) of one request; the connection stays open for the next."""
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        headers = [("host", "gateway"), ("content-length", str(len(body)))]
        if body:
            headers.append(("content-type", content_type))
        out = self.conn.send(h11.Request(method=method, target=path, headers=headers))
        out += self.conn.send(h11.Data(data=body)) if body else b""
        self.writer.write(out + self.conn.send(h11.EndOfMessage()))
        with contextlib.suppress(ConnectionError):  # a refused body may be cut off mid-write
            await self.writer.drain()
        status, response_headers, chunks = None, {}, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await asyncio.wait_for(self.reader.read(65536), 30))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                response_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, response_headers, b"".join(chunks)

    @property
    def usable(self) -> bool:
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    def close(self) -> None:
        self.writer.close()


# -- gRPC -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrpcCase:
    """One bad tts.v1 call: the status `code`; `param`, a field name its message must contain;
    `field`, the google.rpc.BadRequest field path ("" for the request as a whole; None: no
    BadRequest, the code is not INVALID_ARGUMENT)."""

    id: str
    method: str
    payloads: tuple[bytes, ...]
    param: str | None
    field: str | None
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


def synthesize(**kw) -> tts_pb2.SynthesizeRequest:
    sampling = kw.pop("sampling", None)
    streaming = kw.pop("streaming", None)
    msg = tts_pb2.SynthesizeRequest(
        **{"text": "Hello.", "reference_audio": REF_WAV, "x_vector_only": True, **kw}
    )
    if sampling:
        msg.sampling.CopyFrom(tts_pb2.SamplingParams(**sampling))
    if streaming:
        msg.streaming.CopyFrom(tts_pb2.StreamingOptions(**streaming))
    return msg


def _synthesize_cases() -> list[GrpcCase]:
    def c(case_id: str, param: str, field: str, **kw) -> GrpcCase:
        return GrpcCase(case_id, "Synthesize", (synthesize(**kw).SerializeToString(),), param, field)

    nan, inf = float("nan"), float("inf")
    return [
        c("temperature-3.5e38", "temperature", "sampling.temperature", sampling={"temperature": 3.5e38}),
        c("temperature-1e-45", "temperature", "sampling.temperature", sampling={"temperature": 1e-45}),
        c("temperature-nan", "temperature", "sampling.temperature", sampling={"temperature": nan}),
        c("temperature-inf", "temperature", "sampling.temperature", sampling={"temperature": inf}),
        c("temperature-negative", "temperature", "sampling.temperature", sampling={"temperature": -1.0}),
        c("repetition_penalty-1e-45", "repetition_penalty", "sampling.repetition_penalty",
          sampling={"repetition_penalty": 1e-45}),
        c("repetition_penalty-zero", "repetition_penalty", "sampling.repetition_penalty",
          sampling={"repetition_penalty": 0.0}),
        c("repetition_penalty-nan", "repetition_penalty", "sampling.repetition_penalty",
          sampling={"repetition_penalty": nan}),
        c("repetition_penalty-1e30", "repetition_penalty", "sampling.repetition_penalty",
          sampling={"repetition_penalty": 1e30}),
        c("top_p-1e-40", "top_p", "sampling.top_p", sampling={"top_p": 1e-40}),
        c("top_p-1.5", "top_p", "sampling.top_p", sampling={"top_p": 1.5}),
        c("top_p-nan", "top_p", "sampling.top_p", sampling={"top_p": nan}),
        c("top_k-uint32-max", "top_k", "sampling.top_k", sampling={"top_k": 2**32 - 1}),
        c("top_k-above-max", "top_k", "sampling.top_k", sampling={"top_k": lim.TOP_K_MAX + 1}),
        c("seed-uint64-max", "seed", "sampling.seed", sampling={"seed": 2**64 - 1}),
        c("seed-2^63", "seed", "sampling.seed", sampling={"seed": 2**63}),
        c("min_new_frames-uint32-max", "min_new_tokens", "sampling.min_new_frames",
          sampling={"min_new_frames": 2**32 - 1}),
        c("max_new_frames-uint32-max", "max_new_tokens", "max_new_frames", max_new_frames=2**32 - 1),
        c("sample_rate-1", "sample_rate", "sample_rate_hz", sample_rate_hz=1),
        c("sample_rate-uint32-max", "sample_rate", "sample_rate_hz", sample_rate_hz=2**32 - 1),
        c("audio_encoding-unknown", "audio_encoding", "audio_encoding", audio_encoding=99),
        c("task_type-unknown", "task_type", "task_type", task_type=99),
        c("task_type-not-served", "task_type", "task_type", task_type=tts_pb2.TASK_TYPE_CUSTOM_VOICE),
        c("control-only-text", "input", "text", text="\x00\x01\x02"),
        c("empty-text", "input", "text", text=""),
        c("whitespace-text", "input", "text", text=" \n\t "),
        c("text-too-long", "input", "text", text="a" * (lim.TEXT_MAX_CHARS + 1)),
        c("reference_text-200k", "ref_text", "reference_text", reference_text="a" * LONG, x_vector_only=False),
        c("reference_text-missing", "ref_text", "reference_text", x_vector_only=False),
        c("instructions-200k", "instructions", "instructions", instructions="a" * LONG),
        c("instructions-on-base", "instructions", "instructions", instructions="Speak softly."),
        c("voice-200k", "voice", "voice", voice="a" * LONG),
        c("request_id-200k", "request_id", "request_id", request_id="a" * LONG),
        c("request_id-145", "request_id", "request_id", request_id="r" * (lim.DERIVED_REQUEST_ID_MAX_CHARS + 1)),
        c("language-200k", "language", "language", language="a" * LONG),
        c("language-unknown", "language", "language", language="klingon"),
        c("model-200k", "model", "model", model="a" * LONG),
        c("no-voice-no-clip", "voice", "voice", reference_audio=b""),
        c("reference_audio-undecodable", "ref_audio", "reference_audio", reference_audio=UNDECODABLE),
        c("reference_audio-too-big", "ref_audio", "reference_audio", reference_audio=TOO_BIG_CLIP),
        c("reference_audio-too-long", "ref_audio", "reference_audio", reference_audio=TOO_LONG_WAV),
        c("chunk_frames_ramp-1000-values", "chunk_frames_ramp", "streaming.chunk_frames_ramp",
          streaming={"chunk_frames_ramp": [1] * 1000}),
        c("chunk_frames_ramp-zero", "chunk_frames_ramp", "streaming.chunk_frames_ramp",
          streaming={"chunk_frames_ramp": [0]}),
        c("chunk_frames_ramp-huge-value", "chunk_frames_ramp", "streaming.chunk_frames_ramp",
          streaming={"chunk_frames_ramp": [2**32 - 1]}),
        c("first_chunk_frames-uint32-max", "first_chunk_frames", "streaming.first_chunk_frames",
          streaming={"first_chunk_frames": 2**32 - 1}),
        GrpcCase("model-unknown", "Synthesize", (synthesize(model="no-such-model").SerializeToString(),),
                 "model", None, grpc.StatusCode.NOT_FOUND),
    ]  # fmt: skip


def streaming_request(**synthesis) -> bytes:
    config = tts_pb2.StreamingSynthesizeConfig(synthesis=synthesize(**{"text": "", **synthesis}))
    return tts_pb2.StreamingSynthesizeRequest(streaming_config=config).SerializeToString()


def text_input(text: str) -> bytes:
    return tts_pb2.StreamingSynthesizeRequest(
        input=tts_pb2.StreamingSynthesisInput(text=text)
    ).SerializeToString()


def _other_cases() -> list[GrpcCase]:
    s = "StreamingSynthesize"
    synth_prefix = "streaming_config.synthesis."
    bad_split = tts_pb2.StreamingSynthesizeRequest(
        streaming_config=tts_pb2.StreamingSynthesizeConfig(synthesis=synthesize(text=""), text_split=99)
    ).SerializeToString()
    # A string field holding the UTF-8-like bytes of a lone surrogate: SynthesizeRequest.text,
    # and StreamingSynthesizeRequest.input wrapping StreamingSynthesisInput.text.
    surrogate_text = b"\x1a\x03\xed\xa0\x80"
    surrogate_input = b"\x12\x05" + b"\x0a\x03\xed\xa0\x80"
    voice = lambda **kw: tts_pb2.CreateVoiceRequest(  # noqa: E731
        **{"name": "corpus-voice", "reference_audio": REF_WAV, "x_vector_only": True, **kw}
    ).SerializeToString()
    junk, bad_utf8 = b"\xff\xff\xff", b"\x0a\x05\xc3\x28\xc3\x28\x00"
    cases = [
        GrpcCase("streaming-input-first", s, (text_input("Hello."),), "streaming_config", "streaming_config"),
        GrpcCase("streaming-no-messages", s, (), "streaming_config", "streaming_config"),
        GrpcCase(
            "streaming-config-text", s, (streaming_request(text="Hello."),), "text", synth_prefix + "text"
        ),
        GrpcCase(
            "streaming-second-config",
            s,
            (streaming_request(), streaming_request()),
            "streaming_config",
            "streaming_config",
        ),
        GrpcCase("streaming-text_split-unknown", s, (bad_split,), "text_split", "text_split"),
        GrpcCase(
            "streaming-temperature-3.5e38",
            s,
            (streaming_request(sampling={"temperature": 3.5e38}),),
            "temperature",
            synth_prefix + "sampling.temperature",
        ),
        GrpcCase(
            "streaming-instructions-200k",
            s,
            (streaming_request(instructions="a" * LONG),),
            "instructions",
            synth_prefix + "instructions",
        ),
        GrpcCase("streaming-input-surrogate", s, (streaming_request(), surrogate_input), None, ""),
        GrpcCase("create-voice-bad-name", "CreateVoice", (voice(name="../x"),), "name", "name"),
        GrpcCase("create-voice-empty-name", "CreateVoice", (voice(name=""),), "name", "name"),
        GrpcCase(
            "create-voice-reference_text-200k",
            "CreateVoice",
            (voice(reference_text="a" * LONG),),
            "ref_text",
            "reference_text",
        ),
        GrpcCase(
            "create-voice-no-audio",
            "CreateVoice",
            (voice(reference_audio=b""),),
            "reference_audio",
            "reference_audio",
        ),
        GrpcCase(
            "create-voice-audio-too-big",
            "CreateVoice",
            (voice(reference_audio=TOO_BIG_CLIP),),
            "reference_audio",
            "reference_audio",
        ),
        GrpcCase(
            "get-voice-bad-name",
            "GetVoice",
            (tts_pb2.GetVoiceRequest(name="a b").SerializeToString(),),
            "name",
            "name",
        ),
        GrpcCase(
            "delete-voice-200k-name",
            "DeleteVoice",
            (tts_pb2.DeleteVoiceRequest(name="a" * LONG).SerializeToString(),),
            "name",
            "name",
        ),
        GrpcCase("synthesize-text-surrogate", "Synthesize", (surrogate_text,), None, ""),
    ]
    for method in ("Synthesize", "StreamingSynthesize", "CreateVoice", "GetVoice", "DeleteVoice"):
        cases.append(GrpcCase(f"{method}-junk-bytes", method, (junk,), None, ""))
        cases.append(GrpcCase(f"{method}-bad-utf8", method, (bad_utf8,), None, ""))
    return cases  # fmt: skip


GRPC_CASES: list[GrpcCase] = _synthesize_cases() + _other_cases()

ISSUE_GRPC_CASES = (
    "temperature-3.5e38", "temperature-1e-45", "repetition_penalty-1e-45", "top_p-1e-40", "top_k-uint32-max",
    "reference_text-200k", "instructions-200k", "voice-200k", "request_id-200k", "chunk_frames_ramp-1000-values",
    "control-only-text", "Synthesize-junk-bytes", "StreamingSynthesize-bad-utf8",
)  # fmt: skip


async def call(
    channel: grpc.aio.Channel, method: str, payloads: tuple[bytes, ...]
) -> grpc.aio.AioRpcError | None:
    path = f"/tts.v1.TextToSpeechService/{method}"
    try:
        if method == "Synthesize":
            async for _ in channel.unary_stream(path)(payloads[0], timeout=30):
                pass
        elif method == "StreamingSynthesize":
            async for _ in channel.stream_stream(path)(iter(payloads), timeout=30):
                pass
        else:
            await channel.unary_unary(path)(payloads[0], timeout=30)
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


def bad_request_field(exc: grpc.aio.AioRpcError) -> str | None:
    """The field of the google.rpc.BadRequest detail of a status (None: no such detail)."""
    status = rpc_status.from_call(exc)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            return bad_request.field_violations[0].field
    return None
