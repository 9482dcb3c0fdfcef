"""Voice consents live in speaker_cache (Redis here): a second gateway process in front of the same
stack knows a consent the first one recorded, and uses it for a voice upload and over gRPC."""

from __future__ import annotations

import grpc
import httpx
import pytest
from e2e_helpers import REF_WAV

from qtts.pb import tts_pb2, tts_pb2_grpc
from services.launcher import free_port, gateway_spec, start_service, stop_services, wait_serving

pytestmark = pytest.mark.e2e


@pytest.fixture
def second_gateway(stack):
    cfg = stack.config
    http_port, grpc_port = free_port(), free_port()
    proc = start_service(
        gateway_spec(cfg, name="gateway-2", http_port=http_port, grpc_port=grpc_port, metrics_port=0),
        cfg.log_dir,
    )
    try:
        wait_serving(proc, cfg.startup_timeout_s)
        yield f"http://{cfg.host}:{http_port}", f"{cfg.host}:{grpc_port}"
    finally:
        assert stop_services([proc], 20.0) == {"gateway-2": 0}


def test_a_consent_recorded_on_one_gateway_is_known_to_another(stack, second_gateway):
    http2, grpc2 = second_gateway
    files = {"recording": ("consent.wav", REF_WAV, "audio/wav")}
    made = httpx.post(
        f"{stack.http_url}/v1/audio/voice_consents", data={"name": "Me", "language": "en-US"}, files=files
    )
    assert made.status_code == 200, made.text
    consent = made.json()["id"]
    got = httpx.get(f"{http2}/v1/audio/voice_consents/{consent}")
    assert got.status_code == 200 and got.json()["name"] == "Me"
    with grpc.insecure_channel(grpc2) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        voice = stub.CreateVoice(
            tts_pb2.CreateVoiceRequest(name="consented-2", reference_audio=REF_WAV, consent=consent),
            timeout=60,
        )
        assert voice.voice.name == "consented-2"
        stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(name="consented-2"), timeout=30)
    gone = httpx.delete(f"{http2}/v1/audio/voice_consents/{consent}")
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    missing = httpx.get(f"{stack.http_url}/v1/audio/voice_consents/{consent}")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "consent_id"
