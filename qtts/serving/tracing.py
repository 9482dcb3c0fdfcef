"""Optional OpenTelemetry tracing: one span per stage per request, joined across the services.

Off unless the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
is set and the `tracing` extra (opentelemetry-sdk, the OTLP gRPC exporter) is installed; then
`setup_tracing(service)` exports spans over OTLP. The other OTEL_* variables (sampler, headers,
batch delays) work as the SDK documents them.

Spans: each gRPC server call (`GrpcServiceHost`'s interceptor: `server_span`) and each gateway
HTTP request (`TracingMiddleware`), with the caller's W3C trace context taken from the gRPC
metadata / HTTP headers; `outgoing_metadata()` in qtts.serving.log_context passes the current one on.
Without the SDK every call here is a cheap no-op (the API alone returns non-recording spans).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

try:  # the API ships with fastapi; the SDK comes with the `tracing` extra
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - no opentelemetry at all: tracing stays off
    trace = None

_provider: Any = None
TRACER_NAME = "qtts"


def enabled() -> bool:
    return _provider is not None


def setup_tracing(service: str, exporter: Any = None, *, simple: bool = False) -> bool:
    """Install a tracer provider named `qtts-<service>` exporting to `exporter` (default: OTLP over
    gRPC when an endpoint is configured). Returns whether tracing is on."""
    global _provider
    if trace is None:
        return False
    if exporter is None:
        if not (
            os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        ):
            return False
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set but the tracing extra is not installed: no traces"
            )
            return False
        exporter = OTLPSpanExporter()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"qtts-{service}"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing to %s", type(exporter).__name__)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (at process exit)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def inject(carrier: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (traceparent, ...) to `carrier`."""
    if trace is not None:
        propagate.inject(carrier)
    return carrier


@contextlib.contextmanager
def server_span(name: str, carrier: Mapping[str, str], attributes: Mapping[str, Any]) -> Iterator[Any]:
    """A SERVER span for one call, child of the caller's trace context in `carrier`, current while
    the body runs. Yields the span (or None when tracing is unavailable)."""
    if trace is None:
        yield None
        return
    parent = propagate.extract(dict(carrier))
    span = trace.get_tracer(TRACER_NAME).start_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes)
    )
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    try:
        yield span
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        with contextlib.suppress(Exception):  # an async generator closed from another context
            otel_context.detach(token)
        span.end()


def set_attributes(attributes: Mapping[str, Any]) -> None:
    """Attributes on the current span (no-op without one)."""
    if trace is not None:
        trace.get_current_span().set_attributes(dict(attributes))


class TracingMiddleware:
    """ASGI: a SERVER span per HTTP request, named by method and route template."""

    def __init__(self, app: Any, service: str = "gateway"):
        self.app = app
        self.service = service

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not enabled():
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        status = [500]

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        attrs = {
            "http.request.method": scope["method"],
            "url.path": scope["path"],
            "qtts.service": self.service,
        }
        with server_span(f"HTTP {scope['method']}", headers, attrs) as span:
            await self.app(scope, receive, send_and_note)
            route = getattr(scope.get("route"), "path", None)
            if span is not None:
                if route:
                    span.update_name(f"HTTP {scope['method']} {route}")
                    span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
