"""The launcher's --aligner: off by default; on, the aligner starts before the GPU stages."""

from __future__ import annotations

from services.launcher import config_from_args, stack_specs


def test_no_aligner_unless_asked():
    cfg = config_from_args([])
    assert cfg.aligner_port == 0
    assert "aligner" not in [s.name for s in stack_specs(cfg, "/m")]
    assert "aligner" not in cfg.ports()


def test_aligner_flag_starts_the_stage_on_its_ports():
    cfg = config_from_args(["--aligner", "--aligner-args", "--max-batch 8"])
    assert (cfg.aligner_port, cfg.aligner_metrics_port) == (50050, 9101)
    specs = {s.name: s for s in stack_specs(cfg, "/m")}
    spec = specs["aligner"]
    assert spec.module == "services.aligner"
    assert spec.grpc_address == "127.0.0.1:50050"
    assert spec.args[spec.args.index("--port") + 1] == "50050"
    assert spec.args[-2:] == ("--max-batch", "8")
    # the tiny model unless --aligner-args name one
    assert "--model" not in spec.args
    assert cfg.ports()["aligner"] == 50050
    no_metrics = config_from_args(["--aligner", "--metrics-port", "0"])
    assert no_metrics.aligner_metrics_port == 0


def test_a_switch_takes_a_value_or_none_and_its_env_fallback(monkeypatch):
    assert config_from_args(["--aligner", "false"]).aligner_port == 0
    monkeypatch.setenv("TTS_LAUNCHER_ALIGNER", "1")
    assert config_from_args([]).aligner_port == 50050
    monkeypatch.setenv("TTS_LAUNCHER_ALIGNER", "maybe")
    import pytest

    with pytest.raises(SystemExit):
        config_from_args([])


def test_the_image_entrypoint_runs_the_aligner(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    entrypoint = Path(__file__).resolve().parents[3] / "deploy" / "docker" / "entrypoint.sh"
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake_python.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["sh", str(entrypoint), "aligner", "--port=50050"],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 0 and done.stdout.splitlines() == ["-m", "services.aligner", "--port=50050"]
