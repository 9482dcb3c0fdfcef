"""Optional API keys on the gateway, and the voices each key owns.

Off unless keys are configured (`--api-keys-file`, one key a line, `#` comments; and/or
`TTS_GATEWAY_API_KEYS`, comma-separated). When on, every `/v1/` HTTP route and every
`tts.v1` RPC needs `Authorization: Bearer <key>` (HTTP header or gRPC metadata); a WebSocket,
which a browser cannot give headers, may send the key as the `api_key` query parameter instead.
Health, the playground page and the API docs stay open.

A key owns the voices it creates: they are stored under a prefix derived from the key (`owner`),
so another key can neither see, use nor delete them. Only a hash of a key is ever kept per
request.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable
from contextvars import ContextVar
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import grpc

from qtts.request.errors import InvalidArgument
from qtts.serving.internal_auth import rejecting_handler

from .client_identity import bearer_token

ENV_VAR = "TTS_GATEWAY_API_KEYS"
# Paths served without a key: probes, the playground (it asks for the key itself), the API docs.
OPEN_PATHS = ("/health", "/livez", "/readyz", "/docs", "/redoc", "/openapi.json", "/favicon.ico")
OPEN_PREFIXES = ("/static/", "/docs-assets/")
OWNER_CHARS = 8

owner_var: ContextVar[str] = ContextVar("voice_owner", default="")


def current_owner() -> str:
    """The voice owner of this request ("" when API keys are off)."""
    return owner_var.get()


def load_api_keys(path: str = "", env_value: str | None = None) -> frozenset[str]:
    """The configured keys (empty: authentication is off)."""
    keys: set[str] = set()
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.add(line)
    env_value = os.environ.get(ENV_VAR, "") if env_value is None else env_value
    keys.update(k.strip() for k in env_value.split(",") if k.strip())
    return frozenset(keys)


def owner_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:OWNER_CHARS]


class ApiKeys:
    """The set of valid keys; `owner(token)` is the token's owner id, or None when it is not one."""

    def __init__(self, keys: Iterable[str]):
        self._keys = tuple(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def owner(self, token: str) -> str | None:
        # Compare against every key in constant time: the answer must not depend on a prefix.
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(token.encode(), key.encode())
        return owner_of(token) if found and token else None


def scoped_voice_name(name: str, owner: str) -> str:
    """A stored voice's name in the store: `<owner>.<name>` when keys are on."""
    if not owner:
        return name
    if len(name) > 64 - OWNER_CHARS - 1:
        raise InvalidArgument(
            f"voice name {name!r} is too long: with API keys on, at most {64 - OWNER_CHARS - 1} characters",
            param="name",
        )
    return f"{owner}.{name}"


def unscoped_voice_name(stored: str, owner: str) -> str | None:
    """The name a key sees for a stored voice, or None when the voice is not its own."""
    if not owner:
        return stored
    prefix = owner + "."
    return stored[len(prefix) :] if stored.startswith(prefix) else None


def _unauthorized_body(message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    return json.dumps({"error": error}).encode()


class ApiKeyMiddleware:
    """A pure ASGI middleware: a 401 (OpenAI's shape) for a `/v1/` request without a valid key;
    binds `owner_var` for the request otherwise."""

    def __init__(self, app: Any, keys: ApiKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or not self.keys.enabled or _is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        token = bearer_token(headers.get(b"authorization"))
        if not token and scope["type"] == "websocket":
            token = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key") or [""])[0]
        owner = self.keys.owner(token)
        if owner is None:
            message = (
                "You didn't provide an API key: send Authorization: Bearer <key>"
                if not token
                else "Incorrect API key provided"
            )
            await _refuse(scope, send, message)
            return
        bound = owner_var.set(owner)
        try:
            await self.app(scope, receive, send)
        finally:
            owner_var.reset(bound)


def _is_open(path: str) -> bool:
    return path == "/" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) or not path.startswith("/v1/")


async def _refuse(scope: dict, send: Any, message: str) -> None:
    if scope["type"] == "websocket":
        # Before accept: the server answers the handshake with 403.
        await send({"type": "websocket.close", "code": 1008, "reason": "invalid_api_key"})
        return
    body = _unauthorized_body(message)
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def grpc_owner(context: grpc.aio.ServicerContext) -> str:
    """The owner bound by `ApiKeyInterceptor` checks, from the call's metadata ("" when off)."""
    metadata = dict(context.invocation_metadata() or ())
    token = bearer_token(metadata.get("authorization"))
    return owner_of(token) if token else ""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call to `services` without `authorization: Bearer <valid key>`."""

    def __init__(self, keys: ApiKeys, services: Iterable[str]):
        self.keys = keys
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or not self.keys.enabled
            or not handler_call_details.method.startswith(self.prefixes)
        ):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        token = bearer_token(metadata.get("authorization"))
        if self.keys.owner(token) is not None:
            return handler
        message = "missing API key: send authorization: Bearer <key>" if not token else "incorrect API key"
        return rejecting_handler(handler, grpc.StatusCode.UNAUTHENTICATED, message)
