"""`PrefixStateCache`: decoder states right after ICL reference prefixes, kept per distinct prefix.

A stream of a voice seen before copies its slot's state from here (one grouped copy, bit-identical
to decoding the prefix again) instead of decoding the prefix. Used from the decode worker thread only.
"""

from __future__ import annotations

import hashlib

import torch

from qtts.decode_engine.slots import SlotPool
from qtts.lru import BoundedLru

# A slot's whole history (`SlotPool.snapshot`) and the frames decoded into it.
Snapshot = tuple[dict[str, torch.Tensor], int]


class PrefixStateCache:
    """An LRU of `entries` slot snapshots keyed by the prefix's digest (0 entries: off); `hits` and
    `misses` count the starts with a prefix that copied a state and that decoded one."""

    def __init__(self, pool: SlotPool, entries: int):
        self.pool = pool
        self.entries = entries
        self._lru: BoundedLru[bytes, Snapshot] = BoundedLru(entries)
        self.hits = 0
        self.misses = 0

    def key(self, prefix: torch.Tensor) -> bytes | None:
        """The prefix's cache key, or None while the cache is off."""
        if self.entries == 0:
            return None
        host = prefix.detach().to("cpu", torch.long).contiguous()
        return hashlib.sha256(repr(tuple(host.shape)).encode() + host.numpy().tobytes()).digest()

    def holds(self, prefix: torch.Tensor) -> bool:
        """Whether a start after `prefix` would copy a cached state now (any thread: a membership
        test that leaves the LRU order alone; the worker may evict it before that start)."""
        key = self.key(prefix)
        return key is not None and key in self._lru

    def get(self, key: bytes | None) -> Snapshot | None:
        return None if key is None else self._lru.get(key)

    def put(self, key: bytes, slot: int, frames: int) -> Snapshot:
        """Keep a snapshot of `slot` (its state after a prefix of `frames` frames) under `key`;
        returns it."""
        snap = (self.pool.snapshot(slot), frames)
        self._lru.put(key, snap)
        return snap
