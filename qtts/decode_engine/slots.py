"""A preallocated pool of per-stream decoder states with static shapes.

Every piece of a stream's history (each causal conv's input history, each transposed conv's
carried input frames, each attention layer's key/value window) is one row of a tensor shaped
`[capacity + 1, *per_slot_shape]`, allocated once. A decode step names its streams by slot index,
so a step over a fixed batch size and chunk size touches tensors of fixed shapes and can be captured
in a CUDA graph. The extra last row is the padding slot: rows that only pad a batch up to a captured
size read and write it, and nobody reads what they leave there.

The attention window is a ring: position p lives in column p % window, so a step writes only its new
keys; which columns hold valid positions follows from the stream's position alone (see runner.py).

The pool is also the hard bound on live streams: `allocate` fails with `SlotPoolFull` (a
`ResourceExhausted`, i.e. RESOURCE_EXHAUSTED / HTTP 429) when every slot is taken.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qtts.request.errors import ResourceExhausted


class SlotPoolFull(ResourceExhausted):
    """Every decoder slot is in use; the stream must be rejected or retried later."""


class SlotPool:
    """Fixed-capacity per-stream decoder state; slot `capacity` is the padding slot."""

    def __init__(
        self,
        layout: Mapping[str, tuple[int, ...]],
        capacity: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if capacity < 1:
            raise ValueError(f"slot pool capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.padding_slot = capacity
        self.device = torch.device(device)
        self.dtype = dtype
        self.buffers: dict[str, torch.Tensor] = {
            key: torch.zeros((capacity + 1, *shape), device=self.device, dtype=dtype)
            for key, shape in layout.items()
        }
        # Lowest slot first, so a lightly loaded server touches few rows.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._owner: list[int | None] = [None] * capacity

    # ------------------------------------------------------------------ bookkeeping

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def owner(self, slot: int) -> int | None:
        """The stream id holding `slot`, or None when it is free."""
        return self._owner[slot]

    def allocate(self, owner: int) -> int:
        """Take a free slot for stream `owner`, zeroed (a fresh stream's history is all zeros)."""
        if not self._free:
            raise SlotPoolFull(
                f"all {self.capacity} decoder state slots are in use; retry when a stream finishes"
            )
        slot = self._free.pop()
        self._owner[slot] = owner
        self.zero(slot)
        return slot

    def release(self, slot: int, owner: int) -> bool:
        """Return `slot` if `owner` still holds it; False when it was already released (idempotent)."""
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} is outside the pool (capacity {self.capacity})")
        if self._owner[slot] != owner:
            return False
        self._owner[slot] = None
        self._free.append(slot)
        return True

    def check(self, slot: int, owner: int) -> None:
        """Raise if `slot` is not held by `owner` (a stale handle after free or reuse)."""
        if not 0 <= slot < self.capacity or self._owner[slot] != owner:
            raise ValueError(f"decoder state of stream {owner} was freed")

    # ------------------------------------------------------------------ tensors

    def zero(self, slot: int) -> None:
        """Reset one slot's history to zeros (a fresh stream, or a stream reset)."""
        views = [buf[slot] for buf in self.buffers.values()]
        if hasattr(torch, "_foreach_zero_"):
            torch._foreach_zero_(views)  # one grouped launch instead of one per buffer
        else:  # pragma: no cover - every supported torch has it
            for v in views:
                v.zero_()

    def snapshot(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of one slot's whole history (restored with `restore`)."""
        return {key: buf[slot].clone() for key, buf in self.buffers.items()}

    def restore(self, slot: int, snap: dict[str, torch.Tensor]) -> None:
        """Overwrite one slot's history with a `snapshot` (one grouped copy)."""
        dst = [self.buffers[key][slot] for key in snap]
        torch._foreach_copy_(dst, list(snap.values()))

    def slot_bytes(self) -> int:
        """Bytes of state one stream holds."""
        return sum(buf[0].numel() * buf.element_size() for buf in self.buffers.values())

    def total_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.buffers.values())
