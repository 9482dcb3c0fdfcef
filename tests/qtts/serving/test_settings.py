"""qtts/serving/settings.py: flags and env fallbacks from one declaration, one clear line for a bad value,
and docs/settings.md equal to what the declarations generate."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

from qtts.request.errors import InvalidArgument
from qtts.serving.grpc_server import run_service_main
from qtts.serving.settings import ServiceSettings, group, setting

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Inner:
    cert: str = setting("", "certificate for {what}")
    mode: str = setting("on", choices=("on", "off"))
    name: str = setting("", "left out by the group")


@dataclass(frozen=True)
class Demo:
    port: int = setting(1, "a port")
    rate: float = setting(0.5, "per second")
    batch: int | None = setting(None, "by engine when not given", shown="by engine")
    widths: tuple[int, ...] = setting((4, 8), "widths")
    peers: tuple[str, ...] = setting(("a:1",), "peers")
    url: str = setting("", "URL", env=("DEMO_URL",), repr=False)
    inner: Inner = group(Inner(), "in-x", omit=("name",), what="the demo")
    plain: str = "not a setting"


SETTINGS = ServiceSettings(Demo, "demo", "python -m demo")


def test_flags_env_and_defaults_from_one_declaration(monkeypatch):
    assert SETTINGS.parse([]) == Demo()
    monkeypatch.setenv("TTS_DEMO_PORT", "7")
    monkeypatch.setenv("TTS_DEMO_WIDTHS", "1, 2,3")
    monkeypatch.setenv("TTS_DEMO_IN_X_MODE", "off")
    monkeypatch.setenv("DEMO_URL", "redis://x")
    c = SETTINGS.parse(["--rate", "2", "--batch", "3", "--peers", "b:2, c:3", "--in-x-cert", "c.pem"])
    assert (c.port, c.rate, c.batch, c.widths, c.peers, c.url) == (
        7,
        2.0,
        3,
        (1, 2, 3),
        ("b:2", "c:3"),
        "redis://x",
    )
    assert (c.inner.cert, c.inner.mode, c.inner.name) == ("c.pem", "off", "")
    # The flag wins over the env; the service's own env name over the conventional one.
    monkeypatch.setenv("TTS_DEMO_URL", "redis://mine")
    assert SETTINGS.parse(["--port", "9"]).port == 9
    assert SETTINGS.parse([]).url == "redis://mine"
    assert SETTINGS.parse(["--batch", ""]).batch is None


def test_the_parser_has_one_flag_per_setting_and_no_more():
    flags = {a.option_strings[0] for a in SETTINGS.parser()._actions if a.option_strings}
    assert flags == {
        "-h",
        "--port",
        "--rate",
        "--batch",
        "--widths",
        "--peers",
        "--url",
        "--in-x-cert",
        "--in-x-mode",
    }
    assert [e.envs for e in SETTINGS.entries()][5] == ("TTS_DEMO_URL", "DEMO_URL")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--port", "x"], {}, "--port must be an integer, got 'x' (env TTS_DEMO_PORT)"),
        ([], {"TTS_DEMO_RATE": "lots"}, "TTS_DEMO_RATE: --rate must be a number, got 'lots'"),
        ([], {"TTS_DEMO_WIDTHS": "4,x"}, "TTS_DEMO_WIDTHS: --widths must be comma-separated integers"),
        (
            ["--in-x-mode", "maybe"],
            {},
            "--in-x-mode must be one of on, off, got 'maybe' (env TTS_DEMO_IN_X_MODE)",
        ),
        ([], {"TTS_DEMO_IN_X_MODE": "maybe"}, "TTS_DEMO_IN_X_MODE: --in-x-mode must be one of on, off"),
    ],
)
def test_a_bad_value_names_the_flag_and_the_env_variable(argv, env, message, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument) as info:
        SETTINGS.parse(argv)
    assert message in info.value.message


@pytest.mark.parametrize("service", ["gateway", "talker", "code2wav", "speaker_cache"])
def test_a_malformed_env_value_is_one_line_and_exit_status_2(service, monkeypatch, capsys):
    module = importlib.import_module(f"services.{service}.config")
    env = f"TTS_{service.upper()}_METRICS_PORT"
    monkeypatch.setenv(env, "ninety")
    try:
        status = run_service_main(service, module.config_from_args, lambda config: None, [])
    except SystemExit as exc:  # the talker's parser exits itself, with the same one line
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and env in err[0] and "--metrics-port" in err[0] and "Traceback" not in err[0]


def test_docs_settings_md_is_what_the_declarations_generate():
    spec = importlib.util.spec_from_file_location("settings_table", ROOT / "docs" / "settings_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "settings.md").read_text() == module.render(), (
        "docs/settings.md is out of date: run python docs/settings_table.py --write"
    )
