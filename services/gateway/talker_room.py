"""What the gateway knows of each talker's room for new requests, and how it learns it.

A talker publishes its room (`talker.v1.TalkerService`, services/talker/room.py): the gateway
watches it over one long-lived call per talker (`WatchCapacity`: pushed on every change), or polls
it (`GetCapacity`) where a talker does not have the watch. Each published room says how many of
this gateway's calls the talker had seen (`calls_seen`); the calls the gateway sent since are in
flight, and `Endpoint.publish` takes them off the room: a talker relaying hundreds of streams takes
new calls late, and a room that forgot them let the gateway send more than the talker would take,
each refused there a second later (benchmarks/HISTORY.md, the CPU session of 2026-12-05).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.serving.log_context import CALLER_KEY


@dataclass(frozen=True)
class Room:
    """What a talker published of its room: requests it would accept, the retry hint, and the calls
    of this gateway it had seen (None: it did not say)."""

    accept: int
    retry_after_s: int = 1
    calls_seen: int | None = None


# A talker that did not answer the room poll in time: busy, not empty. Its last published room
# stands (counted down by the streams started since). On a CPU stand-in stack relaying 768 streams
# the talker took calls up to a second late (benchmarks/HISTORY.md, the night CPU session): with
# every poll timed out and so taken as "room unknown", the gateway sent every request on, to be
# refused there a second later.
SLOW = object()


def new_caller_id() -> str:
    """This gateway process's id on its talker calls (`x-tts-caller`)."""
    return uuid.uuid4().hex


def caller_metadata(caller: str) -> tuple[tuple[str, str], ...]:
    return ((CALLER_KEY, caller),) if caller else ()


def room_from_pb(resp: talker_pb2.GetCapacityResponse) -> Room:
    seen = resp.calls_seen if resp.HasField("calls_seen") else None
    return Room(resp.accept, max(1, resp.retry_after_s), seen)


async def capacity_probe(channel: Any, caller: str = "", timeout_s: float = 0.5) -> Room | None | object:
    """The talker's published room (GetCapacity); None when it did not say (unknown: has room);
    `SLOW` when it did not answer within `timeout_s`."""
    try:
        resp = await talker_pb2_grpc.TalkerServiceStub(channel).GetCapacity(
            talker_pb2.GetCapacityRequest(caller=caller), timeout=timeout_s
        )
    except grpc.aio.AioRpcError as exc:
        return SLOW if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else None
    return room_from_pb(resp)


async def capacity_watch(channel: Any, caller: str = "") -> AsyncIterator[Room]:
    """The talker's room as it publishes it (WatchCapacity), until the call ends. Raises the
    call's `grpc.aio.AioRpcError` (UNIMPLEMENTED: a talker without the watch)."""
    call = talker_pb2_grpc.TalkerServiceStub(channel).WatchCapacity(
        talker_pb2.GetCapacityRequest(caller=caller)
    )
    try:
        async for resp in call:
            yield room_from_pb(resp)
    finally:
        call.cancel()
