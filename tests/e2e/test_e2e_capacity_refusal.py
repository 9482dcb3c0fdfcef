"""The whole stack as separate processes, its talker at capacity (one stream, no queue): the
gateway refuses new requests at once from the room the talker publishes (GetCapacity), over HTTP
and gRPC, without calling the talker; once the stream ends, requests are served again."""

from __future__ import annotations

import grpc
import httpx
import pytest
from e2e_helpers import REF_B64, REF_WAV, poll, running_stack, scrape, tiny_stack_config

from qtts.pb import tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.e2e

LONG = "A long story that keeps the only slot of the talker busy for a while. " * 20


@pytest.fixture(scope="module")
def full_stack(redis_url, snapshot_root, tmp_path_factory):
    config = tiny_stack_config(
        snapshot_root,
        tmp_path_factory.mktemp("capacity-logs"),
        redis_url=redis_url,
        extra_args={"talker": ("--max-batch", "1", "--max-queue", "0")},
    )
    with running_stack(config) as started:
        yield started


def _talker(stack) -> dict[str, float]:
    return scrape(stack["talker"].spec.metrics_port)


def _talker_refusals(stack) -> float:
    metrics = _talker(stack)
    return metrics.get("tts_talker_refused_total", 0.0) + sum(
        v for k, v in metrics.items() if "code=RESOURCE_EXHAUSTED" in k and "TalkerService/Generate" in k
    )


def test_a_full_talker_is_refused_at_the_gateway_without_a_call(full_stack):
    long_body = {
        "input": LONG,
        "voice": "v",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "max_new_tokens": 3000,
        "stream": True,
        "response_format": "pcm",
    }
    short = dict(long_body, input="Hello.", max_new_tokens=4, stream=False)
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", f"{full_stack.http_url}/v1/audio/speech", json=long_body) as r,
    ):
        assert r.status_code == 200
        chunks = r.iter_raw()
        assert next(chunks)
        assert poll(lambda: _talker(full_stack).get("tts_talker_active_streams", 0.0) == 1, timeout=20)
        # The gateway hears the talker has no room within a poll or two (0.1 s apart).
        assert poll(
            lambda: c.post(f"{full_stack.http_url}/v1/audio/speech", json=short).status_code == 429,
            timeout=10,
        )
        # From here on the gateway knows (a talker's own refusal marks it full too): no more calls.
        talker_refusals = _talker_refusals(full_stack)
        refused = c.post(f"{full_stack.http_url}/v1/audio/speech", json=short)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "at capacity" in refused.json()["error"]["message"]
        req = tts_pb2.SynthesizeRequest(
            text="Hello.", reference_audio=REF_WAV, x_vector_only=True, max_new_frames=4
        )
        with grpc.insecure_channel(full_stack.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(tts_pb2_grpc.TextToSpeechServiceStub(channel).Synthesize(req, timeout=60))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _talker_refusals(full_stack) == talker_refusals  # refused at the gateway, no call
    assert poll(lambda: _talker(full_stack).get("tts_talker_active_streams", 0.0) == 0, timeout=20)
    assert poll(
        lambda: (
            httpx.post(f"{full_stack.http_url}/v1/audio/speech", json=short, timeout=60).status_code == 200
        ),
        timeout=20,
    )
