"""Load with resharding (as in Elastor's reference code, PKU-DAIR/Hetu PR #9): a rank reads the
headers of the files holding its keys (one request each), merges the splits it needs under its new
layout into blocks (one read per block), checks every key's sha256 and concatenates its splits into
its local tensors. No collective, no whole tensor, no conversion."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from impl.common.storage.emulator import Storage

from .fileformat import CheckpointError, header_length, parse_header, sha256, to_tensor
from .layout import CheckpointLayout, TensorMeta, check_rank, join, split_range
from .plan import files_needed, key_index, read_plan
from .store import Checkpoint


@dataclass
class LoadStats:
    read_calls: int = 0
    bytes_read: int = 0
    bytes_needed: int = 0
    blocks: int = 0
    files: int = 0
    t_metadata_s: float = 0.0
    t_io_s: float = 0.0
    t_assembly_s: float = 0.0
    covered: list = field(default_factory=list)  # (name, split) read, for the exactly-once check
    slices_by_file: dict = field(default_factory=dict)  # file -> (name, split) pieces read from it

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0

    def to_dict(self) -> dict:
        return {"read_calls": self.read_calls, "bytes_read": self.bytes_read, "bytes_needed": self.bytes_needed,
                "read_amplification": self.read_amplification, "blocks": self.blocks, "files": self.files,
                "t_metadata_s": self.t_metadata_s, "t_io_s": self.t_io_s, "t_assembly_s": self.t_assembly_s}


def load_rank(ck: Checkpoint, layout: CheckpointLayout, rank: int, storage: Optional[Storage] = None,
              metas: Optional[Sequence[TensorMeta]] = None,
              locate: Optional[Callable[[str], tuple[str, Storage]]] = None) -> tuple[dict[str, torch.Tensor], LoadStats]:
    """``rank``'s local tensors under ``layout`` from checkpoint ``ck`` (any saved layout).
    ``locate``: file -> (path, the Storage that counts its reads), for a commit whose files
    sit in several places (peer holders, :mod:`.peer`); default ``ck.dir`` through ``storage``."""
    storage = storage or Storage()
    locate = locate or (lambda fname: (os.path.join(ck.dir, fname), storage))
    S = ck.splits
    ck_metas = ck.metas
    if metas is not None:
        ck.check_model(metas)
    check_rank(ck_metas, layout.ranks.get(rank, {}), rank, S)
    st = LoadStats()
    used: dict[int, tuple[Storage, int, float]] = {}  # id -> (storage, calls, bytes) before
    t0 = time.perf_counter()
    files = ck.manifest["files"]
    headers, handles, paths = {}, {}, {}
    try:
        for fname in files_needed(ck_metas, layout, rank, S, files):
            p, src = locate(fname)
            paths[fname] = p
            used.setdefault(id(src), (src, src.stats.read_calls, src.stats.read_bytes))
            h = src.open_read(p)
            handles[fname] = h
            first = h.pread(0, 8)
            n = header_length(first) if len(first) == 8 else 8
            if n > h.size:
                raise CheckpointError(f"{p}: truncated safetensors header (needs {n} bytes, file has {h.size})")
            prefix = first + h.pread(8, n - 8)
            if sha256(prefix) != files[fname]["header_sha256"]:
                raise CheckpointError(f"{p}: header checksum mismatch (sha256 differs from the manifest)")
            _, headers[fname] = parse_header(prefix, p, h.size)
        index = key_index(headers, {f: files[f] for f in headers})
        blocks = read_plan(ck_metas, layout, rank, S, index)
        t1 = time.perf_counter()
        raw: dict = {}
        for b in blocks:
            buf = memoryview(handles[b.file].pread(b.offset, b.length))
            if len(buf) != b.length:
                raise CheckpointError(f"{paths[b.file]}: truncated (short read at byte {b.offset})")
            for n in b.needs:
                lo = n.entry.offset - b.offset
                piece = buf[lo:lo + n.entry.length]
                if sha256(piece) != files[b.file]["keys"][n.entry.key][2]:
                    raise CheckpointError(f"{paths[b.file]}: checksum mismatch in key {n.entry.key}")
                raw[(n.name, n.split)] = to_tensor(piece, n.entry)
                st.covered.append((n.name, n.split))
                st.slices_by_file[b.file] = st.slices_by_file.get(b.file, 0) + 1
                st.bytes_needed += n.entry.length
        t2 = time.perf_counter()
    finally:
        for h in handles.values():
            h.close()
    own = layout.ranks.get(rank, {})
    out = {}
    for m in ck_metas:
        if m.name in own:
            parts = [raw[(m.name, j)] for j in split_range(own[m.name], S, m)]
            out[m.name] = join(parts, m) if m.dim is not None else parts[0]
    t3 = time.perf_counter()
    st.read_calls = sum(src.stats.read_calls - c0 for src, c0, _ in used.values())
    st.bytes_read = sum(src.stats.read_bytes - b0 for src, _, b0 in used.values())
    st.blocks, st.files = len(blocks), len(headers)
    st.t_metadata_s, st.t_io_s, st.t_assembly_s = t1 - t0, t2 - t1, t3 - t2
    return out, st
