"""The at-capacity refusal of `POST /v1/audio/speech`, answered ahead of FastAPI's routing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from qtts.request.errors import TTSError

SPEECH_PATH = "/v1/audio/speech"


class EarlyRefusalMiddleware:
    """A pure ASGI middleware, inside the API key, client identity, rate and body-size checks:
    a speech request the gateway would refuse from its headers alone (`GatewayCore.early_refusal`)
    is answered here, with the handler's own response, without FastAPI's routing, dependency
    solving and exception middleware (a quarter of a refusal's cost in a refusal storm,
    benchmarks/refusal_storm.py). Anything else, and a request let in, goes on to the app, whose
    handler checks again and holds the request's place."""

    def __init__(
        self,
        app: Any,
        refusal: Callable[[], TTSError | None],
        respond: Callable[[TTSError], Response],
        route: Callable[[], Any],
    ):
        self.app = app
        self._refusal = refusal
        self._respond = respond
        self._route = route  # the speech route, for the per-route metrics (the router sets it)
        self._route_found: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == SPEECH_PATH:
            busy = self._refusal()
            if busy is not None:
                if self._route_found is None:
                    self._route_found = self._route()  # routes are all added by the first request
                scope["route"] = self._route_found
                await self._respond(busy)(scope, receive, send)
                return
        await self.app(scope, receive, send)
