"""Consistent-hash ring with virtual nodes, used to pin a stream to one replica.

Each replica owns `vnodes` points on a 64-bit ring; a key belongs to the first point clockwise of
its hash. Adding or removing one of N replicas moves only the keys of that replica's arcs (~1/N of
all keys), and a key always maps to the same replica while the membership does not change.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable


def _hash64(data: str) -> int:
    # blake2b is stable across processes and Python versions (unlike hash()), and well mixed.
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over replica names (e.g. `host:port` addresses)."""

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = 160):
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self._vnodes = vnodes
        self._nodes: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> None:
        """Add a replica; a no-op when it is already on the ring."""
        if node in self._nodes:
            return
        self._nodes.add(node)
        self._rebuild()

    def remove(self, node: str) -> None:
        """Remove a replica; a no-op when it is not on the ring."""
        if node not in self._nodes:
            return
        self._nodes.discard(node)
        self._rebuild()

    def get(self, key: str) -> str:
        """The replica owning `key`; raises LookupError when the ring is empty."""
        if not self._points:
            raise LookupError("the hash ring has no replicas")
        i = bisect.bisect_right(self._points, _hash64(key))
        return self._owners[i % len(self._owners)]

    def _rebuild(self) -> None:
        # Ties between points (vanishingly rare) are broken by node name so the ring is deterministic.
        points = sorted((_hash64(f"{node}#{v}"), node) for node in self._nodes for v in range(self._vnodes))
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]
