"""Static KV-slot bookkeeping for the talker engine (pure Python, no torch).

Every running sequence owns one slot: a fixed row of the preallocated KV cache with room for
`max_len` positions. Occupied slots are kept *dense*: they are always exactly `0 .. num_used-1`.
When a sequence in the middle leaves, the sequence in the last slot moves into the hole. Dense
slots let the decode step address the batch as the leading rows of the cache (a plain view,
no gather), so row `i` of a batch bucket *is* slot `i` and padding rows are the free slots after
it. The model runner applies the returned moves (copies of KV rows and per-slot state).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotMove:
    """The sequence `key` moved from slot `src` to slot `dst`; copy its KV and per-slot state."""

    src: int
    dst: int
    key: str


class DenseSlotTable:
    """Allocates KV slots so that the occupied ones are always the first `num_used`."""

    def __init__(self, num_slots: int, max_len: int) -> None:
        if num_slots < 1 or max_len < 2:
            raise ValueError(f"need num_slots >= 1 and max_len >= 2, got {num_slots}, {max_len}")
        self.num_slots = num_slots
        self.max_len = max_len
        # owner[slot] is the key of the sequence in that slot, for the occupied prefix only.
        self._owner: list[str] = []
        self._slot_of: dict[str, int] = {}

    @property
    def num_used(self) -> int:
        return len(self._owner)

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self._owner)

    def fits(self, num_positions: int) -> bool:
        """Whether a sequence needing `num_positions` KV positions can ever live in one slot."""
        return 0 < num_positions <= self.max_len

    def can_allocate(self, num_positions: int) -> bool:
        return self.num_free > 0 and self.fits(num_positions)

    def allocate(self, key: str) -> int:
        """Give `key` the first free slot (always `num_used`, keeping the slots dense)."""
        if key in self._slot_of:
            raise KeyError(f"{key!r} already holds slot {self._slot_of[key]}")
        if self.num_free == 0:
            raise RuntimeError("no free KV slot")
        slot = len(self._owner)
        self._owner.append(key)
        self._slot_of[key] = slot
        return slot

    def slot_of(self, key: str) -> int:
        return self._slot_of[key]

    def owner(self, slot: int) -> str:
        return self._owner[slot]

    def free(self, key: str) -> SlotMove | None:
        """Release `key`'s slot; returns the move that refills the hole, if any."""
        slot = self._slot_of.pop(key)
        last = len(self._owner) - 1
        moved_key = self._owner.pop()
        if slot == last:
            return None
        self._owner[slot] = moved_key
        self._slot_of[moved_key] = slot
        return SlotMove(src=last, dst=slot, key=moved_key)


def slots_for_budget(budget_bytes: int, max_len: int, bytes_per_position: int, max_slots: int) -> int:
    """How many slots of `max_len` positions (+1 scratch position each) fit in `budget_bytes`."""
    per_slot = (max_len + 1) * bytes_per_position
    return max(0, min(max_slots, budget_bytes // per_slot))


def kv_budget_bytes(
    free: int, total: int, own: int, *, reserve: int, others: int, prefix_cache: int, fraction: float
) -> int:
    """Bytes the KV slots may take on a GPU with `free` of `total` bytes free, `own` of them held
    by this process: `fraction` of what is free after this process's own `reserve` (graphs,
    activations, prefill), its prefix cache and what other processes on the GPU may still take of
    the `others` they need (less what they already hold, so the answer does not depend on whether
    code2wav sharing the GPU has allocated its memory before this engine sizes its slots)."""
    others_now = max(0, total - free - own)
    others_to_come = max(0, others - others_now)
    return int(max(0, free - reserve - prefix_cache - others_to_come) * fraction)
