"""qtts.serving.session_calls: a session's write times (what a stream's hops count as zero once
handing on means queueing on a session call), on the caller's and the server's side, with a
writer that takes its time as a busy connection would."""

from __future__ import annotations

import asyncio

from qtts.pb import talker_pb2
from qtts.serving.session_calls import ClientCall, ServerSession

WRITE_S = 0.05  # each message's write


class _Call(ClientCall):
    def __init__(self, start_call, on_written):
        self.pending: list[int] = []
        super().__init__(start_call, 0.0, on_written)

    def put(self, sid: int) -> None:
        self.pending.append(sid)
        self.wake()

    def _take(self):
        if not self.pending:
            return None
        msg = talker_pb2.SessionRequest(cancel=self.pending)
        self.pending = []
        return msg


class _SlowWire:
    """Stands in for a gRPC call: writes each request `WRITE_S` after taking it, reads nothing."""

    def __init__(self):
        self.sent: list[talker_pb2.SessionRequest] = []
        self.task: asyncio.Task | None = None

    def __call__(self, requests):
        async def write_all():
            async for msg in requests:
                await asyncio.sleep(WRITE_S)
                self.sent.append(msg)

        self.task = asyncio.ensure_future(write_all())
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()  # the server never answers here

    def cancel(self) -> None:
        self.task.cancel()


async def test_the_caller_side_times_each_message_from_its_first_item_queued_to_written():
    written: list[float] = []
    wire = _SlowWire()
    call = _Call(wire, written.append)
    call.put(1)
    await asyncio.sleep(0)  # the first message is being written
    call.put(2)  # queued behind it
    call.put(3)
    for _ in range(100):
        if len(written) == 2:
            break
        await asyncio.sleep(0.01)
    assert [list(m.cancel) for m in wire.sent] == [[1], [2, 3]]
    # The first waited its own write; the second, the first's write and its own.
    assert written[0] >= WRITE_S * 0.9 and written[1] >= WRITE_S * 1.8
    await call.close()


async def test_the_server_side_times_each_message_from_its_oldest_event_queued_to_written():
    written: list[float] = []
    session = ServerSession(talker_pb2.SessionResponse, talker_pb2.SessionEvent, talker_pb2.SessionEnd, 2)
    session.on_written = written.append
    reader = asyncio.ensure_future(asyncio.Event().wait())
    done = False
    got: list[talker_pb2.SessionResponse] = []

    async def write_all():
        async for msg in session.responses(reader, lambda: done):
            await asyncio.sleep(WRITE_S)  # the write; the generator resumes after it
            got.append(msg)

    writer = asyncio.ensure_future(write_all())
    await asyncio.sleep(WRITE_S * 2)  # the empty first message went: nothing queued, not timed
    assert got and not written
    for sid in (1, 2, 3):
        session.emit(sid, talker_pb2.GenerateResponse(request_id=f"r{sid}"))
    done = True
    await writer  # ends once nothing is queued and no more will come
    # Two events a message: [1, 2] then [3]; each timed from its oldest event's queueing.
    assert [[e.stream_id for e in m.events] for m in got[1:]] == [[1, 2], [3]]
    assert len(written) == 2
    # The second waited behind the first's write, then its own.
    assert written[0] >= WRITE_S * 0.9 and written[1] >= WRITE_S * 1.8
