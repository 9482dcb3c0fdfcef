"""Helpers of the gRPC tests (tests/qtts, tests/services): real `grpc.aio` servers on ephemeral
ports, a fake incremental decoder, a bidi-stream driver. tests/conftest.py offers them as
fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import grpc

from qtts.serving.grpc_server import GrpcServiceHost
from qtts.serving.metrics import ServiceMetrics


@asynccontextmanager
async def running_host(
    register: Callable[[grpc.aio.Server], Any],
    service_names: Iterable[str],
    metrics: ServiceMetrics | None = None,
    *,
    serving: bool = True,
    metrics_port: int = 0,
    drain_seconds: float = 1.0,
) -> AsyncIterator[tuple[GrpcServiceHost, grpc.aio.Channel]]:
    """Start a `GrpcServiceHost` on an ephemeral port, yield it with a channel to it, then stop both.

    `register(server)` adds the servicers (e.g. `lambda s: add_XServicer_to_server(servicer, s)`).
    """
    host = GrpcServiceHost(
        service_names=service_names,
        metrics=metrics,
        host="127.0.0.1",
        port=0,
        metrics_port=metrics_port,
        drain_seconds=drain_seconds,
    )
    register(host.server)
    port = await host.start()
    if serving:
        await host.set_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield host, channel
    finally:
        await channel.close()
        await host.stop(grace=0.5)


class FakeIncrementalDecoder:
    """Stands in for `qtts.model.IncrementalDecoder` in unit tests: deterministic, cheap, observable.

    Frame f (counted from the stream's start, prefix included) of codes c decodes to
    `samples_per_frame` samples of ((c[0] + f) % 64) / 128. `gate` can hold decodes back, and
    `live` counts states started and not freed.
    """

    def __init__(self, samples_per_frame: int = 1920, batch: bool = True):
        import threading

        self.samples_per_frame = samples_per_frame
        self.live = 0
        self.decoded_frames = 0
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        if not batch:
            self.decode_batch = None

    @staticmethod
    def expected(codes, first_position: int, samples_per_frame: int = 1920):
        import torch

        codes = torch.as_tensor(codes, dtype=torch.long)
        pos = torch.arange(codes.shape[0]) + first_position
        values = ((codes[:, 0] + pos) % 64).float() / 128.0
        return values.repeat_interleave(samples_per_frame)

    def start(self, prefix_codes=None):
        self.live += 1
        return {"pos": 0 if prefix_codes is None else int(prefix_codes.shape[0]), "freed": False}

    def decode(self, state, codes):
        assert not state["freed"], "decode on a freed state"
        self.gate.wait(timeout=30)
        out = self.expected(codes, state["pos"], self.samples_per_frame)
        state["pos"] += codes.shape[0]
        self.decoded_frames += codes.shape[0]
        return out

    def decode_batch(self, states, codes):
        self.batches.append(len(states))
        return [self.decode(s, c) for s, c in zip(states, codes, strict=True)]

    def free(self, state):
        if not state["freed"]:
            state["freed"] = True
            self.live -= 1


class BidiClient:
    """Drives one bidirectional-streaming call from a test: `send()` requests, `read()` responses."""

    def __init__(self, method: Callable[..., Any]):
        import asyncio

        self._queue: asyncio.Queue = asyncio.Queue()
        self.call = method(self._requests())

    async def _requests(self):
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    def send(self, request: Any) -> None:
        self._queue.put_nowait(request)

    def close_requests(self) -> None:
        self._queue.put_nowait(None)

    async def read(self, timeout: float = 20.0) -> Any:
        """The next response, or None at the end of the stream (raises AioRpcError on a status)."""
        import asyncio

        msg = await asyncio.wait_for(self.call.read(), timeout)
        return None if msg is grpc.aio.EOF else msg


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until true (state cleanup runs after the RPC ends, asynchronously)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
