"""Drawing the sequences of each training step: by sequence count or by a fixed token budget G.

A :class:`LengthStream` is one seeded ``numpy.random.Generator`` stream of lengths; sequence
``i`` of the stream has id ``i`` for the whole run, so any rank can regenerate its tokens from
(seed, id) and a test can track every sequence. Draws come in fixed blocks, so the stream (and
every step cut from it) is bit-reproducible for a given (distribution, seed) and independent of
how steps are cut.

Steps:
- :meth:`LengthStream.by_count`: the next ``n`` sequences (HotSPa: 64 per step on CPU, GBS 512).
- :meth:`LengthStream.by_tokens`: sequences until their total reaches the budget G (Hydraulis's
  per-iteration planning and LobRA's, both in the authors' Hetu code). Hydraulis truncates the last
  sequence so that the total is exactly G; the substrate never truncates a sequence (a cut document
  is a different training sample), so the overflowing sequence is handled by ``overflow``:
  - ``"keep"`` (default): it stays in this step; ``G <= total < G + its length``.
  - ``"defer"``: it opens the next step; ``total <= G`` (a single sequence longer than G still
    forms a step on its own, so the stream always advances).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from impl.common.api import ConfigError
from impl.common.varlen.lengths import LengthDist

OVERFLOW = ("keep", "defer")
BLOCK = 1024


@dataclass(frozen=True)
class StepBatch:
    """One step's sequences: stream ids and lengths (int64), in draw order."""

    step: int
    ids: np.ndarray
    lengths: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self.ids)


class LengthStream:
    def __init__(self, dist: LengthDist, seed: int) -> None:
        dist.validate()
        self.dist = dist
        self.rng = np.random.default_rng(seed)
        self._buf = np.empty(0, dtype=np.int64)
        self._pos = 0  # index into _buf of the next unread length
        self._next_id = 0  # stream id of _buf[_pos]
        self._step = 0

    def _ensure(self, n: int) -> None:
        while len(self._buf) - self._pos < n:
            self._buf = np.concatenate([self._buf[self._pos:], self.dist.sample(BLOCK, self.rng)])
            self._pos = 0

    def _take(self, n: int) -> StepBatch:
        self._ensure(n)
        lengths = self._buf[self._pos:self._pos + n].copy()
        ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
        self._pos += n
        self._next_id += n
        out = StepBatch(self._step, ids, lengths)
        self._step += 1
        return out

    def by_count(self, n: int) -> StepBatch:
        if n < 1:
            raise ConfigError(f"workload.seqs_per_step: must be >= 1, got {n}")
        return self._take(n)

    def by_tokens(self, budget: int, overflow: str = "keep") -> StepBatch:
        if budget < 1:
            raise ConfigError(f"workload.tokens_per_step: must be >= 1, got {budget}")
        if overflow not in OVERFLOW:
            raise ConfigError(f"workload.overflow: unknown policy {overflow!r} (choose one of {', '.join(OVERFLOW)})")
        total, n = 0, 0
        while True:
            self._ensure(n + 1)
            length = int(self._buf[self._pos + n])
            if total + length > budget and overflow == "defer" and n > 0:
                break
            total += length
            n += 1
            if total >= budget:
                break
        return self._take(n)
