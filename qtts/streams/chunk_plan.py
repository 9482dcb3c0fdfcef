"""How many frames each audio chunk of a stream decodes: a small first chunk, then a ramp.

code2wav decodes by this plan; the talker gets the plan of each stream in the first credit grant
and sends frames in whole chunks (`end_at_or_below`), since a partial chunk cannot be decoded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_FIRST_CHUNK_FRAMES = 4
DEFAULT_CHUNK_RAMP = (4, 4, 8, 8, 16)


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

    def __post_init__(self) -> None:
        if self.first < 1 or not self.ramp or min(self.ramp) < 1:
            raise ValueError(
                f"chunk sizes must be >= 1 and the ramp non-empty, got {self.first}, {self.ramp}"
            )

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
        return ChunkPlan(min(self.first, limit), tuple(min(r, limit) for r in self.ramp))

    @classmethod
    def from_request(cls, first: int, ramp: Sequence[int], default: ChunkPlan) -> ChunkPlan:
        """A client's plan, where 0 / empty mean the server default."""
        return cls(first or default.first, tuple(ramp) or default.ramp)

    def end_after(self, frames: int) -> int:
        """The first chunk boundary (cumulative frames) above `frames`."""
        end = self.first
        if end > frames:
            return end
        for size in self.ramp[:-1]:
            end += size
            if end > frames:
                return end
        last = self.ramp[-1]
        return end + ((frames - end) // last + 1) * last

    def end_at_or_below(self, frames: int) -> int:
        """The last chunk boundary at or below `frames` (0 when the first chunk is not complete)."""
        end = self.first
        if end > frames:
            return 0
        for size in self.ramp[:-1]:
            if end + size > frames:
                return end
            end += size
        last = self.ramp[-1]
        return end + ((frames - end) // last) * last

    def split(self, total_frames: int) -> list[int]:
        """Chunk sizes for a stream of `total_frames` frames (the last one holds the remainder)."""
        sizes: list[int] = []
        left = total_frames
        while left > 0:
            n = min(self.size(len(sizes)), left)
            sizes.append(n)
            left -= n
        return sizes
