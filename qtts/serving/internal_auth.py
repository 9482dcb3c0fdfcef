"""An optional shared secret between the services: a stage refuses callers that do not present it.

Off unless a token is configured (`--internal-token`, or `TTS_<SERVICE>_INTERNAL_TOKEN`; in
Kubernetes from one Secret for every service). A server with a token answers every call but
health (probes carry no token) without the `x-tts-internal-token` metadata entry with
UNAUTHENTICATED, reflection included (it would list the services and their schemas to anyone); a client with a token sends it on every call through a channel interceptor.
It keeps uninvited callers inside the network away from the talker and speaker_cache (a direct
talker call, a forged PutVoicePrompt); it is no substitute for TLS on an untrusted network.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

import grpc

METADATA_KEY = "x-tts-internal-token"
_OPEN = ("/grpc.health.",)


def rejecting_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that ends every call with `code`."""

    async def reject(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def reject_stream(request: Any, context: grpc.aio.ServicerContext):
        await context.abort(code, message)
        yield  # pragma: no cover - an async generator, as the handler kind needs

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(reject, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(reject, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(reject_stream, des, ser)
    return grpc.stream_stream_rpc_method_handler(reject_stream, des, ser)


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call (but health) without the shared token."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN):
            return handler
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY), "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token):
            return handler
        return rejecting_handler(
            handler, grpc.StatusCode.UNAUTHENTICATED, "this service needs the internal token"
        )


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    return [InternalTokenInterceptor(token)] if token else []


class _AddsToken:
    def __init__(self, token: str):
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(METADATA_KEY, self._token)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One class per call kind: a channel files an interceptor under the first kind it is an instance
# of, so one class implementing all four would only see unary-unary calls.
class _UnaryUnary(_AddsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AddsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_AddsToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_AddsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def client_interceptors(token: str) -> Sequence[grpc.aio.ClientInterceptor] | None:
    """For `grpc.aio.insecure_channel(..., interceptors=...)`: None (no interceptor) without a token."""
    return [cls(token) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)] if token else None
