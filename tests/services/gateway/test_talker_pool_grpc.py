"""Two real gRPC talker servers behind a resolver whose answer changes while streams run: the
gateway's talker client spreads new streams over a talker added at run time, keeps in-flight ones
where they started, and streams outlive the talkers' connection aging."""

from __future__ import annotations

import asyncio
from collections import Counter

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.request.vocabulary import SynthesisSummary
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from services.gateway.job import SynthesisJob
from services.gateway.talker_client import TalkerClient
from services.gateway.talker_pool import StaticResolver, TalkerPool
from tests.synthesis_jobs import talker_job

FRAME = 1920


class NamedTalker(talker_pb2_grpc.TalkerServiceServicer):
    """Streams `max_new_frames` one-frame chunks `delay_s` apart; the summary names this talker."""

    def __init__(self, name: str, delay_s: float):
        self.name = name
        self.delay_s = delay_s
        self.started = 0
        self.peers: set[str] = set()

    async def Generate(self, request, context):
        self.started += 1
        self.peers.add(context.peer())
        n = request.max_new_frames
        for i in range(n):
            await asyncio.sleep(self.delay_s)
            yield talker_pb2.GenerateResponse(
                request_id=request.request_id,
                sequence_number=i,
                audio=tts_pb2.AudioChunk(
                    audio=b"\0" * 2 * FRAME, num_samples=FRAME, first_frame_index=i, num_frames=1
                ),
            )
        yield talker_pb2.GenerateResponse(
            request_id=request.request_id,
            sequence_number=n,
            summary=talker_pb2.GenerateSummary(
                finish_reason=tts_pb2.FINISH_REASON_LENGTH, num_frames=n, code2wav_replica=self.name
            ),
        )


async def start_talker(servicer: NamedTalker, max_connection_age_s: float = 0.0) -> GrpcServiceHost:
    host = GrpcServiceHost(
        service_names=[service_full_name(talker_pb2, "TalkerService")],
        port=0,
        drain_seconds=30.0,
        max_connection_age_s=max_connection_age_s,
    )
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(servicer, host.server)
    await host.start()
    await host.set_serving()
    return host


def job(i: int, frames: int) -> SynthesisJob:
    return talker_job(f"req-{i}", max_new_frames=frames)


async def run_stream(client: TalkerClient, i: int, frames: int, started: asyncio.Event | None = None):
    """(talker name, audio frames received) of one stream."""
    pieces = 0
    async for event in client.generate(job(i, frames)):
        if isinstance(event, SynthesisSummary):
            return event.code2wav_replica, pieces
        pieces += 1
        if started is not None:
            started.set()
    raise AssertionError("no summary")


async def test_streams_spread_over_a_talker_added_at_run_time_and_in_flight_ones_stay():
    a, b = NamedTalker("a", delay_s=0.05), NamedTalker("b", delay_s=0.05)
    host_a, host_b = await start_talker(a), await start_talker(b)
    addr_a, addr_b = f"127.0.0.1:{host_a.bound_port}", f"127.0.0.1:{host_b.bound_port}"
    resolver = StaticResolver([addr_a])
    pool = TalkerPool(resolver, refresh_s=0.05)
    client = TalkerClient(addr_a, pool=pool)
    pool.start()
    try:
        # Four long streams while only talker a resolves.
        events = [asyncio.Event() for _ in range(4)]
        long = [asyncio.create_task(run_stream(client, i, 30, events[i])) for i in range(4)]
        await asyncio.gather(*(e.wait() for e in events))
        assert a.started == 4 and b.started == 0

        resolver.addresses = [addr_a, addr_b]
        for _ in range(100):
            if len(pool.usable()) == 2:
                break
            await asyncio.sleep(0.02)
        # New streams go to the talker with fewer of our streams: b, until both carry four.
        short = await asyncio.gather(*(run_stream(client, 10 + i, 3) for i in range(4)))
        assert Counter(name for name, _ in short) == {"b": 4}
        assert a.started == 4

        # a leaves the resolution: new streams all go to b, a's streams still finish on a.
        resolver.addresses = [addr_b]
        for _ in range(100):
            if [e.address for e in pool.usable()] == [addr_b]:
                break
            await asyncio.sleep(0.02)
        late = await asyncio.gather(*(run_stream(client, 20 + i, 2) for i in range(3)))
        assert {name for name, _ in late} == {"b"}
        assert [await t for t in long] == [("a", 30)] * 4
        for _ in range(100):
            if addr_a not in pool.endpoints:
                break
            await asyncio.sleep(0.02)
        assert list(pool.endpoints) == [addr_b]
    finally:
        await client.close()
        await host_a.stop(0)
        await host_b.stop(0)


async def test_a_stream_outlives_the_talkers_connection_age_and_new_calls_reconnect():
    talker = NamedTalker("a", delay_s=0.05)
    host = await start_talker(talker, max_connection_age_s=0.3)
    address = f"127.0.0.1:{host.bound_port}"
    client = TalkerClient(address, pool=TalkerPool(StaticResolver([address])))
    try:
        # 1.5 s of stream on a connection the server ages out after about 0.3 s.
        assert await run_stream(client, 1, 30) == ("a", 30)
        assert await run_stream(client, 2, 1) == ("a", 1)
        # The second call came over a new connection (another client port).
        assert len(talker.peers) == 2
    finally:
        await client.close()
        await host.stop(0)
