"""Reading an HTTP or WebSocket JSON body: JSON text to Python (`parse_json`, `json_body`), a
typed model's validation failure to one `InvalidArgument` naming the field at fault, worded with
the field's declared range (`validate_body`, `invalid_argument`), and base64 audio fields
(`decode_base64_audio`). The typed models themselves are in `http_request`."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import threading
from typing import Any

import annotated_types as at
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from qtts.lru import BoundedLru
from qtts.request.errors import InvalidArgument

# A speech request's reference clip, decoded, kept by the sha256 of its base64 text. A voice agent
# sends the same clip with every request; its base64 decode was a quarter of a gateway's work in a
# burst of voice clones (py-spy, HISTORY.md, seventh session of 2026-12-06): 0.35 ms for a 3 s
# clip's 192 kB, where hashing the text takes ~0.1 ms. Values shorter than DECODED_MIN_CHARS are
# decoded every time. Only `decode_reference_audio` uses it: uploads (voices, consent recordings)
# come once and are not kept. Its size follows the gateway's `--ref-audio-cache-mb`
# (`size_decoded_cache`: a quarter of it, 0 = off), so that one flag bounds the clips it keeps.
DECODED_MAX_BYTES = 64 << 20
DECODED_MIN_CHARS = 16 << 10
_decoded: BoundedLru[bytes, bytes] | None = BoundedLru(max_cost=DECODED_MAX_BYTES, cost=len)
_decoded_lock = threading.Lock()


def size_decoded_cache(max_bytes: int) -> None:
    """Bound the cache of decoded reference clips to `max_bytes` (0: no cache); its entries go."""
    global _decoded
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    with _decoded_lock:
        _decoded = BoundedLru(max_cost=max_bytes, cost=len) if max_bytes else None


def decode_reference_audio(value: str, field_name: str = "ref_audio") -> bytes:
    """`decode_base64_audio` for a speech request's reference clip: a long value decoded before is
    answered from a bounded cache keyed by its text's sha256 (the same bytes as decoding it again;
    failures are not cached)."""
    cache = _decoded
    if cache is None or len(value) < DECODED_MIN_CHARS:
        return decode_base64_audio(value, field_name)
    key = hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()
    with _decoded_lock:
        raw = cache.get(key)
    if raw is None:
        raw = decode_base64_audio(value, field_name)
        with _decoded_lock:
            cache.put(key, raw)
    return raw


def decode_base64_audio(value: str, field_name: str = "ref_audio") -> bytes:
    """Decode plain base64 or a `data:audio/...;base64,` URL; raise InvalidArgument otherwise."""
    data = value.strip()
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidArgument(
                f"{field_name} data URL must be base64 encoded (data:audio/...;base64,...)", param=field_name
            )
    elif data.startswith(("http://", "https://", "file:")):
        raise InvalidArgument(
            f"{field_name} must be base64 audio or a data URL; URLs are not fetched", param=field_name
        )
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"{field_name} is not valid base64: {exc}", param=field_name) from None
    if not raw:
        raise InvalidArgument(f"{field_name} is empty", param=field_name)
    return raw


def parse_json(raw: bytes | str, what: str = "request body") -> Any:
    """JSON text -> Python; bad JSON, bad UTF-8, too deep nesting or a too long integer is a 400."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidArgument(f"{what} is nested too deeply") from None
    except ValueError as exc:  # bad JSON, bad UTF-8, or an integer too long to convert
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None


async def json_body(request: Request) -> object:
    """The request's body as JSON; an empty body is a 400 too."""
    raw = await request.body()
    if not raw:
        raise InvalidArgument("request body must be a JSON object")
    return parse_json(raw)


def validate_body(model: type[BaseModel], body: Any, what: str = "request body") -> Any:
    """`model` validated from `body`; the first failure as one InvalidArgument naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_argument(model, exc, what) from None


_TYPE_WORDS = {
    "string_type": "a string",
    "bool_type": "a boolean",
    "int_type": "an integer",
    "float_type": "a number",
    "dict_type": "an object",
    "list_type": "a list",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def invalid_argument(
    model: type[BaseModel], exc: ValidationError, what: str = "request body"
) -> InvalidArgument:
    """One InvalidArgument for a pydantic failure: unknown fields first (all of them named), then
    the first failing field in declaration order, worded with the field's declared range."""
    errors = exc.errors(include_url=False)
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and e["loc"])
    if unknown:
        return InvalidArgument(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    e = errors[0]
    if not e["loc"]:
        return InvalidArgument(f"{what} must be a JSON object")
    name = str(e["loc"][0])
    kind, value = e["type"], e.get("input")
    if kind == "missing":
        message = f"{name} is required"
    elif kind.startswith("tts_"):
        message = e["msg"]
    elif kind in _TYPE_WORDS:
        message = f"{name} must be {_TYPE_WORDS[kind]}, got {type(value).__name__}"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        message = f"{name} must be {_declared_range(model, name)}, got {value}"
    elif kind in ("string_too_long", "too_long") and isinstance(value, str):
        message = f"{name} is {len(value)} characters long; the limit is {e['ctx']['max_length']}"
    elif kind == "string_unicode":
        message = f"{name} is not valid Unicode text (a lone UTF-16 surrogate?)"
    elif kind == "literal_error":
        message = f"{name} must be one of {e['ctx']['expected']}, got {repr(value)[:100]}"
    else:
        message = f"{name} {e['msg']}"
    return InvalidArgument(message, param=name)


def _declared_range(model: type[BaseModel], name: str) -> str:
    """A field's range as declared (`in 0.25..4.0`, `in (0, 1]`, `>= 0`)."""
    lo = hi = None
    lo_open = hi_open = False
    for m in model.model_fields[name].metadata:
        if isinstance(m, at.Ge):
            lo = m.ge
        elif isinstance(m, at.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, at.Le):
            hi = m.le
        elif isinstance(m, at.Lt):
            hi, hi_open = m.lt, True
    if lo is not None and hi is not None:
        if not lo_open and not hi_open:
            return f"in {lo}..{hi}"
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{'<' if hi_open else '<='} {hi}"
