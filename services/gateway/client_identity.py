"""Who is asking: the key that per-client limits count by.

With API keys on, a client is its API key (`Authorization: Bearer <key>`, on HTTP and as gRPC
metadata; only a hash of it is kept; a wrong key never gets this far). Without them, a client is
its address, whatever token it sends: a client sending a new random token each time was a new
client each time, and escaped every per-client limit. Behind a proxy, the address is the proxy's
unless the gateway is told to trust its X-Forwarded-For (--forwarded-allow-ips). The key is a
context variable bound per request, like the request id, so the synthesis core needs no
transport objects.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from typing import Any
from urllib.parse import parse_qs

client_var: ContextVar[str] = ContextVar("gateway_client", default="")


def current_client() -> str:
    return client_var.get()


def bearer_token(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def client_key(token: str, address: str, keys_enabled: bool = False) -> str:
    """The client of a request: its API key's hash when keys are on (and it sent one), else its address."""
    if token and keys_enabled:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    return "addr:" + address if address else ""


def grpc_peer_host(peer: str) -> str:
    """`ipv4:1.2.3.4:5678` / `ipv6:[::1]:5678` -> the host part."""
    _, _, rest = (peer or "").partition(":")
    host = rest.rpartition(":")[0] if rest.count(":") >= 1 else rest
    return host.strip("[]") or peer


def grpc_client_key(context: Any, keys_enabled: bool = False) -> str:
    metadata = dict(context.invocation_metadata() or ())
    return client_key(
        bearer_token(metadata.get("authorization")), grpc_peer_host(context.peer()), keys_enabled
    )


class ClientIdentityMiddleware:
    """A pure ASGI middleware binding `client_var` for each HTTP request and WebSocket."""

    def __init__(self, app: Any, keys_enabled: bool = False):
        self.app = app
        self.keys_enabled = keys_enabled

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        auth = next(
            (v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), ""
        )
        address = (scope.get("client") or ("",))[0]
        key = bearer_token(auth)
        if not key and scope["type"] == "websocket":  # browsers send the key as ?api_key=
            key = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key") or [""])[0]
        token = client_var.set(client_key(key, address, self.keys_enabled))
        try:
            await self.app(scope, receive, send)
        finally:
            client_var.reset(token)
