"""The command line of every service of the stack (`ServiceSpec`), from one `StackConfig`."""

from __future__ import annotations

import argparse

from services.launcher.config import StackConfig
from services.launcher.processes import ServiceSpec


def _tls_flags(cfg: StackConfig, client: bool = True) -> list[str]:
    """--tls-* for a service; `client`: it also dials others (--tls-server-name)."""
    return cfg.tls.flags(server_name=client) if cfg.tls is not None else []


def model_flags(cfg: StackConfig, model: str, device: str | None = None) -> tuple[str, ...]:
    return (
        "--model",
        model,
        "--load-format",
        cfg.load_format,
        "--device",
        device or cfg.device,
        "--dtype",
        cfg.dtype,
    )


def _closing_flags(cfg: StackConfig, service: str, client: bool) -> list[str]:
    """What every service's command line ends with: its drain, TLS and the extra flags given for it."""
    return [
        "--drain-seconds",
        str(cfg.drain_seconds),
        *_tls_flags(cfg, client),
        *cfg.extra_args.get(service, ()),
    ]


def _stage_spec(
    cfg: StackConfig,
    service: str,
    port: int,
    metrics_port: int,
    flags: tuple[str, ...] | list[str] = (),
    *,
    name: str | None = None,
    client: bool = False,
) -> ServiceSpec:
    """A stage behind the gateway (`python -m services.<service>`), on `port` with the stack's TLS;
    `flags` stand between its listening flags and its closing ones. `client`: it dials others."""
    args = (
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *flags,
        *_closing_flags(cfg, service, client),
    )
    return ServiceSpec(name or service, f"services.{service}", args, cfg.address(port), metrics_port, cfg.tls)


def speaker_cache_spec(cfg: StackConfig) -> ServiceSpec:
    return _stage_spec(
        cfg,
        "speaker_cache",
        cfg.speaker_cache_port,
        cfg.speaker_cache_metrics_port,
        ("--redis-url", cfg.redis_url),
    )


def aligner_spec(cfg: StackConfig) -> ServiceSpec:
    return _stage_spec(cfg, "aligner", cfg.aligner_port, cfg.aligner_metrics_port)


def code2wav_specs(cfg: StackConfig, model: str) -> list[ServiceSpec]:
    specs = []
    for i, (port, mport) in enumerate(zip(cfg.code2wav_ports, cfg.code2wav_metrics_ports, strict=True)):
        name = f"code2wav-{i}"
        device = cfg.code2wav_devices[i % len(cfg.code2wav_devices)] if cfg.code2wav_devices else None
        flags = ("--replica-name", name, *model_flags(cfg, model, device))
        specs.append(_stage_spec(cfg, "code2wav", port, mport, flags, name=name))
    return specs


def decoder_shares_gpu(cfg: StackConfig) -> bool:
    """Whether a code2wav replica runs on the talker's GPU (so the talker's admission counts the
    decode cost code2wav measures there): on CUDA, with no code2wav devices or one of them the
    talker's."""

    if not cfg.device.startswith("cuda"):
        return False
    return not cfg.code2wav_devices or _gpu(cfg.device) in {_gpu(d) for d in cfg.code2wav_devices}


def aligner_shares_gpu(cfg: StackConfig) -> bool:
    """Whether the aligner stage runs on the talker's GPU (so the talker's KV slots leave it room):
    started, on CUDA, by the last `--device` of its flags (the aligner's default is the CPU)."""
    if not cfg.aligner_port or not cfg.device.startswith("cuda"):
        return False
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--device", default="cpu")
    device = flags.parse_known_args(list(cfg.extra_args.get("aligner", ())))[0].device
    return device.startswith("cuda") and _gpu(device) == _gpu(cfg.device)


def _gpu(device: str) -> str:
    return device if ":" in device else f"{device}:0"


def talker_spec(
    cfg: StackConfig,
    model: str,
    *,
    name: str = "talker",
    port: int | None = None,
    metrics_port: int | None = None,
) -> ServiceSpec:
    flags = (
        *model_flags(cfg, model),
        "--code2wav",
        ",".join(cfg.address(p) for p in cfg.code2wav_ports),
        "--speaker-cache",
        cfg.address(cfg.speaker_cache_port),
        *(["--decoder-shares-gpu"] if decoder_shares_gpu(cfg) else []),
        *(["--aligner-shares-gpu"] if aligner_shares_gpu(cfg) else []),
    )
    return _stage_spec(
        cfg,
        "talker",
        cfg.talker_port if port is None else port,
        cfg.talker_metrics_port if metrics_port is None else metrics_port,
        flags,
        name=name,
        client=True,
    )


def gateway_spec(
    cfg: StackConfig,
    *,
    name: str = "gateway",
    talker_port: int | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    talker_metrics_port: int | None = None,
) -> ServiceSpec:
    """The gateway in front of the stack's talker, or of the one on `talker_port` (whose metrics
    port, for the playground's status strip, is then `talker_metrics_port` or unknown)."""
    grpc_port = cfg.grpc_port if grpc_port is None else grpc_port
    if talker_metrics_port is None and talker_port is None:
        talker_metrics_port = cfg.talker_metrics_port
    talker_metrics = (
        ["--talker-metrics-url", f"http://{cfg.host}:{talker_metrics_port}/metrics"]
        if talker_metrics_port
        else []
    )
    args = [
        "--host",
        cfg.host,
        "--http-port",
        str(cfg.http_port if http_port is None else http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(cfg.gateway_metrics_port if metrics_port is None else metrics_port),
        "--talker",
        cfg.address(cfg.talker_port if talker_port is None else talker_port),
        "--speaker-cache",
        cfg.address(cfg.speaker_cache_port),
        *(["--aligner", cfg.address(cfg.aligner_port)] if cfg.aligner_port else []),
        *talker_metrics,
        *_closing_flags(cfg, "gateway", client=True),
    ]
    return ServiceSpec(
        name,
        "services.gateway",
        tuple(args),
        cfg.address(grpc_port),
        cfg.gateway_metrics_port if metrics_port is None else metrics_port,
    )


def stack_specs(config: StackConfig, model: str) -> list[ServiceSpec]:
    """Every service of the stack, in start order (speaker_cache, code2wav, talker, gateways)."""
    specs = [
        speaker_cache_spec(config),
        *([aligner_spec(config)] if config.aligner_port else []),
        *code2wav_specs(config, model),
        talker_spec(config, model),
        gateway_spec(config),
    ]
    for i in range(1, config.gateway_replicas):
        http, grpc_port, metrics = config.gateway_ports(i)
        specs.append(
            gateway_spec(
                config, name=f"gateway-{i}", http_port=http, grpc_port=grpc_port, metrics_port=metrics
            )
        )
    return specs
