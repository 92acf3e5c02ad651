"""Hardware profile: datasheet figures plus efficiency factors, every field with its unit.

Profiles live in ``conf/hardware/*.yaml``; ``local.yaml`` is written by ``system=calibrate``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class HardwareProfile:
    name: str = "???"
    # Where the numbers come from (datasheet URL/title, or "measured by system=calibrate").
    source: str = "???"
    measured: bool = False
    # Peak dense FLOP/s per dtype (keys: fp32, tf32, fp16, bf16, fp8 as applicable).
    peak_flops: Dict[str, float] = field(default_factory=dict)
    # Achievable FLOP/s of a 3x3 convolution per dtype, FLOPs counted as the direct conv's
    # (2 B Ci Co k^2 Ho Wo): measured by calibrate, where conv libraries (oneDNN, cuDNN) run
    # well off the matmul rate; absent (datasheet profiles) = the matmul peak prices convs.
    conv_flops: Dict[str, float] = field(default_factory=dict)
    # A block-sparse conv's gathered windows, per dtype, measured by calibrate at the engine's
    # shape (impl.common.diffusion.windows: k=3 windows of 2x2 output blocks): the conv's FLOP/s
    # on the (N, C, 4, 4) tiles (FLOPs of the active blocks only), and the bytes/s of the window
    # gather and the block scatter (advanced indexing over short rows). Absent (datasheet
    # profiles) = the conv rate and memory_bw_bytes_per_s price them. Units: these rates count
    # the bytes moved once (size / t), memory_bw_bytes_per_s counts read + write (STREAM copy),
    # so the fallback prices a gather of N bytes at N / bw, half its traffic, as the sparse-op
    # pricing always has (kept: datasheet figures unchanged).
    conv_window_flops: Dict[str, float] = field(default_factory=dict)
    window_gather_bytes_per_s: Dict[str, float] = field(default_factory=dict)
    window_scatter_bytes_per_s: Dict[str, float] = field(default_factory=dict)
    # The other sparse ops' gathers and scatters (impl.common.diffusion.windows), bytes/s per
    # dtype, measured by calibrate on the engine's own functions: a 1x1 conv's cell gather (a
    # strided pick along each channel's flattened map) and its scatter, and a token op's row
    # gather and scatter. Absent = memory_bw_bytes_per_s.
    cell_gather_bytes_per_s: Dict[str, float] = field(default_factory=dict)
    cell_scatter_bytes_per_s: Dict[str, float] = field(default_factory=dict)
    token_gather_bytes_per_s: Dict[str, float] = field(default_factory=dict)
    token_scatter_bytes_per_s: Dict[str, float] = field(default_factory=dict)
    # Host seconds per dispatch-bound torch call (a tiny op from Python: argument parsing,
    # dispatcher, allocation), measured by calibrate on a CPU host, where the host issues ops on
    # the core that computes them, so the cost adds to the step instead of hiding behind
    # asynchronous kernels. 0 (datasheet and GPU profiles) = not charged.
    host_dispatch_s: float = 0.0
    # Achievable FLOP/s of the attention core (softmax(QK^T)V through
    # torch's scaled_dot_product_attention, FLOPs 4 B Nq Nk (heads x head_dim)) per dtype at
    # UNet attention shapes, measured by calibrate: a fused attention kernel (CPU flash
    # attention: tiled softmax passes) runs off the matmul rate. Absent = the matmul peak.
    attn_flops: Dict[str, float] = field(default_factory=dict)
    memory_bytes: float = 0.0
    memory_bw_bytes_per_s: float = 0.0
    gpus_per_node: int = 8
    # Intra-node GPU-GPU link (NVLink / PCIe peer), per direction per GPU.
    intra_node_bw_bytes_per_s: float = 0.0
    intra_node_latency_s: float = 0.0
    # Inter-node network per GPU (e.g. one 400 Gb/s NIC per GPU = 50e9 bytes/s).
    inter_node_bw_bytes_per_s: float = 0.0
    inter_node_latency_s: float = 0.0
    # Host <-> device link (PCIe) and host memory.
    host_link_bw_bytes_per_s: float = 0.0
    host_mem_bw_bytes_per_s: float = 0.0
    # Efficiency factors applied by cost models (fraction of peak actually achieved).
    mfu: float = 0.4
    comm_efficiency: float = 0.8
    # Measured collective figures (calibration only; null for datasheet profiles).
    allreduce_bw_bytes_per_s: Optional[float] = None
    allreduce_latency_s: Optional[float] = None

    def flops(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype`` (peak x mfu)."""
        if dtype not in self.peak_flops:
            known = ", ".join(sorted(self.peak_flops)) or "none"
            raise ValueError(f"hardware.peak_flops has no entry for dtype {dtype!r} (profile {self.name}: {known})")
        return self.peak_flops[dtype] * self.mfu

    def conv_flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s of a k>1 convolution: the measured conv rate, else :meth:`flops`."""
        if dtype in self.conv_flops:
            return self.conv_flops[dtype] * self.mfu
        return self.flops(dtype)

    def attn_flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s of the attention core: the measured rate, else :meth:`flops`."""
        if dtype in self.attn_flops:
            return self.attn_flops[dtype] * self.mfu
        return self.flops(dtype)

    def conv_window_flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s of a k>1 conv on gathered windows: measured, else :meth:`conv_flops_per_s`."""
        if dtype in self.conv_window_flops:
            return self.conv_window_flops[dtype] * self.mfu
        return self.conv_flops_per_s(dtype)

    def window_gather_bw(self, dtype: str) -> float:
        """Bytes/s of a window gather: measured, else the streaming memory bandwidth."""
        return self.window_gather_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def window_scatter_bw(self, dtype: str) -> float:
        """Bytes/s of a block scatter: measured, else the streaming memory bandwidth."""
        return self.window_scatter_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def cell_gather_bw(self, dtype: str) -> float:
        """Bytes/s of a 1x1 conv's cell gather: measured, else the streaming memory bandwidth."""
        return self.cell_gather_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def cell_scatter_bw(self, dtype: str) -> float:
        """Bytes/s of a 1x1 conv's cell scatter: measured, else the streaming memory bandwidth."""
        return self.cell_scatter_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def token_gather_bw(self, dtype: str) -> float:
        """Bytes/s of a token gather: measured, else the streaming memory bandwidth."""
        return self.token_gather_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def token_scatter_bw(self, dtype: str) -> float:
        """Bytes/s of a token scatter: measured, else the streaming memory bandwidth."""
        return self.token_scatter_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s
