"""Hardware profile: datasheet figures plus efficiency factors, every field with its unit.

Profiles live in ``conf/hardware/*.yaml``; ``local.yaml`` is written by ``system=harness/calibrate``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, List, Optional


@dataclass
class GemmSeries:
    """Measured seconds of one bf16 GEMM shape ``x @ W.T`` (``x``: m x k, ``W``: n x k) at several
    row counts ``m`` (tokens of a micro-batch); the step model interpolates log-log in m."""

    n: int = 0
    k: int = 0
    m: List[int] = field(default_factory=list)
    s: List[float] = field(default_factory=list)
    label: str = ""


@dataclass
class AttnSeries:
    """Measured seconds of causal flash attention (batch 1, ``heads`` of ``head_dim``) at sequence
    lengths ``s``: forward and backward (``bwd_s`` = forward + backward - forward)."""

    heads: int = 0
    head_dim: int = 0
    s: List[int] = field(default_factory=list)
    fwd_s: List[float] = field(default_factory=list)
    bwd_s: List[float] = field(default_factory=list)


@dataclass
class KernelTables:
    """Kernel times of this GPU by shape (:mod:`impl.common.megatron.kernels` reads them): GEMMs
    by (m, n, k), causal attention by (s, heads, head_dim). ``source`` says where they were
    measured and how they were carried to this profile (e.g. scaled from another GPU)."""

    source: str = ""
    gemm: List[GemmSeries] = field(default_factory=list)
    attn: List[AttnSeries] = field(default_factory=list)


@dataclass
class MegatronKnobs:
    """What the Megatron-LM step model (:mod:`impl.common.megatron.step`) fits to measured launches
    (``mlsys-bench-calibrate-megatron``) on top of the profile's kernel tables and the
    per-module activation bytes it derives. Each knob has a physical range
    (:data:`impl.common.megatron.fit.KNOB_RANGES`); the fit reports any knob at its bound. A
    profile without knobs prices Megatron from its datasheet figures through
    :func:`impl.common.megatron.derive.step_knobs` (carried from ``megatron.carried_from``)."""

    # Megatron's kernels over the profile's tables (1 = the table's time): GEMMs (wgrad
    # accumulation into fp32 main grads, cuBLAS heuristics), causal flash attention (Megatron's
    # flash-attn with attention dropout vs the table's kernel), memory-bound kernels (norms,
    # activations, rotary, residuals, dropout, loss, Adam: derived bytes over the HBM bandwidth;
    # unfused kernels re-read their inputs).
    gemm_time_factor: float = 1.0
    attn_time_factor: float = 1.0
    elementwise_time_factor: float = 1.0
    # NCCL's achieved fraction of each link's datasheet rate (NVLink inside a node, the NICs
    # across nodes) in the step's collectives and P2P, priced by impl.common.collectives; the
    # step model's communication feature is seconds at the nominal rate, theta = 1 / efficiency.
    intra_node_comm_efficiency: float = 0.8
    inter_node_comm_efficiency: float = 0.8
    # Host/launch time per transformer layer and micro-batch (forward + backward), and per iteration.
    layer_overhead_s: float = 0.0
    iteration_overhead_s: float = 0.0
    # Allocated activation bytes over the derived saved-tensor bytes (allocator block rounding,
    # tensors alive across the backward's transients).
    activation_factor: float = 1.0
    # Bytes per logit element held at the loss peak (bf16 logits, their fp32 copy and the loss's
    # working copies).
    logits_bytes: float = 10.0
    # Allocated bytes besides states, activations and logits (workspaces, buffers), and what
    # PyTorch may allocate on one GPU before an out-of-memory error.
    memory_overhead_bytes: float = 0.0
    allocatable_bytes: float = 0.0


@dataclass
class MegatronSection:
    """The Megatron-LM step model's inputs on this profile (``hardware.megatron``), each null where
    this GPU has no measurement of its own; :func:`impl.common.megatron.derive.step_profile` then
    carries them from ``carried_from`` by datasheet ratios (a measured host: its measured rates)."""

    # Step-model knobs fitted to measured Megatron launches (``mlsys-bench-calibrate-megatron``).
    knobs: Optional[MegatronKnobs] = None
    # Kernel times by shape (GEMMs, causal attention), measured (``mlsys-bench-probe``) or carried
    # from another GPU's measurements.
    kernels: Optional[KernelTables] = None
    # The fitted profile (``conf/hardware/<name>.yaml``) this one's missing knobs and tables come from.
    carried_from: str = "h100-megatron"


@dataclass
class DiffusionRates:
    """Measured rates of the diffusion engines' kernels (``hardware.diffusion``), per dtype, written by
    ``system=harness/calibrate`` on the host that runs the real UNet. Not on any datasheet: a profile without
    them prices each op at its fallback (the matmul peak x ``mfu``, or ``memory_bw_bytes_per_s``), as
    each field says. Read by :mod:`impl.common.diffusion.cost` and :mod:`impl.fisedit.cost` only."""

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
    # Achievable FLOP/s of a token linear (nn.Linear with bias on a (B, N, C) activation) per
    # dtype at UNet transformer-block shapes, measured by calibrate: at these skinny shapes
    # (N = 77-576 tokens, a 4x-wide FF projection) a CPU GEMM runs up to 35% under the square
    # matmul peak. Absent (datasheet profiles) = the matmul peak prices them.
    linear_flops: Dict[str, float] = field(default_factory=dict)
    # A forward's non-module tensor work (impl.common.diffusion.cost.GlueTracer), bytes/s read +
    # written per dtype, measured by calibrate at UNet tensor sizes: activations (SiLU, GELU:
    # transcendental, compute-bound on a CPU core) and the rest (adds, divisions, concatenations,
    # upsampling, strided copies). Absent (datasheet profiles) = not priced on their own: the norm
    # ops' ELEMENTWISE_PASSES stand for them.
    activation_bytes_per_s: Dict[str, float] = field(default_factory=dict)
    elementwise_bytes_per_s: Dict[str, float] = field(default_factory=dict)


@dataclass
class HardwareProfile:
    """One machine: datasheet (or measured) core figures, with the step model's section
    (``megatron``: knobs, kernel tables) and the diffusion engines' measured rates (``diffusion``)."""

    name: str = "???"
    # Where the numbers come from (datasheet URL/title, or "measured by system=harness/calibrate").
    source: str = "???"
    measured: bool = False
    # Peak dense FLOP/s per dtype (keys: fp32, tf32, fp16, bf16, fp8 as applicable).
    peak_flops: Dict[str, float] = field(default_factory=dict)
    # The diffusion engines' measured kernel rates (empty on datasheet profiles).
    diffusion: DiffusionRates = field(default_factory=DiffusionRates)
    memory_bytes: float = 0.0
    memory_bw_bytes_per_s: float = 0.0
    gpus_per_node: int = 8
    # Intra-node GPU-GPU link (NVLink / PCIe peer), per direction per GPU.
    intra_node_bw_bytes_per_s: float = 0.0
    intra_node_latency_s: float = 0.0
    # Inter-node network: ONE NIC's rate per direction (a 400 Gb/s NIC = 50e9 bytes/s), and how
    # many NICs a node has (0 = one per GPU); impl.common.collectives prices rings over every
    # NIC of a node, all-to-all and send/recv over one.
    inter_node_bw_bytes_per_s: float = 0.0
    inter_node_latency_s: float = 0.0
    nics_per_node: int = 0
    # Host <-> device link (PCIe) and host memory.
    host_link_bw_bytes_per_s: float = 0.0
    host_mem_bw_bytes_per_s: float = 0.0
    # Efficiency factors applied by cost models (fraction of peak actually achieved);
    # comm_efficiency: of each link's datasheet rate, in (0, 1] (impl.common.collectives).
    mfu: float = 0.4
    comm_efficiency: float = 0.8
    # Measured collective figures (calibration only; null for datasheet profiles).
    allreduce_bw_bytes_per_s: Optional[float] = None
    allreduce_latency_s: Optional[float] = None
    # The Megatron step model's inputs: fitted knobs, kernel tables, the profile they are carried from.
    megatron: MegatronSection = field(default_factory=MegatronSection)
    # Where fitted fields came from: input file and sha256, knob values, residuals (free-form).
    calibration: Dict[str, Any] = field(default_factory=dict)

    def with_megatron(self, **parts: Any) -> "HardwareProfile":
        """This profile with the given ``megatron`` parts (``knobs``, ``kernels``, ``carried_from``)
        replaced (the others kept)."""
        return replace(self, megatron=replace(self.megatron, **parts))

    def with_diffusion(self, **rates: Any) -> "HardwareProfile":
        """This profile with the given ``diffusion`` rates replaced (the others kept)."""
        return replace(self, diffusion=replace(self.diffusion, **rates))

    def flops(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype`` (peak x mfu)."""
        if dtype not in self.peak_flops:
            known = ", ".join(sorted(self.peak_flops)) or "none"
            raise ValueError(f"hardware.peak_flops has no entry for dtype {dtype!r} (profile {self.name}: {known})")
        return self.peak_flops[dtype] * self.mfu

    def conv_flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s of a k>1 convolution: the measured conv rate, else :meth:`flops`."""
        if dtype in self.diffusion.conv_flops:
            return self.diffusion.conv_flops[dtype] * self.mfu
        return self.flops(dtype)

    def attn_flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s of the attention core: the measured rate, else :meth:`flops`."""
        if dtype in self.diffusion.attn_flops:
            return self.diffusion.attn_flops[dtype] * self.mfu
        return self.flops(dtype)

    def linear_flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s of a token linear: the measured rate, else :meth:`flops`."""
        if dtype in self.diffusion.linear_flops:
            return self.diffusion.linear_flops[dtype] * self.mfu
        return self.flops(dtype)

    def glue_bw(self, kind: str, dtype: str) -> Optional[float]:
        """Bytes/s of a glue op of ``kind`` (``activation`` | ``elementwise``), or None where the
        profile has no glue rates (then glue is not priced on its own)."""
        if dtype not in self.diffusion.elementwise_bytes_per_s:
            return None
        table = self.diffusion.activation_bytes_per_s if kind == "activation" else self.diffusion.elementwise_bytes_per_s
        return table.get(dtype) or self.diffusion.elementwise_bytes_per_s[dtype]

    def conv_window_flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s of a k>1 conv on gathered windows: measured, else :meth:`conv_flops_per_s`."""
        if dtype in self.diffusion.conv_window_flops:
            return self.diffusion.conv_window_flops[dtype] * self.mfu
        return self.conv_flops_per_s(dtype)

    def window_gather_bw(self, dtype: str) -> float:
        """Bytes/s of a window gather: measured, else the streaming memory bandwidth."""
        return self.diffusion.window_gather_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def window_scatter_bw(self, dtype: str) -> float:
        """Bytes/s of a block scatter: measured, else the streaming memory bandwidth."""
        return self.diffusion.window_scatter_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def cell_gather_bw(self, dtype: str) -> float:
        """Bytes/s of a 1x1 conv's cell gather: measured, else the streaming memory bandwidth."""
        return self.diffusion.cell_gather_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def cell_scatter_bw(self, dtype: str) -> float:
        """Bytes/s of a 1x1 conv's cell scatter: measured, else the streaming memory bandwidth."""
        return self.diffusion.cell_scatter_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def token_gather_bw(self, dtype: str) -> float:
        """Bytes/s of a token gather: measured, else the streaming memory bandwidth."""
        return self.diffusion.token_gather_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s

    def token_scatter_bw(self, dtype: str) -> float:
        """Bytes/s of a token scatter: measured, else the streaming memory bandwidth."""
        return self.diffusion.token_scatter_bytes_per_s.get(dtype) or self.memory_bw_bytes_per_s


def refuse_flat_diffusion_keys(node: Any, prefix: str = "") -> None:
    """A profile written before the diffusion rates had their own section holds them at the top
    level: one line naming the first such key and where it lives now."""
    from impl.common.api import ConfigError

    keys = set(node.keys()) if hasattr(node, "keys") else set()
    stale = [f.name for f in fields(DiffusionRates) if f.name in keys]
    if stale:
        raise ConfigError(f"{prefix}hardware.{stale[0]}: moved to hardware.diffusion.{stale[0]} (nest the diffusion rates "
                          f"under 'diffusion:', or re-run system=harness/calibrate)")


# Knob names a profile written before the collectives module may still carry -> their replacement.
RENAMED_KNOBS = {"intra_node_bus_bw_bytes_per_s": "intra_node_comm_efficiency",
                 "inter_node_bus_bw_bytes_per_s": "inter_node_comm_efficiency"}


def refuse_renamed_knobs(node: Any, prefix: str = "") -> None:
    """A profile whose Megatron knobs still hold a bus bandwidth: one line naming the new field
    (an efficiency of the link, not a bandwidth: re-fit or re-derive the profile)."""
    from impl.common.api import ConfigError

    meg = node.get("megatron") if hasattr(node, "get") else None
    knobs = meg.get("knobs") if hasattr(meg, "get") else None
    for old, new in RENAMED_KNOBS.items():
        if hasattr(knobs, "keys") and old in knobs.keys():
            raise ConfigError(f"{prefix}hardware.megatron.knobs.{old}: replaced by hardware.megatron.knobs.{new} (a "
                              f"fraction of the link's datasheet rate; re-run mlsys-bench-calibrate-megatron)")


def hardware_dir() -> "pathlib.Path":
    """The package's ``conf/hardware`` folder."""
    import pathlib

    import conf

    return pathlib.Path(conf.__file__).resolve().parent / "hardware"


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A profile by name (``conf/hardware/<name>.yaml``, the working directory's ``conf/`` first,
    as Hydra searches) or by path, type-checked against :class:`HardwareProfile`."""
    import pathlib

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from impl.common.api import ConfigError

    p = pathlib.Path(name_or_path)
    if not p.suffix:
        local = pathlib.Path.cwd() / "conf" / "hardware" / f"{name_or_path}.yaml"
        p = local if local.is_file() else hardware_dir() / f"{name_or_path}.yaml"
    if not p.is_file():
        known = ", ".join(sorted(x.stem for x in hardware_dir().glob("*.yaml")))
        raise ConfigError(f"hardware: no profile {name_or_path!r} (known: {known})")
    raw = OmegaConf.load(p)
    refuse_flat_diffusion_keys(raw, f"{p}: ")
    refuse_renamed_knobs(raw, f"{p}: ")
    try:
        node = OmegaConf.merge(OmegaConf.structured(HardwareProfile), raw)
    except OmegaConfBaseException as e:
        raise ConfigError(f"hardware {p}: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_object(node)
