"""`BoundedLru`: the one least-recently-used map behind every cache of the project.

The caches bound different things (entries, bytes, or both: the speaker store's prompts), which is
why this is not cachetools' `LRUCache` (one bound, a `getsizeof` for it): one small class that takes
either bound or both, so each cache states its limits and none carries its own eviction loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLru(Generic[K, V]):
    """A map of at most `max_entries` entries whose `cost`s sum to at most `max_cost` (None: that
    bound is off); the least recently used entry goes first. `get` counts as a use, `peek` does
    not. Not thread-safe: a cache shared across threads holds its own lock around it."""

    def __init__(
        self,
        max_entries: int | None = None,
        max_cost: int | None = None,
        cost: Callable[[V], int] | None = None,
    ) -> None:
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        if max_cost is not None and max_cost < 0:
            raise ValueError(f"max_cost must be >= 0, got {max_cost}")
        if max_cost is not None and cost is None:
            raise ValueError("a cost bound needs the cost of an entry")
        self.max_entries = max_entries
        self.max_cost = max_cost
        self._cost = cost
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.cost_used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first."""
        return iter(self._entries)

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of `key`, now the most recently used; `default` when absent."""
        entry = self._entries.get(key)
        if entry is None:
            return default
        self._entries.move_to_end(key)
        return entry[0]

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value of `key` without counting a use."""
        entry = self._entries.get(key)
        return default if entry is None else entry[0]

    def put(self, key: K, value: V) -> bool:
        """Store `value` under `key` as the most recently used, evicting the least recently used
        entries past the bounds. False (nothing stored, an older value of `key` dropped) when the
        value alone costs more than `max_cost` or no entry may be held at all."""
        self.pop(key)
        cost = self._cost(value) if self._cost is not None else 0
        if self.max_entries == 0 or (self.max_cost is not None and cost > self.max_cost):
            return False
        self._entries[key] = (value, cost)
        self.cost_used += cost
        while (self.max_entries is not None and len(self._entries) > self.max_entries) or (
            self.max_cost is not None and self.cost_used > self.max_cost
        ):
            _, (_, evicted) = self._entries.popitem(last=False)
            self.cost_used -= evicted
        return True

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove `key`; its value, or `default` when absent."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return default
        self.cost_used -= entry[1]
        return entry[0]

    def clear(self) -> None:
        self._entries.clear()
        self.cost_used = 0
