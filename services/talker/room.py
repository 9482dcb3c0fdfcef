"""The room the talker publishes to the gateways: GetCapacity answers it, WatchCapacity pushes it.

A gateway refuses new requests at once, without calling, while no talker has room. The room a
talker publishes is its forecast's (forecast.Headroom); the gateway counts the calls it starts
after it. A call in flight when the room was worked out (sent, its handler not yet run: a talker
relaying hundreds of streams takes new calls late) is in neither count, so each published room
also says how many calls of that gateway the talker had seen (`calls_seen`, from the `x-tts-caller`
metadata the gateway sends): the gateway's room is the published one less its calls not yet seen.

WatchCapacity sends the room at once, then whenever it (or the calls seen) changes, checked every
`WATCH_INTERVAL_S`, and at least every `WATCH_HEARTBEAT_S`; it ends when the talker drains.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from qtts.lru import BoundedLru
from qtts.pb import talker_pb2
from qtts.serving.log_context import CALLER_KEY

WATCH_INTERVAL_S = 0.02
WATCH_HEARTBEAT_S = 1.0
# Callers remembered (gateway processes; each restart is a new one). The least recent goes first.
MAX_CALLERS = 4096


class SeenCalls:
    """Generate and GenerateStream calls seen per caller id (`x-tts-caller`)."""

    def __init__(self, max_callers: int = MAX_CALLERS):
        self._counts: BoundedLru[str, int] = BoundedLru(max_entries=max_callers)

    def saw(self, metadata: Any) -> None:
        """Count a call whose handler runs now, if its metadata names its caller."""
        for key, value in metadata or ():
            if key == CALLER_KEY and isinstance(value, str) and value:
                self._counts.put(value, (self._counts.peek(value) or 0) + 1)
                return

    def seen(self, caller: str) -> int:
        return self._counts.peek(caller) or 0


def capacity_message(room: Any, calls_seen: int | None = None) -> talker_pb2.GetCapacityResponse:
    msg = talker_pb2.GetCapacityResponse(
        start_now=room.start_now,
        accept=room.accept,
        retry_after_s=room.retry_after_s,
        running=room.running,
        waiting=room.waiting,
    )
    if calls_seen is not None:
        msg.calls_seen = calls_seen
    return msg


async def published_room(
    headroom: Callable[[], Awaitable[Any]], seen: SeenCalls, caller: str
) -> talker_pb2.GetCapacityResponse:
    """The room now, with the caller's calls seen. Those are read first: a call seen while the
    room is worked out is then counted in the room and not in the calls seen, so the gateway
    subtracts it twice (one request too few, never one too many)."""
    calls_seen = seen.seen(caller) if caller else None
    return capacity_message(await headroom(), calls_seen)


async def watch_room(
    headroom: Callable[[], Awaitable[Any]],
    seen: SeenCalls,
    caller: str,
    stopping: asyncio.Event,
    *,
    interval_s: float = WATCH_INTERVAL_S,
    heartbeat_s: float = WATCH_HEARTBEAT_S,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[talker_pb2.GetCapacityResponse]:
    """The room at once, then on every change and every `heartbeat_s`, until `stopping` is set."""
    last: tuple | None = None
    last_at = 0.0
    while not stopping.is_set():
        msg = await published_room(headroom, seen, caller)
        key = (msg.accept, msg.retry_after_s, msg.calls_seen if msg.HasField("calls_seen") else None)
        now = clock()
        if key != last or now - last_at >= heartbeat_s:
            last, last_at = key, now
            yield msg
        try:
            await asyncio.wait_for(stopping.wait(), interval_s)
        except TimeoutError:
            pass
