"""Deterministic discrete-event core.

Events sit in a heap keyed by ``(time_s, seq)``; ``seq`` is the insertion counter, so events
at the same time run in the order they were scheduled and two runs of the same model are
bit-identical (no dependence on hash order or on comparing callbacks).
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Optional


class EventLoop:
    __slots__ = ("now_s", "events_run", "_heap", "_seq")

    def __init__(self) -> None:
        self.now_s = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, at_s: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at simulated time ``at_s`` (never earlier than now)."""
        if at_s < self.now_s:
            raise ValueError(f"event scheduled in the past: at_s={at_s!r} < now_s={self.now_s!r}")
        heapq.heappush(self._heap, (at_s, self._seq, fn, arg))
        self._seq += 1

    def run(self, until_s: Optional[float] = None) -> int:
        """Process events in (time, insertion) order; returns how many ran in this call."""
        heap, pop = self._heap, heapq.heappop
        ran = 0
        while heap:
            if until_s is not None and heap[0][0] > until_s:
                break
            at_s, _, fn, arg = pop(heap)
            self.now_s = at_s
            fn(arg)
            ran += 1
        self.events_run += ran
        return ran
