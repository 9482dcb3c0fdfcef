"""An in-process talker on real gRPC servers, with in-process code2wav replicas (fake or real)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from qtts.pb import code2wav_pb2_grpc, speaker_cache_pb2_grpc, talker_pb2, talker_pb2_grpc
from qtts.serving.grpc_server import GrpcServiceHost
from services.speaker_cache.config import SpeakerCacheConfig
from services.speaker_cache.server import SpeakerCacheServer
from services.talker.config import TalkerConfig
from services.talker.server import TalkerServer


@dataclass
class Replica:
    address: str
    host: GrpcServiceHost
    servicer: Any


@dataclass
class TalkerStack:
    talker: TalkerServer
    stub: talker_pb2_grpc.TalkerServiceStub
    replicas: list[Replica] = field(default_factory=list)

    @property
    def generator(self) -> Any:
        return self.talker.engine.generator

    def gauge(self, name: str) -> float:
        return self.talker.metrics.registry.get_sample_value(name) or 0.0


async def start_replica(servicer: Any) -> Replica:
    host = GrpcServiceHost(
        service_names=["code2wav.v1.Code2WavService"], host="127.0.0.1", port=0, drain_seconds=0.5
    )
    code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server(servicer, host.server)
    port = await host.start()
    await host.set_serving()
    return Replica(f"127.0.0.1:{port}", host, servicer)


@asynccontextmanager
async def talker_stack(
    replica_servicers: list[Any],
    *,
    bundle: Any,
    generator_factory: Callable | None = None,
    spec_factory: Callable | None = None,
    speaker_cache: str = "",
    code2wav_addresses: list[str] | tuple[str, ...] = (),
    run_warm_up: bool | None = None,
    exit_process: Callable[[int], object] | None = None,
    **config: Any,
) -> AsyncIterator[TalkerStack]:
    async with AsyncExitStack() as stack:
        replicas = []
        for servicer in replica_servicers:
            r = await start_replica(servicer)
            stack.push_async_callback(r.host.stop, 0)
            replicas.append(r)
        cfg = TalkerConfig(
            host="127.0.0.1",
            port=0,
            metrics_port=0,
            code2wav=(*(r.address for r in replicas), *code2wav_addresses),
            speaker_cache=speaker_cache,
            drain_seconds=1.0,
            **config,
        ).validate()
        # The warm-up needs the real model; fakes skip it unless asked.
        warm = run_warm_up if run_warm_up is not None else generator_factory is None
        talker = TalkerServer(
            cfg,
            bundle=bundle,
            generator_factory=generator_factory,
            spec_factory=spec_factory,
            run_warm_up=warm,
            **({} if exit_process is None else {"exit_process": exit_process}),
        )
        port = await talker.start()
        stack.push_async_callback(talker.stop, 0.5)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stack.push_async_callback(channel.close)
        yield TalkerStack(talker, talker_pb2_grpc.TalkerServiceStub(channel), replicas)


async def generate_all(stub: talker_pb2_grpc.TalkerServiceStub, **fields: Any) -> tuple[list, Any]:
    """(audio chunks, summary) of one Generate call."""
    chunks, summary = [], None
    async for msg in stub.Generate(talker_pb2.GenerateRequest(**fields)):
        if msg.WhichOneof("event") == "audio":
            chunks.append(msg.audio)
        else:
            summary = msg.summary
    return chunks, summary


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until `predicate()` holds; fail with the predicate's source when it never does."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def speaker_cache():
    server = SpeakerCacheServer(SpeakerCacheConfig(port=0, metrics_port=0, drain_seconds=0.5).validate())
    port = await server.start()
    await server.wait_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield f"127.0.0.1:{port}", speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(0.5)
