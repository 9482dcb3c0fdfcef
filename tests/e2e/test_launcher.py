"""The launcher's pure parts and its startup failure report (no model needed)."""

from __future__ import annotations

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


def test_default_ports_skip_speaker_cache():
    assert default_code2wav_ports(1) == (50053,)
    assert default_code2wav_ports(3) == (50053, 50055, 50056)
    assert default_code2wav_ports(2, 9103, 9104) == (9103, 9105)


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
