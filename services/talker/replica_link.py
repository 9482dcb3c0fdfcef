"""One stream's Decode call on a code2wav replica of the ring, for `StreamSession`: opening it
(moving past replicas that are down), its events into the stream's queue, the stall clock (the
loop time of the last message either way), and its end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qtts.request.errors import TTSError, Unavailable

from . import code2wav_client as c2w
from .replicas import Code2WavReplicas


class StallCheck:
    """Queued by the stall timer: time to look whether the replica still answers."""


STALL_CHECK = StallCheck()


class ReplicaLink:
    """The Decode call of one request; `put` queues its events (and `STALL_CHECK`) for the stream."""

    def __init__(
        self,
        request_id: str,
        replicas: Code2WavReplicas,
        put: Callable[[Any], None],
        num_codebooks: int,
        ref_codes: np.ndarray | None,
        stall_timeout_s: float = 0.0,
    ):
        self.request_id = request_id
        self.replicas = replicas
        self._put = put
        self._num_codebooks = num_codebooks
        self._ref_codes = ref_codes
        self.stall_timeout_s = stall_timeout_s
        self._loop = asyncio.get_running_loop()
        self._plan: tuple[int, Sequence[int]] = (0, ())
        self.call: Any = None  # c2w.DecodeCall or decode_session.SessionDecodeCall
        self._reader: asyncio.Task | None = None
        self._tried: set[str] = set()
        self.heard = False  # the replica answered (a grant or audio)
        self.exchanged_at = 0.0
        self._stall_timer: asyncio.TimerHandle | None = None

    @property
    def replica(self) -> str:
        return self.call.replica if self.call is not None else ""

    def touch(self) -> None:
        """A message passed on the call: the stall clock starts again."""
        self.exchanged_at = self._loop.time()

    async def open(self, first_chunk_frames: int, chunk_frames_ramp: Sequence[int]) -> None:
        """Open the Decode call on the ring's replica for this request and send StreamStart."""
        self._plan = (first_chunk_frames, tuple(chunk_frames_ramp))
        while True:
            replica = await self.replicas.pick_or_probe(self.request_id, exclude=frozenset(self._tried))
            self._tried.add(replica)
            open_call = getattr(self.replicas, "open_call", None)
            call = (
                open_call(replica)
                if open_call is not None
                else c2w.DecodeCall(
                    self.replicas.stub(replica), replica, getattr(self.replicas, "on_decoder_cost", None)
                )
            )
            try:
                await call.start(self.request_id, self._num_codebooks, self._ref_codes, *self._plan)
            except Unavailable as exc:
                call.cancel()
                self.replicas.mark_down(replica, exc.message)
                continue
            except TTSError:
                # The replica answered with a status of its own (e.g. RESOURCE_EXHAUSTED at its
                # state bound): not a dead replica; the request fails with that status.
                call.cancel()
                raise
            self.call = call
            self.touch()
            self._reader = asyncio.create_task(self._pump(call), name=f"decode-{self.request_id}")
            return

    async def _pump(self, call: c2w.DecodeCall) -> None:
        async for ev in call.events():
            self.touch()
            self._put(ev)

    async def reopen_elsewhere(self) -> None:
        """Open the Decode call on the next replica of the ring (Unavailable when none is left)."""
        await self.close(cancel=True)
        await self.open(*self._plan)

    async def close(self, cancel: bool) -> None:
        """Stop reading the call (and cancel it, freeing the replica's state, with `cancel`)."""
        if self.call is not None and cancel:
            self.call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._reader = None

    def watch_stall(self, waiting: bool) -> None:
        """Arm the stall timer while the stream is `waiting` on its replica (unless off or armed)."""
        if self.stall_timeout_s > 0 and self._stall_timer is None and waiting:
            self._stall_timer = self._loop.call_at(
                self.exchanged_at + self.stall_timeout_s, self._put, STALL_CHECK
            )

    def stall_fired(self) -> float:
        """The stall timer went off: seconds since the last message on the call."""
        self._stall_timer = None
        return self._loop.time() - self.exchanged_at

    def stop_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
