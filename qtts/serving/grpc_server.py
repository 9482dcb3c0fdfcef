"""The asyncio gRPC server every service runs on: health, reflection, error mapping, metrics, drain.

Usage in a service's `server.py`, inside the running event loop (`asyncio.run(serve(config))`)::

    from prometheus_client import CollectorRegistry
    from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
    from qtts.serving.metrics import Code2WavMetrics
    from qtts.pb import code2wav_pb2, code2wav_pb2_grpc

    metrics = Code2WavMetrics(CollectorRegistry())
    host = GrpcServiceHost(
        service_names=[service_full_name(code2wav_pb2, "Code2WavService")],
        metrics=metrics, host=config.host, port=config.port,
        metrics_port=config.metrics_port, drain_seconds=config.drain_seconds,
    )
    code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server(servicer, host.server)
    host.add_shutdown_callback(engine.close)      # runs after the drain
    port = await host.start()                     # health NOT_SERVING, metrics served
    ...load the model, warm up...
    await host.set_serving()
    await host.serve_until_signal()               # SIGTERM/SIGINT: drain, then return

`run_service_main` runs such a server as a process; a SIGTERM/SIGINT before `serve_until_signal()`
(model load, warm-up) stops it at once with exit code 0 instead of killing it.

Servicers raise `qtts.request.errors.TTSError` subclasses; the interceptor (error_mapping.py) turns
them into the matching gRPC status. What the process sets up around the server (log format, heap,
signal handlers) is in process.py.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from qtts.request.errors import TTSError
from qtts.serving import tracing
from qtts.serving.error_mapping import ErrorMappingInterceptor
from qtts.serving.metrics import ServiceMetrics
from qtts.serving.process import (
    add_signal_handlers,
    configure_logging,
    remove_signal_handlers,
    settle_heap,
)

# Client channels between the services: after failed connects gRPC backs off exponentially (up to
# 120 s by default), so a peer that took two minutes to start (graph capture) stayed unreachable
# long after it was serving. Retry connects every 0.25-2 s instead.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

log = logging.getLogger(__name__)

OVERALL = ""  # the health service name that stands for the whole server
# Liveness (the process and its event loop answer): SERVING from start() until a drain or a device
# failure, whatever the stages behind it do, so a probe of it never restarts a pod for an outage
# elsewhere. Readiness is OVERALL.
LIVENESS = "liveness"


def connection_age_options(max_age_s: float, grace_s: float) -> list[tuple[str, int]]:
    """Server options that close each client connection after `max_age_s` (gRPC adds +-10%
    jitter) with a GOAWAY, so clients reconnect and re-resolve and new pods behind a DNS name get
    traffic. Calls in flight on the old connection get `grace_s` to finish: keep it at least as
    long as the longest stream, or aging would cut streams. `max_age_s` 0 turns it off."""
    if max_age_s <= 0:
        return []
    return [
        ("grpc.max_connection_age_ms", int(max_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(grace_s * 1000)),
    ]


def service_full_name(pb2_module: ModuleType, service: str) -> str:
    """The fully qualified proto name of `service` in a generated `*_pb2` module."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name


def _server_options(
    age_options: Iterable[tuple[str, Any]], options: Iterable[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    """Every service's server options, then the connection-age ones, then the caller's."""
    return [
        # A second server on a taken port must fail to bind, not share it: with
        # SO_REUSEPORT a stale process kept answering health checks for a new one.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        # Accept the clients' 10 s keepalive pings (also on idle connections).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        *age_options,
        *options,
    ]


class GrpcServiceHost:
    """A `grpc.aio` server with health, reflection, error mapping, Prometheus metrics and drain.

    Create it inside the running event loop (e.g. in the coroutine given to `asyncio.run`).

    Health is NOT_SERVING (overall and per service) from `start()` until `set_serving()`; on a
    drain it goes back to NOT_SERVING before the server stops accepting RPCs, then in-flight RPCs
    get `drain_seconds` to finish before they are cancelled.

    `max_connection_age_s` > 0 ages client connections out (`connection_age_options`); the grace
    for calls on an aged connection is `max_connection_age_grace_s`, or `drain_seconds` when 0.

    `credentials` (qtts.serving.tls): serve TLS (or mutual TLS) on the port; None: plaintext.
    """

    def __init__(
        self,
        *,
        service_names: Iterable[str],
        metrics: ServiceMetrics | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int = 0,
        drain_seconds: float = 30.0,
        max_connection_age_s: float = 0.0,
        max_connection_age_grace_s: float = 0.0,
        options: Iterable[tuple[str, Any]] = (),
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        redact_errors: bool = False,
        credentials: grpc.ServerCredentials | None = None,
    ):
        try:
            # grpc.aio binds the server to the loop it is created on: a host built before
            # asyncio.run() fails later with "attached to a different loop".
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("GrpcServiceHost must be created inside the running event loop") from None
        self.service_names = list(service_names)
        self.metrics = metrics
        self.host = host
        self.port = port
        self.metrics_port = metrics_port
        self.drain_seconds = drain_seconds
        self.credentials = credentials
        self._error_mapper = ErrorMappingInterceptor(metrics, redact_errors)
        self.server = grpc.aio.server(
            interceptors=[self._error_mapper, *interceptors],
            options=_server_options(
                connection_age_options(max_connection_age_s, max_connection_age_grace_s or drain_seconds),
                options,
            ),
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [
                *self.service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        self._shutdown_callbacks: list[Callable[[], Any]] = []
        self._drain_callbacks: list[Callable[[], Any]] = []
        self._metrics_http: Any = None
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self.bound_port: int | None = None
        self.bound_metrics_port: int | None = None

    @classmethod
    def internal(cls, config: Any, service_name: str, metrics: ServiceMetrics) -> GrpcServiceHost:
        """The host of an internal service (talker, code2wav, speaker_cache) from the settings
        their configs share (qtts/serving/service_config.py): address, ports, drain, connection
        aging where the service has it, the internal token and TLS."""
        from qtts.serving.internal_auth import server_interceptors

        return cls(
            service_names=[service_name],
            metrics=metrics,
            host=config.host,
            port=config.port,
            metrics_port=config.metrics_port,
            drain_seconds=config.drain_seconds,
            max_connection_age_s=getattr(config, "max_connection_age_s", 0.0),
            max_connection_age_grace_s=getattr(config, "max_connection_age_grace_s", 0.0),
            interceptors=server_interceptors(config.internal_token),
            credentials=config.tls.server_credentials(),
        )

    def add_drain_callback(self, callback: Callable[[], Any]) -> None:
        """`callback()` when a drain begins, before in-flight calls get their grace: for calls
        that would otherwise run to its end (a long-lived watch)."""
        self._drain_callbacks.append(callback)

    def add_shutdown_callback(self, callback: Callable[[], Any]) -> None:
        """Run `callback` (sync or async) after the server stopped, in registration order."""
        self._shutdown_callbacks.append(callback)

    async def start(self) -> int:
        """Bind, start serving (health NOT_SERVING) and the metrics endpoint; returns the gRPC port."""
        address = f"{_bracket(self.host)}:{self.port}"
        if self.credentials is None:
            self.bound_port = self.server.add_insecure_port(address)
        else:
            self.bound_port = self.server.add_secure_port(address, self.credentials)
        if self.bound_port == 0:
            raise OSError(f"could not bind gRPC server to {address}")
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        if self.metrics is not None:
            self.metrics.loop_lag.start()
        if self.metrics_port and self.metrics is not None:
            http_server, _ = start_http_server(
                self.metrics_port, addr=self.host, registry=self.metrics.registry
            )
            self._metrics_http = http_server
            self.bound_metrics_port = http_server.server_port
        log.info(
            "serving %s on %s:%d%s (metrics port %s)",
            ", ".join(self.service_names),
            self.host,
            self.bound_port,
            "" if self.credentials is None else " with TLS",
            self.bound_metrics_port or "off",
        )
        return self.bound_port

    async def set_serving(self) -> None:
        """Report SERVING for every service and overall (call after model load and warm-up)."""
        settle_heap()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        startup = getattr(self.metrics, "startup", None)
        if startup is not None:
            startup.serving()

    async def set_not_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def set_failed(self) -> None:
        """NOT_SERVING for readiness and liveness: the process cannot serve again (a device failure)."""
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_unexpected_error(self, callback: Callable[[BaseException], Any]) -> None:
        """`callback(exc)` for every exception a handler raises that is no TTSError."""
        self._error_mapper.on_unexpected = callback

    async def _set_all(self, status: int) -> None:
        for name in [OVERALL, *self.service_names]:
            await self.health.set(name, status)

    def request_stop(self) -> None:
        """Ask `serve_until_signal()` to drain and return (what SIGTERM/SIGINT do)."""
        self._stop_requested.set()

    async def serve_until_signal(self) -> None:
        """Serve until SIGTERM/SIGINT (or `request_stop()`), then drain and stop."""
        loop = asyncio.get_running_loop()
        installed = add_signal_handlers(loop, self._on_signal)
        try:
            await self._stop_requested.wait()
        finally:
            remove_signal_handlers(loop, installed)
            await self.stop()

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("received %s: draining for up to %.1f s", sig.name, self.drain_seconds)
        self._stop_requested.set()

    async def stop(self, grace: float | None = None) -> None:
        """Drain: health NOT_SERVING, refuse new RPCs, give in-flight ones `grace` s, then cancel."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        for callback in self._drain_callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - the drain goes on
                log.exception("drain callback %r failed", callback)
        await self.server.stop(self.drain_seconds if grace is None else grace)
        for callback in self._shutdown_callbacks:
            try:
                result = callback()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - one failing cleanup must not skip the others
                log.exception("shutdown callback %r failed", callback)
        if self.metrics is not None:
            await self.metrics.loop_lag.stop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        log.info("stopped")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def run_service_main(
    name: str,
    config_from_args: Callable[[Sequence[str] | None], Any],
    server_factory: Callable[[Any], Any],
    argv: Sequence[str] | None = None,
) -> int:
    """The body of every `python -m services.<name>`: parse and validate the config (exit 2 with
    the message on a bad flag), then run the server until SIGTERM/SIGINT and its drain.

    A SIGTERM/SIGINT while the server is still starting (model load, warm-up) stops it at once and
    exits 0 (see `_serve`)."""
    try:
        config = config_from_args(argv)
    except TTSError as exc:
        print(f"{name}: {exc.message}", file=sys.stderr)
        return 2
    try:
        configure_logging(config.log_level, getattr(config, "log_format", None), service=name)
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)
    tracing.setup_tracing(name)
    try:
        asyncio.run(_serve(name, config, server_factory))
    finally:
        tracing.shutdown_tracing()
    return 0


async def _serve(name: str, config: Any, server_factory: Callable[[Any], Any]) -> None:
    """Run `server_factory(config).run()`; a signal before it serves ends the process with 0.

    Until the server installs its own handlers (`serve_until_signal()` replaces these once it
    serves), SIGTERM/SIGINT cancel the start-up instead of killing the process (exit 143) or
    raising KeyboardInterrupt. The start-up work still running in a thread (a model load cannot be
    interrupted) would hold the interpreter's exit until it finished, so the process exits without
    joining it, after the server's own shutdown callbacks ran.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    signalled: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        if not signalled:
            log.info("received %s during start-up: stopping", sig.name)
            signalled.append(sig)
            task.cancel()

    installed = add_signal_handlers(loop, on_signal)
    server = None
    try:
        # Built inside the running loop: grpc.aio binds a server to the loop current at creation.
        server = server_factory(config)
        await server.run()
        return
    except asyncio.CancelledError:
        if not signalled:
            raise
        task.uncancel()
    finally:
        if not signalled:
            remove_signal_handlers(loop, installed)
    # The handlers stay: a second signal during this cleanup is ignored, not a kill.
    await _stop_started(server)
    log.info("%s stopped during start-up", name)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _stop_started(server: Any) -> None:
    """Stop what a server started before it was interrupted: nothing is in flight, so no drain."""
    host = getattr(server, "host", None)
    try:
        if isinstance(host, GrpcServiceHost):
            await host.stop(0)
        elif server is not None:
            await server.stop()
    except Exception:  # noqa: BLE001 - the process ends either way; say why its cleanup failed
        log.exception("stopping after an interrupted start-up failed")
