"""Spreads new synthesis streams over every ready talker pod, re-resolving the talker's name.

One gRPC channel over a headless Service resolves the name once and keeps its HTTP/2 connections,
so talker pods added later get no streams from gateways already connected. The pool instead
resolves the name every `refresh_s` (and when no talker is usable), keeps one channel per address
and health-checks each; a new stream goes to the ready talker with the fewest streams this gateway
has in flight there (round robin among equals). A stream stays on the channel it started on until
it ends: an address that leaves the resolution only stops getting new streams, and its channel is
closed once its last stream is done. An address that comes back before that is used again.

Each talker publishes its room for new requests (from its capacity model of the GPU): the pool
watches it (`WatchCapacity`, one long-lived call per talker; polled with `GetCapacity` every
`capacity_refresh_s` from a talker without the watch) and counts the streams it starts after each
published room and those the talker had not yet seen (talker_room.py), so that while no ready
talker has room a new stream is refused at once (`ResourceExhausted` with the talkers'
`Retry-After`: 429 over HTTP, RESOURCE_EXHAUSTED over gRPC, the error event over WebSocket),
without calling a talker and waiting for its no. A talker that says nothing of its room (an older
one) is treated as having room, as before.

The resolver is pluggable (`Resolver`): `DnsResolver` in production, a fake one in the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qtts.request.errors import ResourceExhausted, Unavailable
from qtts.serving.grpc_server import RECONNECT_OPTIONS

from .talker_room import SLOW, Room, caller_metadata, capacity_probe, capacity_watch, new_caller_id

__all__ = ["SLOW", "Room", "capacity_probe", "capacity_watch", "StaticResolver", "TalkerPool"]

log = logging.getLogger(__name__)


class Resolver(Protocol):
    """Turns the configured talker target into the addresses ("ip:port") of its pods."""

    async def resolve(self) -> list[str]: ...


def split_target(target: str) -> tuple[str, int]:
    """host and port of a gRPC target: `dns:///host:port`, `dns://auth/host:port`, `dns:host:port`,
    `ipv4:host:port` or `host:port` (`[v6]:port` for IPv6)."""
    rest = target
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if rest.startswith(scheme):
            rest = rest[len(scheme) :]
            if rest.startswith("//"):
                rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else ""
            break
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"talker target {target!r} is not [dns:///]host:port")
    return host.strip("[]"), int(port)


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class DnsResolver:
    """Every A/AAAA record of the target's host (a headless Service has one per ready pod)."""

    def __init__(self, target: str):
        self.host, self.port = split_target(target)

    async def resolve(self) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        return sorted({_address(info[4][0], self.port) for info in infos})


class StaticResolver:
    """A fixed address list (also what a test changes to add or remove talkers)."""

    def __init__(self, addresses: Iterable[str]):
        self.addresses = list(addresses)

    async def resolve(self) -> list[str]:
        return list(self.addresses)


async def health_probe(channel: Any, timeout_s: float = 1.0) -> bool | None:
    """Whether the server behind `channel` reports SERVING (overall) through grpc.health.v1; None
    when it did not answer within `timeout_s` (a busy talker, not yet a gone one)."""
    try:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
    except grpc.aio.AioRpcError as exc:
        return None if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS)


@dataclass
class Endpoint:
    """One talker address: its channel, whether it is ready, and this gateway's streams on it."""

    address: str
    channel: Any
    ready: bool = False
    # No longer in the resolution: no new streams; closed when `active` reaches 0.
    retired: bool = False
    active: int = 0
    # Probes in a row that got no answer in time: one alone keeps a ready talker ready.
    slow_probes: int = 0
    # Requests it would still accept, from its last published room less the streams started here
    # since (None: unknown, taken as room), and its retry hint.
    room: int | None = None
    retry_after_s: int = 1
    # The room as last published (this gateway's share, before the calls counted against it):
    # above 0 with `room` spent, the next publication may bring more (`TalkerPool.room_wait_s`).
    published: int | None = None
    # Streams this gateway started here (its calls, each carrying its caller id).
    sent: int = 0
    # Its room comes from a WatchCapacity call now (not polled); False after UNIMPLEMENTED too.
    watching: bool = False
    watch_unsupported: bool = False
    watch_task: asyncio.Task | None = None

    def has_room(self) -> bool:
        return self.room is None or self.room > 0

    def publish(self, room: Room) -> None:
        """A room the talker published: less the calls sent here that it had not yet seen."""
        unseen = max(0, self.sent - room.calls_seen) if room.calls_seen is not None else 0
        self.room = room.accept - unseen
        self.published = room.accept
        self.retry_after_s = room.retry_after_s

    def share_spent(self) -> bool:
        """The talker published room here and this gateway's calls took it: its next room (the
        talker seeing those calls, re-splitting its room among the gateways) may have more."""
        return self.room is not None and self.room <= 0 and (self.published or 0) > 0


class Lease:
    """A stream's hold on one endpoint; `release()` (or leaving the `with`) exactly once."""

    def __init__(self, pool: TalkerPool, endpoint: Endpoint):
        self._pool = pool
        self.endpoint = endpoint
        self._released = False

    @property
    def address(self) -> str:
        return self.endpoint.address

    @property
    def channel(self) -> Any:
        return self.endpoint.channel

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """To send with the stream's call: the gateway's caller id, which the talker counts."""
        return caller_metadata(self._pool.caller)

    def unsent(self) -> None:
        """The stream's call could not be made: not one the talker will see, nor room it took."""
        self.endpoint.sent -= 1
        if self.endpoint.room is not None:
            self.endpoint.room += 1

    def mark_unavailable(self) -> None:
        """The talker failed the call as unreachable: no new streams until a probe says SERVING."""
        self.endpoint.ready = False

    def mark_full(self, retry_after_s: int | None) -> None:
        """The talker refused the call at capacity: no room there until it publishes some."""
        self.endpoint.room = 0
        self.endpoint.published = 0
        self.endpoint.retry_after_s = max(1, retry_after_s or 1)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self.endpoint)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Hold:
    """Room kept, while its body is read, for a request let in on its headers: counted against the
    talkers' published room until the request picks a talker (`TalkerPool.pick` in the same
    task) or `release()` (idempotent). Without it every request of a burst past the room passes
    the header check, and all but the room's worth are refused only after their bodies."""

    def __init__(self, pool: TalkerPool):
        self._pool = pool
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._pool._held -= 1


# The hold of the request the current task serves (set by `TalkerPool.hold`, taken by `pick`).
_current_hold: ContextVar[Hold | None] = ContextVar("talker_room_hold", default=None)


class TalkerPool:
    """The ready talkers behind one name, refreshed in the background (`start()`)."""

    def __init__(
        self,
        resolver: Resolver,
        *,
        connect: Callable[[str], Any] = insecure_channel,
        probe: Callable[[Any], Awaitable[bool]] = health_probe,
        refresh_s: float = 5.0,
        min_refresh_gap_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        capacity: Callable[[Any, str], Awaitable[Room | None | object]] | None = capacity_probe,
        capacity_refresh_s: float = 0.1,
        watch: Callable[[Any, str], AsyncIterator[Room]] | None = capacity_watch,
        watch_retry_s: float = 1.0,
        room_wait_s: float = 0.0,
        on_room_wait: Callable[[bool, float], None] | None = None,
    ):
        self._resolver = resolver
        self._connect = connect
        self._probe = probe
        self._capacity = capacity
        self.capacity_refresh_s = capacity_refresh_s
        self._watch = watch if capacity is not None else None
        self.watch_retry_s = watch_retry_s
        # A request finding this gateway's share of the room spent (`Endpoint.share_spent`) waits
        # up to this long for the next published room before it is refused (0: refused at once).
        self.room_wait_s = room_wait_s
        self._on_room_wait = on_room_wait  # (got a talker, seconds waited) of each such wait
        self._room_event = asyncio.Event()  # set, and replaced, on each published room
        self.caller = new_caller_id()
        self._capacity_task: asyncio.Task | None = None
        self.refresh_s = refresh_s
        self._min_gap_s = min_refresh_gap_s
        self._clock = clock
        self._endpoints: dict[str, Endpoint] = {}
        self._held = 0  # rooms kept by `hold()` and not yet taken by `pick()` or released
        self._turn = 0
        self._last_refresh: float | None = None
        self._refreshing: asyncio.Task | None = None
        self._loop_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ state

    @property
    def endpoints(self) -> dict[str, Endpoint]:
        """Every known address (retired ones still carrying streams included)."""
        return dict(self._endpoints)

    def usable(self) -> list[Endpoint]:
        """Endpoints that may take a new stream, sorted by address."""
        return [e for _, e in sorted(self._endpoints.items()) if e.ready and not e.retired]

    # ------------------------------------------------------------------ refresh

    async def refresh(self) -> None:
        """Resolve once, add and retire addresses, probe every current one. Concurrent callers
        share one refresh."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
        await asyncio.shield(self._refreshing)

    async def _refresh(self) -> None:
        self._last_refresh = self._clock()
        try:
            addresses = set(await self._resolver.resolve())
        except Exception as exc:  # noqa: BLE001 - a DNS hiccup must not drop every talker
            log.warning("talker resolution failed (keeping %d talkers): %s", len(self.usable()), exc)
            addresses = None
        if addresses:
            self._apply(addresses)
        current = [e for e in self._endpoints.values() if not e.retired]
        results = await asyncio.gather(*(self._probe(e.channel) for e in current), return_exceptions=True)
        for endpoint, ok in zip(current, results, strict=True):
            if ok is None and endpoint.ready and endpoint.slow_probes < 1:
                # A loaded talker (or a TLS handshake on a loaded host) can miss one probe's
                # deadline; taking it out for that turned requests away with "no talker is ready".
                endpoint.slow_probes += 1
                continue
            endpoint.slow_probes = 0
            ready = ok is True
            if ready != endpoint.ready:
                log.info("talker %s %s", endpoint.address, "ready" if ready else "not ready")
            endpoint.ready = ready

    def _apply(self, addresses: set[str]) -> None:
        for address in addresses:
            endpoint = self._endpoints.get(address)
            if endpoint is None:
                log.info("talker %s added", address)
                self._endpoints[address] = Endpoint(address, self._connect(address))
            elif endpoint.retired:
                log.info("talker %s is back", address)
                endpoint.retired = False
        for address, endpoint in list(self._endpoints.items()):
            if address not in addresses and not endpoint.retired:
                log.info("talker %s removed (%d streams finish there)", address, endpoint.active)
                endpoint.retired = True
                endpoint.ready = False
                if endpoint.active == 0:
                    self._drop(endpoint)

    def _drop(self, endpoint: Endpoint) -> None:
        del self._endpoints[endpoint.address]
        if endpoint.watch_task is not None:
            endpoint.watch_task.cancel()
        close = getattr(endpoint.channel, "close", None)
        if close is not None:
            result = close()
            if asyncio.iscoroutine(result):
                asyncio.ensure_future(result)

    # ------------------------------------------------------------------ streams

    def pick(self) -> Lease | None:
        """A lease on the usable talker with room and the fewest streams of ours, or None if none
        is usable; raises `ResourceExhausted` when every usable talker published that it has no
        room (the shortest retry hint among them). The current task's `hold()` is taken here."""
        if (held := _current_hold.get()) is not None:
            _current_hold.set(None)
            held.release()  # its room is this pick's now
        usable = self.usable()
        if not usable:
            return None
        if (full := self._no_room()) is not None:
            raise full
        usable = [e for e in usable if e.has_room()]
        # Rotate the start so that equally loaded talkers take turns (round robin).
        start = self._turn % len(usable)
        self._turn += 1
        rotated = usable[start:] + usable[:start]
        endpoint = min(rotated, key=lambda e: e.active)
        endpoint.active += 1
        endpoint.sent += 1
        if endpoint.room is not None:  # until the next published room, count what we start there
            endpoint.room -= 1
        return Lease(self, endpoint)

    def refusal(self) -> ResourceExhausted | None:
        """The refusal a new stream gets now because the ready talkers published no room beyond
        what `hold()` keeps (the shortest retry hint among them); None while there is some, or a
        talker's room is unknown, or none is ready (an outage, not a refusal), or, with
        `room_wait_s`, while a share this gateway spent may be refilled (`acquire` waits for it).
        A peek: it takes no lease."""
        full = self._no_room()
        if full is not None and self.room_wait_s > 0 and self._share_spent():
            return None
        return full

    def _share_spent(self) -> bool:
        return any(e.share_spent() for e in self.usable())

    def _no_room(self) -> ResourceExhausted | None:
        """`refusal` without the wait for a spent share to be refilled."""
        usable = self.usable()
        if not usable or any(e.room is None for e in usable):
            return None
        if sum(max(0, e.room or 0) for e in usable) > self._held:
            return None
        retry = min(e.retry_after_s for e in usable)
        return ResourceExhausted(
            f"every talker is at capacity ({len(usable)} ready, none has room); retry later", retry
        )

    def hold(self) -> Hold:
        """Keep room for the request the current task serves until it picks a talker (see Hold)."""
        held = Hold(self)
        self._held += 1
        _current_hold.set(held)
        return held

    async def wait_usable(self, retry_s: float = 0.2) -> None:
        """Return once a talker is usable (refreshing until then): a gateway reports SERVING only
        when a new stream would find a talker."""
        while not self.usable():
            await self.refresh()
            if not self.usable():
                await asyncio.sleep(retry_s)

    def _may_refresh(self) -> bool:
        return self._last_refresh is None or self._clock() - self._last_refresh >= self._min_gap_s

    async def acquire(self) -> Lease:
        """A lease for a new stream; refreshes first when no talker is usable (at most every
        `min_refresh_gap_s`). Raises `Unavailable` when still none is, `ResourceExhausted` when
        none has room: at once where the talkers published none, after up to `room_wait_s` for
        the next published room where this gateway's share was spent.

        The talker splits its room among the gateways by the calls each has been sending, and a
        gateway counts the calls the talker has not seen yet against its share: a burst at one
        gateway (a closed loop's clients whose first streams end together) spent its share in a
        few milliseconds and was refused while the talker had room for it (an H100 at c=768, one
        gateway of four: 52 refused in 80 ms with 124-264 published; HISTORY.md, sixth session of
        2026-12-07)."""
        waited_from: float | None = None
        while True:
            try:
                lease = self.pick()
                break
            except ResourceExhausted:
                if self.room_wait_s <= 0 or not self._share_spent():
                    self._waited(waited_from, False)
                    raise
                now = self._clock()
                waited_from = now if waited_from is None else waited_from
                if now - waited_from >= self.room_wait_s:
                    self._waited(waited_from, False)
                    raise
                await self._next_room(waited_from + self.room_wait_s - now)
        self._waited(waited_from, True)
        if lease is None and self._may_refresh():
            await self.refresh()
            lease = self.pick()
        if lease is None:
            raise Unavailable("no talker is ready")
        return lease

    def _waited(self, since: float | None, got: bool) -> None:
        if since is not None and self._on_room_wait is not None:
            self._on_room_wait(got, self._clock() - since)

    async def _next_room(self, timeout_s: float) -> None:
        """Return at the next published room, or after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._room_event.wait()

    def _published(self) -> None:
        """A room was published: wake the requests waiting for one."""
        self._room_event.set()
        self._room_event = asyncio.Event()

    async def serving(self) -> bool:
        """Whether a new stream would find a talker now (the gateway's readiness): the pool's own
        view, the one `acquire` picks from, after probing every talker afresh (a refresh already
        running is shared). A health check over another channel could say SERVING while every
        channel of the pool still waited out its reconnect backoff and new streams got 503."""
        await self.refresh()
        return bool(self.usable())

    def _release(self, endpoint: Endpoint) -> None:
        endpoint.active -= 1
        if endpoint.retired and endpoint.active == 0 and self._endpoints.get(endpoint.address) is endpoint:
            self._drop(endpoint)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Refresh now and then every `refresh_s`, and poll the talkers' room every
        `capacity_refresh_s`, until `close()`."""
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._loop())
        if self._capacity_task is None and self._capacity is not None:
            self._capacity_task = asyncio.create_task(self._capacity_loop())

    async def poll_capacity(self) -> None:
        """Ask every usable talker whose room no watch brings for its room once (concurrently)."""
        if self._capacity is None:
            return
        current = [e for e in self.usable() if not e.watching]
        results = await asyncio.gather(
            *(self._capacity(e.channel, self.caller) for e in current), return_exceptions=True
        )
        for endpoint, room in zip(current, results, strict=True):
            if endpoint.watching:  # its watch answered meanwhile, later than this poll
                continue
            if isinstance(room, Room):
                endpoint.publish(room)
                self._published()
            elif room is not SLOW:  # no answer: unknown, taken as room (the talker still refuses)
                endpoint.room = None

    def _start_watches(self) -> None:
        if self._watch is None:
            return
        for endpoint in self.usable():
            if not endpoint.watch_unsupported and (endpoint.watch_task is None or endpoint.watch_task.done()):
                endpoint.watch_task = asyncio.create_task(self._watch_room(endpoint))

    async def _watch_room(self, endpoint: Endpoint) -> None:
        """Take `endpoint`'s room from its WatchCapacity call while the call lasts; polls take over
        meanwhile, and for good from a talker without the watch."""
        try:
            async for room in self._watch(endpoint.channel, self.caller):
                endpoint.watching = True
                endpoint.publish(room)
                self._published()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                endpoint.watch_unsupported = True
            elif exc.code() != grpc.StatusCode.CANCELLED:
                log.info("talker %s: room watch ended (%s); polling", endpoint.address, exc.code().name)
        except Exception:  # noqa: BLE001 - polls take over
            log.exception("talker %s: room watch failed; polling", endpoint.address)
        finally:
            endpoint.watching = False
        if not endpoint.watch_unsupported:
            await asyncio.sleep(self.watch_retry_s)  # started again by the capacity loop after this

    async def _capacity_loop(self) -> None:
        while True:
            try:
                self._start_watches()
                await self.poll_capacity()
            except Exception:  # noqa: BLE001 - keep polling whatever one round did
                log.exception("talker capacity poll failed")
            await asyncio.sleep(self.capacity_refresh_s)

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep refreshing whatever one round did
                log.exception("talker pool refresh failed")
            await asyncio.sleep(self.refresh_s)

    async def close(self) -> None:
        for task in (self._loop_task, self._capacity_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._loop_task = self._capacity_task = None
        for endpoint in list(self._endpoints.values()):
            if endpoint.watch_task is not None:
                endpoint.watch_task.cancel()
            close = getattr(endpoint.channel, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
        self._endpoints.clear()
