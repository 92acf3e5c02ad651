"""Keep freed host memory inside the process, as a GPU caching allocator keeps device memory.

glibc's malloc serves a block at or above its mmap threshold with a fresh ``mmap`` and gives
it back to the kernel on ``free``; a heap top above the trim threshold goes back too. A CPU
forward that frees and re-allocates multi-MB activations therefore page-faults on the first
touch of every such tensor, every call: measured on this project's 2-core VM, 8-25k minor
faults per forward of the fidelity UNet (``fisedit_cpu_wide``, 1 thread), and with them
removed the forward took 586-632 ms where it took 654-685 ms (three alternating fresh
processes each, median of 8 forwards; bench/fidelity/README.md, session 12). The fault count
moves between runs, so the cost is also noise. CUDA's caching allocator never returns freed
blocks to the driver during a run, so a GPU step pays nothing of the kind, and neither do
the simulator's cost models. :func:`retain_freed_host_memory` raises both thresholds
(``mallopt``): the effect PyTorch's CPU performance tuning guide gets by recommending a caching
allocator (jemalloc / tcmalloc), here from glibc itself, with no other library to install.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from typing import Callable

from impl.common.registry import Registry

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc caps M_MMAP_THRESHOLD at HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit: larger blocks still mmap.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


@functools.lru_cache(maxsize=None)
def _libc():
    if platform.system() != "Linux":
        return None
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6")
        lib.mallopt  # noqa: B018 - glibc only (musl has no mallopt)
    except (OSError, AttributeError):
        return None
    return lib


_retained = False  # mallopt has no getter: whether this process has set the thresholds


def retain_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (permanent, process-wide).
    Returns whether it applied: False where the C library is not glibc (nothing changed)."""
    global _retained
    lib = _libc()
    if lib is None:
        return False
    _retained = bool(lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _retained


def retained() -> bool:
    """Whether freed host memory is retained in this process (set once, it stays for the
    process: a later ``default`` job in the same process, e.g. a Hydra multirun, still has it)."""
    return _retained


# What each ``host_malloc`` policy does to the process; both say whether the retain setting is
# in force afterwards.
HOST_MALLOC: Registry[Callable[[], bool]] = Registry("value", "workload.host_malloc")
HOST_MALLOC.add("retain", retain_freed_host_memory)
HOST_MALLOC.add("default", retained)


def check_host_malloc(policy: str, field: str = "workload.host_malloc") -> None:
    """An unknown policy is a one-line error naming ``field``."""
    HOST_MALLOC.get(policy, field)


def apply_host_malloc(policy: str, field: str = "workload.host_malloc") -> bool:
    """``retain``: :func:`retain_freed_host_memory`; ``default``: leave the allocator alone.
    Returns whether the retain setting is in force (:func:`retained`: also after an earlier
    ``retain`` in this process)."""
    return HOST_MALLOC.get(policy, field)()


def host_malloc_in_force(policy: str, field: str = "workload.host_malloc") -> str:
    """Apply ``policy`` and name what the process runs under (``retain`` | ``default``), for records."""
    return "retain" if apply_host_malloc(policy, field) else "default"
