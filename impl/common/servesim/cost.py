"""Per-iteration serving costs at paper scale from a hardware profile (roofline) [R].

Units: seconds, bytes, FLOPs. Every constant is a field with its unit and source; the knobs
that neither the model shape nor the hardware profile gives are :class:`ServingCostConfig`
(a system's ``cost`` node, so they have one name and one default):
- GPU: ``hardware.peak_flops[dtype] * mfu`` and ``memory_bw_bytes_per_s`` (datasheet);
- adapter loads: the paper's measured load time by bytes where the hardware profile has one (v1 Fig.
  3-right, ATC Fig. 4; :mod:`impl.common.servesim.load_profile`, ``load_model`` auto/measured), else
  the roofline ``load_model=roofline``: ``host_link_bw_bytes_per_s * h2d_efficiency`` ([R]: ~22 GB/s
  pinned on PCIe4 = 0.69 x 32 GB/s) plus ``h2d_tensor_overhead_s`` per tensor (20 us);
- H2D of activations on the CPU path: always the roofline link rate above;
- host CPU: ``cpu_flops_per_core`` (40 GFLOP/s fp32 [R]) x ``cpu_cores`` (32 per host [R])
  shared by all cold requests of an iteration on the CPU path; per layer it moves x to host per
  distinct LoRA input (2) and a delta back per site over the H2D link (T_xfer), plus a
  sync cost ``cpu_sync_s`` per LoRA input per layer (assumed 100 us [R]; the paper gives only
  "transfer < 1 ms");
- LoRA kernels: BGMV (Punica, pads to the batch max rank: traffic ~ B * max r), MBGMV (S-LoRA,
  no padding: ~ sum r) with an efficiency factor each (``bgmv_efficiency``, ``mbgmv_efficiency``).
- Shapes: the model is a :class:`~impl.common.workloads.pipeline.ModelShape` (LLaMA: SwiGLU,
  grouped-query K/V); weights are its matrices plus embedding and LM head
  (:func:`~impl.common.cost.transformer.layer_matrix_params`; norms, ~0.004% of 7B, left out).
"""
from __future__ import annotations

import functools

import math
from dataclasses import dataclass, field, fields
from typing import List, Optional, Sequence

from impl.common.api import ConfigError
from impl.common.cost.transformer import layer_matrix_params
from impl.common.servesim.load_profile import LOAD_MODELS, MeasuredLoadProfile, measured_profile
from impl.common.workloads.serving import PaperModel

# Bytes per weight element -> the peak_flops entry that prices it.
MODEL_DTYPES = {2: "fp16", 4: "fp32"}


@dataclass
class ServingCostConfig:
    """The serving cost model's own knobs [R] (``system.cost.*``); defaults are the ones every
    CaraServe figure was measured with."""

    h2d_efficiency: float = 0.69  # share of hardware.host_link_bw_bytes_per_s a pinned copy gets
    h2d_tensor_overhead_s: float = 20e-6  # per tensor copied host -> device
    cpu_cores: int = 32
    cpu_flops_per_core: float = 40e9
    cpu_sync_s: float = 100e-6  # per LoRA input per layer on the CPU path
    lora_sites: int = 4  # q, k, v, o
    bgmv_efficiency: float = 1.0  # Punica's BGMV, share of the memory bandwidth
    mbgmv_efficiency: float = 0.5  # S-LoRA's MBGMV: slower than Punica's kernel
    iteration_overhead_s: float = 1e-3  # per scheduler iteration (launches, sampling)
    # Per request row of a decode iteration, on top of the roofline and iteration_overhead_s
    # (0 = none, every paper figure). A CPU engine's per-request Python (attention and KV append
    # per request per layer, the LoRA gather) grows with the batch; the fidelity job fits it to
    # decode steps profiled at a few batch sizes.
    iteration_overhead_per_row_s: float = 0.0
    # Fixed software cost per adapter load on top of bytes/bandwidth (0 = roofline only).
    # The paper observes ONDMD stalls of ~29% of serving time at 9 RPS (ATC'25 version), which the
    # roofline load (~8 ms per mean adapter) does not reproduce; see the CaraServe README.
    load_overhead_s: float = 0.0
    # How an adapter load is priced: "measured" = the paper's load-time table of the hardware
    # profile interpolated by bytes (v1 Fig. 3-right, ATC Fig. 4; an error where the profile has
    # none), "roofline" = bytes / (link x h2d_efficiency) + per-tensor overhead ([R]), "auto" =
    # measured where a table exists, else roofline. Every sim record names the one used
    # (info.cost.load_model).
    load_model: str = "auto"
    # S-LoRA's code copies the full A+B tensor once for A and once for B, so its loads
    # move twice the adapter's bytes; False prices them like everyone else's.
    slora_copies_ab_twice: bool = True
    # A load-time table profiled on the target machine for this model's adapters (rank ->
    # seconds, e.g. the fidelity job's profile of the real run's copies): it replaces the
    # hardware profile's table (load_model auto/measured). Empty = none.
    load_table_ranks: List[int] = field(default_factory=list)
    load_table_times_s: List[float] = field(default_factory=list)
    # Achieved prefill FLOP/s profiled on the target machine (e.g. one isolated prefill of the
    # served model, the fidelity job's profile); 0 = the hardware profile's rate. A CPU prefill
    # runs skinny matmuls plus per-token norm/rotary/softmax/SiLU work that a square-matmul
    # calibration does not see.
    prefill_flops_per_s: float = 0.0
    # Serial cost per cold request per layer on the CPU path, on top of what the CPU path itself
    # exposes beyond the device layer (cpu_layer_extra_s; 0 = none, every paper figure). The serving thread's
    # hand-off to the CPU LoRA worker (copy-in, doorbell, wake-up, result copy-out) does not
    # overlap the layer on a host with few cores; the fidelity job takes it from one isolated
    # CPU-assisted prefill against the same prefill on the device path.
    cpu_layer_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.load_table_ranks) != len(self.load_table_times_s) or len(self.load_table_ranks) == 1:
            raise ConfigError(f"system.cost.load_table_ranks ({len(self.load_table_ranks)}) and load_table_times_s "
                              f"({len(self.load_table_times_s)}) must have the same length, 0 or >= 2")
        if self.load_model not in LOAD_MODELS:
            raise ConfigError(f"system.cost.load_model: unknown {self.load_model!r} (one of: {', '.join(LOAD_MODELS)})")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not v >= 0:
                raise ConfigError(f"system.cost.{f.name} must be >= 0, got {v}")
        for name in ("h2d_efficiency", "bgmv_efficiency", "mbgmv_efficiency", "cpu_flops_per_core"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"system.cost.{name} must be > 0, got {getattr(self, name)}")
        if self.cpu_cores < 1 or self.lora_sites < 1:
            raise ConfigError(f"system.cost.cpu_cores ({self.cpu_cores}) and system.cost.lora_sites "
                              f"({self.lora_sites}) must be >= 1")
        if self.lora_sites > 4:
            raise ConfigError(f"system.cost.lora_sites must be at most 4 (q, k, v, o: the CPU path's two LoRA "
                              f"inputs), got {self.lora_sites}")


@functools.lru_cache(maxsize=64)
def _tp_all_reduce_rate(tp: int, bw_bytes_per_s: float, latency_s: float) -> tuple[float, float]:
    """(seconds per byte, latency seconds) of a TP all-reduce inside one node at the link's
    datasheet rate (the serving knobs carry no link efficiency of their own)."""
    from impl.common import collectives as coll
    from impl.common.hardware import HardwareProfile

    link = HardwareProfile(name="serving-tp", gpus_per_node=tp, intra_node_bw_bytes_per_s=bw_bytes_per_s,
                           intra_node_latency_s=latency_s)
    per_byte, _, lat = coll.link_rate(coll.CollOp.ALL_REDUCE, link, tp, tp, intra_efficiency=1.0)
    return per_byte, lat


@dataclass(kw_only=True)
class ServingCost(ServingCostConfig):
    """The knobs plus the model, the TP degree and the hardware rates they apply to."""

    model: PaperModel = field(default_factory=PaperModel)
    tp: int = 1
    flops_per_s: float = 50e12
    mem_bw_bytes_per_s: float = 600e9
    host_link_bw_bytes_per_s: float = 32e9  # PCIe 4.0 x16
    intra_bw_bytes_per_s: float = 32e9
    intra_latency_s: float = 5e-6
    hardware_name: str = ""
    measured_load: Optional[MeasuredLoadProfile] = None  # set from hardware_name unless load_model=roofline

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.load_model != "roofline" and self.measured_load is None and self.load_table_ranks:
            order = sorted(range(len(self.load_table_ranks)), key=lambda i: self.load_table_ranks[i])
            self.measured_load = MeasuredLoadProfile(
                name="profiled", source="system.cost.load_table_* (profiled on the target machine)",
                layers=self.model.num_layers, hidden=self.model.hidden, sites=self.lora_sites,
                dtype_bytes=self.model.dtype_bytes, ranks=tuple(int(self.load_table_ranks[i]) for i in order),
                times_s=tuple(float(self.load_table_times_s[i]) for i in order))
        if self.load_model != "roofline" and self.measured_load is None:
            self.measured_load = measured_profile(self.hardware_name)
            if self.load_model == "measured" and self.measured_load is None:
                raise ConfigError(f"system.cost.load_model=measured: hardware {self.hardware_name!r} has no measured "
                                  f"adapter-load profile (have: a10, a100-80g, a100-40g); use auto or roofline")
        if not self.model.ffn_hidden:
            raise ConfigError(f"workload.paper_model.ffn_hidden: the serving cost model is LLaMA's "
                              f"(SwiGLU), got {self.model.ffn_hidden}")

    @classmethod
    def from_profile(cls, model, hardware, config: ServingCostConfig | None = None, tp: int = 1,
                     dtype: Optional[str] = None) -> "ServingCost":
        """``dtype``: the FLOP/s entry of ``hardware.peak_flops``; default the model's own
        (``model.dtype_bytes``: 2 -> fp16, the papers' serving precision; 4 -> fp32)."""
        if dtype is None:
            if model.dtype_bytes not in MODEL_DTYPES:
                raise ConfigError(f"workload.paper_model.dtype_bytes: {model.dtype_bytes} has no serving dtype "
                                  f"(one of: {', '.join(map(str, MODEL_DTYPES))})")
            dtype = MODEL_DTYPES[model.dtype_bytes]
        knobs = {f.name: getattr(config, f.name) for f in fields(ServingCostConfig)} if config else {}
        return cls(model=model, tp=tp, flops_per_s=hardware.flops(dtype),
                   mem_bw_bytes_per_s=hardware.memory_bw_bytes_per_s,
                   host_link_bw_bytes_per_s=hardware.host_link_bw_bytes_per_s,
                   intra_bw_bytes_per_s=hardware.intra_node_bw_bytes_per_s,
                   intra_latency_s=hardware.intra_node_latency_s, hardware_name=hardware.name, **knobs)

    # ---- shapes ----------------------------------------------------------------------------
    @property
    def hidden(self) -> int:
        return self.model.hidden

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def dtype_bytes(self) -> int:
        return self.model.dtype_bytes

    @property
    def h2d_bytes_per_s(self) -> float:
        return self.host_link_bw_bytes_per_s * self.h2d_efficiency

    @property
    def d_kv(self) -> int:
        return self.model.kv_hidden

    @property
    def layer_params(self) -> int:
        return layer_matrix_params(self.model)

    @property
    def weight_bytes(self) -> float:
        return (self.num_layers * self.layer_params + 2 * self.model.vocab * self.hidden) * self.dtype_bytes / self.tp

    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.d_kv * self.dtype_bytes / self.tp

    def adapter_bytes(self, rank: int) -> float:
        """layers * sites * 2 * d * r * dtype bytes (128 MiB at r=64 for 7B)."""
        return self.num_layers * self.lora_sites * 2 * self.hidden * rank * self.dtype_bytes

    def _allreduce_s(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        msg = tokens * self.hidden * self.dtype_bytes
        per_byte, lat = _tp_all_reduce_rate(self.tp, self.intra_bw_bytes_per_s, self.intra_latency_s)
        return 2 * self.num_layers * (per_byte * msg + lat)

    # ---- iteration costs -------------------------------------------------------------------
    def prefill_s(self, lens: Sequence[int], ranks: Sequence[int], lora: bool = True, kernel: str = "sgmv") -> float:
        if not lens:
            return 0.0
        T = sum(lens)
        flops = 2 * (self.num_layers * self.layer_params + self.model.vocab * self.hidden) * T / self.tp
        flops += 2 * self.num_layers * self.hidden * sum(n * n for n in lens) / self.tp  # attention
        rate = self.prefill_flops_per_s or self.flops_per_s
        t = max(flops / rate, self.weight_bytes / self.mem_bw_bytes_per_s)
        if lora:
            eff = self.mbgmv_efficiency if kernel == "mbgmv" else self.bgmv_efficiency
            lf = 4 * self.num_layers * self.lora_sites * self.hidden * sum(n * r for n, r in zip(lens, ranks)) / self.tp
            t += lf / (rate * eff)
        return t + self._allreduce_s(T) + self.iteration_overhead_s

    def decode_s(self, ctx: Sequence[int], ranks: Sequence[int], kernel: str = "bgmv", lora: bool = True) -> float:
        B = len(ctx)
        if not B:
            return 0.0
        flops = 2 * (self.num_layers * self.layer_params + self.model.vocab * self.hidden) * B / self.tp
        bytes_ = self.weight_bytes + self.kv_bytes_per_token() * sum(ctx)
        t = max(flops / self.flops_per_s, bytes_ / self.mem_bw_bytes_per_s)
        if lora and ranks:
            per_rank = self.num_layers * self.lora_sites * 2 * self.hidden * self.dtype_bytes / self.tp
            if kernel == "mbgmv":
                t += per_rank * sum(ranks) / (self.mem_bw_bytes_per_s * self.mbgmv_efficiency)
            else:
                t += per_rank * B * max(ranks) / (self.mem_bw_bytes_per_s * self.bgmv_efficiency)
        return t + self._allreduce_s(B) + self.iteration_overhead_s + self.iteration_overhead_per_row_s * B

    @property
    def load_model_used(self) -> str:
        """What priced the adapter loads, for the record."""
        return f"measured:{self.measured_load.name}" if self.measured_load is not None else "roofline"

    def load_s(self, rank: int, copies: float = 1.0) -> float:
        """One adapter's host->GPU load per GPU (each TP rank loads its shard over its own
        link); ``copies`` x the bytes move (S-LoRA: 2)."""
        nbytes = copies * self.adapter_bytes(rank) / self.tp
        if self.measured_load is not None:
            return self.measured_load.load_s(nbytes) + self.load_overhead_s
        tensors = copies * self.num_layers * self.lora_sites * 2
        return nbytes / self.h2d_bytes_per_s + tensors * self.h2d_tensor_overhead_s + self.load_overhead_s

    def lora_inputs(self) -> list[tuple[int, float]]:
        """One entry per distinct LoRA input of a layer (the paper: one sync point each): (sites it
        feeds, its base GEMM's share of the layer's weight-matrix work). q, k, v share the
        attention input (the first min(3, lora_sites) sites); o has its own (the 4th)."""
        d, kv, P = self.hidden, self.d_kv, self.layer_params
        qkv = min(3, self.lora_sites)
        out = [(qkv, (d * d + (qkv - 1) * d * kv) / P)]
        if self.lora_sites > 3:
            out.append((self.lora_sites - 3, d * d / P))
        return out

    def cpu_compute_s(self, tokens: int, rank: int, procs: int, sites: int | None = None) -> float:
        """CPU LoRA FLOPs (x A B, 4 d r per token and site) of ``sites`` sites (default all) of one
        layer for one request, rows split over ``procs`` processes."""
        sites = self.lora_sites if sites is None else sites
        return 4 * sites * self.hidden * rank * math.ceil(tokens / procs) / self.cpu_flops_per_core

    def cpu_xfer_s(self, tokens: int, sites: int | None = None) -> float:
        """One LoRA input's transfers (T_xfer): x to host shared memory once and one
        delta back per site it feeds, over the pinned host link; default: every input of a layer."""
        if sites is None:
            return sum(self.cpu_xfer_s(tokens, k) for k, _ in self.lora_inputs())
        return tokens * self.hidden * self.dtype_bytes * (1 + sites) / self.h2d_bytes_per_s

    def cpu_input_alone_s(self, tokens: int, rank: int, procs: int, sites: int) -> float:
        """One request alone on the CPU path for one LoRA input: compute on ``procs`` processes,
        its transfers and its sync point."""
        return self.cpu_compute_s(tokens, rank, procs, sites) + self.cpu_xfer_s(tokens, sites) + self.cpu_sync_s

    def cpu_procs(self, tokens: int, rank: int, inp: int = 0) -> int:
        """[R] smallest P with T_cpu(L/P) + T_xfer <= T_gpu_base (impl/caraserve/README.md), for
        LoRA input ``inp`` against the base GEMM it overlaps (the request's isolated prefill),
        capped by the cores."""
        sites, share = self.lora_inputs()[inp]
        base = self.prefill_s([tokens], [rank], lora=False) / self.num_layers * share
        for p in range(1, self.cpu_cores + 1):
            if self.cpu_input_alone_s(tokens, rank, p, sites) <= base:
                return p
        return self.cpu_cores

    def cpu_input_s(self, jobs: Sequence[tuple], inp: int) -> float:
        """LoRA input ``inp`` of one layer on the CPU path for every cold request ``(tokens,
        rank)`` of an iteration, from the moment x is ready to the last delta back.

        The host has ``cpu_cores`` cores for all of them: each request wants its profiled
        ``cpu_procs`` processes; if the wants fit they run side by side, otherwise the cores are
        handed out one at a time to the request that is slowest so far (each gets >= 1, none more
        than it wants; ties: lower index), and with more requests than cores each runs on one
        process and they queue on the cores (longest first onto the least-loaded core). Transfers
        of all requests share the one host link (serialised); the sync points overlap."""
        if not jobs:
            return 0.0
        sites = self.lora_inputs()[inp][0]
        C, n = self.cpu_cores, len(jobs)

        def comp(t, r, p):
            return self.cpu_compute_s(t, r, p, sites)

        want = [self.cpu_procs(t, r, inp) for t, r in jobs]
        if sum(want) <= C:
            compute = max(comp(t, r, p) for (t, r), p in zip(jobs, want))
        elif n <= C:
            alloc = [1] * n
            for _ in range(C - n):
                i = max((i for i in range(n) if alloc[i] < want[i]), key=lambda i: (comp(*jobs[i], alloc[i]), -i))
                alloc[i] += 1
            compute = max(comp(t, r, p) for (t, r), p in zip(jobs, alloc))
        else:
            loads = [0.0] * C
            for x in sorted((comp(t, r, 1) for t, r in jobs), reverse=True):
                k = min(range(C), key=lambda k: (loads[k], k))
                loads[k] += x
            compute = max(loads)
        return compute + sum(self.cpu_xfer_s(t, sites) for t, _ in jobs) + self.cpu_sync_s

    def cpu_layer_extra_s(self, jobs: Sequence[tuple], base_layer_s: float, overhead: bool = True) -> float:
        """What the CPU path adds to a layer whose device part takes ``base_layer_s``: each LoRA
        input's CPU path overlaps only its own base GEMM (``y = base + delta`` waits for the
        delta; the next input, e.g. o's after attention, exists only after that), so
        each input exposes max(0, CPU path - its GEMM's share of the layer); the attention and
        the MLP hide none of it. Plus ``cpu_layer_overhead_s`` per cold request (``overhead``)."""
        if not jobs:
            return 0.0
        extra = sum(max(0.0, self.cpu_input_s(jobs, i) - base_layer_s * share)
                    for i, (_, share) in enumerate(self.lora_inputs()))
        return extra + (len(jobs) * self.cpu_layer_overhead_s if overhead else 0.0)
