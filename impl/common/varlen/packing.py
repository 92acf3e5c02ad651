"""Packing variable-length sequences into micro-batches, grouping by length, DP assignment.

A :class:`MicroBatch` is one value that travels through packing, attention and the loss (the
flash-attn / Megatron packed-sequence convention): the sequence ids and lengths, ``cu_seqlens``
(int32 segment offsets into the micro-batch's token row), ``max_seqlen`` and the padded length.
Two layouts:
- packed (default): the sequences lie back to back in one row, ``cu_seqlens = [0, cumsum(L)]``;
  alignment padding follows the last segment (``padded_len >= cu_seqlens[-1]``).
- one per row (pad-to-max): each sequence has its own row of ``row_len`` tokens; the rows are
  laid end to end, so segment i starts at ``i * row_len`` and holds ``L_i`` real tokens and
  ``row_len - L_i`` padding. ``cu_seqlens = [0, row_len, 2 row_len, ...]``; ``lengths`` gives
  the real tokens of each segment.
In both, attention stays inside a segment, padding is never a loss target, and a micro-batch
with no sequences (``is_empty``) is a placeholder that runs no compute.

Rules (every one keeps each sequence whole and drops none):
- :func:`pad_to_max`: ``micro_batch_size`` sequences per micro-batch, each padded to the step's
  longest (or a given row length). Hydraulis batching mode 0 (the authors' code, Hetu `examples/hydraulis`).
- :func:`equal_count`: the sequences in the given order, cut into ``num`` micro-batches whose
  counts differ by at most one (the first ``n % num`` hold one more). Hydraulis mode 1.
- :func:`greedy_pack`: scan shortest-first; open a bin with the shortest unused sequence, then
  add the longest unused sequences that still fit the capacity (Hydraulis's "greedy
  packing", modes 2/3 of the authors' code; the Megatron-like baselines [R] of Hydraulis and HotSPa use it to
  the context length). Topping up "the longest that still fits" is done by repeatedly taking
  the longest unused length <= the room left, which equals the authors' loop (Hetu
  ``python/hetu/data/bucket.py``, ``Bucket.pack_data``: scan the unused sequences longest-first
  and add each that fits). Hetu then runs the packed rows largest-first (:func:`largest_first`;
  Hydraulis's per-iteration planning) and, in its pad-to-max path, truncates rows to the maximum:
  here an over-long sequence is an error instead.
- :func:`hotspa_pack`: open a micro-batch with the longest unused sequence, then add from the
  shortest upward while the total stays <= the group's bound (the authors' code,
  Hetu `examples/hotspa`).
- :func:`group_by_boundaries`: descending boundaries ``[B_0 > B_1 > ... > B_n]``; group g holds
  lengths in ``(B_{g+1}, B_g]`` (HotSPa's grouping, same code).
- :func:`assign_dp`: micro-batch i goes to DP rank ``i mod dp``; ranks left short get empty
  micro-batches so every rank runs the same count (HotSPa's public code drops the
  leftover micro-batches; the harness pads instead [R]).

Padding (``pad``): ``"none"`` (no padding), ``"align"`` (up to a multiple of ``align``, the
dynamic-shape case, e.g. 128 or the TP/CP degree) or ``"bound"`` (up to the capacity, the
static-shape case). With a bound, it must be a multiple of ``align`` so an aligned row never
exceeds it. Ties between equal lengths are broken by sequence id, so every rule is
deterministic.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from impl.common.api import ConfigError

PAD_MODES = ("none", "align", "bound")


@dataclass(frozen=True)
class MicroBatch:
    seq_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    padded_len: int  # tokens in the micro-batch's row (all rows, for one-per-row)
    bound: int = 0  # capacity in real tokens it was packed for; 0 = none
    row_len: int = 0  # one-per-row layout: tokens per row; 0 = packed layout

    def __post_init__(self) -> None:
        if len(self.seq_ids) != len(self.lengths):
            raise ValueError(f"micro-batch: {len(self.seq_ids)} ids but {len(self.lengths)} lengths")
        if self.row_len and max(self.lengths, default=0) > self.row_len:
            raise ValueError(f"micro-batch: a sequence of {max(self.lengths)} tokens > row_len {self.row_len}")
        if self.padded_len < self.layout_tokens:
            raise ValueError(f"micro-batch: padded_len {self.padded_len} < its {self.layout_tokens} laid-out tokens")

    @property
    def one_per_row(self) -> bool:
        return self.row_len > 0

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        """Real (target) tokens."""
        return int(sum(self.lengths))

    @property
    def layout_tokens(self) -> int:
        return self.row_len * len(self.lengths) if self.one_per_row else self.num_tokens

    @property
    def pad_tokens(self) -> int:
        return self.padded_len - self.num_tokens

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths, default=0)

    @property
    def cu_seqlens(self) -> np.ndarray:
        """int32 segment offsets into the row, ``len = num_seqs + 1``."""
        seg = [self.row_len] * len(self.lengths) if self.one_per_row else list(self.lengths)
        return np.concatenate([[0], np.cumsum(seg, dtype=np.int64)]).astype(np.int32)

    @staticmethod
    def empty(bound: int = 0) -> "MicroBatch":
        return MicroBatch((), (), 0, bound)


@dataclass(frozen=True)
class LengthGroup:
    """Sequences whose lengths lie in ``(lower, upper]`` (HotSPa's grouping), longest first."""

    index: int
    upper: int
    lower: int
    seq_ids: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids


def _check_pad(pad: str, align: int, bound: int, field: str) -> None:
    if pad not in PAD_MODES:
        raise ConfigError(f"{field}.pad: unknown mode {pad!r} (choose one of {', '.join(PAD_MODES)})")
    if align < 1:
        raise ConfigError(f"{field}.align: must be >= 1, got {align}")
    if pad == "bound" and bound < 1:
        raise ConfigError(f"{field}.pad: 'bound' padding needs a capacity >= 1, got {bound}")
    if bound and bound % align:
        raise ConfigError(f"{field}.align: capacity {bound} is not a multiple of align {align}")


def padded_length(tokens: int, pad: str, align: int, bound: int) -> int:
    if pad == "none":
        return tokens
    if pad == "bound":
        return bound
    return -(-tokens // align) * align


def _as_arrays(ids: Sequence[int], lengths: Sequence[int], field: str) -> tuple[np.ndarray, np.ndarray]:
    ids_a = np.asarray(ids, dtype=np.int64).reshape(-1)
    len_a = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if len(ids_a) != len(len_a):
        raise ConfigError(f"{field}: {len(ids_a)} sequence ids but {len(len_a)} lengths")
    if len(np.unique(ids_a)) != len(ids_a):
        raise ConfigError(f"{field}: sequence ids repeat")
    if len(len_a) and len_a.min() < 1:
        i = int(np.argmin(len_a))
        raise ConfigError(f"{field}: sequence {int(ids_a[i])} has length {int(len_a[i])} (must be >= 1)")
    return ids_a, len_a


def _check_fits(ids: np.ndarray, lengths: np.ndarray, capacity: int, field: str) -> None:
    if len(lengths) and lengths.max() > capacity:
        i = int(np.argmax(lengths))
        raise ConfigError(f"{field}: sequence {int(ids[i])} of length {int(lengths[i])} exceeds the "
                          f"micro-batch capacity {capacity} (a sequence is never split)")


def _make(ids: Sequence[int], lengths: Sequence[int], pad: str, align: int, bound: int) -> MicroBatch:
    total = int(sum(lengths))
    return MicroBatch(tuple(int(i) for i in ids), tuple(int(x) for x in lengths),
                      padded_length(total, pad, align, bound), bound)


def _order(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices by ascending (length, id)."""
    return np.lexsort((ids, lengths))


def pad_to_max(ids: Sequence[int], lengths: Sequence[int], micro_batch_size: int,
               row_len: Optional[int] = None, field: str = "packing") -> list[MicroBatch]:
    """Consecutive chunks of ``micro_batch_size`` sequences, one row each, padded to ``row_len``
    (default: the longest sequence given)."""
    ids_a, len_a = _as_arrays(ids, lengths, field)
    if micro_batch_size < 1:
        raise ConfigError(f"{field}.micro_batch_size: must be >= 1, got {micro_batch_size}")
    if not len(ids_a):
        return []
    row = int(len_a.max()) if row_len is None else int(row_len)
    _check_fits(ids_a, len_a, row, field)
    out = []
    for s in range(0, len(ids_a), micro_batch_size):
        chunk = slice(s, s + micro_batch_size)
        n = len(ids_a[chunk])
        out.append(MicroBatch(tuple(int(i) for i in ids_a[chunk]), tuple(int(x) for x in len_a[chunk]),
                              n * row, row_len=row))
    return out


def equal_count(ids: Sequence[int], lengths: Sequence[int], num: int, capacity: int = 0,
                pad: str = "align", align: int = 1, field: str = "packing") -> list[MicroBatch]:
    """``num`` micro-batches (fewer if there are fewer sequences) of near-equal sequence counts,
    in the given order. With a ``capacity``, a micro-batch over it is an error with the numbers."""
    ids_a, len_a = _as_arrays(ids, lengths, field)
    if num < 1:
        raise ConfigError(f"{field}.num_micro_batches: must be >= 1, got {num}")
    _check_pad(pad, align, capacity, field)
    out = []
    for part in np.array_split(np.arange(len(ids_a)), min(num, len(ids_a))) if len(ids_a) else []:
        total = int(len_a[part].sum())
        if capacity and total > capacity:
            raise ConfigError(f"{field}: equal-count micro-batch of {len(part)} sequences holds {total} "
                              f"tokens > capacity {capacity} (use more micro-batches)")
        out.append(_make(ids_a[part], len_a[part], pad, align, capacity))
    return out


def greedy_pack(ids: Sequence[int], lengths: Sequence[int], capacity: int, pad: str = "align",
                align: int = 1, field: str = "packing") -> list[MicroBatch]:
    """Hydraulis greedy packing: shortest-first bins topped up with the longest that fit."""
    ids_a, len_a = _as_arrays(ids, lengths, field)
    if capacity < 1:
        raise ConfigError(f"{field}.capacity: must be >= 1, got {capacity}")
    _check_pad(pad, align, capacity, field)
    _check_fits(ids_a, len_a, capacity, field)
    order = _order(ids_a, len_a)
    keys = [int(len_a[i]) for i in order]  # ascending; parallel to idx
    idx = [int(i) for i in order]
    out = []
    while idx:
        first = idx.pop(0)
        keys.pop(0)
        members, room = [first], capacity - int(len_a[first])
        while keys:
            # Longest unused length <= room; among equal lengths the highest id (rightmost).
            j = bisect.bisect_right(keys, room) - 1
            if j < 0:
                break
            members.append(idx.pop(j))
            room -= keys.pop(j)
        out.append(_make(ids_a[members], len_a[members], pad, align, capacity))
    return out


def hotspa_pack(ids: Sequence[int], lengths: Sequence[int], bound: int, pad: str = "align",
                align: int = 128, field: str = "packing") -> list[MicroBatch]:
    """HotSPa's packing: longest unused opens a micro-batch; add shortest-upward while total <= bound."""
    ids_a, len_a = _as_arrays(ids, lengths, field)
    if bound < 1:
        raise ConfigError(f"{field}.bound: must be >= 1, got {bound}")
    _check_pad(pad, align, bound, field)
    _check_fits(ids_a, len_a, bound, field)
    q = deque(int(i) for i in _order(ids_a, len_a))
    out = []
    while q:
        members = [q.pop()]
        total = int(len_a[members[0]])
        while q and total + int(len_a[q[0]]) <= bound:
            members.append(q.popleft())
            total += int(len_a[members[-1]])
        out.append(_make(ids_a[members], len_a[members], pad, align, bound))
    return out


def largest_first(micro_batches: Sequence[MicroBatch]) -> list[MicroBatch]:
    """Micro-batches by real tokens, descending (stable), the order Hetu runs packed rows in."""
    return sorted(micro_batches, key=lambda mb: -mb.num_tokens)


def check_boundaries(boundaries: Sequence[int], field: str = "boundaries") -> list[int]:
    b = [int(x) for x in boundaries]
    if len(b) < 2:
        raise ConfigError(f"{field}: need at least 2 boundaries (upper and lower), got {b}")
    if b[-1] < 0:
        raise ConfigError(f"{field}: the lowest boundary must be >= 0, got {b[-1]}")
    for g in range(len(b) - 1):
        if b[g] <= b[g + 1]:
            raise ConfigError(f"{field}: boundaries must be strictly descending, but {field}[{g}]={b[g]} "
                              f"<= {field}[{g + 1}]={b[g + 1]} in {b}")
    return b


def group_by_boundaries(ids: Sequence[int], lengths: Sequence[int], boundaries: Sequence[int],
                        field: str = "boundaries") -> list[LengthGroup]:
    """One :class:`LengthGroup` per consecutive boundary pair (empty groups included), longest first."""
    b = check_boundaries(boundaries, field)
    ids_a, len_a = _as_arrays(ids, lengths, field)
    if len(len_a) and len_a.max() > b[0]:
        i = int(np.argmax(len_a))
        raise ConfigError(f"{field}: sequence {int(ids_a[i])} of length {int(len_a[i])} is longer than "
                          f"the largest boundary {b[0]} of {b}")
    if len(len_a) and len_a.min() <= b[-1]:
        i = int(np.argmin(len_a))
        raise ConfigError(f"{field}: sequence {int(ids_a[i])} of length {int(len_a[i])} is not above "
                          f"the lowest boundary {b[-1]} of {b}")
    desc = _order(ids_a, len_a)[::-1]
    s_ids, s_len = ids_a[desc], len_a[desc]
    groups = []
    for g in range(len(b) - 1):
        sel = (s_len <= b[g]) & (s_len > b[g + 1])
        groups.append(LengthGroup(g, b[g], b[g + 1], tuple(int(i) for i in s_ids[sel]),
                            tuple(int(x) for x in s_len[sel])))
    return groups


def assign_dp(micro_batches: Sequence[MicroBatch], dp: int, field: str = "dp") -> list[list[MicroBatch]]:
    """``dp`` lists; micro-batch i -> rank ``i mod dp``; short ranks padded with empty ones."""
    if dp < 1:
        raise ConfigError(f"{field}: must be >= 1, got {dp}")
    per_rank = -(-len(micro_batches) // dp)
    ranks: list[list[MicroBatch]] = [list(micro_batches[r::dp]) for r in range(dp)]
    for r in ranks:
        bound = micro_batches[0].bound if micro_batches else 0
        r.extend(MicroBatch.empty(bound) for _ in range(per_rank - len(r)))
    return ranks


def check_packing(ids: Sequence[int], lengths: Sequence[int], micro_batches: Sequence[MicroBatch],
                  field: str = "packing") -> None:
    """Every sequence in exactly one micro-batch with its own length; no bound exceeded."""
    want = {int(i): int(x) for i, x in zip(ids, lengths)}
    seen: dict[int, int] = {}
    for k, mb in enumerate(micro_batches):
        if mb.bound and mb.num_tokens > mb.bound:
            raise ValueError(f"{field}: micro-batch {k} holds {mb.num_tokens} tokens > bound {mb.bound}")
        if mb.one_per_row and mb.max_seqlen > mb.row_len:
            raise ValueError(f"{field}: micro-batch {k} has a sequence of {mb.max_seqlen} tokens "
                             f"> row_len {mb.row_len}")
        for sid, length in zip(mb.seq_ids, mb.lengths):
            if sid in seen:
                raise ValueError(f"{field}: sequence {sid} is in micro-batches {seen[sid]} and {k}")
            if want.get(sid) != length:
                raise ValueError(f"{field}: sequence {sid} has length {length} in micro-batch {k}, "
                                 f"expected {want.get(sid)}")
            seen[sid] = k
    missing = sorted(set(want) - set(seen))
    if missing:
        raise ValueError(f"{field}: {len(missing)} sequences in no micro-batch, e.g. {missing[:5]}")
