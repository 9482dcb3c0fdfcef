"""Plans a batch of ready decode work as shape-static steps (pure Python, no torch).

Input: one `WorkItem` per stream (its stage-local stream id and how many new frames it has).
Output: an ordered list of `Step`s, each one decode call over a fixed (batch size, chunk frames):

- A chunk is cut into pieces no longer than `max_chunk_frames` (the attention window), and, when
  `split_to_captured` is set, into the captured chunk sizes (greedy, largest first), so that a
  5-frame chunk runs as two graph replays (4 + 1) instead of one slow eager call. Splitting is exact:
  the stream's state carries from one piece to the next.
- Piece k of every stream runs in round k; a stream's pieces are therefore decoded in order.
- Within a round, pieces of equal length form a group (the phase of the stream does not matter:
  the ring KV window makes a growing and a sliding-window stream the same shape). A group becomes
  one or more steps padded up to a captured batch size; `max_step_frames` bounds batch x frames.
  Padding is accepted when it is a small share of the step, or when the padded rows x frames are
  few enough to cost less than the launch floor of the extra step a split would take.
- Steps holding a stream's first audio go first in their round (they decide time to first audio).

Rows are identified by stream id, never by their index in the caller's list, so a skipped or empty
row earlier in the batch can not shift anyone's output or state.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

# Accept padding up to this share of a bucket before splitting a group into smaller steps.
_MAX_PAD_SHARE = 0.25


@dataclass(frozen=True)
class WorkItem:
    """`frames` new frames of stream `stream_id`; `first` marks the stream's first audio."""

    stream_id: int
    frames: int
    first: bool = False


@dataclass(frozen=True)
class Row:
    """Frames [offset, offset + frames) of a stream's chunk, decoded in one step row."""

    stream_id: int
    offset: int


@dataclass(frozen=True)
class Step:
    """One decode call: `rows` real rows, padded to `batch`; `captured` = a CUDA graph exists."""

    round: int
    frames: int
    batch: int
    rows: tuple[Row, ...]
    captured: bool
    first: bool = False

    @property
    def padding(self) -> int:
        return self.batch - len(self.rows)


@dataclass(frozen=True)
class PlannerConfig:
    """Captured shapes and limits; validated on construction."""

    chunk_sizes: tuple[int, ...] = ()  # captured chunk lengths in frames (empty: nothing captured)
    batch_sizes: tuple[int, ...] = ()  # captured batch sizes
    max_chunk_frames: int = 72
    max_step_frames: int = 3200
    split_to_captured: bool = True
    # Padding rows x frames always accepted rather than split off into one more step.
    max_pad_frames: int = 64

    def __post_init__(self) -> None:
        if self.max_chunk_frames < 1 or self.max_step_frames < 1:
            raise ValueError("max_chunk_frames and max_step_frames must be >= 1")
        if self.max_pad_frames < 0:
            raise ValueError("max_pad_frames must be >= 0")
        for name in ("chunk_sizes", "batch_sizes"):
            values = getattr(self, name)
            if any(v < 1 for v in values) or len(set(values)) != len(values):
                raise ValueError(f"{name} must be distinct positive integers, got {values}")
        if any(c > self.max_chunk_frames for c in self.chunk_sizes):
            raise ValueError(f"captured chunk sizes must be <= {self.max_chunk_frames} frames")
        object.__setattr__(self, "chunk_sizes", tuple(sorted(self.chunk_sizes)))
        object.__setattr__(self, "batch_sizes", tuple(sorted(self.batch_sizes)))

    @property
    def captures_anything(self) -> bool:
        return bool(self.chunk_sizes) and bool(self.batch_sizes)


@dataclass
class BatchPlanner:
    """Turns ready work into ordered static-shape steps."""

    config: PlannerConfig = field(default_factory=PlannerConfig)

    def pieces(self, frames: int) -> list[int]:
        """How a chunk of `frames` frames is cut (captured sizes when allowed, else window-sized)."""
        cfg = self.config
        out: list[int] = []
        left = frames
        sizes = cfg.chunk_sizes if (cfg.split_to_captured and cfg.captures_anything) else ()
        while left > 0:
            if left in sizes or not sizes:
                n = min(left, cfg.max_chunk_frames)
            else:
                i = bisect.bisect_right(sizes, left) - 1
                # No captured size fits: decode the rest eagerly in one piece.
                n = sizes[i] if i >= 0 else min(left, cfg.max_chunk_frames)
            out.append(n)
            left -= n
        return out

    def plan(self, items: Iterable[WorkItem]) -> list[Step]:
        items = list(items)
        ids = [it.stream_id for it in items]
        if len(set(ids)) != len(ids):
            raise ValueError("a stream appears twice in one batch")
        if any(it.frames < 0 for it in items):
            raise ValueError("a work item has a negative frame count")
        cuts = {it.stream_id: self.pieces(it.frames) for it in items if it.frames > 0}
        first = {it.stream_id for it in items if it.first}
        steps: list[Step] = []
        rounds = max((len(c) for c in cuts.values()), default=0)
        for r in range(rounds):
            groups: dict[int, list[Row]] = {}
            for it in items:
                cut = cuts.get(it.stream_id)
                if cut is None or len(cut) <= r:
                    continue
                groups.setdefault(cut[r], []).append(Row(it.stream_id, sum(cut[:r])))
            round_steps: list[Step] = []
            for frames, rows in groups.items():
                # First-audio rows lead their group so they land in its first step.
                rows.sort(key=lambda row: row.stream_id not in first)
                round_steps.extend(self._group_steps(r, frames, rows, first))
            round_steps.sort(key=lambda s: (not s.first, s.frames))
            steps.extend(round_steps)
        return steps

    def _group_steps(self, rnd: int, frames: int, rows: list[Row], first: set[int]) -> list[Step]:
        cfg = self.config
        limit = max(1, cfg.max_step_frames // frames)
        captured = frames in cfg.chunk_sizes and cfg.captures_anything
        buckets = [b for b in cfg.batch_sizes if b <= limit] if captured else []
        steps: list[Step] = []
        i = 0
        while i < len(rows):
            left = len(rows) - i
            if not buckets:
                take, batch, graph = min(left, limit), min(left, limit), False
            else:
                up = next((b for b in buckets if b >= left), None)
                pad = None if up is None else up - left
                if pad is not None and (pad <= _MAX_PAD_SHARE * up or pad * frames <= cfg.max_pad_frames):
                    take, batch = left, up
                else:
                    down = [b for b in buckets if b <= left]
                    if down:
                        take = batch = down[-1]
                    else:  # fewer rows than the smallest bucket
                        take, batch = left, up
                graph = True
            chunk = tuple(rows[i : i + take])
            steps.append(
                Step(rnd, frames, batch, chunk, graph, first=any(r.stream_id in first for r in chunk))
            )
            i += take
        return steps


class PieceCollector(Generic[T]):
    """Collects step outputs per stream id, in decode order (the caller concatenates them)."""

    def __init__(self) -> None:
        self._pieces: dict[int, list[T]] = {}

    def add(self, step: Step, outputs: Sequence[T]) -> None:
        """`outputs[i]` is what row i of `step` produced; padding rows are not passed."""
        if len(outputs) != len(step.rows):
            raise ValueError(f"step has {len(step.rows)} rows but {len(outputs)} outputs")
        for row, out in zip(step.rows, outputs, strict=True):
            self._pieces.setdefault(row.stream_id, []).append(out)

    def pieces(self) -> Mapping[int, list[T]]:
        return self._pieces

    def get(self, stream_id: int) -> list[T]:
        return self._pieces.get(stream_id, [])
