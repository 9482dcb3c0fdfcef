"""A GPU stage whose device failed: report NOT_SERVING and exit, so Kubernetes starts a fresh one.

After an unrecoverable device error (an illegal memory access, a device-side assert, a lost
device) the CUDA context is unusable: every later kernel of the process fails, so serving on would
fail every request while health still says SERVING. The cure is a new process. An ordinary error
of one request (a bad value, a shape it cannot take) stays that request's error; so does a CUDA
out-of-memory, after which the caching allocator recovers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# Distinct from a crash (1) and a signal (128+n): the log and the pod's last state say which.
DEVICE_FAILURE_EXIT_CODE = 3

# Messages of RuntimeErrors raised by CUDA, cuBLAS and cuDNN calls in torch builds that raise no
# dedicated type for them.
_FATAL_MARKERS = ("CUDA error", "CUBLAS_STATUS_", "CUDNN_STATUS_", "cuDNN error")


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is a device failure no request survives."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _fatal(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _fatal(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a stage without torch has no device
    if torch is not None:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return False
        fatal_types = tuple(
            t for t in (getattr(torch, "AcceleratorError", None), getattr(torch.cuda, "CudaError", None)) if t
        )
        if fatal_types and isinstance(exc, fatal_types):
            return True
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc)
    return any(m in message for m in _FATAL_MARKERS) and "out of memory" not in message


class DeviceFailure:
    """Reports a fatal device error once: health NOT_SERVING (readiness and liveness), then, after
    `flush_s` for the failed streams' errors to reach their callers, exits the process with
    DEVICE_FAILURE_EXIT_CODE. Callable from any thread; `exit` is replaceable for tests."""

    def __init__(
        self,
        host: Any,
        *,
        flush_s: float = 0.5,
        hard_exit_s: float = 5.0,
        exit: Callable[[int], Any] = os._exit,
    ):
        self._host = host  # a qtts.serving.grpc_server.GrpcServiceHost
        self._flush_s = flush_s
        self._hard_exit_s = hard_exit_s
        self._exit = exit
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._exited = False
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def check(self, exc: BaseException) -> bool:
        """Report `exc` when it is a fatal device error; returns whether it was."""
        if not is_fatal_device_error(exc):
            return False
        self.report(exc)
        return True

    def report(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = exc
        log.critical(
            "unrecoverable device error, exiting with code %d so the container is restarted: %s",
            DEVICE_FAILURE_EXIT_CODE,
            exc,
        )
        # A wedged event loop must not keep a dead device serving: the process goes regardless.
        timer = threading.Timer(self._hard_exit_s, self._exit_now)
        timer.daemon = True
        timer.start()
        try:
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._shut_down()))
        except RuntimeError:  # the loop is closed
            self._exit_now()

    async def _shut_down(self) -> None:
        try:
            await self._host.set_failed()
            await asyncio.sleep(self._flush_s)
        finally:
            self._exit_now()

    def _exit_now(self) -> None:
        with self._lock:
            if self._exited:
                return
            self._exited = True
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(DEVICE_FAILURE_EXIT_CODE)
