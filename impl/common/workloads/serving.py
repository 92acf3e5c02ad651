"""Workload for multi-LoRA LLM serving (CaraServe; LobRA reuses the LoRA pieces)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from impl.common.workloads.pipeline import ModelShape


@dataclass
class LlamaShape(ModelShape):
    """Tiny Llama for real mode; defaults = CaraServe's real CPU mode
    (impl/caraserve/README.md). ``ffn_hidden`` is the
    SwiGLU width (LlamaConfig's intermediate_size), ``seq_len`` its max_position_embeddings.
    Built by :func:`impl.common.llm.model.build_llama`."""

    name: str = "llama-tiny"
    num_layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    ffn_hidden: int = 688
    vocab: int = 1024
    seq_len: int = 4096


@dataclass
class PaperModel(ModelShape):
    """Paper-scale shape for sim costs and for the emulated adapter bytes."""

    name: str = "llama2-7b"
    num_layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 32
    ffn_hidden: int = 11008
    vocab: int = 32000
    seq_len: int = 4096
    dtype_bytes: int = 2  # bytes per weight element (fp16)


@dataclass
class ServingTrace:
    """Synthetic trace (impl.common.traces.TraceSpec) or a file that replaces it."""

    num_requests: int = 1000
    arrival: str = "poisson"
    rate_rps: float = 5.0
    cv: float = 3.0
    prompt_median: float = 60.0
    output_median: float = 120.0
    sigma: float = 0.8
    len_min: int = 4
    len_max: int = 2048
    output_min: int = 0  # 0 = len_min
    output_max: int = 0  # 0 = len_max
    file: Optional[str] = None


@dataclass
class ServingAdapters:
    num_adapters: int = 100
    zipf_alpha: float = 1.0
    ranks: List[int] = field(default_factory=lambda: [8, 16, 32, 64])
    rank_weights: List[float] = field(default_factory=lambda: [0.25, 0.25, 0.25, 0.25])
    use_rslora: bool = False
    # One distinct adapter per request (the paper's synthetic setting): num_adapters and
    # the popularity are then ignored.
    per_request: bool = False
    # Popularity: "zipf" (zipf_alpha, the [R] default) or "lognormal", the MAF stand-in
    # of impl/caraserve/README.md: per-adapter weights lognormal with lognormal_sigma (3.54: the top
    # 18.6% of adapters carry 99.6% of the weight, as in the Azure Functions trace), adapters
    # grouped at random into popularity_groups groups (0 = one per server, as the papers map MAF
    # functions), each group an equal share of the requests, weight-proportional within it.
    popularity: str = "zipf"
    lognormal_sigma: float = 3.54
    popularity_groups: int = 0


@dataclass
class ServingWorkload:
    kind: str = "serving"
    model: LlamaShape = field(default_factory=LlamaShape)
    paper_model: PaperModel = field(default_factory=PaperModel)
    trace: ServingTrace = field(default_factory=ServingTrace)
    adapters: ServingAdapters = field(default_factory=ServingAdapters)
    tp: int = 1
    num_servers: int = 1
    # TPOT SLO = slo_scale x the reference's per-token latency (the paper's: 1.5x).
    slo_scale: float = 1.5
    # What slo_scale multiplies: "base" (default, the paper's) = the mean
    # per-token latency of the same trace served by the same engine, batching and prefill policy
    # on the base model alone, no LoRA (a reference run in the job, info.slo_reference);
    # "isolated" = each request's isolated batch-1 TPOT at its rank (the old [R] default, which
    # no scheduler can meet once requests batch); "hf_peft" = the mean per-token latency of an
    # HF-PEFT run (merged adapter, no cross-adapter batching, sim only) on the job's first
    # slo_reference_requests requests and servers (v1's wording).
    slo_reference: str = "base"
    slo_reference_requests: int = 500
    # Real mode on a CPU-only host: the emulated load of a mean-bytes adapter takes load_rho x the
    # measured isolated prefill (rho = T_load / T_prefill, impl/caraserve/README.md);
    # bytes-proportional per rank.
    load_rho: float = 0.5
    # Real mode: rounds of the trace per system (interleaved systems rotate order per round).
    repeats: int = 1
    warmup_requests: int = 2
    torch_threads: int = 1
