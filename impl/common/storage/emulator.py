"""One storage model for every path that reads or writes a store (checkpoints, DCP, SwiftDiffusion's
remote LoRA store): counted file I/O with an optional emulated
per-request latency and per-rank bandwidth cap (the emulated NAS of checkpoint recovery's real mode [R],
impl/ckpt_recovery/README.md: 5 ms per call, 200 MB/s per rank).

A *call* is one I/O request: opening a file, or a read/write that does not continue where the
previous one on the same handle ended (a seek). Sequential reads/writes on one handle stream
as one request; that is how a NAS client's read-ahead and write-behind see them. The same rule
prices our block reads (:class:`Storage.pread`) and DCP's stream reads
(:mod:`impl.common.storage.dcp_fs`), so the comparison is on requests and bytes, not on how
each library chunks its syscalls.

Emulation sleeps: the wall time it adds is real time the caller waits, and records that use
a profile other than ``local`` must list it in ``RunResult.emulated``.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from impl.common.api import ConfigError


@dataclass(frozen=True)
class StorageProfile:
    """Per-call latency and per-rank bandwidth of a store; ``0`` bandwidth = uncapped."""

    name: str = "local"
    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    # Emulated seconds -> wall seconds: shrinks a paper-scale store's times to fit a CPU run
    # (SwiftDiffusion's LoRA store); 1 for the checkpoint paths.
    time_scale: float = 1.0
    # Who shares ``bandwidth_bytes_per_s``: "rank" (each rank has it: the emulator's cap),
    # "node" (the ranks of a node share it: local NVMe, a node's NICs) or "aggregate" (every
    # rank of the job shares it: a NAS). Only the sim prices "node" / "aggregate".
    scope: str = "rank"
    # Node-local stores lose a dead node's files; a checkpoint there is also written to a
    # buddy node (``write_copies`` = 2), whose copy the recovery reads.
    node_local: bool = False
    write_copies: int = 1

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bytes_per_s < 0 or self.time_scale < 0:
            raise ConfigError(f"storage.{self.name}: latency_s ({self.latency_s}), bandwidth_bytes_per_s "
                              f"({self.bandwidth_bytes_per_s}) and time_scale ({self.time_scale}) must be >= 0")
        if self.scope not in SCOPES:
            raise ConfigError(f"storage.{self.name}.scope: unknown {self.scope!r} (one of: {', '.join(SCOPES)})")
        if self.write_copies < 1:
            raise ConfigError(f"storage.{self.name}.write_copies must be >= 1, got {self.write_copies}")

    @property
    def emulated(self) -> bool:
        return self.latency_s > 0 or self.bandwidth_bytes_per_s > 0

    def cost_s(self, calls: int, nbytes: float) -> float:
        bw = nbytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s else 0.0
        return (calls * self.latency_s + bw) * self.time_scale

    def label(self) -> str:
        """The line a record's ``provenance.emulated`` names this store with."""
        bw = f"{self.bandwidth_bytes_per_s / 1e9:.3g} GB/s" if self.bandwidth_bytes_per_s else "uncapped bandwidth"
        return (f"{self.name}: file I/O at {bw} per rank + {self.latency_s * 1e3:.3g} ms per call"
                + (f", x{self.time_scale:g} time scale" if self.time_scale != 1 else "") + " (emulated)")


SCOPES = ("rank", "node", "aggregate")

PROFILES = {
    "local": StorageProfile("local"),
    "nas": StorageProfile("nas", latency_s=5e-3, bandwidth_bytes_per_s=200e6),
    # Another node's host memory (the peer tier's real mode): one rank's share of a 100 Gb/s
    # NIC and an RDMA round trip per call ([R]: emulated nodes share one host's memory).
    "net": StorageProfile("net", latency_s=2e-5, bandwidth_bytes_per_s=12.5e9),
}


# The sim's paper-scale stores ([R], impl/ckpt_recovery/README.md): NAS by aggregate bandwidth and per-call
# latency, local NVMe per node (with a buddy copy), peer CPU memory over a node's 400 GB/s of
# NICs (latency per call [R] 20 us: an RDMA round trip plus a memory registration).
PAPER_PROFILES = {
    "nas5": StorageProfile("nas5", latency_s=5e-3, bandwidth_bytes_per_s=5e9, scope="aggregate"),
    "nas20": StorageProfile("nas20", latency_s=2e-3, bandwidth_bytes_per_s=20e9, scope="aggregate"),
    "nvme": StorageProfile("nvme", latency_s=1e-4, bandwidth_bytes_per_s=4e9, scope="node", node_local=True,
                           write_copies=2),
    "network": StorageProfile("network", latency_s=2e-5, bandwidth_bytes_per_s=400e9, scope="node",
                              node_local=True, write_copies=1),
}


def paper_profile(name: str) -> StorageProfile:
    if name not in PAPER_PROFILES:
        raise ConfigError(f"storage: unknown profile {name!r} (one of: {', '.join(PAPER_PROFILES)})")
    return PAPER_PROFILES[name]


def profile(name: str) -> StorageProfile:
    if name not in PROFILES:
        raise ConfigError(f"storage: unknown profile {name!r} (one of: {', '.join(PROFILES)})")
    return PROFILES[name]


@dataclass
class IOStats:
    read_calls: int = 0
    read_bytes: float = 0
    write_calls: int = 0
    write_bytes: float = 0
    emulated_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __getstate__(self) -> dict:  # a Storage handed to a rank process starts its own lock
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def to_dict(self) -> dict:
        return {"read_calls": self.read_calls, "read_bytes": self.read_bytes, "write_calls": self.write_calls,
                "write_bytes": self.write_bytes, "emulated_s": self.emulated_s}


class Storage:
    """Counted file I/O under a :class:`StorageProfile` (one instance per rank: the bandwidth
    cap is per rank)."""

    def __init__(self, prof: Optional[StorageProfile] = None) -> None:
        self.profile = prof or PROFILES["local"]
        self.stats = IOStats()

    # ---- accounting (also used by the DCP stream wrapper) --------------------------------
    def charge(self, kind: str, calls: int, nbytes: float) -> None:
        cost = self.profile.cost_s(calls, nbytes)
        with self.stats._lock:
            if kind == "read":
                self.stats.read_calls += calls
                self.stats.read_bytes += nbytes
            else:
                self.stats.write_calls += calls
                self.stats.write_bytes += nbytes
            self.stats.emulated_s += cost
        if cost > 0:
            time.sleep(cost)

    # ---- reads ---------------------------------------------------------------------------
    def read_file(self, path: str, charge_bytes: Optional[float] = None) -> bytes:
        """The file's bytes, as one request; ``charge_bytes`` prices it as a file of that size
        (a tiny LoRA file standing for a paper-scale one)."""
        with open(path, "rb") as f:
            data = f.read()
        self.charge("read", 1, len(data) if charge_bytes is None else charge_bytes)
        return data

    def open_read(self, path: str) -> "ReadHandle":
        return ReadHandle(self, path)

    # ---- writes --------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | memoryview, fsync: bool = True,
                   midway: Optional[Callable[[], None]] = None) -> None:
        """Write ``data`` to a new file as one request and fsync it (the rename that publishes
        it is the caller's). ``midway`` runs after half the bytes (a crash test's kill point)."""
        with open(path, "xb") as f:
            if midway is not None:
                half = len(data) // 2
                f.write(data[:half])
                f.flush()
                midway()
                f.write(data[half:])
            else:
                f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        self.charge("write", 1, len(data))


class ReadHandle:
    """An open file whose :meth:`pread` calls are counted (a non-contiguous one is a call)."""

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage, self.path = storage, path
        self._f = open(path, "rb")
        self._pos: Optional[int] = None
        self.size = os.fstat(self._f.fileno()).st_size

    def pread(self, offset: int, n: int) -> bytes:
        data = os.pread(self._f.fileno(), n, offset)
        self.storage.charge("read", 0 if self._pos == offset else 1, len(data))
        self._pos = offset + len(data)
        return data

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ReadHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fsync_dir(path: str) -> None:
    """Make a rename or an unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
