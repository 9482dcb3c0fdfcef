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

Servicers raise `qtts.request.errors.TTSError` subclasses; the interceptor turns them into the matching gRPC
status (`qtts.request.errors.mapping_for`; INVALID_ARGUMENT also carries a `google.rpc.BadRequest` naming
the error's `param`) and counts them in `tts_errors_total{service,code}`. Any other
exception becomes INTERNAL with its traceback logged; the server keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from prometheus_client import start_http_server

from qtts.request.errors import InvalidArgument, TTSError, mapping_for, redact_internal
from qtts.serving import tracing
from qtts.serving.log_context import bind_request_id, log_handler, request_id_from_metadata, request_id_var
from qtts.serving.metrics import ServiceMetrics

# Client channels between the services: after failed connects gRPC backs off exponentially (up to
# 120 s by default), so a peer that took two minutes to start (graph capture) stayed unreachable
# long after it was serving. Retry connects every 0.25-2 s instead.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

log = logging.getLogger(__name__)
# One line per finished call (method, code, seconds), tagged with its request id.
access_log = logging.getLogger("qtts.access")

OVERALL = ""  # the health service name that stands for the whole server
# Liveness (the process and its event loop answer): SERVING from start() until a drain or a device
# failure, whatever the stages behind it do, so a probe of it never restarts a pod for an outage
# elsewhere. Readiness is OVERALL.
LIVENESS = "liveness"
_UNTRACED = ("/grpc.health.", "/grpc.reflection.")
MAX_STATUS_MESSAGE_CHARS = 1000


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


def configure_logging(level: str = "INFO", fmt: str | None = None, service: str = "") -> None:
    """One log format for every service process: text (default) or one JSON object per line
    (`fmt="json"`, or `TTS_LOG_FORMAT=json`), each line tagged with the request id in flight."""
    fmt = fmt or os.environ.get("TTS_LOG_FORMAT", "text")
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), handlers=[log_handler(fmt, service)]
    )


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain errors to gRPC status codes, counts every error a handler ends with, and
    counts and times every call by method and final code (tts_rpc_*)."""

    def __init__(self, metrics: ServiceMetrics | None, redact: bool = False):
        self._metrics = metrics
        # A public front end (the gateway): no internal address in a status message.
        self._redact = redact
        # Sees every unexpected exception (qtts.serving.device_failure: a dead GPU ends the process).
        self.on_unexpected: Callable[[BaseException], Any] | None = None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method),
                deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method, streamed_requests=True),
                deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method),
                deserializer,
                handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(handler.stream_stream, method, streamed_requests=True),
            deserializer,
            handler.response_serializer,
        )

    def _wrap_unary(self, behavior: Callable, method: str, streamed_requests: bool = False) -> Callable:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start, code = time.monotonic(), None
            token = _bind_caller_request_id(context)
            try:
                request = _checked_requests(request) if streamed_requests else _checked(request)
                with self._span(method, context):
                    return await behavior(request, context)
            except BaseException as exc:  # noqa: BLE001 - re-raised or mapped below
                code = _final_code(exc, context)
                await self._handle(exc, context, method)
                raise
            finally:
                self._record(method, code or _code_of(context), start)
                _reset(token)

        return wrapper

    def _wrap_stream(self, behavior: Callable, method: str, streamed_requests: bool = False) -> Callable:
        if inspect.isasyncgenfunction(behavior):

            async def gen_wrapper(request: Any, context: grpc.aio.ServicerContext):
                start, code = time.monotonic(), None
                token = _bind_caller_request_id(context)
                responses = None
                try:
                    request = _checked_requests(request) if streamed_requests else _checked(request)
                    responses = behavior(request, context)
                    with self._span(method, context):
                        async for response in responses:
                            yield response
                except BaseException as exc:  # noqa: BLE001 - re-raised or mapped below
                    code = _final_code(exc, context)
                    await self._handle(exc, context, method)
                    raise
                finally:
                    # Closed now, not whenever it is collected: its cleanup frees per-stream state.
                    if responses is not None:
                        await responses.aclose()
                    self._record(method, code or _code_of(context), start)
                    _reset(token)

            return gen_wrapper
        # A handler that writes with context.write() and returns None.
        return self._wrap_unary(behavior, method, streamed_requests)

    async def _handle(self, exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
        """Abort the call with the mapped status; returns only for exceptions to re-raise as is."""
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            return
        if isinstance(exc, grpc.aio.AbortError):
            # The handler aborted by itself: count it under the code it chose.
            self._count(_code_of(context))
            return
        mapping = mapping_for(exc)
        if isinstance(exc, TTSError):
            message = exc.message
            log.info("%s failed: %s: %s", method, mapping.grpc_code.name, message)
            if self._redact:
                message = redact_internal(message)
        else:
            message = "internal error"
            log.error("%s raised an unexpected exception", method, exc_info=exc)
            if self.on_unexpected is not None:
                self.on_unexpected(exc)
        if len(message) > MAX_STATUS_MESSAGE_CHARS:
            # The status travels in trailing metadata, which clients cap at a few KiB.
            message = message[:MAX_STATUS_MESSAGE_CHARS] + "..."
        self._count(mapping.grpc_code)
        trailing: tuple[tuple[str, str | bytes], ...] = ()
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after:
            # gRPC's own retry policy reads grpc-retry-pushback-ms; our clients read retry-after.
            trailing = (
                ("retry-after", str(retry_after)),
                ("grpc-retry-pushback-ms", str(int(retry_after * 1000))),
            )
        if mapping.grpc_code == grpc.StatusCode.INVALID_ARGUMENT:
            trailing += bad_request_details(mapping.grpc_code, message, getattr(exc, "param", None))
        if trailing:
            await context.abort(mapping.grpc_code, message, trailing_metadata=trailing)
        await context.abort(mapping.grpc_code, message)

    def _count(self, code: grpc.StatusCode | None) -> None:
        if self._metrics is not None and code is not None and code != grpc.StatusCode.OK:
            self._metrics.error(code.name)

    def _span(self, method: str, context: grpc.aio.ServicerContext):
        """The call's SERVER span (qtts.serving.tracing), child of the caller's trace; none for health
        checks and reflection, which probes call every few seconds."""
        if not tracing.enabled() or method.startswith(_UNTRACED):
            return contextlib.nullcontext()
        try:
            carrier = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        except Exception:  # noqa: BLE001 - no metadata: a new trace
            carrier = {}
        attrs = {
            "rpc.system": "grpc",
            "rpc.method": method,
            "qtts.service": getattr(self._metrics, "service", ""),
            "qtts.request_id": request_id_var.get(),
        }
        return tracing.server_span(method.lstrip("/"), carrier, attrs)

    def _record(self, method: str, code: grpc.StatusCode | None, start: float) -> None:
        """tts_rpc_requests_total / tts_rpc_duration_seconds and an access log line (logger
        qtts.access, not for health checks) for one finished call."""
        seconds = time.monotonic() - start
        name = (code or grpc.StatusCode.OK).name
        if self._metrics is not None:
            self._metrics.rpc(method, name, seconds)
        if not method.startswith(_UNTRACED):
            access_log.info("%s %s %.3fs", method, name, seconds)


def bad_request_details(
    code: grpc.StatusCode, message: str, field: str | None
) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata of a `google.rpc.Status` carrying a `google.rpc.BadRequest` that names
    the field at fault ("" for the request as a whole), as grpcio-status's `rpc_status.from_call`
    reads it (`grpc-status-details-bin`)."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=field or "", description=message)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return tuple(rpc_status.to_status(status).trailing_metadata)


@dataclass(frozen=True)
class _Undecodable:
    """What a request that is not a valid protobuf message of its type deserializes to."""

    error: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer`, but bad bytes become an `_Undecodable` for the handler wrapper to refuse as
    INVALID_ARGUMENT (grpc answers a deserializer's exception with UNKNOWN)."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            return _Undecodable(type(exc).__name__)

    return deserialize


def _checked(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"the request is not a valid protobuf message of its type ({request.error})")
    return request


async def _checked_requests(requests: Any):
    async for request in requests:
        yield _checked(request)


def _bind_caller_request_id(context: grpc.aio.ServicerContext):
    """Bind the caller's x-request-id (if it sent one) for the call; returns the reset token."""
    try:
        metadata = context.invocation_metadata()
    except Exception:  # noqa: BLE001 - a context without metadata: nothing to bind
        metadata = ()
    return bind_request_id(request_id_from_metadata(metadata))


def _reset(token) -> None:
    try:
        request_id_var.reset(token)
    except ValueError:  # an async generator closed from another context: nothing bound here
        pass


def _final_code(exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a call that raised `exc` ends with."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, grpc.aio.AbortError):
        return _code_of(context) or grpc.StatusCode.UNKNOWN
    return mapping_for(exc).grpc_code


def _code_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    try:
        return context.code()
    except Exception:  # noqa: BLE001 - older grpc versions lack code() on aio contexts
        return None


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
        await self.server.stop(self.drain_seconds if grace is None else grace)
        for callback in self._shutdown_callbacks:
            try:
                result = callback()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - one failing cleanup must not skip the others
                log.exception("shutdown callback %r failed", callback)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        log.info("stopped")


_SLOW_GC_S = 0.02
_gc_started: list[float] = []


def _time_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        took = time.perf_counter() - _gc_started[0]
        if took >= _SLOW_GC_S:
            log.warning(
                "garbage collection of generation %d took %.0f ms (%d objects collected)",
                info.get("generation", -1),
                took * 1e3,
                info.get("collected", 0),
            )


def settle_heap() -> None:
    """Move everything alive once the service is loaded (model, graphs, modules) out of the
    garbage collector's reach (`gc.freeze`), so a full collection under load walks only the objects
    of requests in flight: a collection holds the GIL, and with it every thread of the process,
    the one driving the GPU too. Collections that still take 20 ms or more are logged."""
    gc.collect()
    gc.freeze()
    if _time_gc not in gc.callbacks:
        gc.callbacks.append(_time_gc)


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


def add_signal_handlers(
    loop: asyncio.AbstractEventLoop, handler: Callable[[signal.Signals], None]
) -> list[signal.Signals]:
    """`handler(sig)` for SIGTERM and SIGINT on `loop` (replacing earlier ones); returns those set."""
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handler, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread / not supported
            pass
    return installed


def remove_signal_handlers(loop: asyncio.AbstractEventLoop, signals: Iterable[signal.Signals]) -> None:
    for sig in signals:
        loop.remove_signal_handler(sig)


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
