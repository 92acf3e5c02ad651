"""One Megatron-LM training iteration: time and peak allocated memory per pipeline rank of a
static layout, as named terms that every Megatron-like baseline of the harness shares.

Time. Each micro-batch on each pipeline stage costs (forward + backward, no overlap of
compute and communication, as the measured launches ran):
- GEMMs: every linear's forward, input-gradient and weight-gradient GEMM (QKV, output
  projection, fc1, fc2 per layer split over tp; the LM head on the last stage) at the profile's
  kernel table time for its (m, n, k) (:mod:`.kernels`; log-log in m), x ``gemm_time_factor``;
- causal flash attention: the table's forward + backward time at the micro-batch's
  length-weighted mean document length, x sum(s^2) / s_eff^2, heads / tp, x ``attn_time_factor``;
- memory-bound kernels: bytes read and written by norms, activations (GeLU / SwiGLU), rotary,
  residual adds and dropout (:func:`elementwise_bytes`), the embedding, the loss over the fp32
  logits and Adam over the rank's shard, over the HBM bandwidth, x ``elementwise_time_factor``;
- TP: four all-reduces per layer (two forward, two backward; with sequence parallelism four
  all-gathers and four reduce-scatters, the same bus bytes) of rows x h x 2 B, plus the
  embedding's forward and the LM head's backward one;
- PP: per stage boundary a forward activation and a backward gradient of rows x h x 2 B / tp
  (Megatron's scatter-gather), a send/recv between the two stages' GPUs;
- every collective and send/recv priced by :mod:`impl.common.collectives` from the profile's
  links and the group's placement (NVLink inside a node; across nodes a ring over the node's
  NICs, or ONE NIC for a send/recv or a group with one rank per node), with its per-hop
  latency: the feature is seconds at the links' nominal rate, under F_INTRA or F_INTER by the
  link that bounds it, theta = 1 / ``intra_node_comm_efficiency`` or ``inter_node_...``;
- ``layer_overhead_s`` per layer (kernel launch gaps and host work that the GPU waits for).
LM head rows (``grid``): pad mbs x context; pack also mbs x context, because the fork pads hidden
states back to the micro-batch grid before the LM head.
1F1B over m micro-batches of stage times t[j, s]: sum_j max_s t + sum_s mean_j t - mean_j max_s t
((m + pp - 1) t when every time is t); the slowest data-parallel rank gates. Then once per
iteration: the distributed optimizer's reduce-scatter of fp32 gradients and all-gather of bf16
parameters over dp (all-reduce without it), the tied-embedding all-reduce between the first and
last stage, Adam over the rank's shard (memory-bound), and ``iteration_overhead_s``.

Memory (bytes, per pipeline rank, what ``torch.cuda.max_memory_allocated`` reports):
- states: bf16 parameters (2 B) and the gradient buffer (fp32 4 B, or 2 B where the stack
  accumulates in bf16) per parameter of the rank, fp32 master + Adam m, v (12 B) over dp with the
  distributed optimizer (else whole); the last stage holds the untied output layer
  (``MegatronModel.params_per_rank``);
- activations: the bytes each module saves for backward (:mod:`.activations`, per architecture,
  with SP, TP, GQA, dropout and recompute), x ``activation_factor``; under 1F1B stage s holds
  min(pp - s, m) micro-batches in flight; the first stage adds the embedding's, the last the
  final norm's and the output layer's; packed micro-batches vary, so the peak is the largest sum
  over in-flight windows; full recompute keeps each layer's input and one layer's working set;
- logits on the last stage: grid x V / tp x ``logits_bytes``, a fitted knob whose range starts
  at what the fork's loss path keeps alive at its peak (``gpt_model.post_language_model_processing``
  holds the bf16 logits, 2 B, and their ``.float()`` copy, 4 B, while
  ``_VocabParallelCrossEntropy.forward`` makes the max-shifted fp32 copy, 4 B, that ``exp`` and
  ``div_`` then overwrite in place and save as the softmax: 10 B; the backward works in place on
  the softmax and casts it to bf16, 6 B) and adds room for the allocator's rounding of these
  V-wide blocks (``fit.knob_ranges``);
- ``memory_overhead_bytes``. A launch fits when every rank's peak is <= ``allocatable_bytes``.
  The runs file's memory is ``torch.cuda.max_memory_allocated`` (``memory_per_rank``:
  ``max_allocated_mb``, with ``max_reserved_mb`` beside it), so the caching allocator's reserve
  stays out of the peak; it sits in ``allocatable_bytes``, a fitted fraction of the GPU's memory
  (range 0.75-1.0: in the February file a rank's max allocated is 0.62-0.97 of its max reserved,
  5th-95th percentile, median 0.86).

Every term is linear in one knob (or in none), so the fit (:mod:`impl.common.megatron.fit`)
prices with this same code through :class:`StepFeatures`; the kernel tables make the features
depend on the profile (its tables and HBM bandwidth), not only on the layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from impl.common import collectives as coll
from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile, MegatronKnobs

from . import activations as act
from .derive import step_knobs, tables_of
from .kernels import attn_fwd_bwd_s, gemm_fwd_bwd_s
from .model import MegatronLayout, MegatronModel, padded_vocab
from .stack import Activation, NormImpl

BF16 = 2.0
# Adam over one parameter of the shard: read fp32 grad, master, m, v; write master, m, v and the
# bf16 parameter; the gradient norm reads the grad once more.
OPT_BYTES_PER_PARAM = 4 * 4 + 3 * 4 + 2 + 4
# The loss over one fp32 logit (vocab-parallel cross-entropy): cast, max, exp, sum, grad.
CE_BYTES_PER_LOGIT = 24.0
TP_COLLECTIVES_PER_LAYER = 4  # all-reduces (no SP) or AG+RS pairs (SP), forward + backward
ULYSSES_ALL_TO_ALLS_PER_LAYER = 8  # q, k, v, out; forward + backward
# Memory-peak spans: Megatron prints max allocated after 10 iterations; a launch runs train_iters.
REPORT_ITERS = 10

# Time features, one coefficient each (theta): see theta_of.
F_GEMM, F_ATTN, F_ELEM, F_INTRA, F_INTER, F_LAYERS, F_ITER, F_FIXED = range(8)
N_TIME = 8
# Memory features: states (fixed), derived activation bytes, logit elements, 1.
M_STATES, M_ACT, M_LOGITS, M_ONE = range(4)
N_MEM = 4


def optimizer_step_s(params: float, shard: int, hw: HardwareProfile, knobs: Optional[MegatronKnobs] = None) -> float:
    """The step model's per-iteration terms for a planner that prices the rest itself: Adam over
    ``params / shard`` parameters on one GPU (memory-bound, ``OPT_BYTES_PER_PARAM`` each) x the
    elementwise factor, plus the per-iteration overhead (the F_ELEM optimizer and F_ITER terms of
    :func:`features`)."""
    k = knobs or step_knobs(hw)
    return (k.elementwise_time_factor * OPT_BYTES_PER_PARAM * params / shard / hw.memory_bw_bytes_per_s
            + k.iteration_overhead_s)


def theta_of(hw: HardwareProfile, k: MegatronKnobs) -> np.ndarray:
    """Seconds per unit of each time feature (the table-priced ones: a factor near 1)."""
    for name in ("gemm_time_factor", "attn_time_factor", "elementwise_time_factor", "intra_node_comm_efficiency",
                 "inter_node_comm_efficiency"):
        if not getattr(k, name) > 0:
            raise ConfigError(f"hardware.megatron.knobs.{name}: must be > 0, got {getattr(k, name)}")
    th = np.zeros(N_TIME)
    th[F_GEMM] = k.gemm_time_factor
    th[F_ATTN] = k.attn_time_factor
    th[F_ELEM] = k.elementwise_time_factor
    th[F_INTRA] = 1.0 / k.intra_node_comm_efficiency
    th[F_INTER] = 1.0 / k.inter_node_comm_efficiency
    th[F_LAYERS] = k.layer_overhead_s
    th[F_ITER] = k.iteration_overhead_s
    th[F_FIXED] = 1.0
    return th


def comm_terms(op: coll.CollOp, hw: HardwareProfile, ranks: int, ranks_per_node: int,
               gpus_per_node: Optional[int] = None) -> tuple[int, float, float]:
    """(time feature, seconds per byte at the links' nominal rate, latency seconds) of ``op`` over
    ``ranks`` GPUs, ``ranks_per_node`` per node, nodes of ``gpus_per_node`` (the layout's)."""
    if gpus_per_node is not None and gpus_per_node != hw.gpus_per_node:
        hw = replace(hw, gpus_per_node=gpus_per_node)
    per_byte, link, lat = coll.link_rate(op, hw, ranks, ranks_per_node, intra_efficiency=1.0, inter_efficiency=1.0)
    return (F_INTRA if link == coll.Link.NVLINK else F_INTER), per_byte, lat


def group_terms(op: coll.CollOp, hw: HardwareProfile, size: int, stride: int, gpus_per_node: int) -> tuple[int, float, float]:
    """:func:`comm_terms` of a group of ``size`` ranks ``stride`` apart in Megatron's rank order."""
    return comm_terms(op, hw, size, coll.group_ranks_per_node(size, stride, gpus_per_node), gpus_per_node)


def p2p_terms(hw: HardwareProfile, intra: bool, gpus_per_node: int) -> tuple[int, float, float]:
    """:func:`comm_terms` of one send/recv inside a node or across two."""
    return comm_terms(coll.CollOp.SEND_RECV, hw, 2, 2 if intra else 1, gpus_per_node)


def phi_of(k: MegatronKnobs) -> np.ndarray:
    """Bytes per unit of each memory feature."""
    return np.array([1.0, k.activation_factor, k.logits_bytes, k.memory_overhead_bytes])


# Bytes each memory-bound op reads and writes per element, forward + backward, as the stack's
# code runs it (every kernel's reads + writes; fp32 where the code upcasts; per-token scalars left
# out). ``tests/common/test_megatron_activations.py`` counts them on each op as the code states it.
# Per hidden element of a norm: fused (apex / TE), 5 bf16 passes; the fork's plain RMSNorm
# forward x.float() 6, pow 8, mean 4, x * rstd 8, .type_as 6, * weight 4 (36) and backward
# the weight product's input gradient 4, weight gradient 6 + its token sum 2, .type_as 6, the
# rstd product's input gradient 8, rstd gradient 12 + its row sum 4, mean's broadcast 4, pow's
# x.pow(1) 8, x 2 8, x grad 12, the two fp32 gradients' sum 12, .float() 6 (92).
NORM_FUSED_BYTES = 10.0
NORM_TORCH_FP32_BYTES = 128.0
# Per element of the fc1 output's f / tp columns (GeLU) or of the SwiGLU output (SwiGLU): fused
# bias-GeLU 5 bf16 passes; plain GeLU bias add 4, gelu 4, gelu_backward 6, bias gradient 2;
# fused SwiGLU (read 2f, write f; backward read g and 2f, write 2f) 16; the fork's plain SwiGLU
# silu 4, product 6, the product's two gradients 6 + 6, silu_backward 6, chunk's cat 8.
GELU_FUSED_BYTES, GELU_PLAIN_BYTES = 10.0, 16.0
SWIGLU_FUSED_BYTES, SWIGLU_PLAIN_BYTES = 16.0, 36.0
# Per element of q and k: a fused RoPE kernel 4 bf16 passes; the fork's plain apply_rotary_pos_emb
# forward t * cos 4, neg 2, rotate_half's cat 4, * sin 4, add 6, cat with the pass-through 4 (24)
# and backward the two products 4 + 4, neg 2, cat 4, the two gradients' sum 6, the slices'
# backward 2 + its sum 6 (28); its output is contiguous, so flash attention's q / k copy (4) is
# not made. Per application and token, over d: cos and sin 8 + 8, their bf16 casts 6 + 6, their
# reads in the four products 2 x 4.
ROPE_FUSED_BYTES, ROPE_PLAIN_BYTES, ROPE_PLAIN_TABLE_BYTES = 8.0, 52.0 - 4.0, 36.0
# Per hidden element of a residual: the fused bias-dropout-add 7 bf16 passes (3 forward, 4
# backward); a plain residual add (no bias, no dropout) 3 forward, and the residual gradient's
# sum 3 in the backward.
RESIDUAL_FUSED_BYTES, RESIDUAL_PLAIN_BYTES = 14.0, 12.0


def norm_elementwise_bytes(model: MegatronModel) -> float:
    """Bytes one norm reads and writes per token, forward + backward (whole: divide by tp under SP)."""
    plain = model.stack.norm_impl == NormImpl.TORCH_FP32
    return (NORM_TORCH_FP32_BYTES if plain else NORM_FUSED_BYTES) * model.hidden


def elementwise_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False) -> float:
    """Bytes one layer's memory-bound kernels read and write per token on one TP rank, forward
    + backward, for the model's kernel stack (the op tables above: a fused kernel reads its
    inputs and writes its outputs once, an unfused op each time): two norms, two residual adds
    (with bias and dropout when the stack has them), the MLP activation, rotary on q and k, and
    the q/k/v layout copies for flash attention (4 bf16 passes of (h + 2 kv) / tp). Norms and
    residuals run on s / tp tokens with SP, whole without."""
    ks = model.stack
    h, f, kv, t = model.hidden, model.ffn_hidden, model.kv_hidden, float(tp)
    sp = t if sequence_parallel else 1.0
    fused_residual = model.dropout > 0 or model.gpt  # GPT's linears carry biases
    b = (2 * norm_elementwise_bytes(model) + 2 * (RESIDUAL_FUSED_BYTES if fused_residual else RESIDUAL_PLAIN_BYTES) * h) / sp
    if ks.activation == Activation.GELU:
        b += (GELU_FUSED_BYTES if ks.activation_fused else GELU_PLAIN_BYTES) * f / t
    else:
        b += (SWIGLU_FUSED_BYTES if ks.activation_fused else SWIGLU_PLAIN_BYTES) * f / t
    b += 2.0 * 4 * (h + 2 * kv) / t
    if ks.rope:
        if ks.rope_fused:
            b += ROPE_FUSED_BYTES * (h + kv) / t
        else:
            b += ROPE_PLAIN_BYTES * (h + kv) / t + 2 * ROPE_PLAIN_TABLE_BYTES * (h // model.heads)
    return b


def _unique_apply(rows: np.ndarray, fn) -> np.ndarray:
    u, inv = np.unique(rows, return_inverse=True)
    return np.asarray(fn(u))[inv].reshape(rows.shape)


def linear_gemm_s(model: MegatronModel, tp: int, rows, tables, extra_forwards: int = 0) -> np.ndarray:
    """Seconds of one layer's GEMMs (forward, input and weight gradients; ``extra_forwards``
    recomputed forwards) for micro-batches of ``rows`` tokens on one TP rank."""
    h, f, kv = model.hidden, model.ffn_hidden, model.kv_hidden
    fc1 = f if model.gpt else 2 * f
    shapes = ((h + 2 * kv) // tp, h), (h, h // tp), (fc1 // tp, h), (h, f // tp)  # (n out, k in)

    def per(u):
        tot = np.zeros_like(u)
        for n, k in shapes:
            fwd, bwd = gemm_fwd_bwd_s(tables, u, n, k)
            tot += (1 + extra_forwards) * fwd + bwd
        return tot

    return _unique_apply(np.asarray(rows, dtype=float), per)


def attention_s(model: MegatronModel, tp: int, rows, attn_sq, tables, extra_forwards: int = 0) -> np.ndarray:
    """Seconds of one layer's causal attention, forward + backward, on one TP rank."""
    rows = np.asarray(rows, dtype=float)
    sq = np.asarray(attn_sq, dtype=float)
    s_eff = np.where(rows > 0, sq / np.maximum(rows, 1.0), 0.0)
    fwd, bwd = attn_fwd_bwd_s(tables, s_eff, sq, model.heads / tp, model.hidden // model.heads)
    return (1 + extra_forwards) * fwd + bwd


@dataclass
class MicroBatchWork:
    """The micro-batches of some iterations, each (iteration, dp rank, micro-batch) entry: rows
    through the layers, sum of squared document lengths (attention) and LM-head rows.
    ``peak_rows`` holds whole runs of independent streams for the memory peaks."""

    rows: np.ndarray
    attn_sq: np.ndarray
    grid: np.ndarray
    peak_rows: Optional[np.ndarray] = None  # (streams, iterations, dp, m)
    run_rows: Optional[np.ndarray] = None  # the same over whole runs (default: peak_rows)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.rows.shape)  # type: ignore[return-value]


def pad_work(lay: MegatronLayout) -> MicroBatchWork:
    """Pad mode: every micro-batch is mbs x context tokens (one iteration is all of them)."""
    n = float(lay.mbs * lay.context)
    full = np.full((1, 1, lay.microbatches), n)
    return MicroBatchWork(rows=full, attn_sq=full * lay.context, grid=full.copy())


def pack_work(lay: MegatronLayout, doc_lengths: np.ndarray, run_doc_lengths: Optional[np.ndarray] = None) -> MicroBatchWork:
    """Pack mode from documents (streams, iterations, gbs) already cut to the context: a
    micro-batch is mbs consecutive documents of its data-parallel rank, one row of their summed
    length (padded to a multiple of tp with sequence parallelism); the LM head still sees
    mbs x context rows. Time is averaged over the first iteration of every stream; a memory peak
    is a maximum over a run, a noisy statistic of one stream, so it is averaged over the streams.
    ``run_doc_lengths`` (streams, train iterations, gbs) spans the whole run for the fit verdict
    (default: the same documents)."""
    rows, per = _pack_rows(lay, doc_lengths)
    sq = (per[:, 0] ** 2).sum(axis=3)
    grid = np.full_like(rows[:, 0], float(lay.mbs * lay.context))
    run_rows = _pack_rows(lay, run_doc_lengths)[0] if run_doc_lengths is not None else None
    return MicroBatchWork(rows=rows[:, 0], attn_sq=sq, grid=grid, peak_rows=rows, run_rows=run_rows)


def _pack_rows(lay: MegatronLayout, doc_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    docs = np.asarray(doc_lengths, dtype=float)
    if docs.ndim == 2:
        docs = docs[None]
    if docs.ndim != 3 or docs.shape[2] != lay.gbs:
        raise ConfigError(f"pack_work: documents must be (streams, iterations, gbs={lay.gbs}), got {docs.shape}")
    r, it = docs.shape[:2]
    per = docs.reshape(r, it, lay.dp, lay.microbatches, lay.mbs)
    rows = per.sum(axis=4)
    if lay.sequence_parallel and lay.tp > 1:
        rows = np.ceil(rows / lay.tp) * lay.tp
    return rows, per


@dataclass
class StepFeatures:
    """A launch's work in units the knobs price: ``T`` (iters, dp, m, pp, N_TIME) per micro-batch
    and stage, ``G`` (N_TIME,) once per iteration, ``M_report`` / ``M_run`` (pp, N_MEM) per stage at
    the reported peak (first data-parallel rank, first REPORT_ITERS iterations) and over the run."""

    T: np.ndarray
    G: np.ndarray
    M_report: np.ndarray
    M_run: np.ndarray

    def iteration_s(self, theta: np.ndarray) -> float:
        return float(np.mean(iteration_times_s(self.T, self.G, theta)))

    def memory_bytes(self, phi: np.ndarray, run: bool = False) -> np.ndarray:
        return (self.M_run if run else self.M_report) @ phi


def iteration_times_s(T: np.ndarray, G: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """1F1B per data-parallel rank, the slowest rank, plus the per-iteration terms; one per iteration."""
    t = T @ theta  # (iters, dp, m, pp)
    worst = t.max(axis=3)
    pipe = worst.sum(axis=2) + t.mean(axis=2).sum(axis=2) - worst.mean(axis=2)
    return pipe.max(axis=1) + float(G @ theta)


def _window_max(c: np.ndarray, k: int) -> float:
    """Largest sum of k consecutive micro-batches within one iteration of one rank, per stream
    (the first axis), averaged over the streams; ``c`` is the zero-led cumulative sum over the
    micro-batches (:func:`_cumsum`)."""
    m = c.shape[-1] - 1
    k = max(1, min(k, m))
    w = c[..., k:] - c[..., :-k]
    return float(w.reshape(w.shape[0], -1).max(axis=1).mean())


def _cumsum(rows: np.ndarray) -> np.ndarray:
    c = np.zeros(rows.shape[:-1] + (rows.shape[-1] + 1,))
    np.cumsum(rows, axis=-1, out=c[..., 1:])
    return c


def _row_max(rows: np.ndarray) -> float:
    return float(rows.reshape(rows.shape[0], -1).max(axis=1).mean())


def layer_terms(model: MegatronModel, tp: int, rows, attn_sq, hw: HardwareProfile, gpus_per_node: int,
                recompute=1.0, sequence_parallel: bool = False, ulysses: int = 1) -> np.ndarray:
    """Time features (..., N_TIME) of one transformer layer, forward + backward, for micro-batches
    of ``rows`` tokens and ``attn_sq`` = sum of squared document lengths: the GEMMs and causal
    attention at the profile's table times, the memory-bound kernels' bytes over HBM, the four TP
    collectives with their latency, one layer's overhead. ``recompute``: ``full`` (or a factor
    > 1, as before) adds one forward. ``ulysses`` > 1 (DeepSpeed-Ulysses, tp 1): each GPU runs
    rows / ulysses tokens through whole-width GEMMs and memory-bound kernels and causal attention
    over every token for heads / ulysses; eight all-to-alls per layer (q, k, v and the output,
    forward and backward), each sending (u - 1) / u of the GPU's rows / u x (h or kv) x 2 B."""
    rows = np.asarray(rows, dtype=float)
    sq = np.asarray(attn_sq, dtype=float)
    full = recompute == "full" or (not isinstance(recompute, str) and recompute > 1.0)
    extra = 1 if full else 0
    tables = tables_of(hw)
    hbm = hw.memory_bw_bytes_per_s
    if not hbm > 0:
        raise ConfigError(f"hardware {hw.name}: memory_bw_bytes_per_s must be > 0 to price Megatron")
    u = max(1, int(ulysses))
    local = rows / u
    f = np.zeros(rows.shape + (N_TIME,))
    f[..., F_GEMM] = linear_gemm_s(model, tp, local, tables, extra)
    f[..., F_ATTN] = attention_s(model, tp * u, rows, sq, tables, extra)
    f[..., F_ELEM] = elementwise_bytes(model, tp, sequence_parallel) * local / hbm * (4.0 / 3.0 if full else 1.0)
    f[..., F_LAYERS] = 1.0
    if tp > 1:
        col, per_byte, lat = group_terms(coll.CollOp.ALL_REDUCE, hw, tp, 1, gpus_per_node)
        f[..., col] = TP_COLLECTIVES_PER_LAYER * per_byte * BF16 * model.hidden * rows
        f[..., F_FIXED] = TP_COLLECTIVES_PER_LAYER * lat
    if u > 1:
        col, per_byte, lat = group_terms(coll.CollOp.ALL_TO_ALL, hw, u, 1, gpus_per_node)
        width = 2 * (model.hidden + model.kv_hidden)  # q + out, k + v
        f[..., col] = per_byte * 2.0 * BF16 * width * local  # forward + backward
        f[..., F_FIXED] = ULYSSES_ALL_TO_ALLS_PER_LAYER * lat
    return f


def layer_time_s(model: MegatronModel, tp: int, rows: float, attn_sq: float, hw: HardwareProfile,
                 gpus_per_node: Optional[int] = None, knobs: Optional[MegatronKnobs] = None) -> float:
    """Seconds of one layer's forward + backward for one micro-batch (see :func:`layer_terms`)."""
    k = knobs or step_knobs(hw)
    return float(layer_terms(model, tp, rows, attn_sq, hw, gpus_per_node or hw.gpus_per_node) @ theta_of(hw, k))


def features(model: MegatronModel, lay: MegatronLayout, hw: HardwareProfile,
             work: Optional[MicroBatchWork] = None) -> StepFeatures:
    """The launch's work in knob units (see the module doc for each term)."""
    lay.check(model)
    work = work if work is not None else pad_work(lay)
    h, tp, pp, dp, u = model.hidden, lay.tp, lay.pp, lay.dp, lay.ulysses
    gpn = lay.gpus_per_node
    V = padded_vocab(model.vocab, tp, model.make_vocab_size_divisible_by)
    Ls = model.num_layers // pp
    P = model.params_per_rank(tp, pp)
    hbm = hw.memory_bw_bytes_per_s
    if not hbm > 0:
        raise ConfigError(f"hardware {hw.name}: memory_bw_bytes_per_s must be > 0 to price Megatron")
    rows, sq, grid = work.rows, work.attn_sq, work.grid
    it, ndp, m = rows.shape
    T = np.zeros((it, ndp, m, pp, N_TIME))
    layers = layer_terms(model, tp, rows, sq, hw, gpn, lay.recompute, lay.sequence_parallel, u)
    tables = tables_of(hw)
    tp_col, tp_per_byte, tp_lat = group_terms(coll.CollOp.ALL_REDUCE, hw, tp, 1, gpn) if tp > 1 else (F_INTRA, 0.0, 0.0)
    # Ulysses: every GPU of the group holds rows / u tokens outside attention (embedding, head, p2p).
    rows, grid = rows / u, grid / u
    for s in range(pp):
        f = T[:, :, :, s, :]
        f[...] = layers * Ls
        if tp > 1:
            # The embedding's forward and the LM head's backward all-reduce.
            extra = (rows if s == 0 else 0.0) + (grid if s == pp - 1 else 0.0)
            f[..., tp_col] += tp_per_byte * BF16 * h * extra
            f[..., F_FIXED] += ((s == 0) + (s == pp - 1)) * tp_lat
        if s == 0:
            # Embedding gather (read a row, write it; GPT adds the position row) and its
            # scatter-add gradient: about 5 passes of h per token.
            f[..., F_ELEM] += 5.0 * BF16 * h * rows / hbm
        if s == pp - 1:
            fwd, bwd = (_unique_apply(np.asarray(grid, dtype=float), lambda u, i=i: gemm_fwd_bwd_s(tables, u, V // tp, h)[i])
                        for i in (0, 1))
            f[..., F_GEMM] += fwd + bwd
            # The final norm (as a layer's) and the loss over the fp32 logits.
            f[..., F_ELEM] += (norm_elementwise_bytes(model) * rows / (tp if lay.sequence_parallel else 1)
                               + CE_BYTES_PER_LOGIT * grid * V / tp) / hbm
        for nb in ([s - 1] if s > 0 else []) + ([s + 1] if s < pp - 1 else []):
            col, per_byte, lat = p2p_terms(hw, coll.same_node(s, nb, tp * u, dp, gpn), gpn)
            f[..., col] += 2.0 * per_byte * BF16 * h * rows / tp
            f[..., F_FIXED] += 2.0 * lat

    # An empty placeholder micro-batch (a rank with fewer micro-batches than the others) costs nothing.
    T *= (rows > 0)[..., None, None]

    G = np.zeros(N_TIME)
    Pmax = max(P)
    dp = dp * u  # Ulysses replicates the parameters over its group: gradients sync over dp x u
    if dp > 1:
        # Distributed optimizer: reduce-scatter of fp32 grads + all-gather of bf16 params; else
        # an all-reduce of fp32 grads. The group: dp ranks tp apart.
        syncs = ((coll.CollOp.REDUCE_SCATTER, 4.0), (coll.CollOp.ALL_GATHER, BF16)) if lay.distributed_optimizer \
            else ((coll.CollOp.ALL_REDUCE, 4.0),)
        for op, nb in syncs:
            col, per_byte, lat = group_terms(op, hw, dp, tp, gpn)
            G[col] += per_byte * nb * Pmax
            G[F_FIXED] += lat
    if pp > 1 and model.tied:
        # fp32 embedding-gradient all-reduce between the first and the last stage
        both = 2 if coll.same_node(0, pp - 1, tp, dp, gpn) else 1
        col, per_byte, lat = comm_terms(coll.CollOp.ALL_REDUCE, hw, 2, both, gpn)
        G[col] += per_byte * 4.0 * V / tp * h
        G[F_FIXED] += lat
    shard = dp if lay.distributed_optimizer else 1
    G[F_ELEM] += OPT_BYTES_PER_PARAM * Pmax / shard / hbm
    G[F_ITER] = 1.0

    peak_rows = work.peak_rows if work.peak_rows is not None else work.rows[None]
    run_rows = work.run_rows if work.run_rows is not None else peak_rows
    M_report = _memory_features(model, lay, P, V, peak_rows[:, :REPORT_ITERS, :1] / u, work.grid / u)
    M_run = _memory_features(model, lay, P, V, run_rows / u, work.grid / u)
    return StepFeatures(T=T, G=G, M_report=M_report, M_run=M_run)


def _memory_features(model: MegatronModel, lay: MegatronLayout, P: list[int], V: int,
                     rows: np.ndarray, grid: np.ndarray) -> np.ndarray:
    tp, pp, sp = lay.tp, lay.pp, lay.sequence_parallel
    Ls = model.num_layers // pp
    m = rows.shape[-1]
    shard = lay.dp if lay.distributed_optimizer else 1
    shard *= lay.ulysses
    M = np.zeros((pp, N_MEM))
    c = _cumsum(rows)
    biggest = _row_max(rows)
    rc = "selective" if lay.recompute == "selective" else "none"
    layer = act.per_token_layer(model, tp, sp, model.dropout, rc)
    emb = sum(act.embedding_bytes(model, tp, sp, model.dropout).values())
    head = sum(act.head_bytes(model, tp, sp).values())
    for s in range(pp):
        M[s, M_STATES] = (BF16 + model.stack.grad_bytes) * P[s] + 12.0 * P[s] / shard
        in_flight = min(pp - s, m)
        window = _window_max(c, in_flight)
        if lay.recompute == "full":
            # Each layer's input for every in-flight micro-batch, and one layer's working set of
            # the largest micro-batch while it is recomputed.
            per_mb = act.full_recompute_bytes(model, tp, sp) * Ls
            units = window * per_mb + biggest * layer
            last = biggest * (per_mb + layer)
        else:
            units = window * layer * Ls
            last = biggest * layer * Ls
        if s == 0:
            units += window * emb
            last += biggest * emb if pp == 1 else 0.0
        if s == pp - 1:
            # The last stage's peak is at the loss: the micro-batch's activations and its logits.
            last += biggest * head
            units = max(units, last) if pp == 1 else last
            M[s, M_LOGITS] = float(grid.max()) * V / tp
        M[s, M_ACT] = units
        M[s, M_ONE] = 1.0
    return M


def linear_memory(model: MegatronModel, lay: MegatronLayout, knobs: MegatronKnobs) -> list[tuple[float, float]]:
    """Per pipeline stage, (fixed bytes, bytes per token) of the step model's peak when every
    1F1B in-flight slot holds a micro-batch of s tokens: the same terms as the step's memory
    (states, activations by module x ``activation_factor``, embedding and head, logits x
    ``logits_bytes``, ``memory_overhead_bytes``) for planners that bound one micro-batch's length."""
    tp, pp, sp, u = lay.tp, lay.pp, lay.sequence_parallel, lay.ulysses
    P = model.params_per_rank(tp, pp)
    V = padded_vocab(model.vocab, tp, model.make_vocab_size_divisible_by)
    Ls = model.num_layers // pp
    shard = lay.dp * u if lay.distributed_optimizer else 1
    rc = "selective" if lay.recompute == "selective" else "none"
    layer = act.per_token_layer(model, tp, sp, model.dropout, rc) / u
    emb = sum(act.embedding_bytes(model, tp, sp, model.dropout).values()) / u
    head = sum(act.head_bytes(model, tp, sp).values()) / u
    out = []
    for s in range(pp):
        fixed = (BF16 + model.stack.grad_bytes) * P[s] + 12.0 * P[s] / shard + knobs.memory_overhead_bytes
        per = (pp - s) * layer * Ls + (pp * emb if s == 0 else 0.0)
        if s == pp - 1:
            per += head
        per *= knobs.activation_factor
        if s == pp - 1:
            per += knobs.logits_bytes * V / tp / u
        out.append((float(fixed), float(per)))
    return out


@dataclass
class StepEstimate:
    """What the model says of one launch."""

    iteration_s: float
    peak_allocated_bytes: list[float]  # per pipeline rank, reported span (first DP replica)
    peak_run_bytes: list[float]  # per pipeline rank, whole run, every DP replica
    allocatable_bytes: float
    breakdown_s: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return max(self.peak_run_bytes) <= self.allocatable_bytes

    @property
    def max_peak_allocated_bytes(self) -> float:
        return max(self.peak_allocated_bytes)


def _breakdown(F: StepFeatures, theta: np.ndarray) -> dict:
    """Seconds of each term on the slowest stage, summed over its micro-batches (first iteration,
    first rank), and the per-iteration terms: where the time goes."""
    t = F.T[0, 0]  # (m, pp, K)
    s = int(np.argmax((t @ theta).sum(axis=0)))
    per = t[:, s, :] * theta
    names = {F_GEMM: "gemm_s", F_ATTN: "attention_s", F_ELEM: "memory_bound_s", F_INTRA: "intra_node_comm_s",
             F_INTER: "inter_node_comm_s", F_LAYERS: "layer_overhead_s", F_FIXED: "latency_s"}
    out = {v: round(float(per[:, k].sum()), 6) for k, v in names.items()}
    out["per_iteration_s"] = round(float(F.G @ theta), 6)
    out["slowest_stage"] = s
    return out


def price(model: MegatronModel, lay: MegatronLayout, hw: HardwareProfile,
          work: Optional[MicroBatchWork] = None, knobs: Optional[MegatronKnobs] = None) -> StepEstimate:
    """Time per iteration and peak allocated memory per pipeline rank of one static launch."""
    k = knobs or step_knobs(hw)
    F = features(model, lay, hw, work)
    theta, phi = theta_of(hw, k), phi_of(k)
    allocatable = k.allocatable_bytes or hw.memory_bytes
    return StepEstimate(iteration_s=F.iteration_s(theta), peak_allocated_bytes=[float(x) for x in F.memory_bytes(phi)],
                        peak_run_bytes=[float(x) for x in F.memory_bytes(phi, run=True)],
                        allocatable_bytes=float(allocatable), breakdown_s=_breakdown(F, theta))


def work_from_microbatches(ranks: "list[list[list[int]]]", lm_head_rows: str = "row",
                           context: int = 0) -> MicroBatchWork:
    """Micro-batches as a planner holds them: per data-parallel rank, a list of packed rows, each
    a list of document lengths. Ranks with fewer rows are padded with empty ones (priced at zero).
    ``lm_head_rows``: ``row`` (the LM head sees the row's tokens) or ``grid`` (Megatron's pack
    mode in the measured fork: mbs x context rows, with mbs the row's document count)."""
    if lm_head_rows not in ("row", "grid"):
        raise ConfigError(f"lm_head_rows: unknown {lm_head_rows!r} (one of: row, grid)")
    if not ranks or not any(ranks):
        raise ConfigError("work_from_microbatches: no micro-batch on any rank")
    m = max(len(r) for r in ranks)
    rows = np.zeros((1, len(ranks), m))
    sq = np.zeros_like(rows)
    grid = np.zeros_like(rows)
    for d, rank in enumerate(ranks):
        for j, docs in enumerate(rank):
            a = np.asarray(docs, dtype=float)
            rows[0, d, j] = a.sum()
            sq[0, d, j] = (a * a).sum()
            grid[0, d, j] = a.sum() if lm_head_rows == "row" else len(a) * context
    return MicroBatchWork(rows=rows, attn_sq=sq, grid=grid, peak_rows=rows[None])


def seq_cost_terms(model: MegatronModel, lay: MegatronLayout, hw: HardwareProfile,
                   knobs: Optional[MegatronKnobs] = None, gemm_scale: float = 1.0,
                   typical: Optional[float] = None) -> tuple[float, float, float]:
    """The step model's time of one packed micro-batch on the slowest pipeline stage as
    ``a * sum(s^2) + b * rows + c`` (the LM head on the row's tokens), for planners that price
    micro-batches one by one (:class:`~impl.common.cost.seqlen.SeqCost`). The table-priced
    kernels are not affine in the rows (a GEMM of few rows runs under its large-row rate), so the
    line is the chord of the step model between ``typical`` / 2 and 2 x ``typical`` tokens
    (default: the layout's context), and ``a`` is one document of ``typical`` tokens' attention
    over typical^2. ``gemm_scale`` multiplies the GEMM terms: LoRA over frozen weights runs the
    forward and input gradient GEMMs but no weight gradient (2/3 of the GEMM time)."""
    if not 0 < gemm_scale <= 1:
        raise ConfigError(f"gemm_scale: must be in (0, 1], got {gemm_scale}")
    k = knobs or step_knobs(hw)
    theta = theta_of(hw, k).copy()
    theta[F_GEMM] *= gemm_scale
    x = float(typical or lay.context)
    r1, r2 = x / 2.0, 2.0 * x
    probe = MicroBatchWork(rows=np.array([[[r1, r2, x]]]), attn_sq=np.array([[[0.0, 0.0, x * x]]]),
                           grid=np.array([[[r1, r2, x]]]))
    t = features(model, lay.with_(gbs=3 * lay.dp * lay.mbs), hw, probe).T[0, 0] @ theta  # (3, pp)
    b = (t[1] - t[0]) / (r2 - r1)
    c = t[0] - b * r1
    a = (t[2] - (b * x + c)) / (x * x)
    s = int(np.argmax(a * x * x + b * x + c))
    return float(a[s]), float(max(b[s], 0.0)), float(max(c[s], 0.0))
