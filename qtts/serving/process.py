"""What a service process sets up around its server: one log format, a settled heap once it is
loaded, and SIGTERM/SIGINT handlers on its event loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable

from qtts.serving.log_context import log_handler

log = logging.getLogger(__name__)


def configure_logging(level: str = "INFO", fmt: str | None = None, service: str = "") -> None:
    """One log format for every service process: text (default) or one JSON object per line
    (`fmt="json"`, or `TTS_LOG_FORMAT=json`), each line tagged with the request id in flight."""
    fmt = fmt or os.environ.get("TTS_LOG_FORMAT", "text")
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), handlers=[log_handler(fmt, service)]
    )


_SLOW_GC_S = 0.02
_gc_started: list[float] = []


def _time_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        took = time.perf_counter() - _gc_started[0]
        if took >= _SLOW_GC_S:
            log.warning(
                "garbage collection of generation %d took %.0f ms (%d objects collected)",
                info.get("generation", -1),
                took * 1e3,
                info.get("collected", 0),
            )


def settle_heap() -> None:
    """Move everything alive once the service is loaded (model, graphs, modules) out of the
    garbage collector's reach (`gc.freeze`), so a full collection under load walks only the objects
    of requests in flight: a collection holds the GIL, and with it every thread of the process,
    the one driving the GPU too. Collections that still take 20 ms or more are logged."""
    gc.collect()
    gc.freeze()
    if _time_gc not in gc.callbacks:
        gc.callbacks.append(_time_gc)


def add_signal_handlers(
    loop: asyncio.AbstractEventLoop, handler: Callable[[signal.Signals], None]
) -> list[signal.Signals]:
    """`handler(sig)` for SIGTERM and SIGINT on `loop` (replacing earlier ones); returns those set."""
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handler, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread / not supported
            pass
    return installed


def remove_signal_handlers(loop: asyncio.AbstractEventLoop, signals: Iterable[signal.Signals]) -> None:
    for sig in signals:
        loop.remove_signal_handler(sig)
