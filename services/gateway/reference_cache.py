"""Decoded reference clips kept by content, so a voice-clone request that repeats a clip (the
common case: an agent speaks in one cloned voice all day) skips the container decode and resample.

Decoding every request's clip in the gateway's thread pool once capped the whole stack's request
rate (BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import numpy as np

from qtts.lru import BoundedLru


def _nbytes(pcm: np.ndarray) -> int:
    return pcm.nbytes


class DecodedReferenceCache:
    """`decode(data)` with an LRU of results keyed by sha256(data), within `max_bytes`.

    Thread-safe (the gateway decodes in worker threads). Results are read-only arrays shared by
    every request that sent the same bytes. Failures are not cached: bad input is decoded (and
    rejected) again each time. Two concurrent first requests of one clip may both decode it."""

    def __init__(
        self,
        decode: Callable[[bytes], np.ndarray],
        max_bytes: int,
        on_hit: Callable[[], None] | None = None,
        on_miss: Callable[[], None] | None = None,
    ):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._decode = decode
        self.max_bytes = max_bytes
        self._entries: BoundedLru[bytes, np.ndarray] = BoundedLru(max_cost=max_bytes, cost=_nbytes)
        self._lock = threading.Lock()
        self._on_hit = on_hit or (lambda: None)
        self._on_miss = on_miss or (lambda: None)

    @property
    def bytes_used(self) -> int:
        return self._entries.cost_used

    def __len__(self) -> int:
        return len(self._entries)

    def cached(self, data: bytes) -> np.ndarray | None:
        """The decoded clip when it is in the cache (a hit), else None; cheap enough for an event
        loop (a hash of the bytes), so a hit needs no trip through a worker thread."""
        return self._lookup(hashlib.sha256(data).digest())

    def _lookup(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            pcm = self._entries.get(key)
        if pcm is not None:
            self._on_hit()
        return pcm

    def __call__(self, data: bytes) -> np.ndarray:
        key = hashlib.sha256(data).digest()
        pcm = self._lookup(key)
        if pcm is not None:
            return pcm
        self._on_miss()
        pcm = np.asarray(self._decode(data))
        pcm.setflags(write=False)
        with self._lock:
            if key not in self._entries:
                self._entries.put(key, pcm)
        return pcm
