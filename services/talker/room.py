"""The room the talker publishes to the gateways: GetCapacity answers it, WatchCapacity pushes it.

A gateway refuses new requests at once, without calling, while no talker has room. The room a
talker publishes is its forecast's (forecast.Headroom); the gateway counts the calls it starts
after it. A call in flight when the room was worked out (sent, its handler not yet run: a talker
relaying hundreds of streams takes new calls late) is in neither count, so each published room
also says how many calls of that gateway the talker had seen (`calls_seen`, from the `x-tts-caller`
metadata the gateway sends): the gateway's room is the published one less its calls not yet seen.
Several gateways asking share the room in proportion to the calls each has been sending
(`SeenCalls.share`), each at least one request while there is any, and with `share_floor` (the
talker's `--room-share-floor`) each at least that fraction of an equal split.

WatchCapacity sends the room at once, then whenever it (or the calls seen) changes, checked every
`WATCH_INTERVAL_S`, and at least every `WATCH_HEARTBEAT_S`; it ends when the talker drains. Room
that a stream's error frees is sent at once, before the error (`RoomNews`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from qtts.lru import BoundedLru
from qtts.pb import talker_pb2
from qtts.request.errors import ResourceExhausted
from qtts.serving.log_context import CALLER_KEY

WATCH_INTERVAL_S = 0.02
WATCH_HEARTBEAT_S = 1.0
# Callers remembered (gateway processes; each restart is a new one). The least recent goes first.
MAX_CALLERS = 4096
# A caller's share of the room follows its calls a second, averaged over this long; a caller that
# sends none still counts this many; callers that have not asked for their room this long are out.
RATE_TAU_S = 2.0
RATE_FLOOR = 0.5
ACTIVE_S = 5.0
# How long a stream's error waits for the watches to send the room its end freed (`RoomNews`):
# each works it out at once, but one whose gateway does not read (the call's flow control) must
# not hold the error longer.
NEWS_WAIT_S = 0.1


class _Caller:
    __slots__ = ("calls", "rate", "rate_at")

    def __init__(self) -> None:
        self.calls = 0  # calls seen
        self.rate = 0.0  # calls a second, decayed over RATE_TAU_S, as of `rate_at`
        self.rate_at = 0.0


class SeenCalls:
    """Generate and GenerateStream calls seen per caller id (`x-tts-caller`), and each caller's
    share of the room: several gateways in front of one talker each get the room in proportion
    to the calls they have been sending (each at least one request while there is room), instead
    of the whole room each, which would let N gateways send N times what the talker takes."""

    def __init__(
        self,
        max_callers: int = MAX_CALLERS,
        clock: Callable[[], float] = time.monotonic,
        share_floor: float = 0.0,
    ):
        if not 0.0 <= share_floor <= 1.0:
            raise ValueError(f"share_floor must be in [0, 1], got {share_floor}")
        # Each asking caller's share is at least this fraction of 1 / (callers asking).
        self.share_floor = share_floor
        self._callers: BoundedLru[str, _Caller] = BoundedLru(max_entries=max_callers)
        # Callers that asked for their room within ACTIVE_S: when each last asked. Pruned as the
        # shares are worked out, so a share looks at the gateways there now, not every one
        # remembered (each gateway restart is a new caller).
        self._asking: dict[str, float] = {}
        self._clock = clock

    def saw(self, metadata: Any) -> None:
        """Count a call whose handler runs now, if its metadata names its caller."""
        for key, value in metadata or ():
            if key == CALLER_KEY and isinstance(value, str) and value:
                entry = self._callers.get(value)  # the most recently used now
                if entry is None:
                    entry = _Caller()
                    self._callers.put(value, entry)
                now = self._clock()
                entry.calls += 1
                entry.rate = _decayed(entry, now) + 1.0 / RATE_TAU_S
                entry.rate_at = now
                return

    def seen(self, caller: str) -> int:
        entry = self._callers.peek(caller)
        return entry.calls if entry is not None else 0

    def share(self, caller: str) -> float:
        """`caller`'s share of the room (1.0 while it is the only caller asking): its recent call
        rate, plus `RATE_FLOOR` so that a quiet gateway still gets some, over all callers' that
        asked for their room within `ACTIVE_S`; with `share_floor`, at least that fraction of an
        equal split among them.

        The rate follows the calls seen, so at a burst's opening the gateway whose calls come
        first holds most of the room and one whose calls come a few hundred milliseconds later
        finds its share taken while the talker still has room: on an H100 at c=768 four gateways
        of 525 requests each refused 0, 60, 164 and 97 (benchmarks/HISTORY.md, fourth session of
        2026-12-07). A floor of 1 gives each at least an equal split: the gateways together may
        then send up to twice the room, and the talker refuses the excess itself."""
        now = self._clock()
        self._asking[caller] = now
        mine = total = 0.0
        for key, asked_at in list(self._asking.items()):
            if now - asked_at > ACTIVE_S:
                del self._asking[key]
                continue
            entry = self._callers.peek(key)
            weight = (_decayed(entry, now) if entry is not None else 0.0) + RATE_FLOOR
            total += weight
            if key == caller:
                mine = weight
        return max(mine / total, self.share_floor / len(self._asking))


def _decayed(entry: _Caller, now: float) -> float:
    return entry.rate * math.exp(-max(0.0, now - entry.rate_at) / RATE_TAU_S)


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
    headroom: Callable[[], Awaitable[Any]],
    seen: SeenCalls,
    caller: str,
    observe: Callable[[float, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> talker_pb2.GetCapacityResponse:
    """The room now, with the caller's calls seen (`_timed_room`); `observe(seconds, calls)`
    hears how long the room took to work out and how many of the caller's calls were seen
    meanwhile (each possibly counted twice so)."""
    msg, seconds, calls = await _timed_room(headroom, seen, caller, clock)
    if observe is not None:
        observe(seconds, calls)
    return msg


async def _timed_room(
    headroom: Callable[[], Awaitable[Any]], seen: SeenCalls, caller: str, clock: Callable[[], float]
) -> tuple[talker_pb2.GetCapacityResponse, float, int]:
    """The room now, the seconds it took to work out, and the caller's calls seen meanwhile. The
    calls seen are read first: a call seen while the room is worked out is then counted in the
    room and not in the calls seen, so the gateway subtracts it twice (one request too few, never
    one too many)."""
    calls_seen = seen.seen(caller) if caller else None
    started = clock()
    room = await headroom()
    seconds = clock() - started
    meanwhile = seen.seen(caller) - calls_seen if caller else 0
    msg = capacity_message(room, calls_seen)
    if caller and msg.accept:
        msg.accept = max(1, math.ceil(msg.accept * seen.share(caller)))
    return msg, seconds, meanwhile


class RoomNews:
    """Room freed between the watches' checks, sent to the gateways before the caller hears why.

    A stream that ends with an error frees its room in the engine as its caller learns of the
    end: the gateway passes the error on at once (an aborted HTTP body, an error event), and the
    client's next request can be at the gateway within a few milliseconds, before the watch's next
    check (`WATCH_INTERVAL_S`) sends the freed room. A gateway that still had the room from before
    (none, on a talker full with that one stream) refused that request at once: 429 "every talker
    is at capacity" with the empty queue's Retry-After, the first-audio budget (seen on the tiny
    CPU stack of the end-to-end tests, whose one-stream step took the whole duty bound on a loaded
    2-core host, so one stream filled the talker). A stream that ends well frees its room seconds
    before its listener hears the end (its audio is made ahead of playback): the check is in time.

    `publish()` wakes every watch to work out the room now and send it if it changed, and returns
    once each has (at most `NEWS_WAIT_S`): the error goes out after the room, on the connection
    that carries both to the gateway."""

    def __init__(self) -> None:
        self.version = 0  # publications asked for
        self._wake = asyncio.Event()  # set, and replaced, by each publication
        self._progress = asyncio.Event()  # set, and replaced, whenever a watch catches up or ends
        # Each watch: the publication its last room was worked out after.
        self._watches: dict[object, int] = {}

    def watch(self, token: object) -> None:
        self._watches[token] = self.version

    def unwatch(self, token: object) -> None:
        self._watches.pop(token, None)
        self._progressed()

    def caught_up(self, token: object, version: int) -> None:
        """`token`'s watch sent (or found unchanged) the room worked out after publication `version`."""
        if token in self._watches:
            self._watches[token] = version
            self._progressed()

    def _progressed(self) -> None:
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()

    async def wait(self, seen: int, timeout_s: float) -> None:
        """Return after `timeout_s`, or as soon as a publication after `seen` is asked for."""
        if self.version > seen:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()

    async def publish(self, timeout_s: float = NEWS_WAIT_S) -> bool:
        """Have every watch send the room now; whether all did within `timeout_s`."""
        self.version += 1
        version = self.version
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                while any(seen < version for seen in self._watches.values()):
                    await self._progress.wait()
        except TimeoutError:
            return False
        return True


async def watch_room(
    headroom: Callable[[], Awaitable[Any]],
    seen: SeenCalls,
    caller: str,
    stopping: asyncio.Event,
    *,
    observe: Callable[[float, int], None] | None = None,
    news: RoomNews | None = None,
    interval_s: float = WATCH_INTERVAL_S,
    heartbeat_s: float = WATCH_HEARTBEAT_S,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[talker_pb2.GetCapacityResponse]:
    """The room at once, then on every change and every `heartbeat_s`, until `stopping` is set;
    `observe` (as `published_room`'s) hears each room sent; `news` wakes it between its checks."""
    last: tuple | None = None
    last_at = 0.0
    token = object()
    if news is not None:
        news.watch(token)
    try:
        while not stopping.is_set():
            version = news.version if news is not None else 0
            msg, seconds, calls = await _timed_room(headroom, seen, caller, time.perf_counter)
            key = (msg.accept, msg.retry_after_s, msg.calls_seen if msg.HasField("calls_seen") else None)
            now = clock()
            if key != last or now - last_at >= heartbeat_s:
                last, last_at = key, now
                if observe is not None:  # the rooms sent, not every one worked out
                    observe(seconds, calls)
                yield msg  # resumed once the message is written
            if news is None:
                await asyncio.sleep(interval_s)  # a drain ends the watch within one interval
                continue
            news.caught_up(token, version)
            await news.wait(version, interval_s)
    finally:
        if news is not None:
            news.unwatch(token)


# How old the engine's last room may be for the front to refuse by it (`FrontRoom`): the watches
# work one out every WATCH_INTERVAL_S while a gateway listens; older, the engine decides.
FRONT_ROOM_FRESH_S = 0.05


class FrontRoom:
    """The engine's last room as the talker's front saw it, for refusals at once.

    With the engine in a process of its own, a request's admission was decided there, when its
    prompt build arrived: after the call waited for its handler, its voice prompt (a speaker_cache
    round trip) and the engine process's turn. On a loaded host that took 0.4-1.5 s for a request
    refused anyway (benchmarks/HISTORY.md, seventh session of 2026-12-07). The rooms worked out
    for the gateways (`headroom`) already say how many more requests the engine accepts; the front
    keeps the last one with the number of builds it had sent before asking, and refuses a request
    at once while that room, less the builds sent since, is spent. A room older than `fresh_s` is
    not used, nor one of an idle talker (no stream running or waiting: a draining talker's, or
    one with no estimate yet): the engine decides, as before."""

    def __init__(self, fresh_s: float = FRONT_ROOM_FRESH_S, clock: Callable[[], float] = time.monotonic):
        self._fresh_s = fresh_s
        self._clock = clock
        self._sent = 0  # prompt builds sent to the engine
        self._last: tuple[float, Any, int] | None = None  # (when heard, the room, builds sent before)

    def build_sent(self) -> None:
        """A prompt build went to the engine (it counts there once it arrives)."""
        self._sent += 1

    def asking(self) -> int:
        """Call just before the room's request is sent: the builds it will count."""
        return self._sent

    def heard(self, room: Any, sent_before: int) -> None:
        """The engine's room (forecast.Headroom), asked for after `sent_before` builds."""
        self._last = (self._clock(), room, sent_before)

    def refusal(self) -> ResourceExhausted | None:
        """The refusal of a request arriving now (None: the engine decides)."""
        if self._last is None:
            return None
        at, room, sent_before = self._last
        if self._clock() - at > self._fresh_s or not (room.running or room.waiting):
            return None
        left = room.accept - (self._sent - sent_before)
        if left > 0:
            return None
        return ResourceExhausted(
            f"the talker is at capacity: no room for another request ({room.running} streams "
            f"generating, {room.waiting} waiting to start); retry later",
            max(1, room.retry_after_s),
        )
