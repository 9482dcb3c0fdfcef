"""GPU-local LRU cache of prompt-prefix KV, keyed by the voice prompt (and whatever else shapes
the prefix: language, mode), so streams that share a voice skip re-prefilling its positions.

Entries are whole-prefix KV tensors `[layers, kv_heads, positions, head_dim]` (keys and values)
on the engine's device, evicted least-recently-used first when the byte budget is exceeded.
Lookups that admit a sequence pin nothing: the copy into the slot happens in the same engine
step, before any insertion can evict the entry.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class PrefixCache:
    """LRU map prefix key -> (keys, values) within `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _nbytes(k: torch.Tensor, v: torch.Tensor) -> int:
        return k.numel() * k.element_size() + v.numel() * v.element_size()

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
        self._entries.move_to_end(key)
        self.hits += 1
        return int(entry[0].shape[2])

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._entries[key]

    def put(self, key: str, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Insert (or refresh) an entry; returns False when it alone exceeds the budget."""
        size = self._nbytes(keys, values)
        if size > self.max_bytes:
            return False
        if key in self._entries:
            self.bytes_used -= self._nbytes(*self._entries.pop(key))
        while self._entries and self.bytes_used + size > self.max_bytes:
            _, (k, v) = self._entries.popitem(last=False)
            self.bytes_used -= self._nbytes(k, v)
        self._entries[key] = (keys, values)
        self.bytes_used += size
        return True
