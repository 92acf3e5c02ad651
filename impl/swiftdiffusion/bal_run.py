"""Real experiment B: BAL (patch at min(first all-loaded step, K)) against a synchronous direct
merge and against two Diffusers baselines on CPU: ``diffusers_pipeline``, the full pipeline API
(``StableDiffusionControlNetPipeline`` + ``load_lora_weights`` / ``set_adapters`` / ``fuse_lora``
per request, :mod:`.diffusers_pipeline`), and ``diffusers_model``, the model-level
``unet.load_lora_adapter`` + ``fuse_lora``.

One launch: rank 0 is the base worker, ranks 1..n the loader processes (one per LoRA slot) over
preallocated shared-memory buffers. Every LoRA read (BAL's loaders, the synchronous merge and
diffusers alike) goes through the same storage emulator (labelled emulated); variants rotate
order per request. Every request runs ``workload.num_controlnets`` ControlNets (serial, local).
Latents of every other variant are compared with the synchronous run."""
from __future__ import annotations

import copy
import tempfile
import time

import torch

from impl.common.diffusion.quality import psnr, ssim
from impl.common.runtime.launch import RankContext, launch
from impl.common.storage.emulator import Storage, StorageProfile

from impl.swiftdiffusion.bal import LoaderClient, SharedSlots, bal_request, check_file, check_k, loader_loop
from impl.swiftdiffusion.denoise import denoise, to_channels_last
from impl.swiftdiffusion.diffusers_pipeline import build_pipeline, pipeline_request, weight_drift
from impl.swiftdiffusion.lora import TargetTable, load_direct, make_lora, merge, restore
from impl.swiftdiffusion.models import build_bundle, request_inputs
from impl.common.execution import set_torch_threads


def storage_for(wl) -> Storage:
    return Storage(StorageProfile("lora remote store", latency_s=wl.remote_latency_s,
                                  bandwidth_bytes_per_s=wl.remote_bw_bytes_per_s, time_scale=wl.time_scale))


def make_lora_files(wl, seed: int, unet, root) -> list[str]:
    """Two request sets of LoRAs (ranks from the workload), so consecutive requests differ."""
    paths = []
    for j in range(2):
        for i, r in enumerate(wl.lora_ranks):
            paths.append(str(make_lora(unet, r, seed + 10 * j + i, f"{root}/lora-{j}-{i}", alpha=2.0 * r,
                                       dtype=torch.float16)))
    return paths


def sync_request(unet_table, storage, paths, idx, run, emulated_bytes):
    """The synchronous direct merge: read (emulated) + load + merge, then denoise, restore."""
    loras = [load_direct(paths[i], unet_table, f"#{i}", data=storage.read_file(paths[i], emulated_bytes)) for i in idx]
    touched = merge(unet_table, loras)
    try:
        return run(None)
    finally:
        restore(unet_table, touched)


def diffusers_request(unet, storage, paths, idx, run, emulated_bytes, timings: dict):
    """diffusers' model-level API per request: load_lora_adapter per LoRA, set_adapters, fuse_lora;
    afterwards unfuse_lora and unload_lora."""
    import pathlib

    t = time.perf_counter()
    names = []
    for i in idx:
        storage.read_file(paths[i], emulated_bytes)  # the fetch from the remote store
        name = f"a{i}"
        unet.load_lora_adapter(str(pathlib.Path(paths[i]).parent), prefix="unet", adapter_name=name,
                               weight_name=pathlib.Path(paths[i]).name)
        names.append(name)
    unet.set_adapters(names, [1.0] * len(names))
    unet.fuse_lora(lora_scale=1.0, adapter_names=names)
    timings.setdefault("load_fuse_s", []).append(time.perf_counter() - t)
    try:
        return run(None)
    finally:
        t = time.perf_counter()
        unet.unfuse_lora()
        unet.unload_lora()
        timings.setdefault("unfuse_unload_s", []).append(time.perf_counter() - t)


@torch.no_grad()
def _base(ctx, wl, seed, paths, slots, k_grid, channels_last=False, execution=None):
    set_torch_threads(max(1, wl.torch_threads))
    device, dtype = _where(execution)
    n_cn = wl.num_controlnets
    b = build_bundle(wl, seed, num_controlnets=n_cn, device=device, dtype=dtype)
    cns, scales = list(b.controlnets.values()), list(wl.cn_scales[:n_cn])
    diff_unet = copy.deepcopy(b.unet)
    pipe = build_pipeline(b, wl, seed, list(b.controlnets), device=device, dtype=dtype)
    if channels_last:
        to_channels_last(b.unet, diff_unet, pipe.unet, *cns)
    pipe_pristine = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    cache = tempfile.TemporaryDirectory(prefix="mlsys-lora-cache-")  # the Diffusers server's local LoRA dir
    table = TargetTable.build(b.unet)
    storage = storage_for(wl)
    client = LoaderClient(slots, table, paths, slots.max_rank)
    n_l = len(wl.lora_ranks)
    variants = ["sync", "diffusers_model", "diffusers_pipeline"] + [f"k{k}" for k in k_grid]
    times = {v: [] for v in variants}
    patch = {f"k{k}": [] for k in k_grid}
    first_done = {f"k{k}": [] for k in k_grid}
    quality = {f"k{k}": [] for k in k_grid}
    k0_equal, extra = [], {}
    try:  # the loaders stop however the requests end
        for r in range(wl.requests + 1):  # request 0 = warm-up
            idx = list(range((r % 2) * n_l, (r % 2) * n_l + n_l))
            inp = request_inputs(wl, seed * 1000 + r, n_cn, b, device=device, dtype=dtype)

            def run(hook, unet=b.unet):
                return denoise(unet, b.scheduler, inp, wl.num_steps, wl.guidance_scale, controlnets=cns, scales=scales,
                               guidance_start=wl.control_guidance_start, guidance_end=wl.control_guidance_end,
                               before_step=hook, channels_last=channels_last)

            out = {}
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                t0 = time.perf_counter()
                if v == "sync":
                    out[v] = sync_request(table, storage, paths, idx, run, wl.lora_paper_bytes)
                elif v == "diffusers_model":
                    out[v] = diffusers_request(diff_unet, storage, paths, idx, lambda h: run(h, diff_unet),
                                               wl.lora_paper_bytes, extra)
                elif v == "diffusers_pipeline":
                    out[v] = pipeline_request(pipe, storage, paths, idx, wl, inp, scales, cache.name, extra)
                else:
                    k = int(v[1:])
                    out[v], pol = bal_request(client, idx, k, run)
                    if r > 0:
                        patch[v].append(pol.patched_at)
                        first_done[v].append(pol.first_all_done)
                _sync(device)  # a request ends when its latents are computed
                if r > 0:
                    times[v].append(time.perf_counter() - t0)
            if r > 0:
                ref = out["sync"]
                for v in quality:
                    quality[v].append((psnr(ref, out[v]), ssim(ref[0], out[v][0])))
                if "k0" in out:
                    k0_equal.append(bool(torch.equal(out["k0"], ref)))
                for v in ("diffusers_model", "diffusers_pipeline"):
                    extra.setdefault(f"{v}_vs_sync_max_rel", []).append(
                        float((out[v].float() - ref.float()).abs().max() / ref.float().abs().max()))
            # after every request our base weights are pristine again (restored by copy); diffusers'
            # unfuse subtracts the delta back, so its weights drift: measured, not required
            extra.setdefault("pristine_after", []).append(all(torch.equal(s.weight, s.pristine) for s in table.sites.values()))
            extra.setdefault("pipeline_weight_drift", []).append(weight_drift(pipe.unet, pipe_pristine))
    finally:
        client.stop()
        cache.cleanup()
    for key in ("load_fuse_s", "unfuse_unload_s", "pipeline_load_fuse_s", "pipeline_unfuse_unload_s"):
        extra[key] = extra[key][1:]  # request 0 is the warm-up
    cn = getattr(pipe, "controlnet", None)
    extra["pipeline"] = type(pipe).__name__ + (f" ({type(cn).__name__})" if cn is not None else "")
    return dict(times=times, patch=patch, first_done=first_done, quality=quality, k0_equal=k0_equal, **extra)


def _where(execution):
    """(device, dtype) of the base worker: the job's execution (None: the CPU in fp32)."""
    if execution is None:
        return torch.device("cpu"), None
    return execution.torch_device(), execution.torch_dtype(None, field_name="execution.dtype")


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _main(ctx: RankContext, wl, seed, paths, slots, k_grid, storage, channels_last=False, execution=None):
    if ctx.rank == 0:
        return _base(ctx, wl, seed, paths, slots, k_grid, channels_last, execution)
    return {"loads": loader_loop(ctx.rank - 1, slots, paths, storage, wl.lora_paper_bytes)}


def run_bal(wl, seed: int, k_grid, timeout_s: float = 1800.0, channels_last: bool = False, execution=None) -> dict:
    """``execution`` (the job's): the base worker (rank 0) runs the models on its device and
    dtype; the loader ranks read files into host shared memory, on the CPU, so the launch's
    group is gloo whatever the device."""
    for k in k_grid:
        check_k(k, wl.num_steps)
    device, _ = _where(execution)
    # the LoRA files need the UNet only (fp32, on the job's device: fast to initialise there)
    b = build_bundle(wl, seed, num_controlnets=0, device=device)
    table = TargetTable.build(b.unet)
    with tempfile.TemporaryDirectory(prefix="mlsys-lora-") as d:
        paths = make_lora_files(wl, seed, b.unet, d)
        for i, p in enumerate(paths):
            check_file(table, p, f"#{i}", max(wl.lora_ranks))
        slots = SharedSlots.allocate(table, len(wl.lora_ranks), max(wl.lora_ranks))
        del b, table
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out = launch(_main, 1 + len(wl.lora_ranks), (wl, seed, paths, slots, list(k_grid), storage_for(wl), channels_last,
                                                      execution), label="bal", timeout_s=timeout_s, backend="gloo")
    res = out.results[0]
    res["loads"] = [x["loads"] for x in out.results[1:]]
    res["storage"] = storage_for(wl).profile.label()
    return res
