"""Property-based fuzzing of what a client can send the gateway: the JSON body of
`POST /v1/audio/speech`, the multipart voice upload, and the tts.v1 request messages (and bytes
that are no message at all). Whatever arrives, the answer is never a 5xx (never INTERNAL or
UNKNOWN on gRPC), and every refusal is the OpenAI-shaped error naming a field or none.

In process, against the gateway app with the fake talker (tests/services/gateway/gateway_fakes.py), so
thousands of examples take seconds. The profile is derandomized: CI runs the same examples each
time, and a failure reproduces with the printed example."""

from __future__ import annotations

import asyncio
import base64
import json

import grpc
import httpx
from gateway_fakes import build_gateway, wav_bytes
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.grpc_servicer import TextToSpeechServicer
from services.gateway.http_app import HttpDeps, create_app

# Examples per surface (2,300 in all).
JSON_EXAMPLES = 1000
MULTIPART_EXAMPLES = 500
GRPC_EXAMPLES = 800

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

WAV = wav_bytes(0.2)
REF = base64.b64encode(WAV).decode()
GOOD = {
    "model": "tiny-base",
    "input": "Hello there.",
    "voice": "any",
    "ref_audio": REF,
    "x_vector_only_mode": True,
    "response_format": "pcm",
    "stream": False,
    "max_new_tokens": 2,
}
SPEECH_FIELDS = [
    "model", "voice", "speaker", "response_format", "speed", "task_type", "language", "instructions",
    "ref_audio", "ref_text", "x_vector_only_mode", "max_new_tokens", "min_new_tokens", "seed",
    "temperature", "top_k", "top_p", "repetition_penalty", "sample_rate", "initial_codec_chunk_frames",
    "non_streaming_mode", "speaker_embedding", "extra_params", "input", "stream", "stream_format",
]  # fmt: skip

# Any text, lone surrogates and control characters included.
any_text = st.text(st.characters(codec=None, categories=None), max_size=40)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 2**64, 1e-45, 3.5e38, 1e308, 5e-324, 0.5, 24000]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, any_text)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4),
    max_leaves=12,
)
# Values each field could plausibly get, next to anything at all.
plausible = {
    "voice": st.one_of(any_text, st.fixed_dictionaries({"id": any_text})),
    "response_format": st.sampled_from(["pcm", "wav", "mp3", "flac", "opus", "aac", "mulaw", "alaw", "PCM", "x"]),
    "stream_format": st.sampled_from(["audio", "sse", "SSE", "json"]),
    "ref_audio": st.one_of(
        st.just(REF), st.just("data:audio/wav;base64," + REF), st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())
    ),
    "speaker_embedding": st.lists(st.one_of(numbers, st.lists(numbers, max_size=3)), max_size=5),
    "task_type": st.sampled_from(["Base", "voice_clone", "CustomVoice", "voice_design", "nope"]),
    "language": st.sampled_from(["en", "zh-CN", "auto", "English", "klingon", "pt_BR"]),
}  # fmt: skip


@st.composite
def speech_bodies(draw) -> bytes:
    """A JSON body: usually the good body with some fields replaced, removed or added."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "value", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "value":
        return json.dumps(draw(json_values)).encode()
    body = dict(GOOD)
    for name in draw(st.lists(st.sampled_from(SPEECH_FIELDS), max_size=5, unique=True)):
        choice = draw(st.sampled_from(["drop", "any", "plausible"]))
        if choice == "drop":
            body.pop(name, None)
        elif choice == "plausible" and name in plausible:
            body[name] = draw(plausible[name])
        else:
            body[name] = draw(json_values)
    for key in draw(st.lists(any_text, max_size=2)):
        body[key] = draw(json_values)
    # json.dumps writes NaN / Infinity and lone surrogates (as \\ud800), which JSON parsers meet.
    return json.dumps(body).encode()


def app_client(gw) -> httpx.AsyncClient:
    async def stage_health():
        return {"talker": "SERVING", "speaker_cache": "SERVING"}

    app = create_app(HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, max_body_bytes=1 << 20))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=10)


def assert_clean_refusal(r: httpx.Response, what) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"], (what, error)
        assert error["param"] is None or isinstance(error["param"], str), (what, error)


def test_speech_json_bodies_never_get_a_5xx():
    gw = build_gateway(frames=2)
    loop = asyncio.new_event_loop()
    client = app_client(gw)
    statuses: list[int] = []

    @settings(FUZZ, max_examples=JSON_EXAMPLES)
    @given(body=speech_bodies())
    def post(body: bytes):
        r = loop.run_until_complete(
            client.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})
        )
        assert_clean_refusal(r, body[:300])
        statuses.append(r.status_code)

    try:
        post()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    assert gw.synth.admission.active == 0
    # Every example ran, and the fuzzer reached both sides.
    assert len(statuses) >= JSON_EXAMPLES and {200, 400} <= set(statuses), set(statuses)


voice_names = st.sampled_from(["", "alice", "bob-1.v2", "true", "false", "1"])
field_text = st.one_of(any_text, voice_names)
clip = st.one_of(st.just(WAV), st.binary(max_size=128), st.just(b"RIFF" + bytes(40)))


def _valid_upload() -> tuple[bytes, str]:
    """A well-formed multipart upload of a new voice (name and clip), as voice_uploads frames it."""
    boundary = "fuzzboundary7MA4YWxkTrZu0gW"
    name = f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nfuzz-valid-voice\r\n'
    clip_part = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="audio_sample"; filename="clip.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + WAV
        + b"\r\n"
    )
    return (
        name.encode() + clip_part + f"--{boundary}--\r\n".encode(),
        f"multipart/form-data; boundary={boundary}",
    )


@st.composite
def voice_uploads(draw) -> tuple[bytes, str]:
    """(body, content type) of a multipart upload: fields and files in any mix, or broken framing."""
    boundary = "fuzzboundary7MA4YWxkTrZu0gW"
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=300)), f"multipart/form-data; boundary={boundary}"
    parts: list[bytes] = []
    names = ["name", "ref_text", "x_vector_only_mode", "type", "consent", "audio_sample", "audio", "file"]
    for name in draw(st.lists(st.one_of(st.sampled_from(names), any_text), max_size=6)):
        as_file = draw(st.booleans())
        value = draw(clip) if as_file else draw(field_text).encode("utf-8", "surrogatepass")
        disposition = f'form-data; name="{name}"' + ('; filename="clip.wav"' if as_file else "")
        head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
        if as_file:
            head += "Content-Type: audio/wav\r\n"
        parts.append(head.encode("utf-8", "surrogatepass") + b"\r\n" + value + b"\r\n")
    body = b"".join(parts) + (f"--{boundary}--\r\n".encode() if draw(st.booleans()) or not parts else b"")
    return body, f"multipart/form-data; boundary={boundary}"


def test_voice_uploads_never_get_a_5xx():
    gw = build_gateway()
    loop = asyncio.new_event_loop()
    client = app_client(gw)
    statuses: list[int] = []

    @settings(FUZZ, max_examples=MULTIPART_EXAMPLES)
    @given(upload=voice_uploads())
    # A valid upload always runs too: among the drawn examples only a few are valid (2 of 500),
    # and with a voice of that name already stored they all answer 409 or 404.
    @example(upload=_valid_upload())
    def post(upload):
        body, ctype = upload
        r = loop.run_until_complete(
            client.post("/v1/audio/voices", content=body, headers={"content-type": ctype})
        )
        assert_clean_refusal(r, body[:300])
        statuses.append(r.status_code)

    try:
        post()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    assert len(statuses) >= MULTIPART_EXAMPLES and {201, 400} <= set(statuses), set(statuses)


# tts.v1 messages: every field drawn over its whole wire range (and unknown enum values). A
# protobuf string cannot hold a lone surrogate; its UTF-8-like bytes come in the raw payloads.
msg_text = st.text(st.characters(codec="utf-8"), max_size=40)
surrogate_fields = st.sampled_from(
    [b"\x1a\x03\xed\xa0\x80", b"\x2a\x03\xed\xb0\x80", b"\x0a\x02\xc3\x28", b"\x0a\x01\xff"]
)
uint32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2, 80, 4096, 4097, 2**32 - 1]))
float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
enum_value = st.integers(-(2**31), 2**31 - 1) | st.integers(0, 4)
optional = lambda s: st.none() | s  # noqa: E731


@st.composite
def sampling_params(draw) -> tts_pb2.SamplingParams:
    values = {
        "temperature": draw(optional(float32)),
        "top_k": draw(optional(uint32)),
        "top_p": draw(optional(float32)),
        "repetition_penalty": draw(optional(float32)),
        "seed": draw(optional(st.integers(0, 2**64 - 1))),
        "min_new_frames": draw(optional(uint32)),
    }
    return tts_pb2.SamplingParams(
        greedy=draw(st.booleans()), **{k: v for k, v in values.items() if v is not None}
    )


@st.composite
def synthesize_requests(draw, text: bool = True) -> tts_pb2.SynthesizeRequest:
    msg = tts_pb2.SynthesizeRequest(
        request_id=draw(st.one_of(st.just(""), msg_text)),
        model=draw(st.sampled_from(["", "tiny-base", "other"]) | msg_text),
        text=draw(st.one_of(st.just("Hello."), msg_text)) if text else "",
        task_type=draw(enum_value),
        voice=draw(st.one_of(st.just(""), msg_text)),
        language=draw(st.sampled_from(["", "en", "auto"]) | msg_text),
        instructions=draw(st.one_of(st.just(""), msg_text)),
        reference_audio=draw(st.one_of(st.just(WAV), st.binary(max_size=64))),
        reference_text=draw(msg_text),
        x_vector_only=draw(st.booleans()),
        audio_encoding=draw(enum_value),
        sample_rate_hz=draw(st.one_of(st.sampled_from([0, 8000, 16000, 24000, 48000]), uint32)),
        max_new_frames=draw(st.one_of(st.sampled_from([0, 1, 2]), uint32)),
    )
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(sampling_params()))
    if draw(st.booleans()):
        msg.streaming.CopyFrom(
            tts_pb2.StreamingOptions(
                first_chunk_frames=draw(uint32), chunk_frames_ramp=draw(st.lists(uint32, max_size=40))
            )
        )
    return msg


@st.composite
def grpc_calls(draw) -> tuple[str, str, list[bytes]]:
    """(method, kind, request payloads): messages of every RPC, or bytes of no message at all."""
    method = draw(
        st.sampled_from(
            ["Synthesize", "Synthesize", "StreamingSynthesize", "CreateVoice", "GetVoice", "DeleteVoice"]
        )
    )
    if draw(st.integers(0, 7)) == 0:  # garbage, or a message of another type
        junk = st.one_of(
            st.binary(max_size=80),
            surrogate_fields,
            st.tuples(synthesize_requests(), surrogate_fields).map(lambda t: t[0].SerializeToString() + t[1]),
        )
        return method, "raw", draw(st.lists(junk, min_size=1, max_size=3))
    if method == "Synthesize":
        msg = draw(synthesize_requests())
        return method, "msg", [msg.SerializeToString()]
    if method == "StreamingSynthesize":
        payloads = []
        if draw(st.integers(0, 5)):
            config = tts_pb2.StreamingSynthesizeConfig(
                synthesis=draw(synthesize_requests(text=draw(st.booleans()))), text_split=draw(enum_value)
            )
            payloads.append(tts_pb2.StreamingSynthesizeRequest(streaming_config=config))
        for _ in range(draw(st.integers(0, 3))):
            payloads.append(
                tts_pb2.StreamingSynthesizeRequest(
                    input=tts_pb2.StreamingSynthesisInput(text=draw(msg_text), flush=draw(st.booleans()))
                )
            )
        if draw(st.booleans()) and payloads:
            payloads.insert(1, payloads[0])  # a second config
        return method, "msg", [p.SerializeToString() for p in payloads]
    if method == "CreateVoice":
        msg = tts_pb2.CreateVoiceRequest(
            name=draw(st.one_of(msg_text, voice_names)),
            reference_audio=draw(clip),
            reference_text=draw(msg_text),
        )
        if draw(st.booleans()):
            msg.x_vector_only = draw(st.booleans())
    else:
        msg = getattr(tts_pb2, f"{method}Request")(name=draw(st.one_of(msg_text, voice_names)))
    return method, "msg", [msg.SerializeToString()]


async def _call(channel: grpc.aio.Channel, method: str, payloads: list[bytes]) -> tuple[grpc.StatusCode, str]:
    path = f"/tts.v1.TextToSpeechService/{method}"
    try:
        if method == "Synthesize":
            async for _ in channel.unary_stream(path)(payloads[0], timeout=10):
                pass
        elif method == "StreamingSynthesize":
            async for _ in channel.stream_stream(path)(iter(payloads), timeout=10):
                pass
        else:
            await channel.unary_unary(path)(payloads[0], timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


# grpc-core's own INTERNAL on the client for a message written after the server ended the call.
CLIENT_WRITE_RACE = "Internal error from Core"


def server_failures(gw) -> int:
    """Calls the server ended with INTERNAL or UNKNOWN (the interceptor counts every final code)."""
    return sum(
        int(sample.value)
        for family in gw.metrics.rpc_total.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("code") in ("INTERNAL", "UNKNOWN")
    )


def test_grpc_requests_never_get_internal_or_unknown():
    gw = build_gateway(frames=2)
    loop = asyncio.new_event_loop()

    async def start():
        server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics, redact=True)])
        servicer = TextToSpeechServicer(gw.synth, gw.voice_service)
        tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    server, channel = loop.run_until_complete(start())
    codes: list[grpc.StatusCode] = []

    @settings(FUZZ, max_examples=GRPC_EXAMPLES)
    @given(call=grpc_calls())
    def call(call):
        method, _, payloads = call
        code, details = loop.run_until_complete(_call(channel, method, payloads))
        assert server_failures(gw) == 0, (method, code, details)
        if details == CLIENT_WRITE_RACE:
            return  # the server had ended the call (its code is counted above) before our last write
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method, code, details)
        codes.append(code)

    try:
        call()
    finally:
        loop.run_until_complete(channel.close())
        loop.run_until_complete(server.stop(0))
        loop.close()
    assert len(codes) >= GRPC_EXAMPLES * 0.9, len(codes)  # a few end in the write race above
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= set(codes), set(codes)
    assert gw.synth.admission.active == 0
