"""Per-route HTTP metrics of the gateway: every request counted by route template, method and
status (tts_http_requests_total) and timed to its last body byte (tts_http_request_duration_seconds),
so a streamed response counts its whole life; and one access log line each."""

from __future__ import annotations

import logging
import time
from typing import Any

from qtts.serving.metrics import GatewayMetrics

# One line per finished request, tagged with its request id (as the gRPC services' qtts.access).
access_log = logging.getLogger("qtts.access")
UNMATCHED = "unmatched"  # no route: one label value, not one per probed path


class HttpMetricsMiddleware:
    """A pure ASGI middleware (streamed bodies pass through untouched)."""

    def __init__(self, app: Any, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = [500]

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # The router put the matched route into the scope on the way in.
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            seconds = time.monotonic() - start
            self.metrics.http_request(route, scope["method"], status[0], seconds)
            if route != "/health":
                access_log.info("%s %s %d %.3fs", scope["method"], scope["path"], status[0], seconds)
