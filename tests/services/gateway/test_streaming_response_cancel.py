"""A streaming HTTP response whose client leaves ends at once, even while its pump is writing: once
the client has gone, every send returns at once, and a cancel that lands in a send with a write
timeout must not be swallowed (Python 3.11's asyncio.wait_for swallowed it, and the stream ran on
into nothing for its whole length, its talker slot held)."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.http_streaming import DisconnectAwareStreamingResponse


async def _leave_mid_send(shift: int) -> tuple[bool, bool, int]:
    """(the response ended within 5 s, its chunks were closed, sends made) for a client that
    leaves `shift` loop turns after the fifth chunk."""
    closed = asyncio.Event()
    sends, stop = 0, False

    async def endless():
        try:
            while not stop:
                await asyncio.sleep(0)
                yield b"\0" * 64
        finally:
            closed.set()

    async def send(message):  # a server whose client has gone: every send returns at once
        nonlocal sends
        sends += 1

    async def receive():
        while sends < 5:
            await asyncio.sleep(0)
        for _ in range(shift):
            await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    response = DisconnectAwareStreamingResponse(endless(), write_timeout_s=30.0, request_id="r")
    call = asyncio.create_task(response({"type": "http"}, receive, send))
    done, _ = await asyncio.wait({call}, timeout=5.0)
    stop = True  # ends a pump that swallowed its cancel, so a failing run still stops
    await call
    return call in done, closed.is_set(), sends


@pytest.mark.parametrize("shift", range(8))  # the cancel lands at a different point of the pump
async def test_a_client_that_leaves_mid_send_ends_the_stream_at_once(shift):
    ended, closed, sends = await _leave_mid_send(shift)
    assert ended and closed, f"the stream ran on after its client left ({sends} sends)"
