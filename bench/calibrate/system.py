"""``system=harness/calibrate``: measure this machine and write ``conf/hardware/local.yaml``.

What is measured, and how each figure is defined (units in every name):

- ``peak_flops[dtype]``: an ``n x n @ n x n`` matmul counts ``2 n^3`` FLOP; per size the median
  over repeats (after warm-up) is taken, and the best size's samples are reported. On CUDA the
  device is synchronised around every timed call; ``tf32`` means fp32 inputs with TF32 tensor
  cores allowed (CUDA only).
- ``conv_flops[dtype]``: 3x3 same-padded convs at UNet block shapes, direct-conv FLOPs.
- ``conv_window_flops`` / ``window_gather_bytes_per_s`` / ``window_scatter_bytes_per_s``
  ``[dtype]``: the three kernels of a block-sparse conv (``impl.common.diffusion.windows``) on
  the same shapes, 2x2 output blocks over a quarter of the map: the conv's FLOP/s on the
  (N, C, 4, 4) windows, and the bytes/s of the window gather and of the block scatter.
- ``cell_gather`` / ``cell_scatter`` / ``token_gather`` / ``token_scatter_bytes_per_s[dtype]``:
  the engine's 1x1-conv cell pick and token-row pick and their scatters, same shapes and cells.
- ``host_dispatch_s`` (CPU only): seconds per tiny ``a + b`` called from Python, the host cost
  of one dispatch-bound torch call.
- ``attn_flops[dtype]``: ``scaled_dot_product_attention`` at UNet self/cross-attention shapes,
  FLOPs ``4 B H Nq Nk d``.
- ``linear_flops[dtype]``: ``nn.Linear`` with bias on ``(B, N, C)`` activations at UNet
  transformer-block shapes (``LINEAR_SHAPES``: projections, the 4x-wide FF, text K/V), FLOPs
  ``2 B N C_in C_out``.
- ``activation_bytes_per_s`` / ``elementwise_bytes_per_s[dtype]``: a forward's non-module
  tensor work (``impl.common.diffusion.cost.GlueTracer``) at UNet sizes (``GLUE_SHAPES``):
  SiLU and GELU, and adds, a multiply, a division, a concatenation and a strided copy
  (``.contiguous()`` of a transposed activation); bytes read + written over time.
- The process keeps freed host memory (``host_malloc: retain``, ``impl.common.host_alloc``), as
  the real runs priced with this profile do.
- On a CPU ``conv_flops`` and ``conv_window_flops`` are timed with cold weights (caches evicted,
  then the input read back, before each timed call: ``weights_evictor``), as in a UNet step that
  streams its weights from DRAM; every other figure is timed back to back.
- ``memory_bw_bytes_per_s``: ``dst.copy_(src)`` of a large buffer on the device, counted as
  bytes read + bytes written (``2 x size / t``, the STREAM "copy" convention).
- ``host_mem_bw_bytes_per_s``: the same copy on host (CPU) tensors.
- ``host_link_bw_bytes_per_s``: bytes moved once per second, ``size / t``: a pinned host ->
  device copy on CUDA; on a CPU-only host there is no link, and a host memcpy stands in
  (named in ``RunResult.emulated``).
- ``intra_node_*``: point-to-point between two local processes over gloo (loopback TCP), by
  ping-pong: one-way time = round trip / 2. Latency is the smallest message's one-way time,
  bandwidth is ``size / one-way time`` of the largest message.
- ``inter_node_*``: one machine cannot measure a network between machines; the loopback
  figures are written there too, and ``RunResult.info["not_measured"]`` says so.
- ``allreduce_*``: ``all_reduce`` (sum) over all the processes. Bandwidth is the nccl-tests
  *bus bandwidth* of a ring: ``busbw = (S / t) * 2 (n - 1) / n`` for ``S`` bytes on ``n``
  ranks (for ``n = 2`` this equals ``S / t``). Latency is the smallest message's time.

The written profile is measured achievable figures, so ``mfu`` and ``comm_efficiency`` are 1.0.
The file is written atomically (temporary file in the same folder, then ``os.replace``).
"""
from __future__ import annotations

import datetime as _dt
import os
import pathlib
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from impl.common.api import ConfigError, JobContext, Metric, RunResult, System
from bench.calibrate.comm import measure_comm
from impl.common.diffusion.windows import (gather_cells, gather_tokens, gather_windows, pad_for_windows, scatter_blocks,
                                           scatter_cells, scatter_tokens, window_size)
from impl.common.hardware import DiffusionRates, HardwareProfile
from impl.common.host_alloc import check_host_malloc, host_malloc_in_force
from impl.common.execution import set_torch_threads

MATMUL_DTYPES = ("fp32", "tf32", "fp16", "bf16")
_TORCH_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_MATMUL_SIZES = {"cpu": [256, 512, 1024], "cuda": [2048, 4096, 8192]}
DEFAULT_MEM_BW_BYTES = {"cpu": 64 * 2**20, "cuda": 1 * 2**30}
PLOT_NAME = "calibrate_p2p.png"


def _positive_ints(name: str, values: List[int]) -> None:
    if not values:
        raise ConfigError(f"system.{name}: needs at least one entry")
    bad = [v for v in values if int(v) <= 0]
    if bad:
        raise ConfigError(f"system.{name}: every entry must be > 0, got {bad[0]}")


@dataclass
class CalibrateConfig:
    # Square matmul sizes n; null = per device ([256, 512, 1024] on CPU, [2048, 4096, 8192] on CUDA).
    matmul_sizes: Optional[List[int]] = None
    dtypes: List[str] = field(default_factory=lambda: ["fp32", "bf16"])
    warmup: int = 2
    repeats: int = 10
    # A measurement stops repeating after this many seconds once it has min_repeats samples.
    max_seconds_per_measurement: float = 0.5
    min_repeats: int = 3
    # Copy buffer for memory bandwidth; null = 64 MiB on CPU (2x a 32 MiB L3), 1 GiB on CUDA.
    mem_bw_bytes: Optional[int] = None
    # Local processes for the gloo measurements (p2p uses ranks 0 and 1; all-reduce uses all).
    comm_procs: int = 2
    p2p_sizes_bytes: List[int] = field(default_factory=lambda: [8, 1024, 16384, 262144, 1048576, 4194304])
    allreduce_sizes_bytes: List[int] = field(default_factory=lambda: [8, 4194304])
    # Rendezvous and every collective time out after this; the whole phase after twice this.
    comm_timeout_s: float = 60.0
    device: str = "auto"  # auto | cpu | cuda
    # torch intra-op threads for the matmul and memory measurements; 0 = torch's default (every
    # core). A run that pins workload.torch_threads=1 gets a fraction of an all-core profile's
    # FLOP/s: price it with a profile measured at its thread count (conf/hardware/local-t1.yaml).
    threads: int = 0
    # Relative paths resolve against the current working directory (the harness keeps the
    # original cwd); absolute paths are used as given.
    output: str = "conf/hardware/local.yaml"
    # retain = keep freed host memory in the process (impl.common.host_alloc), as the real runs
    # do; default = the C library's own behaviour.
    host_malloc: str = "retain"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.matmul_sizes is not None:
            _positive_ints("matmul_sizes", self.matmul_sizes)
        if not self.dtypes:
            raise ConfigError("system.dtypes: needs at least one dtype (one of: " + ", ".join(MATMUL_DTYPES) + ")")
        for d in self.dtypes:
            if d not in MATMUL_DTYPES:
                raise ConfigError(f"system.dtypes: unknown dtype {d!r} (one of: {', '.join(MATMUL_DTYPES)})")
        if self.warmup < 0:
            raise ConfigError(f"system.warmup: must be >= 0, got {self.warmup}")
        if self.min_repeats < 1:
            raise ConfigError(f"system.min_repeats: must be >= 1, got {self.min_repeats}")
        if self.repeats < self.min_repeats:
            raise ConfigError(f"system.repeats: must be >= min_repeats ({self.min_repeats}), got {self.repeats}")
        if not self.max_seconds_per_measurement > 0:
            raise ConfigError(f"system.max_seconds_per_measurement: must be > 0, got {self.max_seconds_per_measurement}")
        if self.mem_bw_bytes is not None and self.mem_bw_bytes < 1024:
            raise ConfigError(f"system.mem_bw_bytes: must be >= 1024, got {self.mem_bw_bytes}")
        if self.comm_procs < 2:
            raise ConfigError(f"system.comm_procs: point-to-point needs 2 processes, got {self.comm_procs}")
        _positive_ints("p2p_sizes_bytes", self.p2p_sizes_bytes)
        _positive_ints("allreduce_sizes_bytes", self.allreduce_sizes_bytes)
        if not self.comm_timeout_s > 0:
            raise ConfigError(f"system.comm_timeout_s: must be > 0, got {self.comm_timeout_s}")
        if self.threads < 0:
            raise ConfigError(f"system.threads: must be >= 0 (0 = torch's default), got {self.threads}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"system.device: unknown device {self.device!r} (one of: auto, cpu, cuda)")
        check_host_malloc(self.host_malloc, "system.host_malloc")
        if not str(self.output).strip():
            raise ConfigError("system.output: needs a path (e.g. conf/hardware/local.yaml)")


# --------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------

def _timed_samples(fn: Callable[[], Any], sync: Callable[[], None], cfg: CalibrateConfig,
                   before: Optional[Callable[[], None]] = None) -> List[float]:
    """Seconds per call: ``cfg.warmup`` untimed calls, then up to ``cfg.repeats`` timed ones;
    ``before`` runs untimed ahead of each timed call (e.g. :func:`weights_evictor`)."""
    for _ in range(cfg.warmup):
        fn()
    sync()
    samples: List[float] = []
    budget_end = time.perf_counter() + cfg.max_seconds_per_measurement
    while len(samples) < cfg.repeats:
        if before is not None:
            before()
            sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
        if len(samples) >= cfg.min_repeats and time.perf_counter() > budget_end:
            break
    return samples


# In a UNet step a conv's weights come from DRAM: the step streams all its weights (~100 MiB
# on the fidelity UNet) past a CPU's last-level cache (32 MiB here) between two uses, while a conv
# timed back to back finds its weights in cache (a 12^2 3x3 conv at 256 channels runs 25% faster
# warm). Its input, the previous op's output, is in cache. So on a CPU the conv and window-conv
# rates are timed with the caches evicted (EVICT_BYTES of other memory written) and the input
# then read back in before each timed call; gathers, scatters and attention (no weights: their
# operands were just written) stay warm.
EVICT_BYTES = 64 * 2**20


def weights_evictor(device: torch.device, keep: torch.Tensor) -> Optional[Callable[[], None]]:
    """An untimed ``before`` for :func:`_timed_samples`: evict the CPU caches, then read ``keep``
    (the op's input) back in; None on a GPU (not evicted)."""
    if device.type != "cpu":
        return None
    buf = torch.empty(EVICT_BYTES // 4, dtype=torch.float32)

    def before() -> None:
        buf.fill_(1.0)
        keep.sum()

    return before


# The 3x3 convolutions calibrate times (batch, channels, spatial): UNet/ResNet block shapes at
# three resolutions (a conv library's rate moves with the shape: 110-260 GFLOP/s on one core).
CONV_SHAPES = {"cpu": [(2, 128, 48), (2, 256, 24), (2, 256, 12)], "cuda": [(8, 320, 64), (8, 640, 32), (8, 1280, 16)]}


def _mix_rate(per_shape: List[tuple]) -> List[float]:
    """Per sample round i, the total work of the shapes over their total time (the rate a mix
    of them sees); ``per_shape`` holds (work, [seconds per round])."""
    n = min(len(secs) for _, secs in per_shape)
    total = sum(q for q, _ in per_shape)
    return [total / sum(secs[i] for _, secs in per_shape) for i in range(n)]


def measure_conv(dtype: str, device: torch.device, sync: Callable[[], None], cfg: CalibrateConfig) -> List[float]:
    """FLOP/s of 3x3, stride-1, same-padded convs, FLOPs = 2 B C^2 9 H W (the direct conv's):
    per sample round, total FLOPs over total time of the shapes (the rate a mix of them sees)."""
    per_shape = []
    for b, c, hw in CONV_SHAPES[device.type]:
        conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False).to(device=device, dtype=_TORCH_DTYPE[dtype]).eval()
        x = torch.randn(b, c, hw, hw, device=device, dtype=_TORCH_DTYPE[dtype])
        with torch.no_grad():
            per_shape.append((2.0 * b * c * c * 9 * hw * hw,
                              _timed_samples(lambda: conv(x), sync, cfg, weights_evictor(device, x))))
    return _mix_rate(per_shape)


# The gathered-window conv calibrate times: the same shapes, at the engine's paper block (2x2
# output blocks of a 3x3 stride-1 conv: (N, C, 4, 4) windows), a centred square of blocks
# covering WINDOW_ACTIVE of the map active (N = B x active blocks, 18-288 windows on the CPU).
WINDOW_BLOCK = 2
WINDOW_ACTIVE = 0.25


def measure_window_conv(dtype: str, device: torch.device, sync: Callable[[], None],
                        cfg: CalibrateConfig) -> Dict[str, List[float]]:
    """A block-sparse conv's three kernels on gathered windows (``impl.common.diffusion.windows``,
    the engine's own gather and scatter): ``flops`` = FLOP/s of the batched conv on the windows
    (2 N C^2 9 bo^2, the active blocks' direct-conv FLOPs), ``gather`` = window bytes gathered
    per second, ``scatter`` = block bytes scattered per second; per sample round, totals over
    the shapes."""
    bo, tdt = WINDOW_BLOCK, _TORCH_DTYPE[dtype]
    win, esize = window_size(bo, 1, 3), torch.empty((), dtype=tdt).element_size()
    per_shape = []
    for b, c, hw in CONV_SHAPES[device.type]:
        nbs = -(-hw // bo)
        side = max(1, round(nbs * WINDOW_ACTIVE ** 0.5))
        lo = (nbs - side) // 2
        r = torch.arange(lo, lo + side, device=device)
        idx = torch.cartesian_prod(r, r)
        x = torch.randn(b, c, hw, hw, device=device, dtype=tdt)
        out = torch.randn(b, c, hw, hw, device=device, dtype=tdt)
        w = torch.randn(c, c, 3, 3, device=device, dtype=tdt)
        xp = pad_for_windows(x, (1, 1), (nbs, nbs), bo, win)
        patches = gather_windows(xp, idx, win, bo)
        with torch.no_grad():
            y = F.conv2d(patches, w)
            n = patches.shape[0]
            per_shape.append({
                "flops": (2.0 * n * c * c * 9 * bo * bo, _timed_samples(lambda: F.conv2d(patches, w), sync, cfg,
                                                                         weights_evictor(device, patches))),
                "gather": (float(patches.numel() * esize),
                           _timed_samples(lambda: gather_windows(xp, idx, win, bo), sync, cfg)),
                "scatter": (float(y.numel() * esize), _timed_samples(lambda: scatter_blocks(out, idx, y, bo), sync, cfg)),
            })
    return {key: _mix_rate([sh[key] for sh in per_shape]) for key in per_shape[0]}


def measure_cell_token_gathers(dtype: str, device: torch.device, sync: Callable[[], None],
                               cfg: CalibrateConfig) -> Dict[str, List[float]]:
    """The engine's other gathers (``impl.common.diffusion.windows``) at the conv shapes, a
    centred square of WINDOW_ACTIVE of the cells active: ``cell_gather`` / ``cell_scatter`` =
    bytes/s of a 1x1 conv's pick of the active cells of every channel and of its scatter back,
    ``token_gather`` / ``token_scatter`` = the same cells as the tokens (rows of C) of a
    (B, H W, C) sequence; per sample round, total bytes over total time of the shapes."""
    tdt = _TORCH_DTYPE[dtype]
    esize = torch.empty((), dtype=tdt).element_size()
    per_shape = []
    for b, c, hw in CONV_SHAPES[device.type]:
        side = max(1, round(hw * WINDOW_ACTIVE ** 0.5))
        lo = (hw - side) // 2
        r = torch.arange(lo, lo + side, device=device)
        flat = (r[:, None] * hw + r[None, :]).flatten()
        x = torch.randn(b, c, hw, hw, device=device, dtype=tdt)
        out = torch.randn(b, c, hw, hw, device=device, dtype=tdt)
        seq = torch.randn(b, hw * hw, c, device=device, dtype=tdt)
        seq_out = torch.randn(b, hw * hw, c, device=device, dtype=tdt)
        ya, ta = gather_cells(x, flat), gather_tokens(seq, flat)
        nbytes = float(ya.numel() * esize)
        per_shape.append({
            "cell_gather": (nbytes, _timed_samples(lambda: gather_cells(x, flat), sync, cfg)),
            "cell_scatter": (nbytes, _timed_samples(lambda: scatter_cells(out, flat, ya), sync, cfg)),
            "token_gather": (nbytes, _timed_samples(lambda: gather_tokens(seq, flat), sync, cfg)),
            "token_scatter": (nbytes, _timed_samples(lambda: scatter_tokens(seq_out, flat, ta), sync, cfg)),
        })
    return {key: _mix_rate([sh[key] for sh in per_shape]) for key in per_shape[0]}


DISPATCH_CALLS = 200  # tiny ops per timed sample: one call is ~1 us, far under the timer's resolution


def measure_dispatch(device: torch.device, sync: Callable[[], None], cfg: CalibrateConfig) -> List[float]:
    """Host seconds per dispatch-bound torch call: ``a + b`` on 4-element tensors from Python
    (argument parsing, dispatcher, output allocation; the arithmetic is nothing), per call."""
    a, b = torch.randn(4, device=device), torch.randn(4, device=device)

    def calls() -> None:
        for _ in range(DISPATCH_CALLS):
            a + b

    return [t / DISPATCH_CALLS for t in _timed_samples(calls, sync, cfg)]


# The attention cores calibrate times (batch, heads, query tokens, key tokens, head dim): a
# UNet's self-attention at two resolutions and its cross-attention to 77 text tokens.
ATTN_SHAPES = {"cpu": [(2, 8, 576, 576, 32), (2, 8, 144, 144, 32), (2, 8, 576, 77, 32)],
               "cuda": [(2, 5, 4096, 4096, 64), (2, 10, 1024, 1024, 64), (2, 5, 4096, 77, 64)]}


def measure_attention(dtype: str, device: torch.device, sync: Callable[[], None], cfg: CalibrateConfig) -> List[float]:
    """FLOP/s of ``scaled_dot_product_attention``, FLOPs = 4 B H Nq Nk d (QK^T and PV); per
    sample round, total FLOPs over total time of the shapes."""
    per_shape = []
    tdt = _TORCH_DTYPE[dtype]
    for b, h, nq, nk, d in ATTN_SHAPES[device.type]:
        q = torch.randn(b, h, nq, d, device=device, dtype=tdt)
        k = torch.randn(b, h, nk, d, device=device, dtype=tdt)
        v = torch.randn(b, h, nk, d, device=device, dtype=tdt)
        with torch.no_grad():
            per_shape.append((4.0 * b * h * nq * nk * d,
                              _timed_samples(lambda: F.scaled_dot_product_attention(q, k, v), sync, cfg)))
    return _mix_rate(per_shape)


# The token linears calibrate times (batch, tokens, in, out): a UNet transformer block's
# projections and FF (GEGLU's 2 x 4C-wide input projection, the 4C -> C output) at two
# resolutions, and the cross-attention K/V projection of 77 text tokens.
LINEAR_SHAPES = {"cpu": [(2, 576, 256, 256), (2, 576, 256, 2048), (2, 576, 1024, 256), (2, 144, 256, 256),
                         (2, 144, 256, 2048), (2, 77, 64, 256)],
                 "cuda": [(2, 4096, 320, 320), (2, 4096, 320, 2560), (2, 4096, 1280, 320), (2, 1024, 640, 640),
                          (2, 1024, 640, 5120), (2, 77, 768, 320)]}


def measure_linear(dtype: str, device: torch.device, sync: Callable[[], None], cfg: CalibrateConfig) -> List[float]:
    """FLOP/s of ``nn.Linear`` (with bias) on (B, N, C) activations, FLOPs = 2 B N C_in C_out;
    per sample round, total FLOPs over total time of the shapes."""
    per_shape = []
    tdt = _TORCH_DTYPE[dtype]
    for b, n, cin, cout in LINEAR_SHAPES[device.type]:
        lin = torch.nn.Linear(cin, cout).to(device=device, dtype=tdt).eval()
        x = torch.randn(b, n, cin, device=device, dtype=tdt)
        with torch.no_grad():
            per_shape.append((2.0 * b * n * cin * cout, _timed_samples(lambda: lin(x), sync, cfg)))
    return _mix_rate(per_shape)


# The glue calibrate times, (op, shape): activations over a resnet's maps and a GEGLU's gate;
# the elementwise mix of residual adds, GEGLU's product, an output-scale division, a skip
# concatenation and the head transposes' copy.
GLUE_SHAPES = {"cpu": {"activation": [("silu", (2, 128, 48, 48)), ("silu", (2, 256, 24, 24)), ("gelu", (2, 576, 1024))],
                       "elementwise": [("add", (2, 128, 48, 48)), ("add", (2, 576, 256)), ("mul", (2, 576, 1024)),
                                       ("div", (2, 256, 24, 24)), ("cat", (2, 256, 24, 24)),
                                       ("copy", (2, 576, 256))]},
               "cuda": {"activation": [("silu", (2, 320, 64, 64)), ("silu", (2, 640, 32, 32)), ("gelu", (2, 4096, 1280))],
                        "elementwise": [("add", (2, 320, 64, 64)), ("add", (2, 4096, 320)), ("mul", (2, 4096, 1280)),
                                        ("div", (2, 640, 32, 32)), ("cat", (2, 640, 32, 32)),
                                        ("copy", (2, 4096, 320))]}}


def _glue_call(op: str, x: torch.Tensor, y: torch.Tensor) -> tuple[Callable[[], Any], int]:
    """The call and its elements read + written."""
    n = x.numel()
    if op == "silu":
        return (lambda: F.silu(x)), 2 * n
    if op == "gelu":
        return (lambda: F.gelu(x)), 2 * n
    if op == "add":
        return (lambda: x + y), 3 * n
    if op == "mul":
        return (lambda: x * y), 3 * n
    if op == "div":
        return (lambda: x / 1.5), 2 * n
    if op == "cat":
        return (lambda: torch.cat([x, y], dim=1)), 4 * n
    t = x.transpose(1, 2)
    return (lambda: t.contiguous()), 2 * n


def measure_glue(dtype: str, device: torch.device, sync: Callable[[], None],
                 cfg: CalibrateConfig) -> Dict[str, List[float]]:
    """Bytes/s (read + written) of each glue kind's mix (``GLUE_SHAPES``), fresh outputs per call."""
    tdt = _TORCH_DTYPE[dtype]
    out: Dict[str, List[float]] = {}
    for kind, items in GLUE_SHAPES[device.type].items():
        per_shape = []
        for op, shape in items:
            x = torch.randn(shape, device=device, dtype=tdt)
            y = torch.randn(shape, device=device, dtype=tdt)
            fn, elems = _glue_call(op, x, y)
            with torch.no_grad():
                per_shape.append((float(elems * x.element_size()), _timed_samples(fn, sync, cfg)))
        out[kind] = _mix_rate(per_shape)
    return out


def measure_matmul(dtype: str, sizes: List[int], device: torch.device, sync: Callable[[], None],
                   cfg: CalibrateConfig) -> tuple[int, List[float]]:
    """FLOP/s samples of the best size (by median): returns (n, samples)."""
    best: tuple[float, int, List[float]] = (-1.0, 0, [])
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else None
    try:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        for n in sizes:
            a = torch.randn(n, n, device=device, dtype=_TORCH_DTYPE[dtype])  # values do not matter
            b = torch.randn(n, n, device=device, dtype=_TORCH_DTYPE[dtype])
            out = torch.empty(n, n, device=device, dtype=_TORCH_DTYPE[dtype])
            secs = _timed_samples(lambda: torch.matmul(a, b, out=out), sync, cfg)
            flops = [2.0 * n**3 / s for s in secs]
            med = statistics.median(flops)
            if med > best[0]:
                best = (med, n, flops)
            del a, b, out
    finally:
        if prev_tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return best[1], best[2]


def measure_copy(nbytes: int, device: torch.device, sync: Callable[[], None], cfg: CalibrateConfig) -> List[float]:
    """Seconds per ``dst.copy_(src)`` of ``nbytes`` on ``device``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _timed_samples(lambda: dst.copy_(src), sync, cfg)


def measure_h2d(nbytes: int, sync: Callable[[], None], cfg: CalibrateConfig) -> List[float]:
    """Seconds per pinned host -> device copy of ``nbytes`` (CUDA only)."""
    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return _timed_samples(lambda: dst.copy_(src, non_blocking=True), sync, cfg)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

def resolve_output(path: str) -> pathlib.Path:
    p = pathlib.Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else pathlib.Path.cwd() / p


def write_profile_atomic(profile: HardwareProfile, path: pathlib.Path, header: str) -> None:
    """Validate ``profile`` against :class:`HardwareProfile`, then write it via temp file + rename."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(profile)  # type-checks every field
    text = header + OmegaConf.to_yaml(node)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def median_profile(paths: List[pathlib.Path], out: pathlib.Path) -> None:
    """One profile whose every measured number is the median over several calibrations' files
    (fresh processes each: what moves between calibrations on a shared host, thread placement
    and clock state, averages out where one calibration's repeats cannot)."""
    from omegaconf import OmegaConf

    if not paths:
        raise ConfigError("calibrate: median_profile needs at least one profile")
    nodes = [OmegaConf.to_container(OmegaConf.load(p)) for p in paths]

    def merge(vals: list, key: str):
        first = vals[0]
        if isinstance(first, dict):
            keys = set(first)
            for v in vals[1:]:
                if not isinstance(v, dict) or set(v) != keys:
                    raise ConfigError(f"calibrate: profiles disagree on the fields of {key or 'the profile'}")
            return {k: merge([v[k] for v in vals], f"{key}.{k}" if key else k) for k in first}
        if isinstance(first, int) and not isinstance(first, bool):  # counts (gpus_per_node): not measured
            if any(v != first for v in vals):
                raise ConfigError(f"calibrate: profiles disagree on {key} ({sorted(set(vals))})")
            return first
        if isinstance(first, float):
            return float(f"{statistics.median(float(v) for v in vals):.4g}")
        return first

    merged = merge(nodes, "")
    merged["source"] = f"median of {len(paths)} calibrations ({nodes[0].get('source', '')} ...)"
    profile = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareProfile), merged))
    header = ("# Written by median_profile (bench/calibrate/system.py); regenerate, do not edit.\n"
              f"# Every number: the median over {len(paths)} fresh system=harness/calibrate runs:\n"
              + "".join(f"#   {p}\n" for p in paths))
    write_profile_atomic(profile, out, header)


def plot_comm(comm: Dict[str, Dict[int, List[float]]], nprocs: int, path: pathlib.Path) -> None:
    """Log-log plot of p2p one-way time (and all-reduce time) against message size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for key, label, marker in (("p2p", "point-to-point, one-way (RTT/2)", "o"),
                               ("allreduce", f"all-reduce, {nprocs} processes", "s")):
        data = comm.get(key) or {}
        sizes = sorted(s for s, v in data.items() if v)
        if not sizes:
            continue
        med = [statistics.median(data[s]) for s in sizes]
        lo = [m - min(data[s]) for s, m in zip(sizes, med)]
        hi = [max(data[s]) - m for s, m in zip(sizes, med)]
        ax.errorbar(sizes, med, yerr=[lo, hi], marker=marker, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time (s), median; bars: min-max")
    ax.set_title("gloo between local processes (system=harness/calibrate)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))


def _host_memory_bytes() -> float:
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = pathlib.Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = float(raw)
        break
    return total


# --------------------------------------------------------------------------------------------
# The system
# --------------------------------------------------------------------------------------------

class Calibrate(System):
    """Measures achievable FLOP/s, memory and link bandwidths here; writes a hardware profile."""

    Config = CalibrateConfig
    modes = ("real",)

    def run(self, job: JobContext) -> RunResult:
        from tqdm import tqdm

        cfg: CalibrateConfig = self.cfg
        cfg.validate()
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("system.device: 'cuda' requested but torch.cuda.is_available() is False")
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and job.execution.is_cuda)
        device = torch.device("cuda") if use_cuda else torch.device("cpu")
        kind = device.type
        sync: Callable[[], None] = torch.cuda.synchronize if use_cuda else (lambda: None)
        host_sync: Callable[[], None] = lambda: None  # noqa: E731
        sizes = list(cfg.matmul_sizes) if cfg.matmul_sizes is not None else DEFAULT_MATMUL_SIZES[kind]
        mem_bytes = int(cfg.mem_bw_bytes) if cfg.mem_bw_bytes is not None else DEFAULT_MEM_BW_BYTES[kind]
        host_bytes = int(cfg.mem_bw_bytes) if cfg.mem_bw_bytes is not None else DEFAULT_MEM_BW_BYTES["cpu"]
        out_path = resolve_output(cfg.output)
        job.out_dir.mkdir(parents=True, exist_ok=True)

        dtypes = [d for d in cfg.dtypes if not (d == "tf32" and not use_cuda)]
        skipped = [d for d in cfg.dtypes if d not in dtypes]
        if not dtypes:
            raise ConfigError(f"system.dtypes: {cfg.dtypes} all need CUDA (tf32); add fp32, fp16 or bf16")
        metrics: Dict[str, Metric] = {}
        info: Dict[str, Any] = {"output": str(out_path), "device": kind,
                                "host_malloc": host_malloc_in_force(cfg.host_malloc, "system.host_malloc")}
        emulated: List[str] = []
        peak: Dict[str, float] = {}
        conv: Dict[str, float] = {}
        window: Dict[str, Dict[str, float]] = {}
        attn: Dict[str, float] = {}
        linear: Dict[str, float] = {}
        glue: Dict[str, Dict[str, float]] = {}
        gathers: Dict[str, Dict[str, float]] = {}
        if skipped:
            info["skipped_dtypes"] = {d: "tf32 needs CUDA tensor cores" for d in skipped}

        phases = [f"matmul {d}" for d in dtypes] + ["device memory", "host memory", "host link",
                                                     "gloo p2p + all-reduce", "write profile"]
        bar = tqdm(total=len(phases), desc="calibrate", unit="phase", disable=not job.show_progress,
                   leave=False)
        phase_s: Dict[str, float] = {}
        current = ["", time.perf_counter()]

        def start(name: str) -> None:
            bar.set_postfix_str(name)
            current[:] = [name, time.perf_counter()]

        def done() -> None:
            phase_s[str(current[0])] = round(time.perf_counter() - float(current[1]), 3)
            bar.update(1)

        info["phase_s"] = phase_s
        keep_threads = torch.get_num_threads()
        if cfg.threads:
            set_torch_threads(cfg.threads)
        info["threads"] = torch.get_num_threads()
        try:
            matmul_n: Dict[str, int] = {}
            for d in dtypes:
                start(f"matmul {d}")
                n, flops = measure_matmul(d, sizes, device, sync, cfg)
                metrics[f"matmul_{d}_flops"] = Metric.from_samples(flops, "FLOP/s", "higher")
                peak[d] = metrics[f"matmul_{d}_flops"].value
                matmul_n[d] = n
                metrics[f"conv_{d}_flops"] = Metric.from_samples(measure_conv(d, device, sync, cfg), "FLOP/s", "higher")
                conv[d] = metrics[f"conv_{d}_flops"].value
                metrics[f"attn_{d}_flops"] = Metric.from_samples(measure_attention(d, device, sync, cfg), "FLOP/s", "higher")
                attn[d] = metrics[f"attn_{d}_flops"].value
                metrics[f"linear_{d}_flops"] = Metric.from_samples(measure_linear(d, device, sync, cfg), "FLOP/s", "higher")
                linear[d] = metrics[f"linear_{d}_flops"].value
                for key, rate in measure_glue(d, device, sync, cfg).items():
                    metrics[f"{key}_{d}_bytes_per_s"] = Metric.from_samples(rate, "B/s", "higher")
                    glue.setdefault(key, {})[d] = metrics[f"{key}_{d}_bytes_per_s"].value
                for key, rate in measure_window_conv(d, device, sync, cfg).items():
                    unit = "FLOP/s" if key == "flops" else "B/s"
                    metrics[f"conv_window_{d}_{key}"] = Metric.from_samples(rate, unit, "higher")
                    window.setdefault(key, {})[d] = metrics[f"conv_window_{d}_{key}"].value
                for key, rate in measure_cell_token_gathers(d, device, sync, cfg).items():
                    metrics[f"{key}_{d}_bytes_per_s"] = Metric.from_samples(rate, "B/s", "higher")
                    gathers.setdefault(key, {})[d] = metrics[f"{key}_{d}_bytes_per_s"].value
                done()
            if not use_cuda:  # on a GPU the host's dispatch overlaps the kernels (launch_s models it)
                metrics["host_dispatch_s"] = Metric.from_samples(measure_dispatch(device, sync, cfg), "s", "lower")
            info["matmul_best_n"] = matmul_n

            start("device memory")
            secs = measure_copy(mem_bytes, device, sync, cfg)
            metrics["mem_bw_bytes_per_s"] = Metric.from_samples([2.0 * mem_bytes / s for s in secs], "B/s", "higher")
            done()

            start("host memory")
            if use_cuda:
                host_secs = measure_copy(host_bytes, torch.device("cpu"), host_sync, cfg)
            else:
                host_secs = secs  # the device is the host: one measurement serves both
            metrics["host_mem_bw_bytes_per_s"] = Metric.from_samples(
                [2.0 * host_bytes / s for s in host_secs], "B/s", "higher")
            done()

            start("host link")
            if use_cuda:
                link = [mem_bytes / s for s in measure_h2d(mem_bytes, sync, cfg)]
            else:
                link = [host_bytes / s for s in host_secs]
                emulated.append("host_link: no host-device link on a CPU-only host; a host memcpy "
                                "(bytes moved once per second) stands in")
            metrics["host_link_bw_bytes_per_s"] = Metric.from_samples(link, "B/s", "higher")
            done()

            set_torch_threads(keep_threads)
            start("gloo")
            comm = measure_comm(cfg)
            p2p, ar = comm["p2p"], comm["allreduce"]
            s_small, s_big = min(p2p), max(p2p)
            metrics["p2p_latency_s"] = Metric.from_samples(p2p[s_small], "s", "lower")
            metrics["p2p_bw_bytes_per_s"] = Metric.from_samples([s_big / t for t in p2p[s_big]], "B/s", "higher")
            n = cfg.comm_procs
            a_small, a_big = min(ar), max(ar)
            from impl.common.collectives import CollOp, bus_factor

            bus = bus_factor(CollOp.ALL_REDUCE, n)  # nccl-tests' busbw convention
            metrics["allreduce_latency_s"] = Metric.from_samples(ar[a_small], "s", "lower")
            metrics["allreduce_bw_bytes_per_s"] = Metric.from_samples(
                [a_big / t * bus for t in ar[a_big]], "B/s", "higher")
            info["p2p_one_way_s"] = {str(s): statistics.median(v) for s, v in sorted(p2p.items())}
            info["allreduce_s"] = {str(s): statistics.median(v) for s, v in sorted(ar.items())}
            info["allreduce_bw_convention"] = f"ring bus bandwidth: S/t * 2(n-1)/n, n={n}"
            info["not_measured"] = ["inter_node_bw_bytes_per_s and inter_node_latency_s: one host cannot "
                                    "measure a network; the loopback p2p figures are written there"]
            done()

            start("write profile")
            host = socket.gethostname()
            try:  # a loaded machine measures low: keep the load next to the numbers
                load = [round(x, 2) for x in os.getloadavg()]
            except OSError:  # pragma: no cover - platforms without getloadavg
                load = []
            info["load_avg_1_5_15"] = load
            info["cpu_count"] = os.cpu_count()
            when = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
            gpus = torch.cuda.device_count() if use_cuda else 1
            memory = float(torch.cuda.get_device_properties(0).total_memory) if use_cuda else _host_memory_bytes()
            def r4(v: float) -> float:  # 4 significant digits: the rest is noise
                return float(f"{v:.4g}")

            profile = HardwareProfile(
                name=out_path.stem if out_path.stem.startswith("local") else "local",
                source=f"measured by system=harness/calibrate on {host} at {when}",
                measured=True,
                peak_flops={d: r4(v) for d, v in peak.items()},
                diffusion=DiffusionRates(
                conv_flops={d: r4(v) for d, v in conv.items()},
                conv_window_flops={d: r4(v) for d, v in window["flops"].items()},
                window_gather_bytes_per_s={d: r4(v) for d, v in window["gather"].items()},
                window_scatter_bytes_per_s={d: r4(v) for d, v in window["scatter"].items()},
                attn_flops={d: r4(v) for d, v in attn.items()},
                linear_flops={d: r4(v) for d, v in linear.items()},
                activation_bytes_per_s={d: r4(v) for d, v in glue["activation"].items()},
                elementwise_bytes_per_s={d: r4(v) for d, v in glue["elementwise"].items()},
                cell_gather_bytes_per_s={d: r4(v) for d, v in gathers["cell_gather"].items()},
                cell_scatter_bytes_per_s={d: r4(v) for d, v in gathers["cell_scatter"].items()},
                token_gather_bytes_per_s={d: r4(v) for d, v in gathers["token_gather"].items()},
                token_scatter_bytes_per_s={d: r4(v) for d, v in gathers["token_scatter"].items()},
                host_dispatch_s=r4(metrics["host_dispatch_s"].value) if "host_dispatch_s" in metrics else 0.0),
                memory_bytes=memory,
                memory_bw_bytes_per_s=r4(metrics["mem_bw_bytes_per_s"].value),
                gpus_per_node=gpus,
                intra_node_bw_bytes_per_s=r4(metrics["p2p_bw_bytes_per_s"].value),
                intra_node_latency_s=r4(metrics["p2p_latency_s"].value),
                inter_node_bw_bytes_per_s=r4(metrics["p2p_bw_bytes_per_s"].value),
                inter_node_latency_s=r4(metrics["p2p_latency_s"].value),
                host_link_bw_bytes_per_s=r4(metrics["host_link_bw_bytes_per_s"].value),
                host_mem_bw_bytes_per_s=r4(metrics["host_mem_bw_bytes_per_s"].value),
                mfu=1.0,
                comm_efficiency=1.0,
                allreduce_bw_bytes_per_s=r4(metrics["allreduce_bw_bytes_per_s"].value),
                allreduce_latency_s=r4(metrics["allreduce_latency_s"].value),
            )
            dev_name = torch.cuda.get_device_name(0) if use_cuda else (platform.processor() or platform.machine())
            header = (
                "# Written by system=harness/calibrate (bench/calibrate/system.py); regenerate, do not edit.\n"
                f"# Host {host}, device {kind} ({dev_name}), torch {torch.__version__}, {when}.\n"
                f"# Load average (1/5/15 min) {load} on {os.cpu_count()} CPUs: a busy host measures low.\n"
                f"# Matmul and memory measured with {info['threads']} torch thread(s) (system.threads).\n"
                "# These are MEASURED ACHIEVABLE figures, not datasheet peaks: mfu and comm_efficiency\n"
                "# are therefore 1.0. Definitions (see the module docstring):\n"
                f"#   peak_flops: median 2n^3/t of the best n in {sizes}; conv_flops: median 2BC^2*9HW/t of a\n"
                f"#   3x3 convs at (B, C, H=W) in {CONV_SHAPES[kind]}; conv_window_flops / window_gather / scatter:\n"
                f"#   the same shapes as a block-sparse conv ({WINDOW_BLOCK}x{WINDOW_BLOCK} blocks, {WINDOW_ACTIVE:.0%} active): conv FLOP/s\n"
                f"#   on the gathered windows, bytes/s of the window gather and block scatter; cell/token gather and\n"
                f"#   scatter: bytes/s of a 1x1 conv's and a token op's pick of the same active cells; host_dispatch_s:\n"
                f"#   seconds per tiny a + b from Python (CPU only); attn_flops: 4BHNqNkd/t\n"
                f"#   of scaled_dot_product_attention at (B, H, Nq, Nk, d) in {ATTN_SHAPES[kind]}; linear_flops: 2BNCiCo/t of\n"
                f"#   nn.Linear (bias) at (B, N, Ci, Co) in {LINEAR_SHAPES[kind]}; host malloc: {info['host_malloc']};\n"
                f"#   activation / elementwise_bytes_per_s: bytes read + written of the glue mix {GLUE_SHAPES[kind]};\n"
                f"#   memory bandwidths count bytes\n"
                f"#   read + written ({mem_bytes} B copy); host link counts bytes moved once"
                f"{'' if use_cuda else ' (CPU-only host: a host memcpy stands in)'};\n"
                f"#   intra_node: gloo loopback ping-pong between 2 local processes, one-way = RTT/2,\n"
                f"#   latency at {s_small} B, bandwidth at {s_big} B; inter_node: NOT measured, copies intra_node;\n"
                f"#   allreduce: {n} processes, ring bus bandwidth S/t*2(n-1)/n at {a_big} B, latency at {a_small} B.\n"
            )
            write_profile_atomic(profile, out_path, header)
            done()
        finally:
            set_torch_threads(keep_threads)
            bar.close()

        plot_path = job.out_dir / PLOT_NAME
        plot_comm(comm, cfg.comm_procs, plot_path)
        return RunResult(metrics=metrics, emulated=emulated, artifacts=[PLOT_NAME], info=info)

