"""One-shot device check of the fast engine (impl/fisedit/README.md, "The fast engine"), independent of Hydra and the text encoder.

``python -m impl.fisedit.gpu_check --shapes tiny sd15 sd21 --out DIR`` builds random-weight
UNets of the given sizes on the device (``tiny``: the tiny UNet of
`conf/workload/diffusion_edit_tiny.yaml` at 16^2; ``sd15``: SD 1.5's UNet, 64^2 latents, fp16;
``sd21``: SD 2.1's UNet, 96^2 latents, fp32, the authors' setting), records an original generation
and then, per shape:

- ``max_abs_eps_fast_vs_reference``: the fast engine's edit against the reference engine's;
- ``host_syncs_per_sparse_step`` / ``host_syncs_per_dense_step``: synchronising calls counted by
  ``torch.cuda.set_sync_debug_mode("warn")`` over one UNet call (after the edit's first step);
- ``max_abs_eps_graph_vs_eager``: the edit replayed from CUDA graphs against the eager one;
- step times (interleaved pairs, as the harness's ``sparse_step_speedup``): dense and sparse,
  eager and graphed, and the reference engine's sparse step eagerly.

Writes ``gpu_check.json`` into ``--out`` and prints one line per shape. On a CPU it runs the
``tiny`` shape eagerly (graph rows absent), which is how it is tested.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
import warnings
from types import SimpleNamespace

import torch

SHAPES = {
    "tiny": dict(sample_size=16, block_out_channels=(32, 64, 64), layers_per_block=1,
                 down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                 attention_head_dim=8, norm_num_groups=8),
    # UNet2DConditionModel's defaults are SD 1.x's layout (320/640/1280/1280, 2 layers per block)
    "sd15": dict(sample_size=64, cross_attention_dim=768, attention_head_dim=8),
    "sd21": dict(sample_size=96, cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20),
                 use_linear_projection=True),
}
DTYPES = {"tiny": torch.float32, "sd15": torch.float16, "sd21": torch.float32}


def _pipe(shape: str, device, block: int, steps: int, frac: float = 0.5):
    from diffusers import DPMSolverMultistepScheduler, UNet2DConditionModel

    from impl.fisedit.pipeline import FISEditPipeline

    torch.manual_seed(0)
    with torch.device(device):
        unet = UNet2DConditionModel(**SHAPES[shape]).to(DTYPES[shape] if device.type == "cuda" else torch.float32).eval()
    comps = SimpleNamespace(unet=unet, scheduler=DPMSolverMultistepScheduler(), vae=None)
    dim = SHAPES[shape]["cross_attention_dim"]

    class P(FISEditPipeline):
        def encode(self, prompt):  # random text states per prompt (no text encoder needed)
            g = torch.Generator("cpu").manual_seed(sum(map(ord, prompt)))
            return torch.randn(2, 77, dim, generator=g).to(self.device, self.dtype)

    return P(comps, block=block, engine="fast", cuda_graph="off", dense_tile_fraction=frac)


def _syncs(pipe, fn) -> int:
    if pipe.device.type != "cuda":
        return -1
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for x in w if "synchroniz" in str(x.message).lower())


def check(shape: str, device, ratio: float, block: int, steps: int, repeats: int, frac: float = 0.5) -> dict:
    from impl.fisedit.mask import synthetic_mask
    from impl.fisedit.real import step_pair_times

    t0 = time.perf_counter()
    pipe = _pipe(shape, device, block, steps, frac)
    st = pipe.state
    orig = pipe.record("a cat", seed=0, num_steps=steps, decode=False)
    mask = synthetic_mask(pipe.latent_hw, ratio, "rect", seed=0)
    row = {"shape": shape, "dtype": str(pipe.dtype), "latent": list(pipe.latent_hw), "mask_ratio": ratio,
           "block": block, "dense_tile_fraction": frac, "steps": steps, "cache_bytes": orig.cache.nbytes}
    kw = dict(seed=0, num_steps=steps, cache=orig.cache, schedule="supplied", mask_steps=max(1, steps // 5), mask=mask,
              decode=False)
    fa = pipe.edit("a dog", **kw)
    row["cache_device"] = str(next(iter(orig.cache.stacks.values())).device) if orig.cache.stacks else "host"
    emb = pipe.encode("a dog")
    sched = pipe.fresh_scheduler(steps)
    i = steps // 2
    z = orig.latents[i - 1]

    def one(sparse):
        st.mode, st.sparse, st.step = ("edit", True, i) if sparse else ("off", False, i)
        st.set_cache(orig.cache)
        pipe.unet_eps(z, sched.timesteps[i], emb, sched)
        pipe._sync()

    one(True)
    row["host_syncs_per_sparse_step"] = _syncs(pipe, lambda: one(True))
    row["host_syncs_per_dense_step"] = _syncs(pipe, lambda: one(False))
    st.mode, st.sparse, st.cache = "off", False, None
    d, s = step_pair_times(pipe, orig, emb, mask, i, repeats)
    row.update(eager_dense_ms=statistics.median(d) * 1e3, eager_sparse_ms=statistics.median(s) * 1e3)
    if device.type == "cuda":
        pipe.graph_on = True
        try:
            gr = pipe.edit("a dog", **kw)
            row["max_abs_eps_graph_vs_eager"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(gr.eps, fa.eps))
            d, s = step_pair_times(pipe, orig, emb, mask, i, repeats)
            row.update(graph_dense_ms=statistics.median(d) * 1e3, graph_sparse_ms=statistics.median(s) * 1e3,
                       graph_stats=pipe.graphed.stats())
            e_f = [pipe.edit("a dog", **kw).total_s for _ in range(2)]
            e_d = [pipe.dense("a dog", seed=0, num_steps=steps, decode=False).total_s for _ in range(2)]
            row.update(graph_e2e_edit_s=min(e_f), graph_e2e_dense_s=min(e_d))
        finally:
            pipe.graph_on = False
    e_f = [pipe.edit("a dog", **kw).total_s for _ in range(2)]
    e_d = [pipe.dense("a dog", seed=0, num_steps=steps, decode=False).total_s for _ in range(2)]
    row.update(eager_e2e_edit_s=min(e_f), eager_e2e_dense_s=min(e_d))
    pipe.set_engine("reference")
    ref = pipe.edit("a dog", **kw)
    row["max_abs_eps_fast_vs_reference"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref.eps, fa.eps))
    row["max_abs_eps"] = max(float(a.float().abs().max()) for a in ref.eps)
    _, s = step_pair_times(pipe, orig, emb, mask, i, max(2, repeats // 2))
    row["reference_eager_sparse_ms"] = statistics.median(s) * 1e3
    row["plans"] = [p for p in pipe.state.plans.summary() if p["kind"] == "window"][:8]
    row["wall_s"] = time.perf_counter() - t0
    for k in ("eager", "graph"):
        if f"{k}_sparse_ms" in row:
            row[f"{k}_sparse_step_speedup"] = row[f"{k}_dense_ms"] / row[f"{k}_sparse_ms"]
            row[f"{k}_e2e_speedup"] = row[f"{k}_e2e_dense_s"] / row[f"{k}_e2e_edit_s"]
    del pipe, orig
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["tiny", "sd15", "sd21"])
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--blocks", type=int, nargs="+", default=[2])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5], help="dense_tile_fraction values")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(sh, b, f) for sh in (a.shapes if device.type == "cuda" else ["tiny"])
            for b in (a.blocks if sh != "tiny" else a.blocks[:1]) for f in a.fractions]
    for sh, b, f in runs:
        try:
            r = check(sh, device, a.ratio, b, a.steps, a.repeats, f)
        except Exception as e:  # keep the other shapes' rows
            import traceback

            r = {"shape": sh, "block": b, "dense_tile_fraction": f, "error": repr(e), "trace": traceback.format_exc()[-3000:]}
        rows.append(r)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "plans"}),
              flush=True)
        (out / "gpu_check.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
