"""Adapter pool on the device: fixed slots, LRU eviction, pinning of in-use adapters, and
per-layer-group residency. Pure bookkeeping shared by the real engine and the simulator.

Residency is per layer group: ``ready[g]`` turns True when group g's copy has completed. The
GPU path may read an adapter's layer only when its group is ready (:meth:`check_resident`);
pinned adapters (used by a queued or running request) are never evicted.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional


class AdapterNotResident(RuntimeError):
    """The GPU path touched an adapter layer whose group load had not completed."""


@dataclass
class PoolEntry:
    adapter: str
    groups: int
    ready: list = field(default_factory=list)
    pins: int = 0
    loading: bool = False
    load_started_s: Optional[float] = None

    def resident(self, group: Optional[int] = None) -> bool:
        return all(self.ready) if group is None else self.ready[group]


class AdapterPool:
    def __init__(self, capacity: int, groups: int):
        if capacity < 1:
            raise ValueError(f"adapter pool capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.groups = groups
        self.entries: "OrderedDict[str, PoolEntry]" = OrderedDict()  # LRU order: oldest first
        self.evictions = 0

    def __contains__(self, adapter: str) -> bool:
        return adapter in self.entries

    def get(self, adapter: str) -> Optional[PoolEntry]:
        return self.entries.get(adapter)

    def touch(self, adapter: str) -> None:
        self.entries.move_to_end(adapter)

    def can_admit(self, adapter: str) -> bool:
        if adapter in self.entries:
            return True
        return len(self.entries) < self.capacity or any(e.pins == 0 for e in self.entries.values())

    def has_free_slot(self) -> bool:
        return len(self.entries) < self.capacity or any(e.pins == 0 for e in self.entries.values())

    def acquire(self, adapter: str) -> tuple[PoolEntry, bool, Optional[str]]:
        """Pin ``adapter`` (reserving a slot). Returns (entry, is_new, evicted adapter or None).

        Raises RuntimeError when every slot is pinned (callers check :meth:`can_admit`)."""
        evicted = None
        entry = self.entries.get(adapter)
        is_new = entry is None
        if is_new:
            if len(self.entries) >= self.capacity:
                victim = next((a for a, e in self.entries.items() if e.pins == 0), None)
                if victim is None:
                    raise RuntimeError(f"adapter pool full: all {self.capacity} slots pinned")
                del self.entries[victim]
                self.evictions += 1
                evicted = victim
            entry = PoolEntry(adapter=adapter, groups=self.groups, ready=[False] * self.groups)
            self.entries[adapter] = entry
        entry.pins += 1
        self.entries.move_to_end(adapter)
        return entry, is_new, evicted

    def release(self, adapter: str) -> None:
        entry = self.entries[adapter]
        if entry.pins <= 0:
            raise RuntimeError(f"adapter {adapter!r} released more often than acquired")
        entry.pins -= 1

    def evict_unpinned(self) -> list[str]:
        """Drop every adapter no request pins (S-LoRA on request finish); returns them."""
        out = [a for a, e in self.entries.items() if e.pins == 0]
        for a in out:
            del self.entries[a]
        self.evictions += len(out)
        return out

    def preload(self, adapter: str) -> PoolEntry:
        """Make ``adapter`` resident without a load (CACHED)."""
        entry, _, _ = self.acquire(adapter)
        entry.pins -= 1
        entry.ready = [True] * self.groups
        return entry

    def check_resident(self, adapter: str, group: int) -> None:
        entry = self.entries.get(adapter)
        if entry is None or not entry.ready[group]:
            raise AdapterNotResident(f"adapter {adapter!r} layer group {group} used before its load completed")
