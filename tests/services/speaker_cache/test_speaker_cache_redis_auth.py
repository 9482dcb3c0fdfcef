"""speaker_cache against a real redis-server that wants a password (and an ACL user), and one
that speaks TLS: every way of giving the credentials works, refused credentials are a clear error,
and no message, log line or repr shows the password."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from qtts.pb import speaker_cache_pb2, speaker_cache_pb2_grpc
from qtts.request.errors import InvalidArgument, Unavailable
from services.launcher import free_port
from services.speaker_cache.config import config_from_args, redacted_url
from services.speaker_cache.records import VoiceRecord
from services.speaker_cache.server import SpeakerCacheServer, build_store
from tests.tls_certs import TestCA

PASSWORD = "default-pw-7Hq"
USER, USER_PASSWORD = "tts", "acl-pw-Z3k"
WRONG = "wrong-pw-Xe9"
SECRETS = (PASSWORD, USER_PASSWORD, WRONG)


def _redis_server(tmp_path: Path, *args: str) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail(
            "redis-server is not installed: these tests need a real one (apt-get install redis-server)"
        )
    log = open(tmp_path / "redis.log", "wb")
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    return proc


def _wait_listening(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"redis-server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail("redis-server did not listen")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def redis_port(tmp_path):
    """A redis-server whose default user needs PASSWORD and with an ACL user USER."""
    port = free_port()
    proc = _redis_server(
        tmp_path,
        "--port",
        str(port),
        "--requirepass",
        PASSWORD,
        "--user",
        USER,
        "on",
        f">{USER_PASSWORD}",
        "~*",
        "&*",
        "+@all",
    )
    try:
        _wait_listening(port, proc, tmp_path / "redis.log")
        yield port
    finally:
        _stop(proc)


def _voice(name: str) -> VoiceRecord:
    pcm = np.sin(np.arange(2400, dtype=np.float32) / 10).astype("<f4").tobytes()
    return VoiceRecord(name=name, reference_pcm_f32=pcm, sample_rate_hz=24000, reference_text="hi")


async def _round_trip(argv: list[str], name: str) -> None:
    store = build_store(config_from_args(argv))
    try:
        await store.ping()
        await store.create_voice(_voice(name), overwrite=True)
        assert (await store.get_voice(name)).reference_text == "hi"
    finally:
        await store.close()


async def test_every_way_of_giving_the_credentials_works(redis_port, tmp_path, monkeypatch):
    url = f"redis://127.0.0.1:{redis_port}/0"
    secret_file = tmp_path / "redis-password"
    secret_file.write_text(PASSWORD + "\n")  # a trailing newline, as `echo` and many Secrets have
    ways = {
        "url": [f"--redis-url=redis://:{PASSWORD}@127.0.0.1:{redis_port}/0"],
        "url-acl-user": [f"--redis-url=redis://{USER}:{USER_PASSWORD}@127.0.0.1:{redis_port}/0"],
        "flag": ["--redis-url", url, "--redis-password", PASSWORD],
        "file": ["--redis-url", url, "--redis-password-file", str(secret_file)],
        "acl-user-flags": ["--redis-url", url, "--redis-username", USER, "--redis-password", USER_PASSWORD],
    }
    for way, argv in ways.items():
        await _round_trip(argv, f"voice-{way}")
    # The conventional variables, and the service's own.
    monkeypatch.setenv("REDIS_URL", url)
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    await _round_trip([], "voice-env")
    monkeypatch.setenv("TTS_SPEAKER_CACHE_REDIS_USERNAME", USER)
    monkeypatch.setenv("TTS_SPEAKER_CACHE_REDIS_PASSWORD", USER_PASSWORD)
    await _round_trip([], "voice-service-env")


@pytest.mark.parametrize("given", ["wrong-password", "no-password", "wrong-user"])
async def test_refused_credentials_are_a_clear_error_that_names_no_password(redis_port, given, caplog):
    url = f"redis://127.0.0.1:{redis_port}/0"
    argv = {
        "wrong-password": ["--redis-url", f"redis://:{WRONG}@127.0.0.1:{redis_port}/0"],
        "no-password": ["--redis-url", url],
        "wrong-user": ["--redis-url", url, "--redis-username", "nobody", "--redis-password", PASSWORD],
    }[given]
    caplog.set_level(logging.INFO)
    config = config_from_args([*argv, "--port", "0", "--metrics-port", "0"])
    server = SpeakerCacheServer(config, health_interval_s=0.05)
    port = await server.start()
    try:
        with pytest.raises(Unavailable, match="refused this service's credentials"):
            await server.store.ping()
        # The service stays NOT_SERVING and tells its callers why, without the password.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel).ListVoices(
                    speaker_cache_pb2.ListVoicesRequest(), timeout=5
                )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "refused this service's credentials" in info.value.details()
        assert not server._serving
    finally:
        await server.stop(0.2)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "redis refused speaker_cache's credentials" in logged
    assert f"127.0.0.1:{redis_port}" in logged  # where it connected to, redacted
    for text in (logged, info.value.details(), repr(config)):
        assert not any(secret in text for secret in SECRETS), text


def test_configuration_errors_redact_the_url(tmp_path):
    cases = {
        "not a redis URL": ([f"--redis-url=http://u:{WRONG}@host:6379/0"], "must start with redis://"),
        "password twice": (
            [f"--redis-url=redis://:{WRONG}@h:6379/0", "--redis-password", PASSWORD],
            "give it one way",
        ),
        "user twice": ([f"--redis-url=redis://{USER}:{WRONG}@h:6379/0", "--redis-username", USER], "one way"),
        "password and file": (
            ["--redis-url=redis://h:6379/0", "--redis-password", PASSWORD, "--redis-password-file", "/x"],
            "not both",
        ),
        "missing file": (
            ["--redis-url=redis://h:6379/0", "--redis-password-file", str(tmp_path / "none")],
            "cannot read it (No such file or directory)",
        ),
        "ca without TLS": (["--redis-url=redis://h:6379/0", "--redis-ca", "/x.pem"], "needs a rediss://"),
        "password without Redis": (["--redis-password", PASSWORD], "need --redis-url"),
    }
    for case, (argv, message) in cases.items():
        with pytest.raises(InvalidArgument) as info:
            config_from_args(argv)
        assert message in info.value.message, case
        assert not any(secret in info.value.message for secret in SECRETS), case
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(InvalidArgument, match="is empty"):
        config_from_args(["--redis-url=redis://h:6379/0", "--redis-password-file", str(empty)])


def test_redacted_url():
    assert redacted_url(f"redis://:{WRONG}@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted_url(f"rediss://{USER}:{WRONG}@[::1]:6380/1") == f"rediss://{USER}:***@[::1]:6380/1"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted_url(f"redis://:{WRONG}@h:port/0") == "redis://<redacted>"


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server that speaks only TLS (certificates of a test CA) and wants PASSWORD."""
    files = TestCA(tmp_path / "pki").issue("redis")
    port = free_port()
    proc = _redis_server(
        tmp_path,
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        files.cert,
        "--tls-key-file",
        files.key,
        "--tls-ca-cert-file",
        files.ca,
        "--tls-auth-clients",
        "no",
        "--requirepass",
        PASSWORD,
    )
    try:
        _wait_listening(port, proc, tmp_path / "redis.log")
        yield port, files.ca
    finally:
        _stop(proc)


async def test_rediss_checks_the_server_against_the_ca(tls_redis):
    port, ca = tls_redis
    argv = ["--redis-url", f"rediss://127.0.0.1:{port}/0", "--redis-password", PASSWORD]
    await _round_trip([*argv, "--redis-ca", ca], "voice-tls")
    # Without the CA the test certificate is not trusted (the system's roots are used).
    store = build_store(config_from_args(argv))
    try:
        with pytest.raises(Unavailable, match="unavailable"):
            await store.ping()
    finally:
        await store.close()
    # Plaintext to the TLS port gets nowhere either.
    store = build_store(config_from_args(["--redis-url", f"redis://127.0.0.1:{port}/0"]))
    try:
        with pytest.raises(Unavailable):
            await store.ping()
    finally:
        await store.close()
