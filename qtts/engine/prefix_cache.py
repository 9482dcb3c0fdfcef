"""GPU-local LRU cache of prompt-prefix KV, keyed by the voice prompt (and whatever else shapes
the prefix: language, mode), so streams that share a voice skip re-prefilling its positions.

Entries are whole-prefix KV tensors `[layers, kv_heads, positions, head_dim]` (keys and values)
on the engine's device, evicted least-recently-used first when the byte budget is exceeded.
Lookups that admit a sequence pin nothing: the copy into the slot happens in the same engine
step, before any insertion can evict the entry.
"""

from __future__ import annotations

import torch

from qtts.lru import BoundedLru


def _nbytes(kv: tuple[torch.Tensor, torch.Tensor]) -> int:
    k, v = kv
    return k.numel() * k.element_size() + v.numel() * v.element_size()


class PrefixCache:
    """LRU map prefix key -> (keys, values) within `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: BoundedLru[str, tuple[torch.Tensor, torch.Tensor]] = BoundedLru(
            max_cost=max_bytes, cost=_nbytes
        )
        self.hits = 0
        self.misses = 0

    @property
    def bytes_used(self) -> int:
        return self._entries.cost_used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def lookup(self, key: str) -> int:
        """Positions cached under `key` (0 on a miss); a hit becomes the most recently used."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return 0
        self.hits += 1
        return int(entry[0].shape[2])

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._entries.peek(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def put(self, key: str, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Insert (or refresh) an entry; returns False when it alone exceeds the budget."""
        return self._entries.put(key, (keys, values))
