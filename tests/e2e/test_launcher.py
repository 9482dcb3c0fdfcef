"""The launcher's pure parts and its startup failure report (no model needed)."""

from __future__ import annotations

import os
import socket

import pytest

from services.launcher import (
    ServiceSpec,
    StackConfig,
    StartupError,
    code2wav_specs,
    config_from_args,
    default_code2wav_ports,
    free_port,
    gateway_spec,
    stack_specs,
    start_service,
    talker_spec,
    wait_serving,
)
from services.launcher import ports as launcher_ports


def test_default_ports_skip_speaker_cache():
    assert default_code2wav_ports(1) == (50053,)
    assert default_code2wav_ports(3) == (50053, 50055, 50056)
    assert default_code2wav_ports(2, 9103, 9104) == (9103, 9105)


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low, high = launcher_ports._ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= p <= high for p in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_parallel_test_workers_draw_ports_from_disjoint_slices():
    candidates = range(20000, 32768)
    slices = [
        launcher_ports._worker_slice(
            candidates, {"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": "3"}
        )
        for i in range(3)
    ]
    assert [len(s) for s in slices] == [4256] * 3
    assert all(a.stop <= b.start for a, b in zip(slices, slices[1:], strict=False))
    assert all(s.start >= candidates.start and s.stop <= candidates.stop for s in slices)
    # Outside a parallel run (or under a name that is not xdist's gwN) every candidate is open.
    assert launcher_ports._worker_slice(candidates, {}) == candidates
    assert launcher_ports._worker_slice(candidates, {"PYTEST_XDIST_WORKER": "main"}) == candidates
    # A worker count that is missing or unreadable still gives each worker its own slice.
    unknown = launcher_ports._worker_slice(candidates, {"PYTEST_XDIST_WORKER": "gw1"})
    assert len(unknown) == len(candidates) // launcher_ports._MAX_PORT_SLICES
    assert unknown.start == candidates.start + len(unknown)


def test_free_port_stays_inside_this_workers_slice(monkeypatch):
    low, _ = launcher_ports._ephemeral_range()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    expected = launcher_ports._worker_slice(range(launcher_ports._LOWEST_PICKED_PORT, low), dict(os.environ))
    ports = [free_port() for _ in range(50)]
    assert all(p in expected for p in ports), (expected, ports)


def test_a_port_something_listens_on_is_not_taken_for_free():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert not launcher_ports._bindable("127.0.0.1", taken)
    assert launcher_ports._bindable("127.0.0.1", taken)


def test_cli_builds_a_stack_config():
    cfg = config_from_args(
        [
            "--model",
            "/m",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--redis-url",
            "redis://r:6379/0",
            "--code2wav-replicas",
            "2",
            "--load-format",
            "dummy",
        ]
    )
    assert (cfg.model, cfg.device, cfg.dtype, cfg.redis_url, cfg.load_format) == (
        "/m",
        "cuda",
        "bfloat16",
        "redis://r:6379/0",
        "dummy",
    )
    assert cfg.code2wav_ports == (50053, 50055) and cfg.code2wav_metrics_ports == (9103, 9105)


def test_code2wav_replicas_take_their_devices_in_turn():
    """--code2wav-devices puts replicas on their own GPUs (the talker keeps --device)."""
    cfg = config_from_args(
        ["--device", "cuda:0", "--code2wav-replicas", "3", "--code2wav-devices", "cuda:1, cuda:2"]
    )
    assert cfg.code2wav_devices == ("cuda:1", "cuda:2")
    devices = [s.args[s.args.index("--device") + 1] for s in code2wav_specs(cfg, "/snap")]
    assert devices == ["cuda:1", "cuda:2", "cuda:1"]
    talker = talker_spec(cfg, "/snap")
    assert talker.args[talker.args.index("--device") + 1] == "cuda:0"
    plain = config_from_args(["--device", "cuda", "--code2wav-replicas", "2"])
    assert [s.args[s.args.index("--device") + 1] for s in code2wav_specs(plain, "/snap")] == ["cuda", "cuda"]


def test_service_flags_wire_the_stages_together():
    cfg = StackConfig.on_free_ports(code2wav_replicas=2)
    talker = talker_spec(cfg, "/snap")
    c2w = ",".join(f"127.0.0.1:{p}" for p in cfg.code2wav_ports)
    assert talker.args[talker.args.index("--code2wav") + 1] == c2w
    assert talker.args[talker.args.index("--speaker-cache") + 1] == f"127.0.0.1:{cfg.speaker_cache_port}"
    names = [s.args[s.args.index("--replica-name") + 1] for s in code2wav_specs(cfg, "/snap")]
    assert names == ["code2wav-0", "code2wav-1"]
    gw = gateway_spec(cfg, talker_port=1234)
    assert gw.args[gw.args.index("--talker") + 1] == "127.0.0.1:1234"
    assert gw.grpc_address == f"127.0.0.1:{cfg.grpc_port}"


def test_gateway_replicas_front_the_one_talker_on_their_own_ports():
    cfg = config_from_args(["--gateway-replicas", "3"])
    gateways = [s for s in stack_specs(cfg, "/snap") if s.module == "services.gateway"]
    assert [g.name for g in gateways] == ["gateway", "gateway-1", "gateway-2"]
    flag = lambda spec, name: spec.args[spec.args.index(name) + 1]  # noqa: E731
    assert [flag(g, "--http-port") for g in gateways] == ["8000", "8001", "8002"]
    assert [flag(g, "--grpc-port") for g in gateways] == ["50051", "50062", "50063"]
    assert [g.metrics_port for g in gateways] == [9100, 9111, 9112]
    assert {flag(g, "--talker") for g in gateways} == {f"127.0.0.1:{cfg.talker_port}"}
    with pytest.raises(ValueError, match="at least one gateway"):
        StackConfig(gateway_replicas=0).validate()


def test_startup_failure_names_the_stage_and_shows_its_log(tmp_path):
    spec = ServiceSpec("broken-stage", "services.no_such_service", (), f"127.0.0.1:{free_port()}")
    proc = start_service(spec, tmp_path)
    with pytest.raises(StartupError) as info:
        wait_serving(proc, timeout=30)
    message = str(info.value)
    assert "broken-stage" in message and "No module named services.no_such_service" in message
    assert (tmp_path / "broken-stage.log").exists()


def test_env_fallbacks_come_from_the_settings_declarations(monkeypatch):
    """TTS_LAUNCHER_<FLAG> for every flag, after it the conventional TTS_MODEL and REDIS_URL."""
    monkeypatch.setenv("TTS_MODEL", "/conventional")
    monkeypatch.setenv("REDIS_URL", "redis://conventional")
    monkeypatch.setenv("TTS_LAUNCHER_REDIS_URL", "redis://mine")
    monkeypatch.setenv("TTS_LAUNCHER_CODE2WAV_REPLICAS", "2")
    monkeypatch.setenv("TTS_LAUNCHER_METRICS_PORT", "0")
    monkeypatch.setenv("TTS_LAUNCHER_TALKER_ARGS", "--engine graph --max-batch '256'")
    cfg = config_from_args(["--code2wav-devices", "cuda:1, cuda:2"])
    assert (cfg.model, cfg.redis_url, cfg.code2wav_ports) == ("/conventional", "redis://mine", (50053, 50055))
    assert cfg.code2wav_metrics_ports == (0, 0) and cfg.gateway_metrics_port == 0
    assert cfg.code2wav_devices == ("cuda:1", "cuda:2")
    assert cfg.extra_args["talker"] == ("--engine", "graph", "--max-batch", "256")
    assert cfg.extra_args["gateway"] == ()
    assert config_from_args(["--model", "/flag"]).model == "/flag"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--http-port", "x"], {}, "--http-port must be an integer, got 'x' (env TTS_LAUNCHER_HTTP_PORT)"),
        ([], {"TTS_LAUNCHER_STARTUP_TIMEOUT": "soon"}, "TTS_LAUNCHER_STARTUP_TIMEOUT: --startup-timeout"),
        (["--dtype", "f8"], {}, "--dtype must be one of float32, bfloat16, float16, got 'f8'"),
        (["--code2wav-replicas", "0"], {}, "--code2wav-replicas must be >= 1, got 0"),
        (["--gateway-replicas", "0"], {}, "--gateway-replicas must be >= 1, got 0"),
        (["--talker-args", "--a 'b"], {}, "--talker-args must be flags as a shell would split them"),
        (["--tls-cert", "/no/such.pem"], {}, "--tls-cert and --tls-key go together"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_setting(argv, env, message, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        config_from_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
