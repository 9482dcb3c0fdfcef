"""The whole stack with the talker's engine in a process of its own (`--engine-process on`, the
default on a GPU), as separate processes on the tiny model: voice-clone audio over HTTP and gRPC,
one metrics endpoint showing both talker processes, and a client that leaves freeing the slot."""

from __future__ import annotations

import grpc
import httpx
import pytest
from e2e_helpers import FRAME, REF_B64, REF_WAV, poll, running_stack, scrape, tiny_stack_config

from qtts.pb import tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.e2e

TEXT = "A long story that the client will not wait to hear until its very end. " * 20


@pytest.fixture(scope="module")
def process_stack(redis_url, snapshot_root, tmp_path_factory):
    config = tiny_stack_config(
        snapshot_root,
        tmp_path_factory.mktemp("engine-process-logs"),
        redis_url=redis_url,
        extra_args={"talker": ("--engine-process", "on")},
    )
    with running_stack(config) as started:
        yield started


def _talker(stack) -> dict[str, float]:
    return scrape(stack["talker"].spec.metrics_port)


def test_voice_clone_audio_through_the_engine_process(process_stack):
    body = {
        "input": "Hello from the engine process.",
        "voice": "v",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "max_new_tokens": 20,
        "seed": 3,
        "response_format": "pcm",
        "stream": False,
    }
    r = httpx.post(f"{process_stack.http_url}/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.content) == 20 * FRAME * 2 and r.headers["x-tts-num-frames"] == "20"
    req = tts_pb2.SynthesizeRequest(
        text="And once more over gRPC.", reference_audio=REF_WAV, x_vector_only=True, max_new_frames=12
    )
    with grpc.insecure_channel(process_stack.grpc_address) as channel:
        samples = sum(
            m.audio.num_samples
            for m in tts_pb2_grpc.TextToSpeechServiceStub(channel).Synthesize(req, timeout=120)
            if m.HasField("audio")
        )
    assert samples == 12 * FRAME
    # One scrape of the talker: the engine process's series (frames, steps) beside the front's
    # (its calls), each family once.
    metrics = _talker(process_stack)
    assert metrics["tts_talker_frames_total"] >= 32
    assert metrics["tts_talker_step_seconds_count"] + metrics["tts_talker_prefill_seconds_count"] >= 32
    assert metrics["tts_talker_prefill_wait_seconds_count"] >= 2  # one a request, from the engine
    generate = "tts_rpc_requests_total{code=OK,method=/talker.v1.TalkerService/Generate,service=talker}"
    assert metrics[generate] >= 2
    text = httpx.get(f"http://127.0.0.1:{process_stack['talker'].spec.metrics_port}/metrics").text
    assert text.count("# TYPE tts_talker_frames_total counter") == 1


def _where_the_stream_is(stack) -> str:
    """What a slot that stays taken looks like from each side: the gateway's live streams and
    outcomes, the talker's streams, and the tail of both logs (a failure says where it stuck)."""
    gateway = scrape(stack["gateway"].spec.metrics_port)
    seen = {
        k: v for k, v in gateway.items() if k.startswith(("tts_gateway_active", "tts_gateway_requests_total"))
    }
    talker = {k: v for k, v in _talker(stack).items() if "active_streams" in k or "waiting" in k}
    logs = "\n".join(f"--- {name}\n{stack[name].log_tail(15)}" for name in ("gateway", "talker"))
    return f"gateway {seen}\ntalker {talker}\n{logs}"


def test_a_client_that_leaves_frees_the_engine_process_slot(process_stack):
    # Generous polls: the gauge comes from the engine process, and two loaded cores (the suite,
    # the stack's processes) can take seconds to turn it over.
    assert poll(lambda: _talker(process_stack).get("tts_talker_active_streams", 0.0) == 0, timeout=20)
    body = {
        "input": TEXT,
        "voice": "v",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "max_new_tokens": 3000,
        "seed": 1,
        "stream": True,
        "response_format": "pcm",
    }
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", f"{process_stack.http_url}/v1/audio/speech", json=body) as r,
    ):
        assert r.status_code == 200
        chunks = r.iter_raw()
        assert next(chunks)
        assert poll(lambda: _talker(process_stack).get("tts_talker_active_streams", 0.0) == 1, timeout=20)
    assert poll(lambda: _talker(process_stack).get("tts_talker_active_streams", 0.0) == 0, timeout=20), (
        _where_the_stream_is(process_stack)
    )
    assert httpx.get(f"{process_stack.http_url}/health", timeout=10).status_code == 200
