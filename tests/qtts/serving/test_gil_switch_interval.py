"""--gil-switch-interval-ms: every service takes it (flag and env), rejects unusable values, and
run_service_main applies it before the server starts."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from qtts.serving import grpc_server
from services.code2wav.config import config_from_args as code2wav_config
from services.gateway.config import config_from_args as gateway_config
from services.speaker_cache.config import config_from_args as speaker_cache_config
from services.talker.config import config_from_args as talker_config

PARSERS = {
    "talker": talker_config,
    "code2wav": code2wav_config,
    "gateway": gateway_config,
    "speaker_cache": speaker_cache_config,
}


@pytest.mark.parametrize("service", sorted(PARSERS))
def test_every_service_takes_the_flag_and_its_env_fallback(service, monkeypatch):
    parse = PARSERS[service]
    # CPython's default (measured better in the stack), 1 ms for the talker's engine thread
    assert parse([]).gil_switch_interval_ms == (1.0 if service == "talker" else 5.0)
    assert parse(["--gil-switch-interval-ms", "1.5"]).gil_switch_interval_ms == 1.5
    monkeypatch.setenv(f"TTS_{service.upper()}_GIL_SWITCH_INTERVAL_MS", "0.5")
    assert parse([]).gil_switch_interval_ms == 0.5


@pytest.mark.parametrize("value", ["0", "-1", "2000"])
def test_unusable_values_exit_with_the_flag_named(value, capsys):
    with pytest.raises(SystemExit):
        talker_config(["--gil-switch-interval-ms", value])
    assert "--gil-switch-interval-ms" in capsys.readouterr().err


def test_run_service_main_sets_the_interval_before_the_server_runs(monkeypatch):
    seen = []

    class Server:
        def __init__(self, config):
            seen.append(sys.getswitchinterval())

        async def run(self):
            return None

    config = SimpleNamespace(log_level="INFO", gil_switch_interval_ms=0.75)
    before = sys.getswitchinterval()
    try:
        assert grpc_server.run_service_main("svc", lambda argv: config, Server, []) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen == [pytest.approx(0.00075)]
