"""The code2wav replicas a talker decodes on: a consistent-hash ring over the healthy ones.

A stream is pinned to `pick(request_id)` when it opens and never moves. A replica that fails to
connect or drops a stream is marked down (taken off the ring, so only its ~1/N share of new
streams moves); a health-check task puts it back once it reports SERVING again. A replica that
stalled a stream is held off the ring for a while first: a hung decoder may still report SERVING.
`on_availability(False)` is called when the last replica leaves the ring and `(True)` when one is
back, so the talker's own health can say that it cannot decode.

A dead replica is told from a slow one by its connection, not by a deadline: each channel's
connectivity is watched, and a connection that was up and is lost is checked at once without
waiting for a reconnect. A refused connection (UNAVAILABLE: nothing listens, the process died)
marks the replica down and `lost` within milliseconds; a live replica that is only slow keeps its
connection READY and is never judged by this path (a 1 s deadline under GPU load once marked a
live replica down). The periodic checks stay as they were for what a connection cannot tell (a
host that vanished, a decoder that hangs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qtts.pb import code2wav_pb2_grpc
from qtts.request.errors import Unavailable
from qtts.serving.grpc_server import RECONNECT_OPTIONS
from qtts.serving.internal_auth import client_interceptors
from qtts.serving.tls import TlsConfig, aio_channel
from qtts.streams.hash_ring import HashRing

from . import code2wav_client as c2w
from .decode_session import ReplicaSession, SessionDecodeCall

log = logging.getLogger(__name__)

CODE2WAV_SERVICE = "code2wav.v1.Code2WavService"
# A replica that stalls again right after its hold is held twice as long, up to this many times.
MAX_STALL_HOLD_FACTOR = 32
PROBE_INTERVAL_S = 0.25  # least time between two on-demand probe rounds (no replica on the ring)


class Code2WavReplicas:
    """Channels, stubs and the ring of the configured code2wav addresses."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        vnodes: int = 160,
        health_interval_s: float = 2.0,
        stall_hold_s: float = 30.0,
        channel_factory: Callable[[str], grpc.aio.Channel] | None = None,
        token: str = "",
        tls: TlsConfig | None = None,
        on_availability: Callable[[bool], None] | None = None,
        sessions: bool = True,
        on_session_written: Callable[[float], None] | None = None,
    ):
        if not addresses:
            raise ValueError("at least one code2wav address is needed")
        self.addresses = tuple(dict.fromkeys(addresses))
        factory = channel_factory or (
            lambda addr: aio_channel(
                addr,
                tls,
                options=[
                    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024),
                    # A replica whose host vanishes without closing the connection is detected
                    # within ~15 s instead of stalling its streams until TCP gives up.
                    ("grpc.keepalive_time_ms", 10_000),
                    ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    *RECONNECT_OPTIONS,
                ],
                # The shared secret (qtts/serving/internal_auth.py) on every call; None without a token.
                interceptors=client_interceptors(token),
            )
        )
        self._channels = {addr: factory(addr) for addr in self.addresses}
        self._stubs = {addr: code2wav_pb2_grpc.Code2WavServiceStub(ch) for addr, ch in self._channels.items()}
        self._health = {addr: health_pb2_grpc.HealthStub(ch) for addr, ch in self._channels.items()}
        # Optimistic start: every replica is on the ring until a connect or a health check fails.
        self._ring = HashRing(self.addresses, vnodes=vnodes)
        self._health_interval_s = health_interval_s
        self._stall_hold_s = stall_hold_s
        self._held_until: dict[str, float] = {}
        self._stall_streak: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None
        self._last_probe = float("-inf")
        self._on_availability = on_availability
        self._lost: set[str] = set()  # replicas whose lost connection was refused: dead, not slow
        self._watchers: list[asyncio.Task] = []
        # Gets the decode cost each replica publishes on its grants (code2wav_client.DecoderCosts).
        self.on_decoder_cost: Callable[[str, float, float, float], None] | None = None
        # Streams as messages on one DecodeSession call per replica (decode_session.py).
        self._sessions = (
            {
                addr: ReplicaSession(self._stubs[addr], on_written=on_session_written)
                for addr in self.addresses
            }
            if sessions
            else {}
        )

    @property
    def healthy(self) -> frozenset[str]:
        return self._ring.nodes

    @property
    def all_lost(self) -> bool:
        """Whether every replica's connection was lost and refused (dead processes, not slow ones)."""
        return set(self.addresses) <= self._lost

    def pick(self, key: str, exclude: frozenset[str] = frozenset()) -> str:
        """The replica for `key`; with `exclude`, the owner on a ring without those replicas."""
        ring = self._ring
        if exclude & ring.nodes:
            ring = HashRing(ring.nodes - exclude)
        try:
            return ring.get(key)
        except LookupError:
            raise Unavailable(
                f"no code2wav replica is available (configured: {', '.join(self.addresses)})"
            ) from None

    async def pick_or_probe(self, key: str, exclude: frozenset[str] = frozenset()) -> str:
        """`pick`, but when no replica is on the ring, first check the ones that are off it (a
        replica that came up since the last periodic check must not fail requests until the
        next one). Concurrent callers share one probe round, and rounds are at least
        PROBE_INTERVAL_S apart, so an outage does not turn every request into a health check."""
        try:
            return self.pick(key, exclude)
        except Unavailable:
            if not (set(self.addresses) - exclude - self._ring.nodes):
                raise
        if self._probe is None or self._probe.done():
            if time.monotonic() - self._last_probe >= PROBE_INTERVAL_S:
                self._last_probe = time.monotonic()
                self._probe = asyncio.ensure_future(self.check_all())
        if self._probe is not None:
            await asyncio.shield(self._probe)
        return self.pick(key, exclude)

    def stub(self, address: str) -> code2wav_pb2_grpc.Code2WavServiceStub:
        return self._stubs[address]

    def open_call(self, address: str) -> c2w.DecodeCall | SessionDecodeCall:
        """A new stream's call on `address`: on its DecodeSession once that has answered,
        otherwise a Decode call of its own."""
        session = self._sessions.get(address)
        call = session.open(address, self.on_decoder_cost) if session is not None else None
        return (
            call if call is not None else c2w.DecodeCall(self._stubs[address], address, self.on_decoder_cost)
        )

    def mark_down(self, address: str, reason: str) -> None:
        if address in self._ring:
            log.warning("code2wav replica %s marked down: %s", address, reason)
            self._ring.remove(address)
            if not len(self._ring) and self._on_availability is not None:
                self._on_availability(False)

    def mark_stalled(self, address: str, reason: str) -> None:
        """Take a replica that stalled a stream off the ring and keep it off for its hold, even
        while its health checks pass. Each stall after the last hold ended without a stream
        completing there doubles the hold; the stalls of one hang (concurrent streams) count once."""
        now = time.monotonic()
        if now >= self._held_until.get(address, 0.0):
            streak = self._stall_streak.get(address, 0) + 1
            self._stall_streak[address] = streak
            hold = self._stall_hold_s * min(2 ** (streak - 1), MAX_STALL_HOLD_FACTOR)
            self._held_until[address] = now + hold
            reason = f"{reason}; held off the ring for {hold:.1f} s"
        self.mark_down(address, reason)

    def stream_completed(self, address: str) -> None:
        """A stream ended normally on `address`: its stall streak (if any) is over."""
        self._stall_streak.pop(address, None)

    def held(self, address: str) -> bool:
        """Whether a stall keeps `address` off the ring for now."""
        return time.monotonic() < self._held_until.get(address, 0.0)

    def mark_up(self, address: str) -> None:
        if address not in self._ring and not self.held(address):
            log.info("code2wav replica %s is serving again", address)
            was_empty = not len(self._ring)
            self._ring.add(address)
            if was_empty and self._on_availability is not None:
                self._on_availability(True)

    async def check(self, address: str, timeout_s: float = 1.0) -> bool:
        """One health check; updates the ring and returns whether the replica serves."""
        try:
            resp = await self._health[address].Check(
                # wait_for_ready: a channel between reconnect attempts gets its next try within
                # the timeout instead of failing the check at once.
                health_pb2.HealthCheckRequest(service=CODE2WAV_SERVICE),
                timeout=timeout_s,
                wait_for_ready=True,
            )
            serving = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as exc:
            serving = False
            reason = f"health check failed: {exc.code().name}"
        else:
            self._lost.discard(address)
            reason = "health check reports NOT_SERVING"
        if serving:
            self.mark_up(address)
        else:
            self.mark_down(address, reason)
        return serving

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(a) for a in self.addresses))

    async def check_lost(self, address: str, timeout_s: float = 1.0) -> None:
        """A connection to `address` that was up is gone: ask at once, failing fast. Refused
        (UNAVAILABLE) is a dead process: down and lost now. No answer in time is no verdict."""
        try:
            await self._health[address].Check(
                health_pb2.HealthCheckRequest(service=CODE2WAV_SERVICE), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                return
            self._lost.add(address)
            was_on = address in self._ring
            self.mark_down(address, "its connection was lost and a new one is refused")
            if not was_on and not len(self._ring) and self._on_availability is not None:
                self._on_availability(False)  # already off the ring: now known dead
            return
        await self.check(address)  # it answered on a new connection (a restart, a GOAWAY)

    async def _watch(self, address: str) -> None:
        """Follow `address`'s channel: a lost connection is checked at once (`check_lost`), a
        connection back up is checked at once (a restarted replica returns without waiting
        for the next round)."""
        channel = self._channels[address]
        ready = grpc.ChannelConnectivity.READY
        try:
            state = channel.get_state(try_to_connect=True)
            while True:
                await channel.wait_for_state_change(state)
                was, state = state, channel.get_state(try_to_connect=False)
                try:
                    if was == ready and state != ready:
                        await self.check_lost(address)
                    elif state == ready and address not in self._ring:
                        await self.check(address)
                except Exception:  # noqa: BLE001 - the watch must outlive any single check
                    log.exception("code2wav replica %s: connectivity check failed", address)
        except Exception:  # noqa: BLE001 - a channel without connectivity (a test's fake)
            log.warning("code2wav replica %s: its connectivity cannot be watched", address)

    def start(self) -> None:
        """Start the periodic health checks and the connectivity watches."""
        if self._task is None:
            self._task = asyncio.create_task(self._health_loop(), name="code2wav-health")
            self._watchers = [
                asyncio.create_task(self._watch(a), name=f"code2wav-watch-{a}") for a in self.addresses
            ]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the loop must outlive any single failure
                log.exception("code2wav health check round failed")

    async def close(self) -> None:
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        for task in [*self._watchers, *([self._task] if self._task is not None else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task, self._watchers = None, []
        for session in self._sessions.values():
            await session.close()
        await asyncio.gather(*(ch.close() for ch in self._channels.values()))
