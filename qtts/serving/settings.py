"""Settings declared once: each field of a service's frozen config dataclass carries its help,
choices and extra env names (`setting(...)`), and its flag, env fallback and parser follow from
the field's name and type.

    @dataclass(frozen=True)
    class FooConfig:
        max_batch: int = setting(64, "streams generated together in one step")
        tls: TlsConfig = group(TlsConfig(), "tls", what="gRPC between the services")

    SETTINGS = ServiceSettings(FooConfig, "foo", prog="python -m services.foo")
    config = SETTINGS.parse(argv).validate()

`max_batch` becomes `--max-batch` with the env fallback `TTS_FOO_MAX_BATCH`; a group's fields
become `--tls-cert` / `TTS_FOO_TLS_CERT` and so on. A flag wins over the env, the env over the
default. A value that does not parse, or is not one of the choices, is an `InvalidArgument` naming
the flag and the env variable, which `run_service_main` prints as one line before exiting with 2.
Range checks stay in each config's `validate()`, which also serves configs built in code.

docs/settings.md is generated from these declarations (`python docs/settings_table.py --write`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from qtts.request.errors import InvalidArgument

_KEY = "qtts.settings"


@dataclass(frozen=True)
class Setting:
    """What a field's declaration says beyond its name, type and default."""

    help: str = ""
    choices: tuple[str, ...] = ()
    # Env names read after TTS_<SERVICE>_<NAME>, in order (e.g. the conventional REDIS_URL).
    env: tuple[str, ...] = ()
    # Text to value; None: from the field's type (str, int, float, int | None, tuple[int | str, ...]).
    parse: Callable[[str], Any] | None = None
    # The default as help and docs say it, where its value does not say it (e.g. "by engine").
    shown: str | None = None


@dataclass(frozen=True)
class Group:
    """A nested settings dataclass (e.g. TlsConfig) under a flag prefix."""

    prefix: str
    omit: tuple[str, ...] = ()
    # Substituted for {what} in the nested settings' help ({prefix} is the flag prefix).
    what: str = ""


def setting(
    default: Any,
    help: str = "",
    *,
    choices: Sequence[str] = (),
    env: Sequence[str] = (),
    parse: Callable[[str], Any] | None = None,
    shown: str | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field declared as a setting (flag, env fallback, docs)."""
    meta = Setting(help, tuple(choices), tuple(env), parse, shown)
    return dataclasses.field(default=default, repr=repr, metadata={_KEY: meta})


def group(default: Any, prefix: str, *, omit: Sequence[str] = (), what: str = "") -> Any:
    """A dataclass field holding a nested settings dataclass whose flags start with --<prefix>-."""
    return dataclasses.field(default=default, metadata={_KEY: Group(prefix, tuple(omit), what)})


@dataclass(frozen=True)
class Entry:
    """One setting as the command line and the environment see it."""

    path: tuple[str, ...]  # field names from the config down (("tls", "cert"))
    flag: str  # --tls-cert
    envs: tuple[str, ...]  # TTS_GATEWAY_TLS_CERT, then the setting's extra names
    setting: Setting
    hint: Any  # the field's type
    default: Any
    help: str  # with {what} / {prefix} filled in

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def default_text(self) -> str:
        if self.setting.shown is not None:
            return self.setting.shown
        return _show(self.default)


class SettingsError(Exception):
    """A value that does not parse; `parse` adds where it came from."""


def _show(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SettingsError("must be an integer") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SettingsError("must be a number") from None


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise SettingsError("must be true or false")


def _optional_int(text: str) -> int | None:
    return _int(text) if text.strip() else None


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SettingsError("must be comma-separated integers") from None


def _str_tuple(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


_PARSERS: dict[Any, Callable[[str], Any]] = {
    str: str,
    bool: _bool,
    int: _int,
    float: _float,
    int | None: _optional_int,
    tuple[int, ...]: _int_tuple,
    tuple[str, ...]: _str_tuple,
}


def _parser_for(entry: Entry) -> Callable[[str], Any]:
    if entry.setting.parse is not None:
        return entry.setting.parse
    fn = _PARSERS.get(entry.hint)
    if fn is not None:
        return fn
    raise TypeError(f"{entry.flag}: no parser for {entry.hint!r}; give setting(..., parse=)")


def entries(cls: type, service: str) -> Iterator[Entry]:
    """Every setting of `cls` in declaration order, nested groups in place."""
    yield from _entries(cls, cls(), f"TTS_{service.upper()}_", "--", (), {})


def _entries(
    cls: type, defaults: Any, env_prefix: str, flag_prefix: str, path: tuple[str, ...], fmt: dict
) -> Iterator[Entry]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        value = getattr(defaults, f.name)
        if isinstance(meta, Group):
            sub_fmt = {"what": meta.what, "prefix": meta.prefix}
            sub_env = f"{env_prefix}{meta.prefix.upper().replace('-', '_')}_"
            for e in _entries(hints[f.name], value, sub_env, f"--{meta.prefix}-", (*path, f.name), sub_fmt):
                if e.path[-1] not in meta.omit:
                    yield e
        elif isinstance(meta, Setting):
            envs = (env_prefix + f.name.upper(), *meta.env)
            text = meta.help.format(**fmt) if fmt else meta.help
            flag = flag_prefix + f.name.replace("_", "-")
            yield Entry((*path, f.name), flag, envs, meta, hints[f.name], value, text)


@dataclass(frozen=True)
class ServiceSettings:
    """A service's settings: its config class, env prefix (TTS_<SERVICE>_) and program name."""

    config: type
    service: str
    prog: str
    description: str | None = None

    def entries(self) -> list[Entry]:
        return list(entries(self.config, self.service))

    def parser(self) -> argparse.ArgumentParser:
        """One flag per setting; values stay text until `parse` (so the env gets the same checks)."""
        p = argparse.ArgumentParser(
            prog=self.prog, description=self.description, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        for e in self.entries():
            extra = f"env {', '.join(e.envs)}"
            if e.default_text:
                extra += f"; default {e.default_text}"
            help_text = f"{e.help} ({extra})" if e.help else extra
            metavar = "{" + ",".join(e.setting.choices) + "}" if e.setting.choices else None
            # A boolean setting is a switch: `--flag` alone means true (`--flag false` also parses).
            switch = {"nargs": "?", "const": "true"} if e.hint is bool else {}
            p.add_argument(
                e.flag,
                dest=e.dest,
                default=None,
                metavar=metavar,
                help=help_text.replace("%", "%%"),
                **switch,
            )
        return p

    def parse(self, argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> Any:
        """The config from flags, env fallbacks and defaults, not yet validated; `InvalidArgument`
        naming the flag and the env variable for a value that does not parse."""
        parser = parser or self.parser()
        ns = parser.parse_args(argv)
        values: dict[tuple[str, ...], Any] = {}
        for e in self.entries():
            given = getattr(ns, e.dest, None)
            source = None
            if given is not None:
                raw, source = given, "flag"
            else:
                for name in e.envs:
                    if name in os.environ:
                        raw, source = os.environ[name], name
                        break
            if source is None:
                continue
            try:
                values[e.path] = _value(e, raw)
            except SettingsError as exc:
                message = f"{e.flag} {exc}, got {raw!r}"
                raise InvalidArgument(
                    f"{message} (env {e.envs[0]})" if source == "flag" else f"{source}: {message}"
                ) from None
        return _build(self.config(), values, ())

    def table(self) -> str:
        """The settings as a Markdown table: flag, env, default, what it does."""
        rows = ["| flag | env | default | what it does |", "|---|---|---|---|"]
        for e in self.entries():
            text = e.help
            if e.setting.choices:
                choices = ", ".join(_choice(c) for c in e.setting.choices)
                text = f"{text}; one of {choices}" if text else f"one of {choices}"
            # A `shown` default is prose; a value is code.
            default = e.setting.shown or (f"`{e.default_text}`" if e.default_text else "")
            envs = ", ".join(f"`{n}`" for n in e.envs)
            text = text.replace("|", "\\|")
            rows.append(f"| `{e.flag}` | {envs} | {default} | {text} |")
        return "\n".join(rows) + "\n"


def _choice(c: str) -> str:
    return f"`{c}`" if c else '`""`'


def _value(e: Entry, raw: str) -> Any:
    value = _parser_for(e)(raw)
    if e.setting.choices and value not in e.setting.choices:
        raise SettingsError(f"must be one of {', '.join(_choice(c).strip('`') for c in e.setting.choices)}")
    return value


def _build(obj: Any, values: dict[tuple[str, ...], Any], path: tuple[str, ...]) -> Any:
    changes = {}
    for f in dataclasses.fields(obj):
        here = (*path, f.name)
        if here in values:
            changes[f.name] = values[here]
        elif isinstance(f.metadata.get(_KEY), Group):
            changes[f.name] = _build(getattr(obj, f.name), values, here)
    return dataclasses.replace(obj, **changes)
