"""The interceptor every service's server runs: domain errors to gRPC status codes, and every call
counted, timed, traced and logged.

Servicers raise `qtts.request.errors.TTSError` subclasses; the interceptor turns them into the matching gRPC
status (`qtts.request.errors.mapping_for`; INVALID_ARGUMENT also carries a `google.rpc.BadRequest` naming
the error's `param`) and counts them in `tts_errors_total{service,code}`. Any other
exception becomes INTERNAL with its traceback logged; the server keeps running. A request that is
not a valid protobuf message of its type is refused as INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from qtts.request.errors import InvalidArgument, TTSError, mapping_for, redact_internal, retry_after_ms
from qtts.serving import tracing
from qtts.serving.log_context import (
    bind_request_id,
    request_id_from_metadata,
    request_id_var,
    waited_since_sent,
)
from qtts.serving.metrics import ServiceMetrics

log = logging.getLogger(__name__)
# One line per finished call (method, code, seconds), tagged with its request id.
access_log = logging.getLogger("qtts.access")

_UNTRACED = ("/grpc.health.", "/grpc.reflection.")
MAX_STATUS_MESSAGE_CHARS = 1000


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
            token = _bind_caller_request_id(context, self._metrics, method)
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
                token = _bind_caller_request_id(context, self._metrics, method)
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
        if _unimplemented(exc, context):
            self._count(grpc.StatusCode.UNIMPLEMENTED)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented here")
        status = map_exception(exc, method, redact=self._redact, on_unexpected=self.on_unexpected)
        self._count(status.code)
        if status.trailing:
            await context.abort(status.code, status.message, trailing_metadata=status.trailing)
        await context.abort(status.code, status.message)

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
        record_call(self._metrics, method, code, start)


@dataclass(frozen=True)
class MappedStatus:
    """The status a call that raised an exception ends with: code, message and trailing metadata."""

    code: grpc.StatusCode
    message: str
    trailing: tuple[tuple[str, str | bytes], ...] = ()


def map_exception(
    exc: BaseException,
    method: str,
    *,
    redact: bool = False,
    on_unexpected: Callable[[BaseException], Any] | None = None,
) -> MappedStatus:
    """The status of a call whose handler raised `exc` (not a cancel): a TTSError's mapped code
    and message (redacted for a public front end), INTERNAL for anything else (logged with its
    traceback, and handed to `on_unexpected`); retry hints and a BadRequest naming the field in
    the trailing metadata."""
    mapping = mapping_for(exc)
    if isinstance(exc, TTSError):
        message = exc.message
        log.info("%s failed: %s: %s", method, mapping.grpc_code.name, message)
        if redact:
            message = redact_internal(message)
    else:
        message = "internal error"
        log.error("%s raised an unexpected exception", method, exc_info=exc)
        if on_unexpected is not None:
            on_unexpected(exc)
    if len(message) > MAX_STATUS_MESSAGE_CHARS:
        # The status travels in trailing metadata, which clients cap at a few KiB.
        message = message[:MAX_STATUS_MESSAGE_CHARS] + "..."
    trailing: tuple[tuple[str, str | bytes], ...] = ()
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after:
        # gRPC's own retry policy reads grpc-retry-pushback-ms; our clients read retry-after
        # (whole seconds) or retry-after-ms (spread over half a hint more, as over HTTP).
        spread_ms = str(retry_after_ms(retry_after))
        trailing = (
            ("retry-after", str(retry_after)),
            ("retry-after-ms", spread_ms),
            ("grpc-retry-pushback-ms", spread_ms),
        )
    if mapping.grpc_code == grpc.StatusCode.INVALID_ARGUMENT:
        trailing += bad_request_details(mapping.grpc_code, message, getattr(exc, "param", None))
    return MappedStatus(mapping.grpc_code, message, trailing)


def record_call(
    metrics: ServiceMetrics | None, method: str, code: grpc.StatusCode | None, start: float
) -> None:
    """tts_rpc_requests_total / tts_rpc_duration_seconds and an access log line (logger
    qtts.access, not for health checks) for one finished call that began at `start`
    (time.monotonic())."""
    seconds = time.monotonic() - start
    name = (code or grpc.StatusCode.OK).name
    if metrics is not None:
        metrics.rpc(method, name, seconds)
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


def _bind_caller_request_id(context: grpc.aio.ServicerContext, metrics: Any = None, method: str = ""):
    """Bind the caller's x-request-id (if it sent one) for the call; returns the reset token. With
    `metrics`, times how long the call waited since the caller sent it (tts_rpc_accept_seconds)."""
    try:
        metadata = context.invocation_metadata()
    except Exception:  # noqa: BLE001 - a context without metadata: nothing to bind
        metadata = ()
    if metrics is not None and (waited := waited_since_sent(metadata)) is not None:
        metrics.rpc_accepted(method, waited)
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
    if _unimplemented(exc, context):
        return grpc.StatusCode.UNIMPLEMENTED
    return mapping_for(exc).grpc_code


def _unimplemented(exc: BaseException, context: grpc.aio.ServicerContext) -> bool:
    """A generated servicer base's method this service does not implement (it sets UNIMPLEMENTED
    and raises NotImplementedError): UNIMPLEMENTED, which callers fall back on, not INTERNAL."""
    return isinstance(exc, NotImplementedError) and _code_of(context) == grpc.StatusCode.UNIMPLEMENTED


def _code_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    try:
        return context.code()
    except Exception:  # noqa: BLE001 - older grpc versions lack code() on aio contexts
        return None
