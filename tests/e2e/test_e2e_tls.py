"""The whole stack as separate processes with mutual TLS between every service (one certificate
for all of them, as the chart mounts one Secret): a voice-clone synthesis goes through every hop,
and each internal port refuses plaintext clients, clients without a certificate and clients with
another CA's certificate."""

from __future__ import annotations

import grpc
import httpx
import pytest
from e2e_helpers import wav_frames

from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.serving.probe import health_status
from qtts.serving.tls import TlsConfig, sync_channel
from qtts.tiny_model import build_tiny_snapshot
from services.launcher import StackConfig, StartupError, demo_request, start_stack
from tests.tls_certs import SERVICE_NAME, TestCA

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = TestCA(folder / "ca")
    stack, client = ca.issue("stack"), ca.issue("client")
    intruder = TestCA(folder / "other", "another CA").issue("intruder")
    return {
        "stack": TlsConfig(cert=stack.cert, key=stack.key, ca=stack.ca, server_name=SERVICE_NAME),
        "client": TlsConfig(cert=client.cert, key=client.key, ca=client.ca, server_name=SERVICE_NAME),
        "no-cert": TlsConfig(ca=client.ca, server_name=SERVICE_NAME),
        "intruder": TlsConfig(cert=intruder.cert, key=intruder.key, ca=client.ca, server_name=SERVICE_NAME),
    }


@pytest.fixture(scope="module")
def tls_stack(pki, snapshot_root, tmp_path_factory):
    model = snapshot_root / "tiny-base"
    if not (model / "config.json").exists():
        build_tiny_snapshot(model, "base")
    config = StackConfig.on_free_ports(
        model=str(model),
        startup_timeout_s=300.0,
        drain_seconds=2.0,
        log_dir=tmp_path_factory.mktemp("tls-logs"),
        tls=pki["stack"],
    )
    try:
        started = start_stack(config)
    except StartupError as exc:
        pytest.fail(f"the stack with mutual TLS did not start: {exc}")
    yield started
    started.stop(grace=10.0)


def _internal(stack) -> dict[str, str]:
    return {p.name: p.spec.grpc_address for p in stack.processes if p.name != "gateway"}


def test_a_voice_clone_synthesis_goes_through_every_hop_over_mutual_tls(tls_stack):
    # demo_request stores a voice (gateway -> speaker_cache); the talker resolves it and caches
    # its prompt (talker -> speaker_cache) and decodes through code2wav (talker -> code2wav).
    body = demo_request(tls_stack)
    r = httpx.post(f"{tls_stack.http_url}/v1/audio/speech", json={**body, "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    assert wav_frames(r.content) > 0
    for proc in tls_stack.processes:
        if proc.name != "gateway":
            assert " with TLS " in proc.log_path.read_text(), f"{proc.name} served plaintext"


@pytest.mark.parametrize("caller", ["plaintext", "no-cert", "intruder"])
def test_every_internal_port_refuses_callers_without_the_stacks_certificate(tls_stack, pki, caller):
    tls = None if caller == "plaintext" else pki[caller]
    for name, address in _internal(tls_stack).items():
        assert health_status(address, pki["client"], timeout=5) == "SERVING", name
        assert health_status(address, tls, timeout=5) == "UNREACHABLE", name
    # A direct talker call (what the gateway's limits protect) gets nowhere either.
    with sync_channel(_internal(tls_stack)["talker"], tls) as channel:
        with pytest.raises(grpc.RpcError) as info:
            talker_pb2_grpc.TalkerServiceStub(channel).GetModelInfo(
                talker_pb2.GetModelInfoRequest(), timeout=5
            )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
