"""What each rank writes (the save plan) and reads (the read plan): pure functions over a
layout and a checkpoint index, printable and testable without I/O (the
format and resharded load of Elastor's reference code (PKU-DAIR/Hetu PR #9)).

Save: split j of a tensor is written once, by the lowest rank that holds it (``duplicate``:
by every holder, the reference code's behaviour; the loader then takes the first file).
Read: a rank needs, per tensor, the splits of its fraction under the new layout; per file
the needed keys are sorted by offset and consecutive ones merged into one block, one read
each.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from .fileformat import Entry, WriteItem
from .layout import CheckpointLayout, TensorMeta, local_splits, split_range


def owners(metas: Sequence[TensorMeta], layout: CheckpointLayout, S: int) -> dict[tuple[str, Optional[int]], list[int]]:
    """(name, split) -> ranks holding it, ascending."""
    out: dict = {}
    for r in sorted(layout.ranks):
        own = layout.ranks[r]
        for m in metas:
            if m.name in own:
                for j in split_range(own[m.name], S, m):
                    out.setdefault((m.name, j), []).append(r)
    return out


def save_items(metas: Sequence[TensorMeta], layout: CheckpointLayout, S: int, rank: int,
               local: Mapping[str, torch.Tensor], duplicate: bool = False) -> list[WriteItem]:
    """The items ``rank`` writes from its local state."""
    own = owners(metas, layout, S)
    items = []
    for m in metas:
        tg = layout.ranks.get(rank, {}).get(m.name)
        if tg is None:
            continue
        for j, t in local_splits(local[m.name], m, tg, S).items():
            holders = own[(m.name, j)]
            if duplicate or holders[0] == rank:
                items.append(WriteItem(m.name, j, t))
    return items


def model_order(metas: Sequence[TensorMeta]) -> dict[str, int]:
    return {m.name: i for i, m in enumerate(metas)}


@dataclass(frozen=True)
class Need:
    name: str
    split: Optional[int]
    file: str
    entry: Entry


@dataclass
class ReadBlock:
    """One read: [offset, offset+length) of ``file``, holding ``needs`` back to back."""

    file: str
    offset: int
    length: int
    needs: list[Need] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.file}@{self.offset}+{self.length} ({len(self.needs)} keys)"


def key_index(files: Mapping[str, Mapping[str, Entry]], manifest_files: Mapping[str, dict]) -> dict:
    """(name, split) -> (file, Entry), the first file (lowest rank) holding a key winning."""
    idx: dict = {}
    for fname in sorted(manifest_files, key=lambda f: manifest_files[f]["rank"]):
        for key, (name, j, _sha) in manifest_files[fname]["keys"].items():
            idx.setdefault((name, j), (fname, files[fname][key]))
    return idx


def needed(metas: Sequence[TensorMeta], layout: CheckpointLayout, rank: int, S: int) -> list[tuple[str, Optional[int]]]:
    own = layout.ranks.get(rank, {})
    return [(m.name, j) for m in metas if m.name in own for j in split_range(own[m.name], S, m)]


def files_needed(metas, layout, rank, S, manifest_files) -> list[str]:
    """Files holding this rank's keys (from the manifest alone: no header read yet)."""
    where: dict = {}
    for fname in sorted(manifest_files, key=lambda f: manifest_files[f]["rank"]):
        for _key, (name, j, _sha) in manifest_files[fname]["keys"].items():
            where.setdefault((name, j), fname)
    return sorted({where[n] for n in needed(metas, layout, rank, S)})


def read_plan(metas: Sequence[TensorMeta], layout: CheckpointLayout, rank: int, S: int, index: Mapping) -> list[ReadBlock]:
    """Merged blocks for ``rank`` under ``layout`` (needs must be in ``index``)."""
    per_file: dict[str, list[Need]] = {}
    for name, j in needed(metas, layout, rank, S):
        f, e = index[(name, j)]
        per_file.setdefault(f, []).append(Need(name, j, f, e))
    blocks = []
    for f in sorted(per_file):
        cur: Optional[ReadBlock] = None
        for n in sorted(per_file[f], key=lambda n: n.entry.offset):
            if cur is not None and cur.offset + cur.length == n.entry.offset:
                cur.length += n.entry.length
                cur.needs.append(n)
            else:
                cur = ReadBlock(f, n.entry.offset, n.entry.length, [n])
                blocks.append(cur)
    return blocks


def format_read_plan(blocks: Sequence[ReadBlock]) -> str:
    return "\n".join(str(b) for b in blocks)
