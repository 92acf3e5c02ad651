"""Megatron-LM training logs -> runs-file lines (the schema of
``impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz``, fields in ``impl/common/megatron/data/README.md``).

The logs are the ones the public fork ``Sakura-gh/Megatron-LM`` committed (branch ``llama``:
``logs/gpt/*.log``, ``logs/llama/*.log``, ``tmp_for_test_logs/*.log``): one file per launch, or
one file per node of a multi-node launch (``..._node0.log``, ``..._node1.log``: one launch), or
several launches appended to one file (each starts with the launch script's echo, else with
torchrun's warning block). Only the logs are read: what Megatron printed (its arguments,
iteration reports, memory reports, per-rank parameter counts, out-of-memory messages, the fork's
sequence-length statistics) and what the launch script echoed.

    python -m bench.fidelity.fork_logs --git /work/.mirror/Sakura-gh+Megatron-LM/repo --ref llama \\
        --exclude impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz \\
        --out impl/common/megatron/data/megatron_h100_holdout.jsonl.gz

The printed arguments are right where the file name disagrees; a launch that printed none (a
node file whose node 0 is missing, or a launch that died first) takes its layout from the launch
script's echo, else from its file name, with ``model_dims`` null, like the February file. A
launch already in an ``--exclude`` file, and the second log of a launch logged twice (the test
logs repeat launches that have files of their own), are left out and counted.
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import gzip
import json
import pathlib
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from impl.common.api import ConfigError

REPO = "Sakura-gh/Megatron-LM"
DEFAULT_PREFIXES = ("logs/gpt/", "logs/llama/", "tmp_for_test_logs/")

# The printed arguments the February file keeps, plus the ones that make a LLaMA (norm, MLP,
# positions, key/value groups): the loader builds the model from them.
CONFIG_KEYS = (
    "accumulate_allreduce_grads_in_fp32", "add_bias_linear", "add_position_embedding",
    "apply_query_key_layer_scaling", "attention_dropout", "bf16", "clip_grad", "data_parallel_size", "data_path",
    "dataset_file", "distribute_saved_activations", "empty_unused_memory_level", "encoder_num_layers",
    "ffn_hidden_size", "fp16", "global_batch_size", "hidden_dropout", "hidden_size", "json_file", "json_key",
    "kv_channels", "log_interval", "lr", "make_vocab_size_divisible_by", "max_position_embeddings",
    "max_tokens_to_oom", "micro_batch_size", "num_attention_heads", "num_layers",
    "num_layers_per_virtual_pipeline_stage", "num_microbatches", "optimizer", "overlap_p2p_comm",
    "padded_vocab_size", "params_dtype", "pipeline_model_parallel_size", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "seed", "seq_length", "sequence_packing", "sequence_parallel",
    "swiglu", "tensor_model_parallel_size", "timing_log_level", "tokenizer_model", "tokenizer_type",
    "tokenizer_vocab_size", "train_iters", "transformer_impl", "untie_embeddings_and_output_weights",
    "use_distributed_optimizer", "use_flash_attn", "use_rotary_position_embeddings", "variable_seq_lengths",
    "virtual_pipeline_model_parallel_size", "vocab_file", "vocab_size", "weight_decay", "world_size",
    # LLaMA
    "normalization", "position_embedding_type", "group_query_attention", "num_query_groups",
)
# What the February file keeps of a launch that printed no arguments.
NO_ARGS_CONFIG_KEYS = ("dataset_file", "num_microbatches", "padded_vocab_size", "tokenizer_vocab_size")
# Model names by (layers, hidden), the sizes the fork's scripts launch (benchmark/{gpt,llama}/*.sh).
MODEL_NAMES = {(32, 4096): "7b", (40, 5120): "13b", (60, 6656): "30b", (60, 6672): "30b", (60, 7168): "30b"}

_TORCHRUN_START = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+\] torch\.distributed\.run: \[WARNING\] \s*$")
_ARGS_BEGIN = re.compile(r"^-+ arguments -+\s*$")
_ARGS_END = re.compile(r"^-+ end of arguments -+\s*$")
_ARG = re.compile(r"^  ([A-Za-z_][A-Za-z0-9_]*) \.{2,} ?(.*?)\s*$")
_AFTER_ARGS = re.compile(r"setting number of micro-batches|> building \S+ tokenizer|> initializing torch distributed")
_ARG_LIKE = re.compile(r"^  [A-Za-z_][A-Za-z0-9_]* \.")  # starts like an argument line
_ITER = re.compile(r"^ iteration\s+(\d+)/\s*(\d+) \|.*elapsed time per iteration \(ms\): ([0-9.]+) \|")
_LOSS = re.compile(r"lm loss: ([0-9.Ee+-]+)")
_GRAD = re.compile(r"grad norm: ([0-9.Ee+-]+)")
_SKIP = re.compile(r"number of skipped iterations:\s*(\d+)")
_NAN = re.compile(r"number of nan iterations:\s*(\d+)")
_MEM = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| "
                  r"max allocated: ([0-9.]+) \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)")
_PARAMS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)")
_VOCAB = re.compile(r"> padded vocab \(size: (\d+)\) with \d+ dummy tokens \(new size: (\d+)\)")
_MICRO = re.compile(r"setting number of micro-batches to constant (\d+)")
_OOM = re.compile(r"(?:rank (?P<rank>\d+) catch )?CUDA out of memory\. Tried to allocate ([0-9.]+) (MiB|GiB|KiB|B)\. "
                  r"GPU (\d+) has a total capac\w* of ([0-9.]+) GiB of which ([0-9.]+) (MiB|GiB|KiB|B) is free\. "
                  r"Process \d+ has ([0-9.]+) (MiB|GiB) memory in use\. Of the allocated memory ([0-9.]+) (MiB|GiB) "
                  r"is allocated by PyTorch, and ([0-9.]+) (MiB|GiB|KiB|B) is reserved")
_HIST = re.compile(r"rank (\d+): (\{'packing_seq_len': \{[^}]*\}, 'real_seq_len': \{[^}]*\}\})")
_SMI_NAME = re.compile(r"^\|\s+\d+\s+NVIDIA (.+?)\s{2,}\S+\s+\|")
_SMI_MEM = re.compile(r"\|\s+(\d+)MiB / (\d+)MiB \|")
_DONE = re.compile(r"\[after training is done\]")
_FILE_NAME = re.compile(r"^(?P<arch>gpt|llama)_megatron_gpus(?P<gpus>\d*)_(?P<model>\d+b)_seqlen(?P<seq>\d+)_gbs(?P<gbs>\d+)"
                        r"_mbs(?P<mbs>\d+)_dp(?P<dp>\d+)_tp(?P<tp>\d+)_pp(?P<pp>\d+)_(?P<mode>[a-z]+)"
                        r"(?:_(?P<sp>sp|nosp))?(?:_node(?P<node>\d+))?\.log$")
_TEST_NAME = re.compile(r"^test_(?P<arch>gpt|llama)_gpus(?P<gpus>\d+)_.*\.log$")
# The fork's launch scripts echo the launch before torchrun starts (benchmark/{gpt,llama}/*.sh):
# the machine, and for a multi-node launch its node rank; the model and layout; pack and SP.
_PREAMBLE = re.compile(r"^local_ip = ([0-9.]+),")
_NODE_RANK = re.compile(r"nodes_num = (\d+), gpus_num = \d+, node_rank = (\d+)")
_SCRIPT = re.compile(r"^use (?P<arch>gpt|llama) (?P<model>\d+b) model, gpu_num=(?P<gpus>\d+), seq_len = (?P<seq>\d+), "
                     r"DP=(?P<dp>\d+), MP=(?P<tp>\d+), PP=(?P<pp>\d+), GBS=(?P<gbs>\d+), MBS=(?P<mbs>\d+)\s*$")
_NODE = re.compile(r"^(?P<stem>.+)_node(?P<node>\d+)\.log$")

# Error kinds (the February file's names), each a pattern of the log line that shows it.
ERROR_KINDS = (
    ("oom", re.compile(r"CUDA out of memory|OutOfMemoryError")),
    ("nccl_cuda_oom", re.compile(r"NCCL.*(?:Cuda failure \d* ?'out of memory'|cudaErrorMemoryAllocation)")),
    ("nccl_error", re.compile(r"NCCL error|DistBackendError")),
    ("child_failed", re.compile(r"ChildFailedError")),
    ("python_exception", re.compile(r"^Traceback \(most recent call last\)")),
    ("sigterm_received", re.compile(r"Received (?:Signals\.)?SIGTERM|SignalException")),
    ("cuda_invalid_configuration", re.compile(r"invalid configuration argument")),
    ("gloo_or_rendezvous", re.compile(r"[Gg]loo|RendezvousError|rendezvous")),
    ("exit_barrier", re.compile(r"exit barrier|_exit_barrier")),
    ("invalid_parallel_config", re.compile(r"is not divisible by|must be divisible|divisible by")),
    ("assertion", re.compile(r"^AssertionError")),
    ("cuda_driver_error", re.compile(r"CUDA driver error|cudaErrorLaunchFailure|unspecified launch failure")),
    ("illegal_memory_access", re.compile(r"illegal memory access")),
    ("launch_failed", re.compile(r"^torchrun: error:")),
)
_ERROR_LINE = re.compile(r"^(?:(?:[\w.]+\.)?\w*(?:Error|Exception)\b.*:|torchrun: error:)")


def _err(path: str, line: int, what: str) -> ConfigError:
    return ConfigError(f"{path}:{line}: {what}")


def typed(value: str):
    """A printed argument as Megatron printed it, typed: True/False/None, int, float, else the text."""
    if value in ("True", "False"):
        return value == "True"
    if value == "None":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _mib(value: str, unit: str) -> float:
    return float(value) * {"B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}[unit]


def _gib(value: str, unit: str) -> float:
    return round(_mib(value, unit) / 1024, 2)


@dataclass
class Segment:
    """One launch's lines from one file (one node's view of it)."""

    path: str
    node: Optional[int]
    first_line: int
    lines: list = field(default_factory=list)  # (line number, text)
    torchrun_time: Optional[str] = None


def split_launches(path: str, text: str, node: Optional[int] = None) -> list[Segment]:
    """A log's launches: each starts at torchrun's warning block (the first one at line 1)."""
    segs: list[Segment] = []
    cur: Optional[Segment] = None
    preamble = False  # the current launch began with the launch script's echo, torchrun not yet started
    for i, raw in enumerate(text.splitlines(), 1):
        m = _TORCHRUN_START.match(raw)
        p = _PREAMBLE.match(raw)
        if cur is None or p or (m and not preamble):
            if cur is not None and not any(t.strip() for _, t in cur.lines):
                segs.pop()
            cur = Segment(path=path, node=node, first_line=i)
            segs.append(cur)
            preamble = bool(p)
        if m:
            preamble = False
            cur.torchrun_time = cur.torchrun_time or m.group(1)
        cur.lines.append((i, raw))
    if cur is not None and not any(t.strip() for _, t in cur.lines):
        segs.pop()
    return segs


@dataclass
class Parsed:
    """What one segment printed."""

    args: dict = field(default_factory=dict)
    iterations: list = field(default_factory=list)
    memory: list = field(default_factory=list)
    params: dict = field(default_factory=dict)
    ooms: list = field(default_factory=list)
    hist: dict = field(default_factory=dict)  # rank -> dict
    vocab: Optional[tuple] = None  # (tokenizer size, padded size) of the first print
    microbatches: Optional[int] = None
    iters_total: Optional[int] = None  # the "N/ total" of the iteration reports
    kinds: set = field(default_factory=set)
    error_line: Optional[str] = None
    oom_line: Optional[str] = None
    done: bool = False
    gpu_name: Optional[str] = None
    gpu_total_mib: Optional[int] = None
    local_ip: Optional[str] = None
    nodes: Optional[tuple] = None  # (nodes of the launch, this node's rank) as the launch script echoed
    script: dict = field(default_factory=dict)  # the layout the launch script echoed


def parse_segment(seg: Segment, node_label: Optional[str] = None) -> Parsed:
    """Every fact of one segment; a malformed line of a block Megatron prints in a fixed format
    (arguments, iteration report, memory report, histogram) raises one line naming file and line."""
    out = Parsed()
    in_args = False
    for n, text in seg.lines:
        if in_args:
            if _ARGS_END.match(text) or _AFTER_ARGS.search(text):
                # A block another rank wrote across can lose its end line: Megatron's next
                # prints close it.
                in_args = False
                if _ARGS_END.match(text):
                    continue
            m = _ARG.match(text)
            if m:
                out.args[m.group(1)] = typed(m.group(2))
            elif _ARG_LIKE.match(text):
                raise _err(seg.path, n, f"arguments: cannot parse {text.strip()[:80]!r} (expected '  name ...... value')")
            # Anything else inside the block is another rank's output written across it (the
            # fork's test logs have such blocks): skipped, the argument it cut is lost.
            continue
        m = _PREAMBLE.match(text)
        if m:
            out.local_ip = m.group(1)
            nr = _NODE_RANK.search(text)
            out.nodes = (int(nr.group(1)), int(nr.group(2))) if nr else None
            continue
        m = _SCRIPT.match(text)
        if m:
            out.script = dict(m.groupdict(), mode="pad", sp="nosp")
            continue
        if out.script and text.strip() in ("use sequence-packing", "use sequence parallel"):
            out.script["mode" if "packing" in text else "sp"] = "pack" if "packing" in text else "sp"
            continue
        if _DONE.search(text):
            # Rank 0's last print, often written onto another rank's line.
            out.done = True
        if _ARGS_BEGIN.match(text):
            if out.args:
                raise _err(seg.path, n, "arguments: a second argument block in one launch")
            in_args = True
            continue
        if text.startswith(" iteration ") and "elapsed time per iteration" in text:
            m = _ITER.match(text)
            if not m:
                raise _err(seg.path, n, f"iteration: cannot parse {text.strip()[:80]!r}")
            out.iters_total = int(m.group(2))
            loss, grad, skip, nan = (_LOSS.search(text), _GRAD.search(text), _SKIP.search(text), _NAN.search(text))
            out.iterations.append({"elapsed_ms": float(m.group(3)),
                                   "grad_norm": float(grad.group(1)) if grad else None,
                                   "iteration": int(m.group(1)),
                                   "lm_loss": float(loss.group(1)) if loss else None,
                                   "nan": int(nan.group(1)) if nan else None,
                                   "skipped": int(skip.group(1)) if skip else None})
            continue
        if "memory (MB)" in text and "[Rank " in text:
            # Ranks print at once: several reports can share one line.
            found = list(_MEM.finditer(text))
            if not found:
                raise _err(seg.path, n, f"memory: cannot parse {text.strip()[:80]!r}")
            for m in found:
                out.memory.append({"after_iters": int(m.group(2)), "allocated_mb": float(m.group(3)),
                                   "max_allocated_mb": float(m.group(4)), "max_reserved_mb": float(m.group(6)),
                                   "rank": int(m.group(1)), "reserved_mb": float(m.group(5))})
            continue
        found = list(_PARAMS.finditer(text))
        if found:
            for m in found:
                out.params[f"{m.group(1)},{m.group(2)}"] = int(m.group(3))
            continue
        if "rank " in text and "'packing_seq_len'" in text:
            found = list(_HIST.finditer(text))
            if not found:
                raise _err(seg.path, n, f"seq_len_histogram: cannot parse {text.strip()[:80]!r}")
            for m in found:
                try:
                    out.hist[int(m.group(1))] = ast.literal_eval(m.group(2))
                except (ValueError, SyntaxError):
                    raise _err(seg.path, n, "seq_len_histogram: not a dict literal") from None
            continue
        m = _VOCAB.search(text)
        if m:
            # Megatron pads to a multiple of 128 x tp while it reads its arguments; the fork's data
            # loader builds the tokenizer again without tp: the largest print is the model's.
            v = (int(m.group(1)), int(m.group(2)))
            out.vocab = max(out.vocab, v, key=lambda x: x[1]) if out.vocab else v
            continue
        m = _MICRO.search(text)
        if m:
            out.microbatches = int(m.group(1))
            continue
        # Anywhere in the line: ranks write their tracebacks across each other.
        m = _OOM.search(text)
        if m:
            g = m.groups()[1:]
            event = {"allocated_by_pytorch_gib": _gib(g[8], g[9]),
                             "free_mib": round(_mib(g[4], g[5]), 2), "gpu_local_index": int(g[2]),
                             "node": out.local_ip or node_label, "process_in_use_gib": _gib(g[6], g[7]),
                             "rank": int(m.group("rank")) if m.group("rank") else None,
                             "reserved_unallocated_mib": round(_mib(g[10], g[11]), 2),
                             "total_capacity_gib": float(g[3]),
                             "tried_to_allocate_mib": round(_mib(g[0], g[1]), 2)}
            if event not in out.ooms:  # a chained traceback repeats the message
                out.ooms.append(event)
            out.oom_line = out.oom_line or text.strip()[:400]
        if out.gpu_name is None:
            m = _SMI_NAME.match(text)
            if m:
                out.gpu_name = m.group(1).strip()
        if out.gpu_total_mib is None:
            m = _SMI_MEM.search(text)
            if m:
                out.gpu_total_mib = int(m.group(2))
        for kind, pat in ERROR_KINDS:
            if pat.search(text):
                out.kinds.add(kind)
        if out.error_line is None and _ERROR_LINE.match(text.strip()) and "Warning" not in text:
            out.error_line = text.strip()[:400]
    return out


def _name_fields(path: str) -> dict:
    base = pathlib.PurePosixPath(path).name
    m = _FILE_NAME.match(base)
    if m:
        return m.groupdict()
    m = _TEST_NAME.match(base)
    return m.groupdict() if m else {}


def _effective(args: dict, names: dict) -> Optional[dict]:
    if args.get("num_layers") is not None:
        layers, hidden = args["num_layers"], args["hidden_size"]
        llama = args.get("normalization") == "RMSNorm" or bool(args.get("swiglu"))
        kv = args.get("num_query_groups") if args.get("group_query_attention") else None
        dims = f"L{layers}-h{hidden}-ffn{args.get('ffn_hidden_size')}-heads{args.get('num_attention_heads')}"
        if kv and kv != args.get("num_attention_heads"):
            dims += f"-kv{kv}"
        return {"arch": "llama" if llama else "gpt", "dp": args.get("data_parallel_size"),
                "gbs": args.get("global_batch_size"), "gpus": args.get("world_size"),
                "mbs": args.get("micro_batch_size"), "mode": "pack" if args.get("sequence_packing") else "pad",
                "model": MODEL_NAMES.get((layers, hidden), names.get("model")), "model_dims": dims,
                "pp": args.get("pipeline_model_parallel_size"), "recompute": args.get("recompute_granularity"),
                "seq_length": args.get("seq_length"), "sequence_parallel": bool(args.get("sequence_parallel")),
                "tp": args.get("tensor_model_parallel_size")}
    if "dp" not in names or names["mode"] not in ("pad", "pack"):
        return None  # no printed layout and no readable name: nothing to price
    num = {k: int(names[k]) for k in ("seq", "gbs", "mbs", "dp", "tp", "pp")}
    mode = names["mode"]
    return {"arch": names["arch"], "dp": num["dp"], "gbs": num["gbs"],
            "gpus": int(names["gpus"]) if names.get("gpus") else num["dp"] * num["tp"] * num["pp"],
            "mbs": num["mbs"], "mode": mode, "model": names["model"], "model_dims": None, "pp": num["pp"],
            "recompute": None, "seq_length": num["seq"],
            "sequence_parallel": None if names.get("sp") is None else names["sp"] == "sp", "tp": num["tp"]}


def _summary(its: list, eff: Optional[dict]) -> dict:
    rest = [r["elapsed_ms"] for r in its[1:]]
    med = statistics.median(rest) if rest else None
    pad = bool(eff) and eff.get("mode") == "pad" and eff.get("gbs") and eff.get("seq_length")
    tokens = eff["gbs"] * eff["seq_length"] if pad else None
    gpus = (eff or {}).get("gpus")
    losses = [r["lm_loss"] for r in its if r.get("lm_loss") is not None]
    return {
        "first_report_ms": its[0]["elapsed_ms"] if its else None,
        "last_lm_loss": losses[-1] if losses else None,
        "max_ms_excl_first": max(rest) if rest else None,
        "mean_ms_excl_first": round(statistics.fmean(rest), 2) if rest else None,
        "median_ms_excl_first": med,
        "min_ms_excl_first": min(rest) if rest else None,
        "n_reports": len(its),
        "samples_per_s": round(eff["gbs"] / (med / 1e3), 3) if med and eff and eff.get("gbs") else None,
        "spread_pct_excl_first": round((max(rest) - min(rest)) / med * 100, 2) if len(rest) > 1 else None,
        "tflops_logged": None,
        "tokens_per_iter": tokens,
        "tokens_per_iter_note": ("gbs*seq_length (padded tokens included)" if pad else
                                 "unknown: pad tokens are dropped, real token count per iteration is not logged"),
        "tokens_per_s": round(tokens / (med / 1e3), 1) if tokens and med else None,
        "tokens_per_s_per_gpu": round(tokens / (med / 1e3) / gpus, 1) if tokens and med and gpus else None,
    }


def _histogram(hist: dict) -> Optional[dict]:
    if not hist:
        return None
    first = min(hist)
    distinct = {json.dumps(v, sort_keys=True) for v in hist.values()}
    return {"n_distinct": len(distinct), "rank0_or_first": hist[first], "ranks_printed": sorted(hist)}


def _status(parsed: Sequence[Parsed], its: list) -> str:
    kinds = set().union(*(p.kinds for p in parsed))
    if any(p.ooms for p in parsed) or "oom" in kinds or "nccl_cuda_oom" in kinds:
        return "oom"
    # The end: rank 0's last print, or (a log of another node) the last report at train_iters.
    if any(p.done or (p.iterations and p.iterations[-1]["iteration"] == p.iters_total) for p in parsed):
        return "ok"
    # Cut by the time limit (the traceback is the signal's), or cut with no error printed.
    if its and ("sigterm_received" in kinds or not kinds):
        return "incomplete"
    if kinds:
        return "error"
    return "incomplete"


def _start(segs: Sequence[Segment]) -> Optional[str]:
    times = [s.torchrun_time for s in segs if s.torchrun_time]
    return min(times) if times else None


def launch_record(segs: Sequence[Segment], *, branch: str, commit: str, rid: str = "") -> dict:
    """One runs-file line from the segments of one launch (one per node file)."""
    multi = len(segs) > 1 or any(s.node is not None for s in segs)
    parsed = [parse_segment(s, f"node{s.node}" if multi and s.node is not None else None) for s in segs]
    args = next((p.args for p in parsed if p.args), {})
    # Where the launch printed no arguments: the launch script's echo, else the file name.
    names = next((p.script for p in parsed if p.script), None) or _name_fields(segs[0].path)
    its_by_file = [p.iterations for p in parsed if p.iterations]
    its = max(its_by_file, key=len) if its_by_file else []
    eff = _effective(args, names)
    vocab = max((p.vocab for p in parsed if p.vocab), key=lambda x: x[1], default=None)
    if args:
        config = {k: args.get(k) for k in CONFIG_KEYS}
        json_file = args.get("json_file")
        config["dataset_file"] = args.get("dataset_file") or (pathlib.PurePosixPath(json_file).name
                                                             if isinstance(json_file, str) else None)
        config["num_microbatches"] = next((p.microbatches for p in parsed if p.microbatches), None)
        config["padded_vocab_size"] = vocab[1] if vocab else None
        config["tokenizer_vocab_size"] = vocab[0] if vocab else None
    else:
        config = {k: None for k in NO_ARGS_CONFIG_KEYS}
        config["num_microbatches"] = next((p.microbatches for p in parsed if p.microbatches), None)
    memory = sorted((m for p in parsed for m in p.memory), key=lambda m: (m["rank"], m["after_iters"]))
    first_mem = [m for m in memory if m["after_iters"] == min(x["after_iters"] for x in memory)] if memory else []
    params: dict = {}
    for p in parsed:
        params.update(p.params)
    if eff and eff.get("tp") and eff.get("pp"):
        # The fork's test logs hold launches whose prints interleave in one file: a rank outside
        # this launch's (tp, pp) grid printed for the other launch.
        params = {k: v for k, v in params.items()
                  if int(k.split(",")[0]) < eff["tp"] and int(k.split(",")[1]) < eff["pp"]}
    hist: dict = {}
    for p in parsed:
        hist.update(p.hist)
    kinds = sorted(set().union(*(p.kinds for p in parsed)))
    status = _status(parsed, its)
    err_line = next((p.oom_line for p in parsed if p.oom_line), None) or next(
        (p.error_line for p in parsed if p.error_line), None)
    return {
        "config": config,
        "effective": eff,
        "error_kinds": kinds or None,
        "error_line": err_line if kinds else None,
        "gpu_name_printed": next((p.gpu_name for p in parsed if p.gpu_name), None),
        "gpu_total_mib_nvidia_smi": next((p.gpu_total_mib for p in parsed if p.gpu_total_mib), None),
        "id": rid,
        "iterations": its,
        "max_allocated_mb_max_over_ranks": max((m["max_allocated_mb"] for m in first_mem), default=None),
        "max_reserved_mb_max_over_ranks": max((m["max_reserved_mb"] for m in first_mem), default=None),
        "memory_per_rank": first_mem,
        # Nodes of the launch (8 GPUs each), also where only one node's log was kept.
        "num_nodes": max([len(segs), -(-((eff or {}).get("gpus") or 0) // 8)] + [p.nodes[0] for p in parsed if p.nodes]),
        "oom_events": [o for p in parsed for o in p.ooms],
        "params_per_tp_pp_rank": dict(sorted(params.items())),
        "same_config_runs": None,
        "seq_len_histogram": _histogram(hist),
        "source": {"branch": branch, "commit": commit, "paths": [s.path for s in segs], "repo": REPO},
        "start_time": _start(segs),
        "status": status,
        "summary": _summary(its, eff),
    }


def group_launches(files: dict[str, str]) -> list[list[Segment]]:
    """Launches from {path: text}: node files of one stem are one launch (their k-th launches
    together); other files give one launch per torchrun block."""
    stems: dict[str, dict[int, str]] = {}
    singles = []
    for path in sorted(files):
        m = _NODE.match(path)
        if m:
            stems.setdefault(m.group("stem"), {})[int(m.group("node"))] = path
        else:
            singles.append(path)
    launches: list[list[Segment]] = []
    for path in singles:
        launches.extend([s] for s in split_launches(path, files[path]))
    for stem, nodes in sorted(stems.items()):
        per_node = {n: split_launches(p, files[p], node=n) for n, p in sorted(nodes.items())}
        depth = max((len(v) for v in per_node.values()), default=0)
        for k in range(depth):
            segs = [v[k] for _, v in sorted(per_node.items()) if k < len(v)]
            if segs:
                launches.append(segs)
    return launches


def read_git(gitdir: str, ref: str, prefixes: Iterable[str] = DEFAULT_PREFIXES) -> tuple[str, dict[str, str]]:
    """(commit, {path: text}) of the ``*.log`` files under ``prefixes`` at ``ref`` of a (bare) repository."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", gitdir, *a], check=True, capture_output=True, text=True,
                                  errors="replace").stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise ConfigError(f"--git: git {' '.join(a[:2])} failed in {gitdir}: {getattr(e, 'stderr', e)!s}".strip()) from None
    commit = git("rev-parse", ref).strip()
    paths = [p for p in git("ls-tree", "-r", "--name-only", commit, "--", *prefixes).splitlines() if p.endswith(".log")]
    files, absent = {}, []
    for p in paths:
        try:
            files[p] = git("show", f"{commit}:{p}")
        except ConfigError:
            absent.append(p)  # listed in the tree, its blob not in this copy (a partial mirror)
    if absent:
        print(f"note: {len(absent)} log files listed at {ref} could not be read from {gitdir} (first: {absent[0]}); "
              f"left out", file=sys.stderr)
    return commit, files


def read_folder(root: str) -> dict[str, str]:
    base = pathlib.Path(root)
    if not base.is_dir():
        raise ConfigError(f"--folder: no such folder {root}")
    return {str(p.relative_to(base).as_posix()): p.read_text(errors="replace") for p in sorted(base.rglob("*.log"))}


def _layout_key(rec: dict):
    e = rec.get("effective") or {}
    return tuple(e.get(k) for k in ("model", "dp", "tp", "pp", "mbs", "gbs", "seq_length", "mode"))


def _time(s: Optional[str]) -> Optional[_dt.datetime]:
    return _dt.datetime.strptime(s, "%Y-%m-%d %H:%M:%S") if s else None


def known_elsewhere(rec: dict, others: Sequence[dict], slack_s: float = 120.0) -> bool:
    """The same launch in another runs file: same layout, model and mode started within ``slack_s``
    of each other (the files take the start from different nodes' clocks), or the same iteration
    reports to the last digit."""
    its = [r["elapsed_ms"] for r in rec.get("iterations") or []]
    t = _time(rec.get("start_time"))
    key = _layout_key(rec)
    for o in others:
        if its and its == [r["elapsed_ms"] for r in o.get("iterations") or []]:
            return True
        ot = _time(o.get("start_time"))
        if t and ot and key == _layout_key(o) and abs((t - ot).total_seconds()) <= slack_s:
            return True
    return False


def same_launch(a: dict, b: dict, slack_s: float = 5.0) -> bool:
    """One launch logged twice in the tree (the fork's test logs repeat launches that also have
    files of their own): the same iteration reports, or started within ``slack_s`` by torchrun with
    layouts that do not disagree."""
    its = [r["elapsed_ms"] for r in a.get("iterations") or []]
    if its and its == [r["elapsed_ms"] for r in b.get("iterations") or []]:
        return True
    ta, tb = _time(a.get("start_time")), _time(b.get("start_time"))
    if not (ta and tb) or abs((ta - tb).total_seconds()) > slack_s:
        return False
    return a.get("effective") is None or b.get("effective") is None or _layout_key(a) == _layout_key(b)


@dataclass
class Normalised:
    records: list
    known: int  # launches left out: already in an --exclude file
    repeated: int  # launches left out: a second log of a launch kept


def _richer(r: dict):
    """Which of two logs of one launch to keep: printed arguments, more nodes, more reports."""
    e = r.get("effective") or {}
    return (not e.get("model_dims"), -len(r["source"]["paths"]), -len(r.get("iterations") or []),
            r["source"]["paths"][0])


def normalise(files: dict[str, str], *, branch: str, commit: str, exclude: Sequence[dict] = (),
              prefix: str = "H") -> Normalised:
    """The launches of ``files`` in start order, ids ``H001``..., less those already in ``exclude``
    and the second logs of one launch."""
    recs = [launch_record(segs, branch=branch, commit=commit) for segs in group_launches(files)]
    fresh = [r for r in recs if not known_elsewhere(r, exclude)]
    kept: list[dict] = []
    for r in sorted(fresh, key=_richer):
        if not any(same_launch(r, k) for k in kept):
            kept.append(r)
    kept.sort(key=lambda r: (r["start_time"] or "9999", r["source"]["paths"][0]))
    width = max(3, len(str(len(kept))))
    for i, r in enumerate(kept, 1):
        r["id"] = f"{prefix}{i:0{width}d}"
    by_cfg: dict = {}
    for r in kept:
        if r["effective"] and r["effective"].get("model_dims"):
            by_cfg.setdefault(json.dumps(r["effective"], sort_keys=True), []).append(r["id"])
    for r in kept:
        if r["effective"] and r["effective"].get("model_dims"):
            same = [i for i in by_cfg[json.dumps(r["effective"], sort_keys=True)] if i != r["id"]]
            r["same_config_runs"] = same or None
    return Normalised(kept, len(recs) - len(fresh), len(fresh) - len(kept))


COMPARED = ("status", "iterations", "summary", "memory_per_rank", "max_allocated_mb_max_over_ranks",
            "params_per_tp_pp_rank", "oom_events", "seq_len_histogram", "effective", "config", "num_nodes")


def compare(recs: Sequence[dict], others: Sequence[dict]) -> tuple[int, dict]:
    """(launches of ``recs`` found in ``others``, field -> how many of them differ there): a check
    that this module reads logs as the file ``others`` was made. ``oom_events`` counts events,
    ``config`` the printed arguments both have."""
    matched, differ = 0, {f: 0 for f in COMPARED}
    for r in recs:
        o = next((x for x in others if known_elsewhere(r, [x])), None)
        if o is None:
            continue
        matched += 1
        for f in COMPARED:
            a, b = r.get(f), o.get(f)
            if f == "oom_events":
                a, b = len(a or []), len(b or [])
            elif f == "config":
                keys = set(a or {}) & set(b or {})
                a, b = {k: a[k] for k in keys}, {k: b[k] for k in keys}
            elif f == "memory_per_rank":
                a, b = (sorted(a or [], key=lambda m: m["rank"]), sorted(b or [], key=lambda m: m["rank"]))
            differ[f] += a != b
    return matched, differ


def _read_runs(path: str) -> list[dict]:
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"--exclude: no such file {path}")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as fh:
        return [json.loads(t) for t in fh if t.strip()]


def write_runs(recs: Sequence[dict], out: pathlib.Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in recs)
    if out.suffix == ".gz":
        # mtime 0: the same logs give the same bytes.
        with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as fh:
            fh.write(text.encode())
    else:
        out.write_text(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--git", help="a git directory (bare is fine) holding the fork")
    src.add_argument("--folder", help="a folder of *.log files")
    ap.add_argument("--ref", default="llama", help="branch or commit of --git (default llama)")
    ap.add_argument("--branch", default=None, help="branch named in source (default --ref)")
    ap.add_argument("--commit", default="", help="commit named in source for --folder")
    ap.add_argument("--prefix", action="append", default=None, help=f"tree folders to read (default {DEFAULT_PREFIXES})")
    ap.add_argument("--exclude", action="append", default=[], help="runs file whose launches are left out")
    ap.add_argument("--out", default=None, help="runs file to write (.jsonl or .jsonl.gz)")
    ap.add_argument("--compare", default=None, metavar="RUNS",
                    help="instead of writing: how the launches found in RUNS agree with its lines, per field")
    a = ap.parse_args(argv)
    try:
        if a.git:
            commit, files = read_git(a.git, a.ref, tuple(a.prefix or DEFAULT_PREFIXES))
        else:
            commit, files = a.commit, read_folder(a.folder)
        if a.compare:
            recs = [launch_record(segs, branch=a.branch or a.ref, commit=commit) for segs in group_launches(files)]
            matched, differ = compare(recs, _read_runs(a.compare))
            print(f"{len(files)} log files -> {len(recs)} launches, {matched} of them in {a.compare}; differing:")
            for f, n in differ.items():
                print(f"  {f:<34} {n}")
            return 0
        if not a.out:
            raise ConfigError("--out: a runs file to write is needed (or --compare)")
        others = [r for p in a.exclude for r in _read_runs(p)]
        res = normalise(files, branch=a.branch or a.ref, commit=commit, exclude=others)
        recs = res.records
        write_runs(recs, pathlib.Path(a.out))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts: dict = {}
    for r in recs:
        arch = (r["effective"] or {}).get("arch") or "-"
        counts[(arch, r["status"])] = counts.get((arch, r["status"]), 0) + 1
    print(f"{len(files)} log files -> {len(recs)} launches -> {a.out} (left out: {res.known} already in --exclude, "
          f"{res.repeated} logged twice in the tree)")
    for (arch, status), n in sorted(counts.items()):
        print(f"  {arch:<6} {status:<11} {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
