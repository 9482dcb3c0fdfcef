"""`X-Request-Id` at the gateway's HTTP front: a client's id is kept (if it is a sane token), else
one is made; it is bound for the request (qtts.serving.log_context), becomes the synthesis job's id, goes
to the talker as gRPC metadata, and comes back as a response header on every route."""

from __future__ import annotations

from typing import Any

from qtts.serving.log_context import METADATA_KEY, bind_request_id, request_id_var, valid_request_id

from .validation import new_request_id

_HEADER = METADATA_KEY.encode()


class RequestIdMiddleware:
    """A pure ASGI middleware; the id is the same header name both ways."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == _HEADER), "")
        rid = given if valid_request_id(given) else new_request_id()
        token = bind_request_id(rid)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == _HEADER for k, _ in headers):
                    headers.append((_HEADER, rid.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
