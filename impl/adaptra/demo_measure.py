"""Manual measurement of the CPU link-delay experiment (not a test; impl/adaptra/README.md,
"Reconstructed choices").

    python -m impl.adaptra.demo_measure                 # c = 6t = 120 ms on link (0, 1)
    python -m impl.adaptra.demo_measure --delay-ms 60 --link 2 --n 24

Setup [R]: 4 processes = 4 stages, 2 tiny transformer blocks each (d=64, seq 32,
micro-batch 2), torch threads 1, each F/B/W sleep-padded to t (default 20 ms). Variants:
(a) 1F1B + inline blocking sends, (b) delay-blind ZB + FIFO worker (depth 1),
(c) ZB + K delegates, (d) ADAPTRA schedule (Alg. 2 + 3/4 from the oracle delays) + K delegates.
Each variant also runs at c = 0. Prints median iteration times over the measured iterations,
our acceptance ratios [R], and whether all variants' losses are identical.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from impl.common.execution import set_torch_threads


def main(argv=None) -> None:
    from impl.adaptra.builder import AdaptraPlanner
    from impl.common.runtime.executor import LaunchOptions, NamedSchedule, PipelineJob, run_pipeline
    from impl.common.workloads.pipeline import ModelShape, PipelineWorkload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--n", type=int, default=12, help="micro-batches per iteration")
    ap.add_argument("--op-ms", type=float, default=20.0, help="pad every F/B/W to this (t)")
    ap.add_argument("--delay-ms", type=float, default=120.0, help="injected per-message delay c")
    ap.add_argument("--link", type=int, default=0, help="slow link (i, i+1)")
    ap.add_argument("--delegates", type=int, default=6)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-zero", action="store_true", help="skip the c = 0 runs")
    ap.add_argument("--variants", default="a,b,c,d")
    args = ap.parse_args(argv)
    set_torch_threads(1)

    S, N, t = args.stages, args.n, args.op_ms / 1e3
    shape = ModelShape(num_layers=2 * S, hidden=64, heads=4, ffn_mult=4, vocab=256, seq_len=32)
    wl = PipelineWorkload(model=shape, stages=S, micro_batch_size=2, num_microbatches=N, torch_threads=1)
    variants = {
        "a": ("1F1B + inline", NamedSchedule("1f1b", S, N), "inline"),
        "b": ("ZB + FIFO(Q=1)", NamedSchedule("zb", S, N), "fifo"),
        "c": (f"ZB + delegated(K={args.delegates})", NamedSchedule("zb", S, N), "delegated"),
        "d": (f"ADAPTRA + delegated(K={args.delegates})", AdaptraPlanner(t, S, N, formula="paper", steps_per_op=30),
              "delegated"),
    }
    chosen = [v.strip() for v in args.variants.split(",")]
    delays_ms = ([0.0] if not args.no_zero else []) + [args.delay_ms]
    results: dict[tuple[str, float], object] = {}
    print(f"S={S} N={N} t={args.op_ms:g} ms, link ({args.link}, {args.link + 1}), "
          f"{args.warmup} warm-up + {args.iterations} measured iterations, d={shape.hidden} seq={shape.seq_len} mb=2")
    for c_ms in delays_ms:
        for key in chosen:
            label, fn, comm = variants[key]
            delays = {(args.link, args.link + 1): c_ms / 1e3} if c_ms else None
            t0 = time.perf_counter()
            st = run_pipeline(PipelineJob(fn, wl, shape, comm=comm, delays=delays, iterations=args.iterations,
                                          warmup=args.warmup, seed=0,
                                          num_delegates=args.delegates if comm == "delegated" else None, op_pad_s=t),
                              LaunchOptions(timeout_s=1800))
            results[(key, c_ms)] = st
            times = sorted(st.iteration_times_s)
            raw = {op: st.mean_raw_op_s(op) * 1e3 for op in ("F", "B", "W", "BW") if st.mean_raw_op_s(op)}
            print(f"c={c_ms:5.0f} ms ({key}) {label:28s} median {statistics.median(times) * 1e3:7.0f} ms "
                  f"[min {times[0] * 1e3:.0f}, max {times[-1] * 1e3:.0f}]  raw compute/op ms "
                  + " ".join(f"{k}={v:.2f}" for k, v in raw.items()) + f"  (run {time.perf_counter() - t0:.0f} s)",
                  flush=True)

    def med(key, c_ms):
        return results[(key, c_ms)].median_iteration_time_s

    c = args.delay_ms
    print("\nacceptance (our targets [R], impl/adaptra/README.md):")
    if {"b", "d"} <= set(chosen):
        print(f"  (d)/(b) speedup at c={c:g} ms: {med('b', c) / med('d', c):.2f}x "
              f"(target: >= 1.3x at c=3t, >= 1.7x at c=6t)")
    if {"b", "c"} <= set(chosen):
        print(f"  (c)/(b) speedup at c={c:g} ms: {med('b', c) / med('c', c):.2f}x (target: >= 1.2x at c=6t)")
    if "d" in chosen and not args.no_zero:
        added = med("d", c) - med("d", 0.0)
        print(f"  (d) T(c) - T(0) = {added * 1e3:.0f} ms (target: <= c + 2t = {c + 2 * args.op_ms:.0f} ms)")
    if not args.no_zero:
        base = [med(k, 0.0) for k in chosen]
        print(f"  c=0 spread: {(max(base) / min(base) - 1) * 100:.1f}% (target: within +-10%)")
    losses = [results[k].losses for k in results]
    print(f"  losses identical across all runs: {all(x == losses[0] for x in losses)}")


if __name__ == "__main__":
    main()
