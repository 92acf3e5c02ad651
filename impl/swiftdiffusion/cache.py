"""An LRU cache with a hard capacity (ControlNet servers, LoRA host caches, the sim)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

from impl.common.api import ConfigError


class LRUCache:
    def __init__(self, capacity: int, what: str = "cache"):
        if capacity < 0:
            raise ConfigError(f"{what}: capacity must be >= 0, got {capacity}")
        self.capacity, self.what = capacity, what
        self.items: "OrderedDict[Hashable, Any]" = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def __contains__(self, key) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key, load: Callable[[], Any]):
        """The cached value (a hit refreshes it) or ``load()`` inserted, evicting the LRU entry."""
        if key in self.items:
            self.hits += 1
            self.items.move_to_end(key)
            return self.items[key]
        self.misses += 1
        value = load()
        if self.capacity == 0:
            return value
        while len(self.items) >= self.capacity:
            del self.items[self._victim()]
            self.evictions += 1
        self.items[key] = value
        assert len(self.items) <= self.capacity
        return value

    def _victim(self):
        return next(iter(self.items))  # least recently used


class LFUCache(LRUCache):
    """Evicts the cached entry used least often; counts are kept from the first request on (also
    for evicted keys), ties go to the least recently used. Same interface and capacity bound."""

    def __init__(self, capacity: int, what: str = "cache"):
        super().__init__(capacity, what)
        self.counts: dict = {}

    def get(self, key, load: Callable[[], Any]):
        self.counts[key] = self.counts.get(key, 0) + 1
        return super().get(key, load)

    def _victim(self):
        return min(self.items, key=lambda k: self.counts[k])  # OrderedDict order: LRU first on ties
        while len(self.items) >= self.capacity:
            victim = min(self.items, key=lambda k: self.counts[k])  # OrderedDict order: LRU first on ties
            del self.items[victim]
            self.evictions += 1
        self.items[key] = value
        assert len(self.items) <= self.capacity
        return value
