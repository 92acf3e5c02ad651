"""``mlsys-bench-probe``: measure the Megatron step model's kernel tables on this machine's CUDA GPU
and write them into a hardware profile (``kernels``), plus the raw measurements as a probe file
(the format of ``impl/common/megatron/data/h200_kernels_2026-12-04.jsonl``).

    mlsys-bench-probe --output conf/hardware/local-kernels.yaml            # ~2-3 min
    mlsys-bench-probe --quick --output /tmp/probe.yaml                       # ~60 s

What it times, each call with CUDA events after warm-up, the median of ``--repeats`` calls,
inputs rotated among three buffers so the cache cannot serve repeats:
- bf16 GEMMs ``x @ W.T`` for the linear layers of the step model's shapes (LLaMA-7B QKV, output,
  gate+up, down; GPT-13B FC1, FC2; a tp-8 split): the forward shape (m, n, k) and the two backward
  shapes, input gradient (m, k, n) and weight gradient (n, k, m), at m = 128 .. ``--max-rows``
  tokens (every doubling);
- causal ``scaled_dot_product_attention`` (flash kernel where available), batch 1, 32 heads of
  128, s = 1K .. ``--max-seq``: forward, and forward + backward.
Without a CUDA device it prints one line and exits 2. The profile it writes is ``--base`` (a
datasheet profile, default h100-sxm) with ``kernels`` replaced and ``measured`` kernel source.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import pathlib
import sys
import time
from typing import Optional, Sequence

SHAPES = {  # label -> (n out, k in)
    "llama7b_qkv": (12288, 4096), "llama7b_o": (4096, 4096), "llama7b_gateup": (22016, 4096),
    "llama7b_down": (4096, 11008), "gpt13b_fc1": (20480, 5120), "gpt13b_fc2": (5120, 20480),
    "llama70b_o_tp8": (1024, 8192),
}
QUICK_SHAPES = ("llama7b_qkv", "llama7b_down", "gpt13b_fc1", "llama70b_o_tp8")


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _time(fn, repeats: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn(0)
    torch.cuda.synchronize()
    out = []
    for i in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i + 1)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return _median(out)


def gemm_row(m: int, n: int, k: int, repeats: int, label: str) -> dict:
    import torch

    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    s = _time(lambda i: xs[i % 3] @ ws[i % 3].t(), repeats)
    del xs, ws
    return {"kind": "gemm", "shape": label, "m": m, "k": k, "n": n, "s": s, "tflops": 2.0 * m * n * k / s / 1e12}


def attn_row(s: int, heads: int, head_dim: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    qkv = [[torch.randn(1, heads, s, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)] for _ in range(3)]
    g = torch.randn(1, heads, s, head_dim, device="cuda", dtype=torch.bfloat16)

    def fwd(i):
        q, k, v = qkv[i % 3]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwdbwd(i):
        fwd(i).backward(g)

    with torch.no_grad():
        t_f = _time(fwd, repeats)
    t_fb = _time(fwdbwd, repeats)
    return {"kind": "attn", "s": s, "heads": heads, "head_dim": head_dim, "fwd_s": t_f, "fwdbwd_s": t_fb,
            "fwd_tflops": 2.0 * s * s * head_dim * heads / t_f / 1e12}


def _doublings(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def probe(quick: bool, max_rows: int, max_seq: int, repeats: int, budget_s: float, log=print) -> list[dict]:
    import torch

    t0 = time.monotonic()
    p = torch.cuda.get_device_properties(0)
    rows = [{"kind": "env", "gpu": torch.cuda.get_device_name(0), "sms": p.multi_processor_count,
             "mem": p.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda,
             "date": _dt.date.today().isoformat(), "quick": quick}]
    ms = _doublings(128, max_rows)
    shapes = {k: SHAPES[k] for k in (QUICK_SHAPES if quick else SHAPES)}
    for s in _doublings(1024, max_seq):
        rows.append(attn_row(s, 32, 128, repeats))
        log(f"attn s={s}: fwd {rows[-1]['fwd_s'] * 1e3:.3f} ms, fwd+bwd {rows[-1]['fwdbwd_s'] * 1e3:.3f} ms")
    for label, (n, k) in shapes.items():
        for m in ms:
            # forward (m, n, k), input gradient (m, k, n), weight gradient (n, k, m)
            for tag, (mm, nn, kk) in (("fwd", (m, n, k)), ("dgrad", (m, k, n)), ("wgrad", (n, k, m))):
                if time.monotonic() - t0 > budget_s:
                    log(f"budget of {budget_s:.0f} s reached: stopping (tables hold what was measured)")
                    return rows
                rows.append(gemm_row(mm, nn, kk, repeats, f"{label}_{tag}"))
        log(f"gemm {label}: {len(ms)} row counts x fwd/dgrad/wgrad ({time.monotonic() - t0:.0f} s)")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mlsys-bench-probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default="conf/hardware/local-kernels.yaml", help="profile to write")
    ap.add_argument("--raw", default=None, help="probe file (jsonl) to write beside it (default: <output>.jsonl)")
    ap.add_argument("--base", default="h100-sxm", help="datasheet profile the written one starts from")
    ap.add_argument("--quick", action="store_true", help="~60 s: 4 GEMM shapes, rows to 16K, attention to 16K, 10 repeats")
    ap.add_argument("--max-rows", type=int, default=None, help="largest GEMM row count (default 32768; quick 16384)")
    ap.add_argument("--max-seq", type=int, default=None, help="longest attention sequence (default 32768; quick 16384)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per shape (default 20; quick 10)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop measuring after this many seconds (default 170; quick 60)")
    a = ap.parse_args(argv)
    try:
        import torch
        ok = torch.cuda.is_available()
    except ImportError:
        ok = False
    if not ok:
        print("mlsys-bench-probe: error: no CUDA device (torch.cuda.is_available() is False); the probe times "
              "GPU kernels", file=sys.stderr)
        return 2
    from impl.common.api import ConfigError
    from bench.calibrate.system import write_profile_atomic
    from impl.common.hardware import load_hardware
    from impl.common.megatron.kernels import tables_from_jsonl

    quick = a.quick
    max_rows = a.max_rows or (16384 if quick else 32768)
    max_seq = a.max_seq or (16384 if quick else 32768)
    repeats = a.repeats or (10 if quick else 20)
    budget = a.budget_s or (60.0 if quick else 170.0)
    t0 = time.monotonic()
    rows = probe(quick, max_rows, max_seq, repeats, budget, log=lambda s: print(s, file=sys.stderr))
    out = pathlib.Path(a.output)
    raw = pathlib.Path(a.raw) if a.raw else out.with_suffix(".jsonl")
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    try:
        base = load_hardware(a.base)
        tabs = tables_from_jsonl(raw, source=f"{raw.name}: mlsys-bench-probe on {rows[0]['gpu']} "
                                             f"({rows[0]['date']}, {'quick' if quick else 'full'})")
    except ConfigError as e:
        print(f"mlsys-bench-probe: error: {e}", file=sys.stderr)
        return 2
    prof = dataclasses.replace(base.with_megatron(kernels=tabs, knobs=None), name=out.stem,
                               source=f"{base.source}; kernel tables measured by mlsys-bench-probe on {rows[0]['gpu']}")
    header = (f"# {out.stem}: {base.name} with kernel tables measured by `mlsys-bench-probe` on {rows[0]['gpu']}\n"
              f"# ({rows[0]['date']}; raw measurements in {raw.name}). Fit Megatron knobs on top with\n"
              f"# `mlsys-bench-calibrate-megatron --kernels {raw} --kernels-gpu <datasheet profile>`.\n")
    write_profile_atomic(prof, out, header)
    print(json.dumps({"profile": str(out), "raw": str(raw), "gpu": rows[0]["gpu"], "gemm_rows": sum(r["kind"] == "gemm" for r in rows),
                      "attn_rows": sum(r["kind"] == "attn" for r in rows), "seconds": round(time.monotonic() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
