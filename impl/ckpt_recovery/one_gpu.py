"""One process, world 1 (``real.scenario: one_gpu``, README "One GPU"): save stall and load time of
training state that lives where the job runs (the GPU under ``execution=cuda``, the CPU
otherwise), ours against torch DCP sync and async, one policy per job.

The state is a decoder's (``workload.model``, e.g. ~1 B parameters for ``gpu/ckpt_recovery``)
parameters in the job's dtype plus fp32 Adam moments and per-parameter step scalars, made
directly on the device with a seeded generator (a checkpoint moves bytes; no forward pass is
needed to give them values). The model is built on the meta device only for its names and
shapes, so the metas and shard dims are the real decoder's and a world-1 checkpoint of ours
loads into any TP/PP layout later (partition-agnostic).

Each of ``workload.iterations`` steps runs ``real.step_s`` of matmuls on the device (a synthetic
training step, labelled so), then sets every step scalar to the step number; every
``real.ckpt_every`` steps a save is due:

* ``ckpt_recovery``: :class:`impl.common.checkpoint.async_save.AsyncCheckpointer` with a world-1
  gloo group: the stall is the copy into preallocated host shared memory (device to host for a
  GPU state); its saver process splits, writes and commits while the next steps run; a due
  save is skipped while the last one is in flight (skip-not-wait);
* ``dcp_sync``: ``dcp.save`` of the device tensors (the stall is the whole save);
* ``dcp_async``: ``dcp.async_save`` (thread executor, DCP's default staging to host memory);
  the stall is the staging, plus waiting for the previous save when it is still in flight.

Then the last committed checkpoint is loaded back into fresh device tensors (``t_load_s``:
header/metadata, reads, assembly and the host-to-device copy, synchronised) and compared bit for
bit, dtype included, with the state at that step.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from impl.common.api import ConfigError, Metric, RunResult
from impl.common.registry import Registry
from impl.common.checkpoint.layout import StagePlan, TensorMeta, check_layout, pipeline_layout
from impl.common.checkpoint.model_state import state_metas
from impl.common.models.varlen_gpt import VarlenGPT
from impl.common.storage.emulator import Storage, StorageProfile
from impl.common.papers import paper_entries


def param_names(shape) -> list[tuple[str, tuple]]:
    """The decoder's parameters (name, shape), from a model built on the meta device."""
    with torch.device("meta"):
        model = VarlenGPT(shape, 0)
    return [(k, tuple(p.shape)) for k, p in model.named_parameters()]


def state_bytes(shape, param_dtype: torch.dtype) -> int:
    """Bytes of the state :func:`make_state` builds (params + fp32 m, v + fp32 step scalars)."""
    per = torch.empty((), dtype=param_dtype).element_size() + 8
    return sum(int(torch.Size(s).numel()) * per + 4 for _, s in param_names(shape))


def make_state(shape, seed: int, device: torch.device, param_dtype: torch.dtype) -> tuple[dict, list[TensorMeta]]:
    """Flat state (``param/``, ``exp_avg/``, ``exp_avg_sq/``, ``step/``) on ``device``, seeded."""
    g = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for k, s in param_names(shape):
        state[f"param/{k}"] = torch.randn(s, generator=g, device=device, dtype=param_dtype)
        state[f"exp_avg/{k}"] = torch.randn(s, generator=g, device=device, dtype=torch.float32).mul_(1e-3)
        state[f"exp_avg_sq/{k}"] = torch.rand(s, generator=g, device=device, dtype=torch.float32).mul_(1e-6)
        state[f"step/{k}"] = torch.zeros((), device=device, dtype=torch.float32)
    return state, state_metas(state)


def world_layout(metas, num_layers: int):
    """Every tensor whole on rank 0 (the one-GPU layout)."""
    return pipeline_layout(metas, [[StagePlan((0,), (0, num_layers))]], num_layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_step(seconds: float, device: torch.device, dtype: torch.dtype) -> None:
    """``seconds`` of matmuls on ``device`` (the training step's stand-in), synchronised."""
    n = 4096 if device.type == "cuda" else 128
    a = torch.randn(n, n, device=device, dtype=dtype if device.type == "cuda" else torch.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
        _sync(device)


@contextlib.contextmanager
def world_one():
    """A gloo group of one process (ours' per-step agreement and DCP's collectives run on it)."""
    if dist.is_initialized():
        raise ConfigError("real.scenario: one_gpu runs in the job's own process, which already has a "
                          "process group (run it outside torchrun)")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _set_step(state: dict, step: int) -> None:
    for k, v in state.items():
        if k.startswith("step/"):
            v.fill_(float(step))


def _save_loop(policy: str, state: dict, metas, layout, root: str, prof: StorageProfile, k, steps: int,
               device: torch.device, dtype: torch.dtype, group) -> dict:
    out: dict = {"saves": 0, "skipped": 0}
    out["stall_s"] = ONE_GPU.get(policy).save(out, state, metas, layout, root, prof, k, steps, device, dtype, group)
    return out


def _save_elastor(out: dict, state: dict, metas, layout, root: str, prof: StorageProfile, k, steps: int,
                  device: torch.device, dtype: torch.dtype, group) -> list[float]:
    from impl.common.checkpoint.async_save import AsyncCheckpointer

    extra = {"consumed_samples": 0, "scheduler": {"last_epoch": 0}}
    t_start = time.perf_counter()
    ck = AsyncCheckpointer(root, 0, 1, metas, layout, k.splits, state, prof=prof, keep=k.keep,
                           min_interval_s=0.0, group=group)
    ck.wait_ready()
    out["t_saver_start_s"] = time.perf_counter() - t_start
    for s in range(1, steps + 1):
        synthetic_step(k.step_s, device, dtype)
        _set_step(state, s)
        _sync(device)
        ck.step(s, state, dict(extra, consumed_samples=s), due=s % k.ckpt_every == 0)
    t0 = time.perf_counter()
    log = ck.finish()
    out["t_drain_s"] = time.perf_counter() - t0
    out.update(saves=log["saves"], skipped=log["skipped_saves"], committed=log["committed_steps"], io=log["io"])
    out["step"] = log["committed_steps"][-1] if log["committed_steps"] else None
    return list(ck.log.stall_s)


def _save_dcp(sync: bool):
    def save(out: dict, state: dict, metas, layout, root: str, prof: StorageProfile, k, steps: int,
             device: torch.device, dtype: torch.dtype, group) -> list[float]:
        from impl.ckpt_recovery import dcp_baseline as D

        storage = Storage(prof)
        stalls: list[float] = []
        fut, last = None, None
        for s in range(1, steps + 1):
            synthetic_step(k.step_s, device, dtype)
            _set_step(state, s)
            _sync(device)
            if s % k.ckpt_every:
                continue
            path = os.path.join(root, f"step{s:08d}")
            t0 = time.perf_counter()
            if sync:
                D.save_sync(state, path, storage)
            else:
                if fut is not None:
                    fut.result()  # one save in flight: waiting for the previous one is stall
                fut = D.save_async(state, path, storage, group)
            stalls.append(time.perf_counter() - t0)
            out["saves"] += 1
            last = s
        t0 = time.perf_counter()
        if fut is not None:
            fut.result()
        out["t_drain_s"] = time.perf_counter() - t0
        out.update(step=last, io=storage.stats.to_dict())
        return stalls
    return save


def _load(policy: str, state: dict, metas, layout, root: str, prof: StorageProfile, step: int,
          device: torch.device) -> dict:
    storage = Storage(prof)
    _sync(device)
    t0 = time.perf_counter()
    loaded, info = ONE_GPU.get(policy).load(state, metas, layout, root, storage, step, device)
    _sync(device)
    info["t_load_s"] = time.perf_counter() - t0
    info["bit_exact"] = set(loaded) == set(state) and all(
        loaded[k].dtype == v.dtype and loaded[k].device == v.device and torch.equal(loaded[k], v)
        for k, v in state.items())
    return info


def _load_elastor(state: dict, metas, layout, root: str, storage: Storage, step: int,
                  device: torch.device) -> tuple[dict, dict]:
    from impl.common.checkpoint.reshard import load_rank
    from impl.common.checkpoint.store import CheckpointStore

    ck = CheckpointStore(root, storage).open(step)
    host, st = load_rank(ck, layout, 0, storage, metas=metas)
    return {k: v.to(device) for k, v in host.items()}, st.to_dict()


def _load_dcp(state: dict, metas, layout, root: str, storage: Storage, step: int,
              device: torch.device) -> tuple[dict, dict]:
    from impl.ckpt_recovery import dcp_baseline as D

    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    D.load(loaded, os.path.join(root, f"step{step:08d}"), storage)
    needed = sum(t.numel() * t.element_size() for t in loaded.values())
    return loaded, {"read_calls": storage.stats.read_calls, "bytes_read": storage.stats.read_bytes,
                    "bytes_needed": needed, "read_amplification": storage.stats.read_bytes / needed}


@dataclass(frozen=True)
class OneGpuBackend:
    save: Callable  # the save loop: fills the record's save facts, returns the stalls
    load: Callable  # (loaded tensors, load facts)
    stall_note: str  # what its stall is


# The policies the one_gpu scenario runs (no re-layout: one process saves and reloads).
ONE_GPU: Registry[OneGpuBackend] = Registry("policy", "policy")
ONE_GPU.add("ckpt_recovery", OneGpuBackend(_save_elastor, _load_elastor,
                                           "copy into preallocated host shared memory (device to host)"))
ONE_GPU.add("dcp_sync", OneGpuBackend(_save_dcp(sync=True), _load_dcp, "the whole dcp.save"))
ONE_GPU.add("dcp_async", OneGpuBackend(_save_dcp(sync=False), _load_dcp,
                                       "dcp.async_save staging to host memory, plus waiting for the previous save"))


def run(policy: str, wl, k, seed: int, execution, prof: StorageProfile) -> dict:
    """One policy's save loop and reload on the job's device; plain data for the record."""
    device = execution.torch_device()
    dtype = execution.torch_dtype(wl.dtype)
    state, metas = make_state(wl.model, seed, device, dtype)
    layout = world_layout(metas, wl.model.num_layers)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    base = k.root or None
    if base:
        os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckpt-one-gpu-", dir=base)
    try:
        with world_one() as group:
            saved = _save_loop(policy, state, metas, layout, root, prof, k, wl.iterations, device, dtype, group)
            step = saved["step"]
            if step is None:
                raise RuntimeError(f"{policy}: no save committed in {wl.iterations} steps (real.ckpt_every="
                                   f"{k.ckpt_every})")
            _set_step(state, step)  # the state as it was at the committed step
            loaded = _load(policy, state, metas, layout, root, prof, step, device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"saved": saved, "loaded": loaded, "state_bytes": nbytes,
            "params": sum(int(torch.Size(s).numel()) for _, s in param_names(wl.model)),
            "dtype": str(dtype).replace("torch.", ""), "device": str(device), "tensors": len(state),
            "root": base or tempfile.gettempdir()}


def result(o: dict, policy: str, prof: StorageProfile, execution, k) -> RunResult:
    s, ld = o["saved"], o["loaded"]
    stalls = s["stall_s"]
    m = {"t_stall_s": Metric.from_samples(stalls, "s") if stalls else Metric.scalar(float("nan"), "s"),
         "t_stall_max_s": Metric.scalar(max(stalls) if stalls else float("nan"), "s"),
         "t_drain_s": Metric.scalar(s["t_drain_s"], "s"),
         "t_load_s": Metric.scalar(ld["t_load_s"], "s"),
         "load_bytes_per_s": Metric.scalar(o["state_bytes"] / ld["t_load_s"], "B/s", "higher"),
         "read_calls": Metric.scalar(float(ld["read_calls"]), "calls"),
         "read_amplification": Metric.scalar(ld["read_amplification"], "ratio"),
         "saves": Metric.scalar(float(s["saves"]), "saves", "higher"),
         "skipped_saves": Metric.scalar(float(s["skipped"]), "saves"),
         "state_bytes": Metric.scalar(float(o["state_bytes"]), "B")}
    info = {"scenario": "one_gpu", "policy": policy, "device": execution.device, "backend": "none",
            "gpu_name": execution.gpu_name if execution.is_cuda else None, "param_dtype": o["dtype"],
            "params": o["params"], "tensors": o["tensors"], "storage": prof.label(), "checkpoint_dir": o["root"],
            "loaded_step": s["step"], "bit_exact": ld["bit_exact"], "save_io": s.get("io"),
            "training_step": f"synthetic: {k.step_s} s of matmuls on the device per step",
            "stall_note": ONE_GPU.get(policy).stall_note}
    if "t_saver_start_s" in s:
        info["t_saver_start_s"] = s["t_saver_start_s"]
        info["committed_steps"] = s.get("committed")
    res = RunResult(metrics=m, emulated=[prof.label()] if prof.emulated else [], info=info)
    if not ld["bit_exact"]:
        res.mark_invalid(f"{policy}: the reloaded state differs from the saved one (step {s['step']})")
    return res


def check(wl, k, policy: str, fault) -> None:
    """The one_gpu scenario's preflight: one process, no fault, a policy it runs, S splits that
    fit the model (one line each)."""
    if policy not in ONE_GPU:
        raise ConfigError(f"policy: {policy!r} does not run real.scenario=one_gpu (one of: {', '.join(ONE_GPU.names())})")
    if (wl.num_gpus, wl.tp, wl.pp, wl.dp) != (1, 1, 1, 1):
        raise ConfigError(f"workload: real.scenario=one_gpu runs one process (num_gpus=tp=pp=dp=1), got num_gpus="
                          f"{wl.num_gpus}, tp={wl.tp}, pp={wl.pp}, dp={wl.dp}")
    if getattr(fault, "kind", "none") != "none":
        raise ConfigError(f"fault.kind: real.scenario=one_gpu injects no fault, got {fault.kind!r}")
    if k.ckpt_every < 1 or wl.iterations < k.ckpt_every:
        raise ConfigError(f"real.ckpt_every: {k.ckpt_every} must be in 1..workload.iterations ({wl.iterations})")
    if k.step_s < 0:
        raise ConfigError(f"real.step_s: must be >= 0, got {k.step_s}")
    with torch.device("meta"):
        fake = {f"param/{n}": torch.empty(s) for n, s in param_names(wl.model)}
    metas = state_metas(fake)
    check_layout(metas, world_layout(metas, wl.model.num_layers), k.splits)
    # Room in /dev/shm for ours' snapshot is checked when the saver starts (check_shm: one line),
    # not here: composing the preset on a host without that room must still pass.


def band(e: dict) -> str:
    return f"{e['value']:g}-{e['high']:g}" if e.get("high") is not None else f">= {e['value']:g}"


def figure(records: list, out_dir) -> list:
    """The gpu/ckpt_recovery preset's hook: per system stall / drain / load, and ours' ratios
    against DCP beside our reconstructed targets [R] (impl/ckpt_recovery/paper.yaml); also as markdown."""
    import pathlib

    by = {r["system"]: r for r in records if r.get("status") in ("ok", "invalid")}
    val = lambda s, m: by[s]["metrics"][m]["value"] if s in by and m in by[s]["metrics"] else float("nan")  # noqa: E731
    lines = ["| system | stall (median) s | stall max s | drain s | load s | load GB/s | saves / skipped | bit-exact | device |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in ("ckpt_recovery", "dcp_sync", "dcp_async"):
        if s in by:
            info = by[s].get("info", {})
            lines.append(f"| {s} | {val(s, 't_stall_s'):.4g} | {val(s, 't_stall_max_s'):.4g} | {val(s, 't_drain_s'):.3g} | "
                         f"{val(s, 't_load_s'):.3g} | {val(s, 'load_bytes_per_s') / 1e9:.3g} | "
                         f"{val(s, 'saves'):.0f} / {val(s, 'skipped_saves'):.0f} | {info.get('bit_exact')} | "
                         f"{info.get('device')} {info.get('gpu_name') or ''} |")
    paper = paper_entries("ckpt_recovery")
    lines += ["", "| figure | paper / spec | ours |", "|---|---|---|"]
    for name, base, metric in (("gpu_stall_vs_sync", "dcp_sync", "t_stall_s"),
                               ("gpu_stall_vs_async", "dcp_async", "t_stall_s"),
                               ("gpu_load_vs_dcp", "dcp_sync", "t_load_s")):
        e = paper.get(name)
        if e is not None:
            ours = val(base, metric) / val("ckpt_recovery", metric)
            lines.append(f"| {e['setting']} | {band(e)}x ({e['source']}) | {ours:.3g}x |")
    text = "\n".join(lines)
    print(text)
    path = pathlib.Path(out_dir) / "gpu_ckpt_recovery.md"
    path.write_text(text + "\n")
    return [path]
