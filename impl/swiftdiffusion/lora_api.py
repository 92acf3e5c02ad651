"""Real experiment D: measured costs of diffusers' LoRA API on CPU against Katz' direct merge.

Every operation runs ``repeats`` times on the same UNet (files on local disk, no emulation):
``load_lora_adapter`` (default and ``low_cpu_mem_usage``), ``fuse_lora``, ``unfuse_lora``,
``unload_lora``, a hotswap load (``enable_lora_hotswap`` + ``hotswap=True``) and the direct
path (read + check + in-place merge; restore)."""
from __future__ import annotations

import pathlib
import statistics
import tempfile
import time

import torch

from impl.swiftdiffusion.lora import TargetTable, load_direct, make_lora, merge, restore
from impl.swiftdiffusion.models import build_bundle
from impl.common.execution import set_torch_threads


@torch.no_grad()
def run_lora_api(wl, seed: int, device=None, dtype=None) -> dict:
    """``device`` / ``dtype``: the job's execution (None: the CPU in fp32); each timed call
    ends when the device is done."""
    set_torch_threads(max(1, wl.torch_threads))
    on_cuda = device is not None and torch.device(device).type == "cuda"

    def _t(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    b = build_bundle(wl, seed, num_controlnets=0, device=device, dtype=dtype)
    unet = b.unet
    rank = max(wl.lora_ranks)
    out: dict[str, list] = {}

    def rec(k, v):
        out.setdefault(k, []).append(v)

    with tempfile.TemporaryDirectory(prefix="mlsys-lora-api-") as d:
        paths = [make_lora(unet, rank, seed + i, f"{d}/l{i}", alpha=2.0 * rank) for i in range(2)]
        table = TargetTable.build(unet)
        kw = lambda p: dict(prefix="unet", weight_name=p.name)  # noqa: E731
        for rep in range(wl.repeats):
            for low in (False, True):
                p = paths[0]
                rec("load_lora_adapter_low_cpu_mem_s" if low else "load_lora_adapter_s",
                    _t(lambda: unet.load_lora_adapter(str(p.parent), adapter_name="x", low_cpu_mem_usage=low, **kw(p))))
                rec("fuse_lora_s", _t(lambda: unet.fuse_lora(lora_scale=1.0, adapter_names=["x"])))
                rec("unfuse_lora_s", _t(lambda: unet.unfuse_lora()))
                rec("unload_lora_s", _t(lambda: unet.unload_lora()))
            rec("direct_load_s", _t(lambda: rec("_l", load_direct(paths[0], table, "l0"))))
            lo = out.pop("_l")[0]
            touched = set()
            rec("direct_merge_s", _t(lambda: touched.update(merge(table, [lo]))))
            rec("direct_restore_s", _t(lambda: restore(table, touched)))
        # hotswap: one adapter stays injected, the next one's weights are swapped in
        unet.enable_lora_hotswap(target_rank=rank)
        unet.load_lora_adapter(str(paths[0].parent), adapter_name="hs", **kw(paths[0]))
        for rep in range(wl.repeats):
            p = paths[(rep + 1) % 2]
            rec("hotswap_load_s", _t(lambda: unet.load_lora_adapter(str(p.parent), adapter_name="hs", hotswap=True,
                                                                    **kw(p))))
        unet.unload_lora()
    med = {k: statistics.median(v) for k, v in out.items()}
    med["diffusers_load_fuse_s"] = med["load_lora_adapter_s"] + med["fuse_lora_s"]
    med["direct_load_merge_s"] = med["direct_load_s"] + med["direct_merge_s"]
    med["direct_vs_load_fuse_x"] = med["diffusers_load_fuse_s"] / med["direct_load_merge_s"]
    return dict(median=med, samples=out, rank=rank)
