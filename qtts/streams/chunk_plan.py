"""How many frames each audio chunk of a stream decodes: a small first chunk, then a ramp.

code2wav decodes by this plan; the talker gets the plan of each stream in the first credit grant
and sends frames in whole chunks (`end_at_or_below`), since a partial chunk cannot be decoded.

The default starts with one frame (as vLLM-Omni's `initial_codec_chunk_frames` and Nari Labs' ttfa
profile do): the prefill step makes it, so first audio waits for no frame step at all. The ramp then
grows so that each chunk needs its frames at most 1.5x faster than real time
(`required_speedup`): frame steps up to 53 ms keep every chunk ahead of the listener, about what
the 4-frame start allowed (1.43x, 56 ms). The ramp ends in 16 frames, a captured decode shape.

Under load the one-frame start costs more than it gives: a young stream has 80 ms of audio
buffered, so its second chunk must beat any long step or slow decode, and the talker budgets each
step's prefill from the tightest stream's slack, so many young streams make the prefills crawl.
On the talker tests' simulated clock, 512 streams starting at once heard first audio after 5.1 s
at the median instead of 2.4 s, with gaps; an open loop of 100 requests/s with one-frame starts
(H100-like costs, mixed 2-20 s lengths) backed up to a p95 first audio of 0.8 s.

So a busy talker (`StartPolicy`: 4 streams starting, or 64 generating) asks for the 2-frame start
(`STEADY_PLAN`, its ramp no steeper than the 4-frame start's: 1.43x real time): 160 ms buffered,
one frame step more than the one-frame start. A burst (32 streams starting at once) asks for the
4-frame start (`BURST_PLAN`). Until 5737c78 the 4-frame start began at 4 starting or 128
generating, which an open loop of 100 requests/s always is: its first audio waited three frame
steps after the prefill (H100, d99e487: p95 184 ms). On the simulated clock the 2-frame start
for the steady load took the p95 from 116 to 97 ms at 100 requests/s and from 161 to 134 ms at
150, without gaps. Small starts are taken only while the talker's recent steps and trips
through code2wav keep their early chunks on time (`StartPlanner`).

A heavily loaded talker asks for an 8-frame start (`HEAVY_PLAN`). On one H200 at a82a653, with
prompt builds no longer holding admission back, 768 and 1,024 closed-loop streams (the 4-frame
start for all) heard gaps in 22% and 76% of the streams, and the talker's late-chunk log named
the early chunks: the chunk ending at frame 8 arrived 75-250 ms late, its 4 frames generated in
155-212 ms (steps of ~50 ms among a burst's prefills) and decoded after a ~200 ms trip through
code2wav, against 320 ms of audio buffered. 8 frames buffer 640 ms, the hop and the next chunk's
generation together."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qtts.request.vocabulary import NATIVE_SAMPLE_RATE, SAMPLES_PER_FRAME

DEFAULT_FIRST_CHUNK_FRAMES = 1
DEFAULT_CHUNK_RAMP = (1, 2, 2, 4, 4, 8, 8, 16)
# A busy talker's plan (`StartPolicy`): this many streams starting (submitted, no first audio yet)
# or this many generating (or waiting to) make it busy. Its ramp needs at most 1.43x real time.
STEADY_FIRST_CHUNK_FRAMES = 2
STEADY_CHUNK_RAMP = (2, 2, 4, 4, 8, 8, 8, 16)
BUSY_STARTING = 4
BUSY_STREAMS = 64
# A burst's plan: this many streams starting at once.
BURST_FIRST_CHUNK_FRAMES = 4
BURST_CHUNK_RAMP = (4, 4, 8, 8, 16)
BURST_STARTING = 32
# A heavily loaded talker's plan: this many generating (or waiting to).
HEAVY_FIRST_CHUNK_FRAMES = 8
HEAVY_CHUNK_RAMP = (8, 16)
HEAVY_STREAMS = 384


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk sizes in frames: `first`, then `ramp[0]`, `ramp[1]`, ..., the last value repeating.

    A tiny first chunk starts audio fast; growing chunks amortise decode cost once the listener
    has a buffer (each chunk arrives while the previous one is still playing). The default ramp ends
    in one repeating size that is a captured decode shape, so the chunks of streams in steady state
    all have one length and share one graph step.
    """

    first: int = DEFAULT_FIRST_CHUNK_FRAMES
    ramp: tuple[int, ...] = DEFAULT_CHUNK_RAMP
    # The frame the first chunk starts at: 0, or where a flush cut the stream's chunks (`flushed`).
    start: int = 0

    def __post_init__(self) -> None:
        if self.first < 1 or not self.ramp or min(self.ramp) < 1:
            raise ValueError(
                f"chunk sizes must be >= 1 and the ramp non-empty, got {self.first}, {self.ramp}"
            )
        if self.start < 0:
            raise ValueError(f"a plan starts at frame >= 0, got {self.start}")

    def size(self, chunk_index: int) -> int:
        """Frames in chunk number `chunk_index` (0 = the first chunk)."""
        if chunk_index == 0:
            return self.first
        return self.ramp[min(chunk_index - 1, len(self.ramp) - 1)]

    @property
    def largest(self) -> int:
        return max(self.first, *self.ramp)

    def capped(self, limit: int) -> ChunkPlan:
        """The same plan with every size at most `limit` (a chunk must fit in the credit window)."""
        return ChunkPlan(min(self.first, limit), tuple(min(r, limit) for r in self.ramp), self.start)

    def flushed(self, at: int) -> ChunkPlan:
        """The plan after a flush at frame `at` (>= `start`): the frames since the last chunk
        boundary are decoded now as a chunk of their own, which takes that chunk's place in the
        ramp, and the chunk after it, of the size that follows, starts at `at`. On a boundary
        nothing is cut: the plan is unchanged. code2wav counts chunks the same way
        (services/code2wav/stream.py: a flushed chunk moves its chunk index on by one)."""
        if at < self.start:
            raise ValueError(f"a flush at frame {at} is before the plan's start {self.start}")
        end, k = self.start, 0
        while end + self.size(k) <= at:
            end += self.size(k)
            k += 1
        if end == at:
            return self
        # Chunk k is the flushed one; the rest of the plan is chunk k + 1 on.
        nxt = k + 1
        return ChunkPlan(self.size(nxt), self.ramp[min(nxt, len(self.ramp) - 1) :], at)

    @classmethod
    def from_request(cls, first: int, ramp: Sequence[int], default: ChunkPlan) -> ChunkPlan:
        """A client's plan, where 0 / empty mean the server default."""
        return cls(first or default.first, tuple(ramp) or default.ramp)

    def end_after(self, frames: int) -> int:
        """The first chunk boundary (cumulative frames) above `frames`."""
        frames -= self.start
        end = self.first
        if end > frames:
            return self.start + end
        for size in self.ramp[:-1]:
            end += size
            if end > frames:
                return self.start + end
        last = self.ramp[-1]
        return self.start + end + ((frames - end) // last + 1) * last

    def end_at_or_below(self, frames: int) -> int:
        """The last chunk boundary at or below `frames` (`start`, 0 unless flushed, when the first
        chunk is not complete)."""
        frames -= self.start
        end = self.first
        if end > frames:
            return self.start
        for size in self.ramp[:-1]:
            if end + size > frames:
                return self.start + end
            end += size
        last = self.ramp[-1]
        return self.start + end + ((frames - end) // last) * last

    def required_speedup(self) -> float:
        """How much faster than real time the talker must make frames for every chunk to arrive
        before the listener has played all the audio before it.

        Playback starts when the first chunk arrives, after `first` frames were made; chunk k+1
        is due when the audio of chunks 0..k has played, so its frames beyond the first chunk's,
        S(k+1) - first, must be made in S(k) frames of playback time (S = cumulative frames; a
        constant hop through code2wav delays every chunk alike). The worst k is among the ramp's
        chunks and the first repeat of its last size: after that the ratio only falls (or, for a
        last size below `first`, rises towards real time, 1.0, which no plan can go below)."""
        worst, done = 1.0, self.first
        for k in range(1, len(self.ramp) + 2):
            nxt = done + self.size(k)
            worst = max(worst, (nxt - self.first) / done)
            done = nxt
        return worst

    def split(self, total_frames: int) -> list[int]:
        """Chunk sizes for a stream of `total_frames` frames (the last one holds the remainder)."""
        sizes: list[int] = []
        left = total_frames
        while left > 0:
            n = min(self.size(len(sizes)), left)
            sizes.append(n)
            left -= n
        return sizes


STEADY_PLAN = ChunkPlan(STEADY_FIRST_CHUNK_FRAMES, STEADY_CHUNK_RAMP)
BURST_PLAN = ChunkPlan(BURST_FIRST_CHUNK_FRAMES, BURST_CHUNK_RAMP)
HEAVY_PLAN = ChunkPlan(HEAVY_FIRST_CHUNK_FRAMES, HEAVY_CHUNK_RAMP)


@dataclass(frozen=True)
class StartPolicy:
    """Which first chunk a new stream asks for, by how busy the talker is: the talker's
    `--start-plan-*` flags. 0 turns a threshold off."""

    busy_starting: int = BUSY_STARTING  # streams without first audio yet: the 2-frame start
    busy_streams: int = BUSY_STREAMS  # streams generating or waiting to: the 2-frame start
    burst_starting: int = BURST_STARTING  # streams without first audio yet: the 4-frame start
    heavy_streams: int = HEAVY_STREAMS  # streams generating or waiting to: the 8-frame start

    def __post_init__(self) -> None:
        if min(self.busy_starting, self.busy_streams, self.burst_starting, self.heavy_streams) < 0:
            raise ValueError("start plan thresholds must be >= 0")

    def plan(self, starting: int, streams: int) -> ChunkPlan | None:
        """The plan a new stream asks for when `starting` other streams have no first audio yet
        and `streams` are generating or waiting to: None (the decoder's default, a one-frame
        start) on a light talker, `STEADY_PLAN` on a busy one, `BURST_PLAN` in a burst,
        `HEAVY_PLAN` on a heavily loaded one."""
        if self.heavy_streams and streams >= self.heavy_streams:
            return HEAVY_PLAN
        if self.burst_starting and starting >= self.burst_starting:
            return BURST_PLAN
        if (self.busy_starting and starting >= self.busy_starting) or (
            self.busy_streams and streams >= self.busy_streams
        ):
            return STEADY_PLAN
        return None


DEFAULT_START_POLICY = StartPolicy()

FRAME_S = SAMPLES_PER_FRAME / NATIVE_SAMPLE_RATE  # 80 ms


class StartPlanner:
    """`StartPolicy` by the counts, then checked against the talker's recent frame steps and trips
    through code2wav: a small start (one frame, or `STEADY_PLAN`'s two) is taken only while the
    steps and hops keep its early chunks ahead of the listener with `margin` to spare, and gives
    way to the next larger one otherwise (`BURST_PLAN` the last).

    A small start fits when the steps are fast enough for its ramp (`required_speedup` x step <=
    a frame / margin) and its first chunk's audio covers the next chunk's frame steps and hop
    (size(1) x step + hop <= first x frame / margin). Steps and hops are the 90th percentile of the
    last `window` seen, each step once (the chunks one step hands on share its `step_s`; counted
    per chunk, one step of 300 streams filled the window). On the talker tests' simulated clock
    (test_capacity: 26 requests/s beside a decoder, steps of ~30 ms, trips of 40-60 ms), the
    2-frame start by the counts alone gapped in 48 of 562 admitted streams; with this check at a
    margin of 1.25, in 2; at 1.6 and 1.75 in none, the open loop's first audio unchanged. The
    plan is chosen when the request arrives, and a queued one starts later, under whatever load
    is then: hence the margin, and no small start for a request that arrives behind a backlog
    (`backlog`: requests submitted at least `BACKLOG_AGE_S` ago and not yet admitted). Over 24
    seeds of that clock's overload test (26 requests/s, the talker's default coalescing), the
    backlog rule took the admitted streams that gapped from 27 of 13,615 (8 seeds; up to 17 ms)
    to 21 of 13,641 (3 seeds; up to 12 ms); the gaps it removes are 2-frame starts chosen while
    the steps were fast and taken up 0.9-1.7 s later beside steps of 80 ms. An 8-frame start for
    steps too slow for the 4-frame ramp as well took it to 7, but a text-streamed request whose
    first piece made fewer than 8 frames then heard nothing until its next piece, and a CPU's
    slow steps chose it: not taken.
    Not thread-safe: the talker's event loop owns it."""

    # A request submitted this long ago and not admitted is queued, not just between two plans
    # of the scheduler (a step of the talker is 5-30 ms; a backlog holds requests for seconds).
    BACKLOG_AGE_S = 0.05

    @classmethod
    def backlog(cls, queued_at: Iterable[float], now: float) -> int:
        """How many of the requests queued at `queued_at` (oldest first, one clock with `now`)
        have waited `BACKLOG_AGE_S` or longer: the queue's head, so no backlog costs one look."""
        before = now - cls.BACKLOG_AGE_S
        return sum(1 for _ in itertools.takewhile(lambda at: at <= before, queued_at))

    # The trips it hears: each stream's first this many chunks (`trip_chunks`; 0: every chunk).
    # code2wav decodes a chunk with little audio ahead of it at once and holds later ones, far
    # ahead of their listeners, for wider calls: on an H100 at 100-150 requests/s a first chunk's
    # trip had p90 75-100 ms, all chunks' about 150 ms, and counted over all chunks the check
    # moved half the starts to 4 frames (HISTORY.md, third session of 2026-12-06).
    TRIP_CHUNKS = 3

    def __init__(
        self,
        policy: StartPolicy = DEFAULT_START_POLICY,
        window: int = 256,
        margin: float = 1.6,
        trip_chunks: int = TRIP_CHUNKS,
    ):
        if window < 1 or margin < 1 or trip_chunks < 0:
            raise ValueError("window must be >= 1, margin >= 1 and trip_chunks >= 0")
        self.policy = policy
        self.margin = margin
        self.trip_chunks = trip_chunks
        self._steps: deque[float] = deque(maxlen=window)
        self._last_step_s = 0.0
        self._hops: deque[float] = deque(maxlen=window)
        # Why the last `plan` chose as it did: "counts" (the policy's choice), "timing" (moved up
        # by the steps and hops) or "backlog" (moved up: the request arrives behind a queue).
        self.why = "counts"
        # The smaller starts the last `plan` checked and turned down, each with the bound it
        # failed: (first frames, "ramp" (steps too slow for its ramp) or "trip" (its first
        # chunk's audio does not cover the next chunk's steps and trip through code2wav)).
        self.misfits: list[tuple[int, str]] = []

    @property
    def moved(self) -> bool:
        """Whether the last `plan` moved the counts' choice up (the timing or a backlog)."""
        return self.why != "counts"

    def observe_step(self, seconds: float) -> None:
        """A frame step (prefill included) took `seconds`: the `step_s` of a chunk handed on. The
        chunks of one step come one after another with the same figure, and count once."""
        if seconds > 0 and math.isfinite(seconds) and seconds != self._last_step_s:
            self._last_step_s = seconds
            self._steps.append(seconds)

    def observe_hop(self, seconds: float) -> None:
        """A young stream's chunk's trip through code2wav (sent to audio back) took `seconds`
        (the talker feeds each stream's first `trip_chunks` chunks: `ChunkHops`)."""
        if seconds >= 0 and math.isfinite(seconds):
            self._hops.append(seconds)

    def plan(self, starting: int, streams: int, backlog: int = 0) -> ChunkPlan | None:
        """The plan for a new stream when `starting` streams have no first audio yet, `streams`
        generate or wait to, and `backlog` of those have queued for `BACKLOG_AGE_S` or longer."""
        self.why, self.misfits = "counts", []
        chosen = self.policy.plan(starting, streams)
        if chosen is not None and chosen != STEADY_PLAN:
            return chosen
        ladder: tuple[ChunkPlan | None, ...] = (None, STEADY_PLAN) if chosen is None else (STEADY_PLAN,)
        why = "timing"
        if backlog > 0:  # it starts later, under whatever load is then: no small start
            ladder, why = (), "backlog"
        elif not self._steps:
            return chosen
        step = _p90(self._steps) if self._steps else 0.0
        hop = _p90(self._hops) if self._hops else 0.0
        for candidate in ladder:
            plan = candidate or ChunkPlan()
            if (bound := self._misfit(plan, step, hop)) is None:
                self.why = why if candidate != chosen else "counts"
                return candidate
            self.misfits.append((plan.first, bound))
        self.why = why
        return BURST_PLAN

    def _misfit(self, plan: ChunkPlan, step_s: float, hop_s: float) -> str | None:
        """The bound `plan` fails at these steps and trips ("ramp" checked first, then "trip"),
        or None when it fits."""
        budget_s = FRAME_S / self.margin
        if plan.required_speedup() * step_s > budget_s:
            return "ramp"
        if plan.size(1) * step_s + hop_s > plan.first * budget_s:
            return "trip"
        return None


def _p90(values: deque[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
