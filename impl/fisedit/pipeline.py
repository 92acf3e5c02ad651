"""Denoising loops of FISEdit over the engine: record, dense edit, and the two edit schedules.

The loop mirrors ``StableDiffusionPipeline`` (CFG batch 2, ``scale_model_input``,
``scheduler.step``) so that the dense path is the stock computation and the edit run's
scheduler state evolves from its own outputs (`impl/fisedit/README.md`, "Reconstructed choices").

Schedules (the authors' code, `Hankpipi/diffusers-hetu`), for N steps and k = ``mask_steps``:
- ``online``: steps 0..k-1 dense with the edited prompt, the mask captured from their latents
  against the cached ones, steps k..N-1 sparse;
- ``supplied``: the mask is given; steps 0..N-k-1 sparse, the last k dense.
A mask covering more than ``dense_fallback_ratio`` of the latent runs every step dense, and
the result says so.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from impl.common.diffusion.pipelines import Components, encode_prompts, scheduler_fingerprint

from impl.fisedit.cache import ActivationCache
from impl.fisedit.sparse_modules import EngineState, install, uninstall
from impl.fisedit.graphs import GraphedUNet, resolve_cuda_graph
from impl.fisedit.mask import capture_mask, check_mask, check_pool_factors
from impl.fisedit.schedules import EDIT_SCHEDULES


@dataclass
class RunOutput:
    latent: torch.Tensor  # final latent (1, C, H, W)
    latents: list  # latent after each step
    eps: list  # guided noise prediction per step
    step_times_s: list
    phases: list  # "dense" | "sparse" | "record" per step
    total_s: float = 0.0
    mask: Optional[torch.Tensor] = None
    mask_info: dict = field(default_factory=dict)
    dense_fallback: bool = False
    image: Optional[torch.Tensor] = None
    cache: Optional[ActivationCache] = None


def _fits_on(device: torch.device, cache: ActivationCache, margin_bytes: float = 2 * 2**30) -> bool:
    """The cache (already there, or to be moved) fits in the device's free memory with a margin."""
    if all(t.device == device for d in cache.entries.values() for t in d.values()):
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return cache.nbytes + margin_bytes <= free


class FISEditPipeline:
    def __init__(self, comps: Components, *, guidance_scale: float = 7.5, block: int = 2, exact: bool = False,
                 radical_attn: bool = False, conv_min_cells: int = 0, linear_min_cells: int = 0,
                 attn_min_cells: int = 0, pool_factors=None, progress: bool = False, engine: str = "fast",
                 cache_device: str = "auto", cuda_graph: str = "auto", dense_tile_fraction: float = 0.5):
        self.c = comps
        self.guidance = guidance_scale
        self.device = next(comps.unet.parameters()).device
        self.dtype = next(comps.unet.parameters()).dtype
        size = comps.unet.config.sample_size
        self.latent_hw = (size, size) if isinstance(size, int) else tuple(size)
        nlev = len(comps.unet.config.block_out_channels)
        check_pool_factors(self.latent_hw, pool_factors or [2 ** i for i in range(nlev)])
        self.state = EngineState(latent_hw=self.latent_hw, block=block, exact=exact, radical_attn=radical_attn,
                                 conv_min_cells=conv_min_cells, linear_min_cells=linear_min_cells,
                                 attn_min_cells=attn_min_cells, engine=engine, dense_tile_fraction=dense_tile_fraction,
                                 device=self.device, dtype=self.dtype)
        self.cache_device = cache_device
        self.graph_on = resolve_cuda_graph(cuda_graph, self.device)
        self.graphed = GraphedUNet(comps.unet, self._graph_key, keep=self._engine_buffers)
        self.op_names = install(comps.unet, self.state)
        self.progress = progress

    def set_engine(self, engine: str) -> None:
        """Switch reference <-> fast on the installed UNet (the fast one adds ResnetBlock2D wrappers)."""
        self.graphed.drop()
        uninstall(self.c.unet)
        self.state.engine = engine
        self.state.edit_version += 1
        self.op_names = install(self.c.unet, self.state)

    # ---- cache placement and graph regime ---------------------------------------------------
    def cache_store_device(self) -> Optional[str]:
        """Where a recorded cache lives (``system.cache_device``): host; device; auto = the
        job's device on CUDA (the fast engine), host on a CPU job (where they coincide)."""
        if self.cache_device == "device" or (self.cache_device == "auto" and self.device.type == "cuda"
                                             and self.state.fast):
            return str(self.device)
        return None

    def _prepare_cache(self, cache: Optional[ActivationCache]) -> None:
        """Fast engine: stack the cache per op so a device-side step index selects a step
        (on the job's device when it is to live there and fits; else it stays where it is)."""
        if cache is None or not self.state.fast:
            return
        dev = self.cache_store_device()
        if dev is None and self.device.type != "cpu":
            return  # host cache on a GPU job: per-step copies (cache_device: host)
        target = torch.device(dev) if dev else torch.device("cpu")
        if target.type == "cuda" and not _fits_on(target, cache):
            return
        cache.consolidate(target)

    def _engine_buffers(self) -> list:
        from impl.fisedit.sparse_modules import wrappers

        return [w.__dict__.get("_fast") for w in wrappers(self.c.unet).values()]

    def _graph_key(self):
        """(class, key) of the UNet call about to run, or None = eager (record, host cache)."""
        st = self.state
        if not self.graph_on or st.record_cache is not None or st.timing:
            return None
        if st.mode == "edit" and st.sparse:
            if not st.fast or st.cache is None or not st.cache.stacks:
                return None
            return ("sparse", (st.edit_version, id(st.cache), st.block))
        if st.mode in ("off", "edit"):
            return ("dense", (st.engine,))
        return None

    # ---- pieces ----------------------------------------------------------------------------
    def encode(self, prompt: str) -> torch.Tensor:
        return encode_prompts(self.c, ["", prompt]).to(self.device, self.dtype)

    def initial_latent(self, seed: int) -> torch.Tensor:
        g = torch.Generator("cpu").manual_seed(seed)
        ch = self.c.unet.config.in_channels
        return torch.randn((1, ch, *self.latent_hw), generator=g).to(self.device, self.dtype)

    def fresh_scheduler(self, num_steps: int):
        s = copy.deepcopy(self.c.scheduler)
        s.set_timesteps(num_steps, device=self.device)
        return s

    @torch.no_grad()
    def unet_eps(self, z, t, emb, scheduler) -> torch.Tensor:
        inp = scheduler.scale_model_input(torch.cat([z, z]), t)
        self.state.set_step_index()
        if self.graph_on:
            with self.graphed.active():
                out = self.c.unet(inp, t, encoder_hidden_states=emb, return_dict=False)[0]
        else:
            out = self.c.unet(inp, t, encoder_hidden_states=emb, return_dict=False)[0]
        u, c = out.chunk(2)
        return u + self.guidance * (c - u)

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        vae = self.c.vae
        return vae.decode(z / vae.config.scaling_factor, return_dict=False)[0]

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- loops -----------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, prompt: str, *, seed: int, num_steps: int, phases: list[str],
            cache: Optional[ActivationCache] = None, record: Optional[ActivationCache] = None,
            mask: Optional[torch.Tensor] = None, on_dense_done: Optional[Callable] = None,
            decode: bool = True, desc: str = "") -> RunOutput:
        """Generic loop: ``phases[i]`` in {record, dense, sparse}. ``on_dense_done(i, out)`` may
        return a mask once the leading dense steps are done (the online schedule)."""
        from tqdm.auto import tqdm

        st = self.state
        t_start = time.perf_counter()
        emb = self.encode(prompt)
        sched = self.fresh_scheduler(num_steps)
        if cache is not None:
            cache.check_compatible(seed=seed, scheduler=scheduler_fingerprint(sched),
                                   timesteps=[int(t) for t in sched.timesteps.tolist()],
                                   latent_shape=(1, self.c.unet.config.in_channels, *self.latent_hw))
        if mask is not None:
            mask = check_mask(mask, self.latent_hw)
        z = self.initial_latent(seed) * sched.init_noise_sigma
        if record is not None:
            record.meta.update(seed=seed, scheduler=scheduler_fingerprint(sched), prompt=prompt,
                               timesteps=[int(t) for t in sched.timesteps.tolist()], latent_shape=tuple(z.shape),
                               z_T=z.detach().cpu().clone())
        out = RunOutput(latent=z, latents=[], eps=[], step_times_s=[], phases=[], mask=mask)
        self._prepare_cache(cache)
        st.set_cache(cache)
        st.record_cache = record
        st.set_mask(mask)
        try:
            for i, t in enumerate(tqdm(sched.timesteps, desc=desc or "denoise", disable=not self.progress,
                                       leave=False)):
                phase = phases[i]
                if phase == "sparse" and (st.mask is None or cache is None or not cache.has_step(i)):
                    phase = "dense"  # no mask yet, or a cache miss (step dropped by the budget)
                self._sync()
                t0 = time.perf_counter()
                st.step = i
                st.mode = "record" if phase == "record" else ("edit" if (cache is not None or record is not None) else "off")
                st.sparse = phase == "sparse"
                if record is not None:
                    record.begin_step(i)
                eps = self.unet_eps(z, t, emb, sched)
                z = sched.step(eps, t, z, return_dict=False)[0]
                if record is not None:
                    record.put(i, "__latent__", z)
                    record.end_step(i)
                self._sync()
                out.step_times_s.append(time.perf_counter() - t0)
                out.phases.append(phase)
                out.latents.append(z)
                out.eps.append(eps)
                if on_dense_done is not None and st.mask is None and i + 1 < len(phases) and phases[i + 1] == "sparse":
                    m = on_dense_done(i, out)
                    if m is not None:
                        m = check_mask(m, self.latent_hw)
                        out.mask = m
                        st.set_mask(m)
        finally:
            st.mode, st.sparse, st.cache, st.record_cache = "off", False, None, None
        out.latent = z
        if decode:
            out.image = self.decode(z)
        self._sync()
        out.total_s = time.perf_counter() - t_start
        out.cache = record
        return out

    def record(self, prompt: str, *, seed: int, num_steps: int, budget_bytes: float = float("inf"),
               decode: bool = True) -> RunOutput:
        cache = ActivationCache(budget_bytes=budget_bytes, store_device=self.cache_store_device())
        return self.run(prompt, seed=seed, num_steps=num_steps, phases=["record"] * num_steps, record=cache,
                        decode=decode, desc="original (record)")

    def dense(self, prompt: str, *, seed: int, num_steps: int, decode: bool = True) -> RunOutput:
        return self.run(prompt, seed=seed, num_steps=num_steps, phases=["dense"] * num_steps, decode=decode,
                        desc="dense edit")

    def edit(self, prompt: str, *, seed: int, num_steps: int, cache: ActivationCache, schedule: str,
             mask_steps: int, mask: Optional[torch.Tensor] = None, mask_method: str = "otsu",
             dense_fallback_ratio: float = 0.5, record: Optional[ActivationCache] = None,
             decode: bool = True, mask_override: Optional[torch.Tensor] = None) -> RunOutput:
        """One edit. ``supplied``: ``mask`` is required. ``online``: the mask is captured after
        ``mask_steps`` dense steps (``mask_override`` then replaces it, e.g. a synthetic mask of
        a controlled ratio, after the capture cost was paid)."""
        k = mask_steps
        if not EDIT_SCHEDULES.get(schedule, "schedule").captures_mask:
            if mask is None:
                raise ValueError("the supplied-mask schedule needs a mask")
            mask = check_mask(mask, self.latent_hw)
            if float(mask.float().mean()) > dense_fallback_ratio:
                out = self.run(prompt, seed=seed, num_steps=num_steps, phases=["dense"] * num_steps, cache=cache,
                               record=record, decode=decode, desc="edit (dense fallback)")
                out.mask, out.dense_fallback = mask, True
                return out
            phases = ["sparse"] * (num_steps - k) + ["dense"] * k
            return self.run(prompt, seed=seed, num_steps=num_steps, phases=phases, cache=cache, record=record,
                            mask=mask, decode=decode, desc="edit (supplied mask)")
        info: dict = {}

        def capture(i, out: RunOutput):
            orig = [cache.get(j, "__latent__") for j in range(i + 1)]
            m, inf = capture_mask(out.latents, orig, method=mask_method)
            info.update(inf)
            if mask_override is not None:
                info["override_ratio"] = float(mask_override.float().mean())
                m = mask_override
            if float(m.float().mean()) > dense_fallback_ratio:
                info["dense_fallback"] = True
                return None
            return m

        phases = ["dense"] * k + ["sparse"] * (num_steps - k)
        out = self.run(prompt, seed=seed, num_steps=num_steps, phases=phases, cache=cache, record=record,
                       on_dense_done=capture, decode=decode, desc="edit (online mask)")
        out.mask_info = info
        out.dense_fallback = bool(info.get("dense_fallback"))
        return out
