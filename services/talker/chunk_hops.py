"""Where each chunk of one stream spends its time on the talker, per hop, and how the listener
fared: the talker's tts_talker_chunk_hop_seconds, tts_talker_first_chunk_hop_seconds,
deadline slack and underrun metrics.

Times are `time.perf_counter`: when the engine made a chunk's last frame and the stream's task got
it (`made`), when the task sent the chunk to code2wav (`sent`), when its audio came back and was
taken by the caller (`handed_on`). code2wav says how long it held each chunk (its wait for a decode
call and the call, AudioOut.held_ns): the rest of the code2wav hop is the chunk's transit, the
frames' trip there and the audio's trip back through both event loops
(tts_talker_code2wav_transit_seconds). Of the transit, the audio's wait on this side, from its
message read off the call to the stream's task taking it, is the talker's own
(tts_talker_code2wav_audio_queued_seconds); a late chunk's log line splits the hop so."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class ChunkHops:
    """One stream's chunk timing; `metrics` None records nothing. `on_code2wav_hop` hears the
    trips through code2wav of the stream's first `early_chunks` chunks (0: of every chunk): the
    start planner's (`StartPlanner.trip_chunks`)."""

    def __init__(
        self,
        request_id: str,
        metrics: Any = None,
        on_code2wav_hop: Callable[[float], None] | None = None,
        early_chunks: int = 0,
    ):
        self.request_id = request_id
        self._metrics = metrics
        self._on_code2wav_hop = on_code2wav_hop  # an early chunk's trip through code2wav, seconds
        self._early_left: float = early_chunks or math.inf  # trips still to report
        self._made_at: dict[int, tuple[float, float]] = {}  # end frame -> (made, received)
        self._sent_at: dict[int, float] = {}  # end frame -> sent to code2wav
        self._handed_at = 0.0  # the last hand-on (at first: the submission to the engine)

    def submitted(self) -> None:
        """The request went to the engine: the first chunk's hops count from now."""
        self._handed_at = time.perf_counter()

    def made(self, end_frame: int, made_at: float) -> None:
        """Frames up to `end_frame` were made by the engine at `made_at` and reached the task now."""
        self._made_at[end_frame] = (made_at, time.perf_counter())

    def sent(self, end_frame: int) -> None:
        self._sent_at[end_frame] = time.perf_counter()
        # Frames handed on within the chunk end no chunk (a text-fed stream's come one at a time);
        # the ends of chunks sent before it wait for their audio.
        for frame in [f for f in self._made_at if f < end_frame and f not in self._sent_at]:
            del self._made_at[frame]

    def first_chunk(
        self, end_frame: int, arrived: float, now: float, held_s: float = 0.0, received_at: float = 0.0
    ) -> None:
        """The first chunk apart: its "generate" hop runs from submission (queue, prefill and its
        frames), and first audio is the sum of its hops. `held_s`: how long code2wav held it (0:
        not said); `received_at`: when its audio was read off the call (0: not stamped)."""
        hops = self._hops(end_frame, arrived, now)
        self._transit(hops, held_s, arrived, received_at)
        if self._metrics is not None:
            for hop, seconds in hops.items():
                self._metrics.first_chunk_hop_seconds.labels(hop).observe(max(seconds, 0.0))
        self._handed_at = now

    def chunk(
        self,
        end_frame: int,
        arrived: float,
        now: float,
        slack_s: float,
        held_s: float = 0.0,
        received_at: float = 0.0,
    ) -> None:
        """A later chunk handed on with `slack_s` of audio still buffered (below 0: a gap);
        `held_s`: how long code2wav held it (0: not said); `received_at`: when its audio was read
        off the call (0: not stamped)."""
        hops = self._hops(end_frame, arrived, now)
        transit, queued = self._transit(hops, held_s, arrived, received_at)
        self._handed_at = now
        if self._metrics is None:
            return
        self._metrics.deadline_slack_seconds.observe(slack_s)
        for hop, seconds in hops.items():
            self._metrics.chunk_hop_seconds.labels(hop).observe(max(seconds, 0.0))
        if slack_s < 0:
            self._metrics.underruns_total.inc()
            split = (
                ""
                if transit is None
                else f" (held there {held_s * 1e3:.0f} ms, in transit {transit * 1e3:.0f} ms"
                + ("" if queued is None else f", queued here {queued * 1e3:.0f} ms")
                + ")"
            )
            log.info(
                "request %s: audio up to frame %d handed on %.0f ms late; %s",
                self.request_id,
                end_frame,
                -slack_s * 1e3,
                ", ".join(
                    f"{hop} {seconds * 1e3:.0f} ms" + (split if hop == "code2wav" else "")
                    for hop, seconds in hops.items()
                ),
            )

    def _transit(
        self, hops: dict[str, float], held_s: float, arrived: float, received_at: float
    ) -> tuple[float | None, float | None]:
        """The chunk's code2wav hop less the time code2wav held it, and of it the audio's wait
        on this side (from `received_at` to `arrived`), each observed (None: not known)."""
        if "code2wav" not in hops:
            return None, None
        queued = None
        if received_at > 0:
            queued = max(arrived - received_at, 0.0)
            if self._metrics is not None:
                self._metrics.code2wav_audio_queued_seconds.observe(queued)
        if held_s <= 0:
            return None, queued
        transit = max(hops["code2wav"] - held_s, 0.0)
        if self._metrics is not None:
            self._metrics.code2wav_transit_seconds.observe(transit)
        return transit, queued

    def restarted(self, now: float) -> None:
        """The playback clock restarted (the listener waited for text): no hops to judge."""
        self._handed_at = now

    def _hops(self, end_frame: int, arrived: float, now: float) -> dict[str, float]:
        """The time of the chunk ending at `end_frame` per hop (empty when it is not known)."""
        made = self._made_at.pop(end_frame, None)
        sent = self._sent_at.pop(end_frame, None)
        if made is None or sent is None or not arrived:
            return {}
        made_at, received_at = made
        if self._on_code2wav_hop is not None and self._early_left > 0:
            self._early_left -= 1
            self._on_code2wav_hop(arrived - sent)
        return {
            "generate": made_at - self._handed_at,
            "engine_to_loop": received_at - made_at,
            "to_code2wav": sent - received_at,
            "code2wav": arrived - sent,
            "to_gateway": now - arrived,
        }
