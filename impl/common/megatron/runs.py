"""Measured Megatron-LM launches (the runs-file format of ``impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz``,
fields in ``impl/common/megatron/data/README.md``): parse and check every line, turn a launch into the step
model's inputs (model, layout, micro-batch work) and its measured outcome.

Pack-mode documents come from the launch's own ``seq_len_histogram`` (``real_seq_len``: documents
per power-of-two bucket, already cut to the context) when it printed one, else from the file's
pooled histogram at the same context. Reconstructed, documented in ``bench/fidelity/README.md``:
a document is log-uniform within its bucket (the previous bound, b] (the first bucket: (b/2, b]);
of the top bucket (the context C), the share cut to exactly C is the file's P(len > C | len > C/2)
measured at a longer context (for the longest context, the share one octave down).

The buckets are the file's own: every integer key of a histogram is a bucket's upper bound, and
one key ``>Nk`` (``>16k``, ``>32k``, ...) counts the documents above the last bound. A launch
that printed no layout (``effective.mode`` null on an ``error`` launch) is kept unpriced and
counted (``Launch.no_layout``); any other bad value fails with one line naming line and field.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import pathlib
import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

import numpy as np

from impl.common.api import ConfigError

from .model import MegatronLayout, MegatronModel
from .stack import stack_from_args
from .step import REPORT_ITERS, MicroBatchWork, pack_work, pad_work

STATUSES = ("ok", "oom", "error", "incomplete")
_TOP_LABEL = re.compile(r"^>(\d+)k$")
_LAYOUT_FIELDS = ("dp", "tp", "pp", "mbs", "gbs", "seq_length")


@dataclass
class Launch:
    """One line of a runs file, checked."""

    id: str
    status: str
    model: Optional[MegatronModel]
    layout: Optional[MegatronLayout]
    line: int
    train_iters: int = 100
    measured_iteration_ms: Optional[float] = None
    measured_peak_allocated_mb: Optional[float] = None
    printed_params: dict = field(default_factory=dict)  # (tp rank, pp rank) -> count
    printed_padded_vocab: Optional[int] = None
    histogram: Optional[dict] = None  # bucket upper bound (int, or the top label '>Nk') -> documents
    num_nodes: Optional[int] = None
    name: str = ""  # the model's name in the file (7b, 13b)
    arch: str = ""  # effective.arch (gpt, llama; empty where the file has none)
    skip_reason: str = ""  # why a launch with a layout is not priced
    no_layout: bool = False  # printed no layout (effective.mode null on an error launch): skipped, counted

    reports: int = 0  # iteration reports printed
    printed_stages: tuple = ()  # pipeline stages whose memory the log printed (empty: unknown = all)

    @property
    def measured_fits(self) -> Optional[bool]:
        """Ran (ok, or cut by the time limit after printing an iteration) = fits; out of memory =
        does not; a launch cut before its first report, or another error, tells nothing."""
        if self.status == "incomplete":
            return True if self.reports > 0 else None
        return {"ok": True, "oom": False}.get(self.status)

    @property
    def mode(self) -> Optional[str]:
        return self.layout.mode if self.layout else None


def _err(path: str, line: int, field_name: str, why: str) -> ConfigError:
    return ConfigError(f"{path}:{line}: {field_name}: {why}")


def _int(rec: dict, key: str, path: str, line: int, where: str) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(path, line, f"{where}.{key}", f"must be a positive integer, got {v!r}")
    return v


def _dims_of(spec, path: str, line: int) -> dict:
    """``L32-h4096-ffn11008-heads32`` (``-kv8`` where key/value heads are fewer than heads)."""
    try:
        parts = dict((p.rstrip("0123456789"), int(p[len(p.rstrip("0123456789")):])) for p in str(spec).split("-"))
        dims = {"num_layers": parts["L"], "hidden": parts["h"], "ffn_hidden": parts["ffn"], "heads": parts["heads"]}
    except (KeyError, ValueError):
        raise _err(path, line, "effective.model_dims", f"expected like 'L32-h4096-ffn16384-heads32', got {spec!r}") from None
    if "kv" in parts:
        dims["kv_heads"] = parts["kv"]
    return dims


def _printed_args(cfg: dict) -> bool:
    """Whether the log printed Megatron's arguments (not only the few fields every line carries)."""
    return "num_layers" in cfg or "transformer_impl" in cfg


def _model_of(rec: dict, eff: dict, path: str, line: int) -> Optional[MegatronModel]:
    """The model the launch printed; None when it printed neither its arguments nor its dims
    (:func:`load_runs` then takes the dims of another launch of the same model name)."""
    cfg = rec.get("config") or {}
    if not isinstance(cfg, dict):
        raise _err(path, line, "config", f"must be an object, got {type(cfg).__name__}")
    arch = eff.get("arch") or "gpt"
    if cfg.get("num_layers") is not None:
        keys = {"num_layers": "num_layers", "hidden": "hidden_size", "ffn_hidden": "ffn_hidden_size",
                "heads": "num_attention_heads"}
        dims = {k: cfg.get(c) for k, c in keys.items()}
        for k, v in dims.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _err(path, line, f"config.{keys[k]}", f"must be a positive integer, got {v!r}")
    else:
        spec = eff.get("model_dims")
        if spec is None:
            return None
        dims = _dims_of(spec, path, line)
        dims.pop("kv_heads", None)
    vocab = cfg.get("tokenizer_vocab_size")
    if vocab is None:
        return None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise _err(path, line, "config.tokenizer_vocab_size", f"must be a positive integer, got {vocab!r}")
    ctx = _int(eff, "seq_length", path, line, "effective")
    untie = cfg.get("untie_embeddings_and_output_weights")
    # Key/value heads: Megatron reads num_query_groups only with group_query_attention on.
    groups = cfg.get("num_query_groups") if cfg.get("group_query_attention") else None
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
        raise _err(path, line, "config.num_query_groups", f"must be a positive integer, got {groups!r}")
    if groups is None and "-kv" in str(eff.get("model_dims") or ""):
        groups = _dims_of(eff.get("model_dims"), path, line).get("kv_heads")
    dims["kv_heads"] = 0 if groups in (None, dims["heads"]) else groups
    try:
        # The kernels from the printed arguments; a launch that printed none runs its fork's stack.
        stack = stack_from_args(cfg) if _printed_args(cfg) else None
        drop = cfg.get("hidden_dropout")
        return MegatronModel(arch=arch, vocab=vocab, max_position_embeddings=int(cfg.get("max_position_embeddings") or ctx),
                             hidden_dropout=float(drop) if isinstance(drop, (int, float)) and not isinstance(drop, bool) else None,
                             untie_embeddings=None if untie is None else bool(untie),
                             make_vocab_size_divisible_by=int(cfg.get("make_vocab_size_divisible_by") or 128),
                             name=str(eff.get("model") or ""), stack=stack, **dims)
    except ConfigError as e:
        raise _err(path, line, "effective", str(e)) from None


def _distributed_optimizer(cfg) -> bool:
    """The printed ``use_distributed_optimizer`` (the fork's launches that printed none ran it)."""
    if isinstance(cfg, dict) and _printed_args(cfg):
        return stack_from_args(cfg).distributed_optimizer
    return True


def parse_line(text: str, line: int, path: str = "runs") -> Launch:
    """One runs-file line; a malformed one raises a one-line :class:`ConfigError` naming the line and field."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise _err(path, line, "json", f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise _err(path, line, "json", f"expected an object, got {type(rec).__name__}")
    rid = rec.get("id")
    if not isinstance(rid, str) or not rid:
        raise _err(path, line, "id", f"must be a non-empty string, got {rid!r}")
    status = rec.get("status")
    if status not in STATUSES:
        raise _err(path, line, "status", f"unknown {status!r} (one of: {', '.join(STATUSES)})")
    eff = rec.get("effective")
    out = Launch(id=rid, status=status, model=None, layout=None, line=line, num_nodes=rec.get("num_nodes"))
    out.name = str((eff or {}).get("model") or "") if isinstance(eff, dict) else ""
    out.arch = str((eff or {}).get("arch") or "") if isinstance(eff, dict) else ""
    if eff is None:
        return out
    if not isinstance(eff, dict):
        raise _err(path, line, "effective", f"must be an object or null, got {type(eff).__name__}")
    mode = eff.get("mode")
    if mode is None and status == "error":
        # The launch failed before printing its arguments: nothing to price, counted by the caller.
        out.no_layout = True
        return out
    vals = {k: _int(eff, k, path, line, "effective") for k in _LAYOUT_FIELDS}
    if mode not in ("pad", "pack"):
        raise _err(path, line, "effective.mode", f"unknown {mode!r} (one of: pad, pack)")
    if isinstance(eff.get("gpus"), int) and eff["gpus"] != vals["dp"] * vals["tp"] * vals["pp"]:
        # Well-formed but self-contradictory (the log's file name and its layout disagree): not
        # priced, and said so, rather than guessing which of the two is right.
        out.skip_reason = f"effective.gpus {eff['gpus']} != dp x tp x pp = {vals['dp'] * vals['tp'] * vals['pp']}"
        return out
    rc = eff.get("recompute")
    try:
        out.layout = MegatronLayout(dp=vals["dp"], tp=vals["tp"], pp=vals["pp"], mbs=vals["mbs"], gbs=vals["gbs"],
                                    context=vals["seq_length"], mode=mode,
                                    sequence_parallel=bool(eff.get("sequence_parallel")),
                                    recompute="none" if rc in (None, "none") else str(rc),
                                    distributed_optimizer=_distributed_optimizer(rec.get("config")))
    except ConfigError as e:
        raise _err(path, line, "effective", str(e)) from None
    out.model = _model_of(rec, eff, path, line)
    cfg = rec.get("config") or {}
    out.train_iters = int(cfg.get("train_iters") or 100)
    pv = cfg.get("padded_vocab_size")
    out.printed_padded_vocab = pv if isinstance(pv, int) else None
    its = rec.get("iterations") or []
    if not isinstance(its, list):
        raise _err(path, line, "iterations", f"must be a list, got {type(its).__name__}")
    out.reports = len(its)
    summ = rec.get("summary") or {}
    med = summ.get("median_ms_excl_first")
    if med is not None:
        if not isinstance(med, (int, float)) or not math.isfinite(med) or med <= 0:
            raise _err(path, line, "summary.median_ms_excl_first", f"must be a positive number, got {med!r}")
        out.measured_iteration_ms = float(med)
    peak = rec.get("max_allocated_mb_max_over_ranks")
    if peak is not None:
        if not isinstance(peak, (int, float)) or not math.isfinite(peak) or peak <= 0:
            raise _err(path, line, "max_allocated_mb_max_over_ranks", f"must be a positive number, got {peak!r}")
        out.measured_peak_allocated_mb = float(peak)
    ranks = []
    for m in rec.get("memory_per_rank") or []:
        r = m.get("rank") if isinstance(m, dict) else None
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise _err(path, line, "memory_per_rank.rank", f"must be a rank number, got {r!r}")
        ranks.append(r)
    # Global rank -> pipeline stage (Megatron's order: tp fastest, then dp, then pp). Some logs
    # kept only the second node's prints: the measured peak is then that stage's alone.
    out.printed_stages = tuple(sorted({r // (vals["tp"] * vals["dp"]) for r in ranks if r < out.layout.gpus}))
    for k, v in (rec.get("params_per_tp_pp_rank") or {}).items():
        try:
            t, p = (int(x) for x in str(k).split(","))
        except ValueError:
            raise _err(path, line, "params_per_tp_pp_rank", f"key {k!r} is not 'tp,pp'") from None
        out.printed_params[(t, p)] = int(v)
    hist = ((rec.get("seq_len_histogram") or {}).get("rank0_or_first") or {}).get("real_seq_len")
    if hist:
        out.histogram = parse_histogram(hist, path, line)
    return out


def is_top(key) -> bool:
    """The histogram's top bucket (documents above its last bound), keyed by its label."""
    return isinstance(key, str)


def parse_histogram(hist, path: str = "runs", line: int = 0) -> dict:
    """``{bound: count, '>Nk': count}`` with the buckets the file printed: integer keys are bucket
    upper bounds, at most one key ``>Nk`` counts the documents above the last bound (N x 1024 must
    be that bound)."""
    where = "seq_len_histogram.rank0_or_first.real_seq_len"
    if not isinstance(hist, dict):
        raise _err(path, line, where, f"must be an object of bucket -> count, got {type(hist).__name__}")
    out: dict = {}
    top = None
    for k, v in hist.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _err(path, line, f"{where}.{k}", f"count must be a non-negative integer, got {v!r}")
        m = _TOP_LABEL.match(str(k))
        if m:
            if top is not None:
                raise _err(path, line, f"{where}.{k}", f"a second top bucket (already {top!r})")
            top = str(k)
            out[top] = v
            continue
        try:
            b = int(k)
        except (TypeError, ValueError):
            raise _err(path, line, f"{where}.{k}", "keys must be bucket bounds (integers) or the top label '>Nk'") from None
        if b < 1:
            raise _err(path, line, f"{where}.{k}", f"bucket bound must be >= 1, got {b}")
        out[b] = v
    bounds = sorted(b for b in out if not is_top(b))
    if top is not None and bounds and int(_TOP_LABEL.match(top).group(1)) * 1024 != bounds[-1]:
        raise _err(path, line, f"{where}.{top}", f"top label names {int(_TOP_LABEL.match(top).group(1)) * 1024} "
                   f"but the last bucket bound is {bounds[-1]}")
    return out


def _open(path: pathlib.Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def load_runs(path: str | pathlib.Path) -> list[Launch]:
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"--runs: no such file {p}")
    out = []
    with _open(p) as fh:
        for i, text in enumerate(fh, 1):
            if text.strip():
                out.append(parse_line(text, i, str(p)))
    if not out:
        raise ConfigError(f"--runs: {p} holds no launch")
    # A launch that printed no arguments takes the dims of a launch of the same arch and name
    # (a LLaMA 7B is not a GPT 7B).
    by_name = {(la.model.arch, la.model.name): la.model for la in out if la.model is not None and la.model.name}
    for la in out:
        key = (la.arch or "gpt", la.name)
        if la.model is None and la.layout is not None and key in by_name:
            base = by_name[key]
            la.model = replace(base, max_position_embeddings=max(la.layout.context, 1))
    return out


def file_sha256(path: str | pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class DocLengths:
    """Document lengths per context for pack-mode launches (see the module doc)."""

    def __init__(self, launches: Iterable[Launch], own: bool = False) -> None:
        # own=False: every launch of a context draws from the file's pooled histogram there (one
        # dataset, one order; a run's own histogram is its first replica's share of it).
        self.own = own
        self.cache: dict = {}
        self.pooled: dict[int, dict] = {}
        for la in launches:
            if la.histogram and la.layout:
                pool = self.pooled.setdefault(la.layout.context, {})
                for k, v in la.histogram.items():
                    pool[k] = pool.get(k, 0) + v

    def cut_share(self, context: int) -> float:
        """Share of the top bucket's documents that are longer than ``context`` (cut to it)."""
        for c in sorted(self.pooled):
            if c >= 2 * context:
                h = self.pooled[c]
                above = sum(v for k, v in h.items() if is_top(k) or k > context)
                top = above + h.get(context, 0)
                if top:
                    return above / top
        first = min((k for h in self.pooled.values() for k in h if not is_top(k)), default=context)
        if context // 2 >= first and context // 2 in self.pooled:
            return self.cut_share(context // 2)
        lower = [c for c in self.pooled if c < context]
        return self.cut_share(max(lower)) if lower else 0.0

    def histogram(self, la: Launch) -> dict:
        h = (la.histogram if self.own else None) or self.pooled.get(la.layout.context)
        if not h:
            raise ConfigError(f"runs line {la.line} ({la.id}): pack mode needs a length histogram and the file has none "
                              f"at context {la.layout.context}")
        return h

    def sample(self, la: Launch, iterations: int, rng: np.random.Generator, streams: int = 1) -> np.ndarray:
        """(streams, iterations, gbs) document lengths for one pack launch."""
        ctx = la.layout.context
        h = self.histogram(la)
        bounds = np.array(sorted(b for b in h if not is_top(b) and b <= ctx), dtype=float)
        counts = np.array([h.get(int(b), 0) for b in bounds], dtype=float)
        if not bounds.size or counts.sum() <= 0:
            raise ConfigError(f"runs line {la.line} ({la.id}): seq_len_histogram has no document <= {ctx}")
        lows = np.concatenate([[bounds[0] / 2.0], bounds[:-1]])
        n = streams * iterations * la.layout.gbs
        pick = rng.choice(len(bounds), size=n, p=counts / counts.sum())
        b, lo = bounds[pick], lows[pick]
        lengths = np.ceil(lo * np.exp(np.log(b / lo) * rng.random(n)))
        cut = (b == ctx) & (rng.random(n) < self.cut_share(ctx))
        lengths[cut] = ctx
        return np.minimum(lengths, ctx).reshape(streams, iterations, la.layout.gbs)


# Independent document streams a pack launch's peaks are averaged over: the reported peak (10
# iterations of one replica) is noisier than the whole run's, which needs fewer.
STREAMS = 8
RUN_STREAMS = 2


def seed_of(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def work_of(la: Launch, docs: DocLengths, streams: int = STREAMS) -> MicroBatchWork:
    """The micro-batches the step model prices for this launch. The launches of a file read one
    dataset in one order (seed 1234: two launches of one layout print the same peak to the byte),
    so the streams are seeded by the context and the histogram, not by the launch: launches of a
    context see the same documents, cut differently by their layouts."""
    if la.layout.mode == "pad":
        return pad_work(la.layout)
    key = (la.layout.context, la.layout.gbs, la.train_iters, streams, docs.own)
    if docs.own:
        key += (la.id,)
    if key not in docs.cache:
        rng = np.random.default_rng(seed_of("|".join(map(str, key))))
        docs.cache[key] = (docs.sample(la, REPORT_ITERS, rng, streams), docs.sample(la, la.train_iters, rng, RUN_STREAMS))
    report, run = docs.cache[key]
    return pack_work(la.layout, report, run)

