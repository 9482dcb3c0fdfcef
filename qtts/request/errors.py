"""Domain errors shared by every service, and the one table that maps them to HTTP and gRPC."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import grpc


class TTSError(Exception):
    """Base class of errors a request can end with; the message is shown to the client.

    `param`, when known, names the request field at fault (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidArgument(TTSError):
    """The request is malformed or asks for something the served model cannot do."""


class NotFound(TTSError):
    """A named model, voice or speaker does not exist."""


class AlreadyExists(TTSError):
    """A named voice already exists."""


class ResourceExhausted(TTSError):
    """Admission control rejected the request (no free slot, state bound reached).

    `retry_after_s`, when known, is how long the refusing stage expects its queue to take to
    drain: sent as gRPC trailing metadata `retry-after` and as the HTTP `Retry-After` header."""

    def __init__(self, message: str, retry_after_s: int | None = None, param: str | None = None):
        super().__init__(message, param)
        self.retry_after_s = retry_after_s


# A refusal's hint in milliseconds is spread over [1, 1 + RETRY_SPREAD) of its `retry_after_s`.
RETRY_SPREAD = 0.5


def retry_after_ms(retry_after_s: float, draw: Callable[[], float] = random.random) -> int:
    """The retry hint in milliseconds (`retry-after-ms`), drawn at random from at least the hint
    to half as much again. Clients that honour one whole-second Retry-After come back together
    and are mostly refused again together; the OpenAI SDK reads `retry-after-ms` first, so its
    clients come back spread out, never before the hint."""
    return int(retry_after_s * 1000 * (1 + RETRY_SPREAD * draw()))


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """The HTTP headers of a refusal with a retry hint: the standard whole seconds and the spread
    milliseconds."""
    return {"Retry-After": str(int(retry_after_s)), "retry-after-ms": str(retry_after_ms(retry_after_s))}


class FailedPrecondition(TTSError):
    """A precondition of the call does not hold: a stream protocol's order was broken (frames
    before start or beyond the granted credit), or a reference digest names no prompt held."""


class Unavailable(TTSError):
    """A stage the request needs is not serving (starting, draining, or gone)."""


class GenerationFailed(TTSError):
    """Generation ended without a valid result (e.g. the frame cap was hit without end-of-speech)."""


class Cancelled(TTSError):
    """The client went away or cancelled the request."""


class PayloadTooLarge(TTSError):
    """The HTTP request body is larger than the server accepts (it never crosses a gRPC hop)."""


class RequestTimeout(TTSError):
    """The HTTP client stopped sending its request body."""


@dataclass(frozen=True)
class ErrorMapping:
    http_status: int
    openai_type: str
    grpc_code: grpc.StatusCode
    # OpenAI's error `code`: a short string, or None (null) where nothing more specific is known.
    openai_code: str | None


ERROR_TABLE: dict[type[TTSError], ErrorMapping] = {
    # HTTP-only errors first: a gRPC code maps back to the last class that has it.
    PayloadTooLarge: ErrorMapping(
        413, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT, "payload_too_large"
    ),
    RequestTimeout: ErrorMapping(408, "invalid_request_error", grpc.StatusCode.CANCELLED, "request_timeout"),
    InvalidArgument: ErrorMapping(
        400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT, "invalid_value"
    ),
    NotFound: ErrorMapping(404, "not_found_error", grpc.StatusCode.NOT_FOUND, "not_found"),
    AlreadyExists: ErrorMapping(409, "conflict_error", grpc.StatusCode.ALREADY_EXISTS, "already_exists"),
    ResourceExhausted: ErrorMapping(
        429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_exceeded"
    ),
    FailedPrecondition: ErrorMapping(
        400, "invalid_request_error", grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition"
    ),
    Unavailable: ErrorMapping(503, "service_unavailable_error", grpc.StatusCode.UNAVAILABLE, "unavailable"),
    GenerationFailed: ErrorMapping(500, "server_error", grpc.StatusCode.INTERNAL, "generation_failed"),
    Cancelled: ErrorMapping(499, "cancelled_error", grpc.StatusCode.CANCELLED, "cancelled"),
}

_INTERNAL = ErrorMapping(500, "server_error", grpc.StatusCode.INTERNAL, None)
_BY_GRPC_CODE = {m.grpc_code: cls for cls, m in ERROR_TABLE.items()}


def mapping_for(exc: BaseException) -> ErrorMapping:
    """The HTTP/OpenAI/gRPC mapping of an exception; unknown exceptions are internal errors."""
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return _INTERNAL


def from_grpc(code: grpc.StatusCode, details: str | None, trailing_metadata=None) -> TTSError:
    """Rebuild the domain error a downstream stage reported through a gRPC status (with the
    `retry-after` its trailing metadata carries, for RESOURCE_EXHAUSTED)."""
    cls = _BY_GRPC_CODE.get(code, TTSError)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        cls = Unavailable
    if cls is ResourceExhausted:
        return ResourceExhausted(details or code.name.lower(), retry_after_of(trailing_metadata))
    return cls(details or code.name.lower())


def retry_after_of(metadata) -> int | None:
    """The whole seconds of a `retry-after` metadata entry, or None."""
    for key, value in metadata or ():
        if key == "retry-after":
            try:
                return max(0, int(value))
            except (TypeError, ValueError):
                return None
    return None


# What a message must not show a client: addresses of the services behind the gateway (gRPC
# peers, host:port, URLs with credentials). Internal hops keep them; the public edge redacts.
_INTERNAL_ADDRESS = re.compile(
    r"(?:\b(?:ipv4|ipv6|unix|dns):\S+)"
    r"|(?:\b(?:redis|rediss|http|https)://\S+)"
    r"|(?:\[[0-9A-Fa-f:.]+\](?::\d+)?)"
    r"|(?:\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b)"
    r"|(?:\b[A-Za-z][\w-]*(?:\.[\w-]+)*:\d{2,5}\b)"
)


def redact_internal(message: str) -> str:
    """`message` with internal addresses replaced by `<internal>`."""
    return _INTERNAL_ADDRESS.sub("<internal>", message)


def openai_error_body(exc: BaseException) -> dict:
    """The OpenAI-shaped JSON error body for an exception: `param` names the field at fault when
    known, `code` is a string or null (the HTTP status is the response's own). Internal addresses
    in the message are redacted: this body goes to the public."""
    m = mapping_for(exc)
    if isinstance(exc, TTSError):
        message, param = redact_internal(exc.message), exc.param
    else:
        message, param = "internal server error", None
    return {"error": {"message": message, "type": m.openai_type, "param": param, "code": m.openai_code}}
