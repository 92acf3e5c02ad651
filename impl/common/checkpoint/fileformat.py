"""One safetensors file per rank: key naming, ordering, serialisation and header parsing.

Keys are ``<8-digit seq>_<name>_split_<j>`` (or ``_full``). The safetensors writer lays tensors
out by dtype (descending alignment), then key; the sequence number is assigned in the order
(dtype, split index, model order), so on disk every dtype's tensors run split 0 of all
tensors, then split 1, ...: the tensors a rank needs from one split index (a contiguous
range of layers, or all of them) are one byte range. Nothing here unpickles: a header is JSON
and tensor bytes go through ``torch.frombuffer``.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from safetensors.torch import save as st_save

from .layout import DTYPES

ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
             "I32": "int32", "U8": "uint8"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or used; the message is one line naming the file."""


def split_key(seq: int, name: str, j: Optional[int]) -> str:
    return f"{seq:08d}_{name}_" + ("full" if j is None else f"split_{j:04d}")


@dataclass(frozen=True)
class WriteItem:
    """One unit a rank writes: split ``j`` (None: whole) of tensor ``name``."""

    name: str
    split: Optional[int]
    tensor: torch.Tensor


def file_order(dtype: torch.dtype, split: Optional[int], model_pos: int) -> tuple:
    """Where a key goes in its file: by dtype, then split index (whole tensors first), then
    model order (what :func:`serialize` sorts by; the sim lays out paper-scale files with it)."""
    return (str(dtype), -1 if split is None else split, model_pos)


def serialize(items: Sequence[WriteItem], order: dict[str, int]) -> tuple[bytes, dict[str, list]]:
    """safetensors bytes and ``key -> [name, split]``; ``order`` is the model order of names."""
    ranked = sorted(items, key=lambda it: file_order(it.tensor.dtype, it.split, order[it.name]))
    tensors, keys = {}, {}
    for seq, it in enumerate(ranked):
        k = split_key(seq, it.name, it.split)
        tensors[k] = it.tensor.contiguous()
        keys[k] = [it.name, it.split]
    return st_save(tensors), keys


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    length: int


def parse_header(prefix: bytes, file: str, size: int) -> tuple[int, dict[str, Entry]]:
    """(header bytes incl. the 8-byte length, key -> Entry) from the file's first bytes."""
    if len(prefix) < 8:
        raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if 8 + n > len(prefix):
        raise CheckpointError(f"{file}: truncated safetensors header (needs {8 + n} bytes, file has {len(prefix)})")
    try:
        hdr = json.loads(prefix[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e.__class__.__name__})") from None
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        if v["dtype"] not in ST_DTYPES:
            raise CheckpointError(f"{file}: key {k} has unsupported dtype {v['dtype']}")
        out[k] = Entry(k, ST_DTYPES[v["dtype"]], tuple(v["shape"]), 8 + n + a, b - a)
        if 8 + n + b > size:
            raise CheckpointError(f"{file}: truncated safetensors file (key {k} ends at byte {8 + n + b}, "
                                  f"file has {size})")
    return 8 + n, out


def header_length(first8: bytes) -> int:
    return 8 + struct.unpack("<Q", first8[:8])[0]


def to_tensor(buf: memoryview | bytes, e: Entry) -> torch.Tensor:
    dt = DTYPES[e.dtype]
    if e.length == 0:
        return torch.empty(e.shape, dtype=dt)
    return torch.frombuffer(bytearray(buf), dtype=dt).reshape(e.shape)


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
