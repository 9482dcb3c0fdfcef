"""TLS and mutual TLS between the services (qtts/serving/tls.py), with certificates made for the test: a
stage with a CA refuses clients without a certificate it signed, plaintext clients, and clients
whose certificate another CA signed; the stages' own clients get through. Bad files are a clear
one-line error at start-up."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import replace

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qtts.pb import speaker_cache_pb2, speaker_cache_pb2_grpc, talker_pb2, talker_pb2_grpc
from qtts.request.errors import InvalidArgument
from qtts.request.vocabulary import AudioPiece, SynthesisSummary
from qtts.serving import probe
from qtts.serving.grpc_server import run_service_main
from qtts.serving.tls import TlsConfig, aio_channel
from services.code2wav.config import config_from_args as c2w_config_from_args
from services.gateway.config import GatewayConfig
from services.gateway.config import config_from_args as gateway_config_from_args
from services.gateway.server import GatewayServer
from services.gateway.talker_client import TalkerClient
from services.gateway.voice_client import VoiceClient
from services.launcher import free_port
from services.speaker_cache.config import config_from_args as sc_config_from_args
from services.speaker_cache.server import SpeakerCacheServer
from services.talker.config import config_from_args as talker_config_from_args
from services.talker.speaker_cache_client import SpeakerCacheClient
from tests.qtts.serving.stage_servers import (
    code2wav_server,
    fake_talker,
    speaker_cache_server,
    voice_clone_job,
)
from tests.services.talker.stack import eventually
from tests.tls_certs import SERVICE_NAME, TestCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Server and client certificates of one CA, and an intruder's of another."""
    folder = tmp_path_factory.mktemp("pki")
    ca = TestCA(folder / "ca")
    server, client = ca.issue("server"), ca.issue("client")
    intruder = TestCA(folder / "other", "another CA").issue("intruder")
    return {
        "server": TlsConfig(cert=server.cert, key=server.key, ca=server.ca),
        "client": TlsConfig(cert=client.cert, key=client.key, ca=client.ca),
        # TLS that trusts the CA but has no certificate of its own.
        "no-cert": TlsConfig(ca=client.ca),
        # A certificate of another CA (which the client also trusts for the server's sake).
        "intruder": TlsConfig(cert=intruder.cert, key=intruder.key, ca=client.ca),
        # A client that trusts only the other CA: the server's certificate fails its check.
        "wrong-ca": TlsConfig(cert=client.cert, key=client.key, ca=intruder.ca),
        "files": (server, client, intruder),
    }


REFUSED = ("plaintext", "no-cert", "intruder", "wrong-ca")


async def _refused(address: str, tls: TlsConfig | None) -> None:
    """A call over `tls` (None: plaintext) never reaches the server's handlers."""
    async with aio_channel(address, tls) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


def _client(pki, kind: str) -> TlsConfig | None:
    return None if kind == "plaintext" else pki[kind]


# ---------------------------------------------------------------------------- speaker_cache


async def test_speaker_cache_with_mtls_serves_its_callers_and_refuses_everyone_else(pki):
    async with speaker_cache_server(tls=pki["server"]) as address:
        # The gateway's and the talker's clients, with the client certificate.
        voices = VoiceClient(address, tls=pki["client"])
        try:
            assert await voices.list() == []
        finally:
            await voices.close()
        cache = SpeakerCacheClient(address, tls=pki["client"])
        try:
            assert await cache.get_prompt("k" * 16) is None
        finally:
            await cache.close()
        for kind in REFUSED:
            await _refused(address, _client(pki, kind))
        # Over a raw channel too: the RPC itself, not only health.
        async with aio_channel(address, pki["no-cert"]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel).PutVoicePrompt(
                    speaker_cache_pb2.PutVoicePromptRequest(key="k"), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # The probe the chart runs: SERVING with the pod's certificate, refused without it.
        assert await asyncio.to_thread(probe.health_status, address, pki["client"]) == "SERVING"
        assert await asyncio.to_thread(probe.health_status, address, None) == "UNREACHABLE"
        server_files = pki["files"][0]
        ok = ["--tls-cert", server_files.cert, "--tls-key", server_files.key, "--tls-ca", server_files.ca]
        assert await asyncio.to_thread(probe.main, [address, *ok]) == 0
        assert await asyncio.to_thread(probe.main, [address]) == 1


async def test_tls_without_client_auth_accepts_clients_without_a_certificate(pki):
    async with speaker_cache_server(tls=replace(pki["server"], client_auth="none")) as address:
        voices = VoiceClient(address, tls=pki["no-cert"])
        try:
            assert await voices.list() == []
        finally:
            await voices.close()
        await _refused(address, None)  # still TLS: plaintext gets nowhere


# ---------------------------------------------------------------------------- talker and code2wav


async def test_talker_and_code2wav_speak_mutual_tls_and_refuse_other_callers(pki, fake_decoder):
    async with code2wav_server(fake_decoder, "c2w-tls", tls=pki["server"]) as c2w_address:
        for kind in REFUSED:
            await _refused(c2w_address, _client(pki, kind))
        # The talker dials code2wav with its certificate; --tls-server-name is what it checks.
        talker_tls = replace(pki["server"], server_name=SERVICE_NAME)
        async with fake_talker([], code2wav_addresses=[c2w_address], tls=talker_tls) as s:
            talker_address = f"127.0.0.1:{s.talker.host.bound_port}"
            for kind in REFUSED:
                await _refused(talker_address, _client(pki, kind))
            async with aio_channel(talker_address, pki["no-cert"]) as channel:
                call = talker_pb2_grpc.TalkerServiceStub(channel).Generate(
                    talker_pb2.GenerateRequest(text="frames=2"), timeout=5
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            client = TalkerClient(talker_address, tls=replace(pki["client"], server_name=SERVICE_NAME))
            try:
                events = [e async for e in client.generate(voice_clone_job("tls"))]
            finally:
                await client.close()
        assert sum(e.num_frames for e in events if isinstance(e, AudioPiece)) == 3
        assert isinstance(events[-1], SynthesisSummary) and events[-1].num_frames == 3


async def test_a_talker_that_does_not_trust_code2wav_gets_no_replica(pki, fake_decoder):
    """The client checks the server too: a replica whose certificate the talker's CA did not sign
    never joins the ring."""
    async with code2wav_server(fake_decoder, "c2w-untrusted", tls=pki["server"]) as c2w_address:
        async with fake_talker(
            [],
            code2wav_addresses=[c2w_address],
            tls=replace(pki["wrong-ca"], server_name=SERVICE_NAME),
            health_interval_s=0.1,
        ) as s:
            assert await s.talker.replicas.check(c2w_address) is False
            await eventually(lambda: c2w_address not in s.talker.replicas.healthy)


# ---------------------------------------------------------------------------- the gateway's public ports


async def test_the_gateways_public_ports_take_tls(pki):
    server_files = pki["files"][0]
    config = GatewayConfig(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=0,
        talker=f"127.0.0.1:{free_port()}",  # nothing there: health says so, over TLS
        speaker_cache=f"127.0.0.1:{free_port()}",
        drain_seconds=0.5,
        public_tls=TlsConfig(cert=server_files.cert, key=server_files.key, flag="public-tls"),
    ).validate()
    gateway = GatewayServer(config)
    await gateway.start()
    try:
        verify = ssl.create_default_context(cafile=server_files.ca)
        async with httpx.AsyncClient(verify=verify) as http:
            r = await http.get(f"https://127.0.0.1:{config.http_port}/health", timeout=10)
            assert r.status_code == 503  # TLS works; the talker is down
            with pytest.raises(httpx.HTTPError):
                await http.get(f"http://127.0.0.1:{config.http_port}/health", timeout=5)
        public = TlsConfig(ca=server_files.ca)
        address = f"127.0.0.1:{config.grpc_port}"
        assert await asyncio.to_thread(probe.health_status, address, public) == "NOT_SERVING"
        assert await asyncio.to_thread(probe.health_status, address, None) == "UNREACHABLE"
    finally:
        await gateway.stop()


# ---------------------------------------------------------------------------- start-up errors


def _flags(files, **override) -> list[str]:
    given = {"cert": files.cert, "key": files.key, "ca": files.ca, **override}
    return [a for name, path in given.items() if path is not None for a in (f"--tls-{name}", path)]


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing-cert", "--tls-cert /nowhere/server.crt: cannot read it (No such file or directory)"),
        ("key-without-cert", "--tls-cert and --tls-key go together"),
        ("not-pem", "not a PEM file"),
        ("mismatched-key", "are not a certificate and its private key"),
        ("ca-without-cert", "--tls-ca on a server needs --tls-cert and --tls-key"),
        ("bad-client-auth", "--tls-client-auth must be one of require, none"),
    ],
)
def test_bad_tls_files_are_one_clear_line_at_start_up(pki, case, message, tmp_path, capsys):
    server, client, _ = pki["files"]
    not_pem = tmp_path / "junk.crt"
    not_pem.write_text("certainly not a certificate\n")
    argv = {
        "missing-cert": _flags(server, cert="/nowhere/server.crt"),
        "key-without-cert": _flags(server, cert=None, ca=None),
        "not-pem": _flags(server, ca=str(not_pem)),
        "mismatched-key": _flags(server, key=client.key),
        "ca-without-cert": _flags(server, cert=None, key=None),
        "bad-client-auth": [*_flags(server), "--tls-client-auth", "optional"],
    }[case]
    for parse in (sc_config_from_args, c2w_config_from_args):
        with pytest.raises(InvalidArgument) as info:
            parse(argv)
        assert message in info.value.message
    with pytest.raises(SystemExit):  # the talker's parser exits with its usage and the message
        talker_config_from_args(argv)
    assert message in capsys.readouterr().err.splitlines()[-1]
    assert run_service_main("speaker_cache", sc_config_from_args, SpeakerCacheServer, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("speaker_cache: ") and message in err


def test_flags_and_env_fallbacks_reach_every_service(pki, monkeypatch):
    server, client, _ = pki["files"]
    argv = _flags(server)
    for parse in (sc_config_from_args, c2w_config_from_args, talker_config_from_args):
        tls = parse(argv).tls
        assert (tls.cert, tls.key, tls.ca, tls.mutual) == (server.cert, server.key, server.ca, True)
    monkeypatch.setenv("TTS_TALKER_TLS_CERT", server.cert)
    monkeypatch.setenv("TTS_TALKER_TLS_KEY", server.key)
    monkeypatch.setenv("TTS_TALKER_TLS_CA", server.ca)
    monkeypatch.setenv("TTS_TALKER_TLS_SERVER_NAME", SERVICE_NAME)
    assert talker_config_from_args([]).tls.server_name == SERVICE_NAME
    assert c2w_config_from_args([]).tls.enabled is False  # another service's variables
    # The gateway: --tls-* for its calls (a CA alone is fine: it serves no internal port),
    # --public-tls-* for its own ports.
    gw = gateway_config_from_args(
        ["--tls-ca", client.ca, "--public-tls-cert", server.cert, "--public-tls-key", server.key]
    )
    assert gw.tls.enabled and not gw.tls.cert and gw.public_tls.cert == server.cert
    with pytest.raises(InvalidArgument, match="--public-tls-cert and --public-tls-key go together"):
        gateway_config_from_args(["--public-tls-cert", server.cert])
    assert not gateway_config_from_args([]).tls.enabled


def test_the_launcher_passes_its_tls_flags_to_every_service_and_its_health_checks(pki):
    from services.launcher import config_from_args as launcher_config_from_args
    from services.launcher import stack_specs

    server, _, _ = pki["files"]
    config = launcher_config_from_args([*_flags(server), "--tls-server-name", SERVICE_NAME])
    specs = {s.name: s for s in stack_specs(config, "/models/tiny")}
    for name, spec in specs.items():
        assert spec.args[spec.args.index("--tls-cert") + 1] == server.cert, name
        # Only the services that dial others take the name their peers' certificates carry.
        assert ("--tls-server-name" in spec.args) is (name in ("talker", "gateway")), name
        # The launcher checks the internal services' health over TLS; the gateway's own ports
        # stay plaintext.
        assert spec.tls is (None if name == "gateway" else config.tls), name
    assert launcher_config_from_args([]).tls is None
