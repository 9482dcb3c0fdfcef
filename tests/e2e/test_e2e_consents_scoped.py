"""Voice consents belong to the key that recorded them (issue 28), through the real processes: a
gateway with two API keys in front of the stack. Key B cannot list, read, rename or delete key A's
consent, nor cite it in a voice upload (HTTP or gRPC): each is answered exactly as for an id that
does not exist, so B learns nothing of A's records. Before the fix every key saw every record,
the person's name included."""

from __future__ import annotations

import dataclasses

import grpc
import httpx
import pytest
from e2e_helpers import REF_WAV, extra_gateway

from qtts.pb import tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "key-a-" + "a" * 20, "key-b-" + "b" * 20
MISSING = "cons_000000000000000000000000"


@dataclasses.dataclass
class Keyed:
    http_url: str
    grpc_address: str

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.http_url, headers={"authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def keyed(stack, tmp_path_factory) -> Keyed:
    cfg = stack.config
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    with extra_gateway(cfg, "gateway-keyed", ("--api-keys-file", str(keys))) as gw:
        yield Keyed(gw.url, gw.grpc_address)


@pytest.fixture
def consent_of_a(keyed) -> str:
    with keyed.client(KEY_A) as a:
        files = {"recording": ("consent.wav", REF_WAV, "audio/wav")}
        r = a.post(
            "/v1/audio/voice_consents", data={"name": "Alice Example", "language": "en-US"}, files=files
        )
        assert r.status_code == 200, r.text
        yield r.json()["id"]
        a.delete(f"/v1/audio/voice_consents/{r.json()['id']}")


def _same_as_missing(r: httpx.Response, missing: httpx.Response, consent: str) -> None:
    """`r` (for another key's id) says what `missing` (for an id nobody has) says."""
    assert (r.status_code, r.json()["error"]["param"]) == (
        missing.status_code,
        missing.json()["error"]["param"],
    )
    assert r.json()["error"]["message"].replace(consent, MISSING) == missing.json()["error"]["message"]
    assert "Alice" not in r.text


def test_list_shows_only_the_keys_own_consents(keyed, consent_of_a):
    with keyed.client(KEY_A) as a, keyed.client(KEY_B) as b:
        assert consent_of_a in [c["id"] for c in a.get("/v1/audio/voice_consents?limit=100").json()["data"]]
        listed = b.get("/v1/audio/voice_consents?limit=100")
        assert listed.status_code == 200 and consent_of_a not in listed.text and "Alice" not in listed.text
        # Nor as a cursor: as an unknown id.
        r = b.get(f"/v1/audio/voice_consents?after={consent_of_a}")
        missing = b.get(f"/v1/audio/voice_consents?after={MISSING}")
        _same_as_missing(r, missing, consent_of_a)


def test_read_of_another_keys_consent_is_not_found(keyed, consent_of_a):
    with keyed.client(KEY_A) as a, keyed.client(KEY_B) as b:
        assert a.get(f"/v1/audio/voice_consents/{consent_of_a}").json()["name"] == "Alice Example"
        r = b.get(f"/v1/audio/voice_consents/{consent_of_a}")
        _same_as_missing(r, b.get(f"/v1/audio/voice_consents/{MISSING}"), consent_of_a)


def test_rename_of_another_keys_consent_is_not_found(keyed, consent_of_a):
    with keyed.client(KEY_A) as a, keyed.client(KEY_B) as b:
        r = b.post(f"/v1/audio/voice_consents/{consent_of_a}", json={"name": "Mallory"})
        _same_as_missing(
            r, b.post(f"/v1/audio/voice_consents/{MISSING}", json={"name": "Mallory"}), consent_of_a
        )
        assert a.get(f"/v1/audio/voice_consents/{consent_of_a}").json()["name"] == "Alice Example"
        renamed = a.post(f"/v1/audio/voice_consents/{consent_of_a}", json={"name": "Alice E."})
        assert renamed.status_code == 200 and renamed.json()["name"] == "Alice E."


def test_delete_of_another_keys_consent_is_not_found(keyed, consent_of_a):
    with keyed.client(KEY_A) as a, keyed.client(KEY_B) as b:
        r = b.delete(f"/v1/audio/voice_consents/{consent_of_a}")
        _same_as_missing(r, b.delete(f"/v1/audio/voice_consents/{MISSING}"), consent_of_a)
        assert a.get(f"/v1/audio/voice_consents/{consent_of_a}").status_code == 200


def test_a_voice_cannot_cite_another_keys_consent(keyed, consent_of_a):
    files = {"audio": ("ref.wav", REF_WAV, "audio/wav")}
    with keyed.client(KEY_A) as a, keyed.client(KEY_B) as b:
        r = b.post("/v1/audio/voices", data={"name": "stolen", "consent": consent_of_a}, files=files)
        missing = b.post("/v1/audio/voices", data={"name": "stolen", "consent": MISSING}, files=files)
        assert missing.status_code == 404
        _same_as_missing(r, missing, consent_of_a)
        assert b.get("/v1/audio/voices/stolen").status_code == 404
        ok = a.post("/v1/audio/voices", data={"name": "consented", "consent": consent_of_a}, files=files)
        assert ok.status_code == 201, ok.text
        assert a.delete("/v1/audio/voices/consented").status_code == 200
    with grpc.insecure_channel(keyed.grpc_address) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        request = tts_pb2.CreateVoiceRequest(name="stolen", reference_audio=REF_WAV, consent=consent_of_a)
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateVoice(request, metadata=[("authorization", f"Bearer {KEY_B}")], timeout=60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "Alice" not in err.value.details()
        made = stub.CreateVoice(request, metadata=[("authorization", f"Bearer {KEY_A}")], timeout=60)
        assert made.voice.name == "stolen"
        stub.DeleteVoice(
            tts_pb2.DeleteVoiceRequest(name="stolen"),
            metadata=[("authorization", f"Bearer {KEY_A}")],
            timeout=30,
        )
