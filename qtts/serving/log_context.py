"""One request id in every stage's logs, and log lines as JSON when asked.

The gateway takes a client's `X-Request-Id` (or makes one) and every hop passes it on as the gRPC
metadata key `x-request-id`; each service's interceptor binds it for the call (`request_id_var`,
a context variable, so tasks the call starts inherit it), and `RequestIdFilter` puts it on every
log record made meanwhile. `TTS_LOG_FORMAT=json` (or `configure_logging(fmt="json")`) writes one
JSON object per line: time, level, logger, message, service, request_id, exception.
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextvars import ContextVar, Token

from qtts.serving import tracing

METADATA_KEY = "x-request-id"
# When the caller sent the call (wall clock, ns): the receiving service times how long the call
# waited before its handler ran (qtts.serving.error_mapping, tts_rpc_accept_seconds). Across hosts
# the figure carries their clock offset (NTP keeps it to milliseconds).
SENT_AT_KEY = "x-tts-sent-at-ns"
# A gateway's id (random per process) on its talker calls: the talker counts the calls it has seen
# from each caller and says so with its published room (services/talker/room.py).
CALLER_KEY = "x-tts-caller"
HEADER = "X-Request-Id"
LOG_FORMATS = ("text", "json")

request_id_var: ContextVar[str] = ContextVar("request_id", default="")

# What a caller may send: ids, UUIDs, trace-ish tokens; anything else is replaced by our own.
_VALID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def valid_request_id(value: str | None) -> bool:
    return bool(value) and _VALID.match(value) is not None


def current_request_id() -> str:
    return request_id_var.get()


def bind_request_id(request_id: str) -> Token:
    return request_id_var.set(request_id)


def outgoing_metadata(request_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata for a call to the next stage: `request_id` (default: the bound one), the
    current trace context (qtts.serving.tracing), whichever there are, and the time it is sent."""
    rid = request_id if request_id is not None else request_id_var.get()
    metadata = [(METADATA_KEY, rid)] if rid else []
    metadata += tracing.inject({}).items()
    metadata.append((SENT_AT_KEY, str(time.time_ns())))
    return tuple(metadata)


def waited_since_sent(metadata: object, now_ns: int | None = None) -> float | None:
    """Seconds since the caller sent the call (its `SENT_AT_KEY`; not below 0), or None when it
    did not say."""
    for key, value in metadata or ():
        if key == SENT_AT_KEY and isinstance(value, str) and value.isdigit():
            now_ns = time.time_ns() if now_ns is None else now_ns
            return max(0.0, (now_ns - int(value)) / 1e9)
    return None


def request_id_from_metadata(metadata: object) -> str:
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and valid_request_id(value):
            return value
    return ""


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (and `request_tag`, " [id]" or "") to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or request_id_var.get()
        record.request_id = rid
        record.request_tag = f" [{rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.service:
            entry["service"] = self.service
        rid = getattr(record, "request_id", "")
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"


def log_handler(fmt: str = "text", service: str = "") -> logging.Handler:
    """A stderr handler in `fmt` ("text" or "json") that tags records with the request id."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    return handler
