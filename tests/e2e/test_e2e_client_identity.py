"""Per-client limits cannot be dodged (issue 28), through the real processes: without API keys a
client is its address, so a client that sends a new random Bearer token each time is still one
client for --max-streams-per-client and --rate-limit-per-s; WebSocket handshakes and gRPC calls
count against the same rate. Before the fix every token was a new client (5 of 5 streams and 3 of
3 requests admitted where 2 and 1 should have been) and handshakes were not counted at all."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets

import grpc
import httpx
import pytest
from e2e_helpers import REF_B64, extra_gateway
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from qtts.pb import tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.e2e

BURST = 4  # --rate-limit-burst; the rate refills one request every 50 s, so none during a test
STREAMS = 2  # --max-streams-per-client


@dataclasses.dataclass
class Limited:
    http_url: str
    grpc_address: str


@pytest.fixture(scope="module")
def limited(stack) -> Limited:
    cfg = stack.config
    flags = (
        "--rate-limit-per-s",
        "0.02",
        "--rate-limit-burst",
        str(BURST),
        "--max-streams-per-client",
        str(STREAMS),
    )
    # /health, which extra_gateway polls until ready, is never counted against the limits.
    with extra_gateway(cfg, "gateway-limited", flags) as gw:
        yield Limited(gw.url, gw.grpc_address)


def _random_bearer() -> dict[str, str]:
    return {"authorization": f"Bearer {secrets.token_hex(8)}"}


def _client(url: str, address: str, **kw) -> httpx.Client:
    return httpx.Client(base_url=url, transport=httpx.HTTPTransport(local_address=address), **kw)


def test_random_tokens_do_not_escape_the_rate_limit_and_handshakes_count(limited):
    with _client(limited.http_url, "127.0.0.3", timeout=30) as c:
        codes = [c.get("/v1/models", headers=_random_bearer()).status_code for _ in range(BURST + 2)]
    assert codes == [200] * (BURST - 1) + [429] * 3 or codes == [200] * BURST + [429] * 2, codes
    url = limited.http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, source_address=("127.0.0.3", 0), additional_headers=_random_bearer(), open_timeout=10)
    assert refused.value.response.status_code == 429
    assert int(refused.value.response.headers["retry-after"]) >= 1
    # Another address is another client: its handshake is admitted.
    with connect(url, source_address=("127.0.0.4", 0), open_timeout=10) as ws:
        ws.send('{"type": "session.close"}')


def test_a_websocket_handshake_takes_a_token_from_the_same_bucket(limited):
    url = limited.http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    for _ in range(BURST):
        with connect(url, source_address=("127.0.0.5", 0), open_timeout=10) as ws:
            ws.send('{"type": "session.close"}')
    with _client(limited.http_url, "127.0.0.5", timeout=30) as c:
        assert c.get("/v1/models", headers=_random_bearer()).status_code == 429


def test_random_tokens_over_grpc_share_one_bucket(limited):
    with grpc.insecure_channel(limited.grpc_address) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        codes = []
        for _ in range(BURST + 1):
            try:
                stub.ListVoices(
                    tts_pb2.ListVoicesRequest(), metadata=tuple(_random_bearer().items()), timeout=30
                )
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    assert codes == [grpc.StatusCode.OK] * BURST + [grpc.StatusCode.RESOURCE_EXHAUSTED], codes


def _event(ws, kind: str) -> dict:
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, str) and (event := json.loads(msg))["type"] == kind:
            return event


def test_random_tokens_do_not_escape_the_streams_per_client_bound(limited):
    # A WebSocket segment that waits for more text holds its stream slot: two such sessions
    # from one address, each with its own random token, hold the client's two slots.
    url = limited.http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    config = {
        "type": "session.config",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "response_format": "pcm",
    }
    with contextlib.ExitStack() as sessions:
        for _ in range(STREAMS):
            ws = sessions.enter_context(
                connect(
                    url, source_address=("127.0.0.6", 0), additional_headers=_random_bearer(), open_timeout=10
                )
            )
            ws.send(json.dumps(config))
            ws.send(json.dumps({"type": "input.text", "text": "Hello and"}))
            _event(ws, "audio.start")
            with contextlib.suppress(TimeoutError):  # admitted: audio, or silence while it waits for text
                msg = ws.recv(timeout=2)
                assert isinstance(msg, bytes), msg
        third = sessions.enter_context(
            connect(
                url, source_address=("127.0.0.6", 0), additional_headers=_random_bearer(), open_timeout=10
            )
        )
        third.send(json.dumps(config))
        third.send(json.dumps({"type": "input.text", "text": "Hello and"}))
        err = _event(third, "error")
        assert err["code"] == "rate_limit_exceeded" and "this client" in err["message"], err


def test_a_forwarded_address_from_an_untrusted_peer_is_no_new_client(limited):
    # After the gRPC test, 127.0.0.1's bucket is empty (HTTP and gRPC share it). Without
    # --forwarded-allow-ips no peer is a trusted proxy (uvicorn's default trusted 127.0.0.1), so
    # an X-Forwarded-For of its own choosing does not make it a new client.
    with _client(limited.http_url, "127.0.0.1", timeout=30) as c:
        for i in range(3):
            headers = {"x-forwarded-for": f"198.51.100.{i + 1}", **_random_bearer()}
            assert c.get("/v1/models", headers=headers).status_code == 429
