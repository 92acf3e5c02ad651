"""ControlNet-as-a-Service (as in the authors' code, `modelscope/Katz`) on CPU processes: real
experiment A of README.md.

Rank 0 is the base worker; ranks 1..k are ControlNet servers, each with an LRU cache of
ControlNets loaded from ``save_pretrained`` directories. For every step of a request the base
worker sends the (CFG-batched) latent input and timestep to the request's k servers, runs the
UNet down half while they run their ControlNets, receives their residuals (one flat buffer per
server), aggregates them (scaled sum = ``MultiControlNetModel``; ``katz_mean`` variant) and
runs mid + up. The same job times the one-process diffusers-semantics loop (ControlNets serial
before a full ``UNet2DConditionModel.forward``) interleaved, and the components of the bound
(T_down, T_cn, T_rest in-process; T_comm as a residual-sized round trip). With ``channels_last``
the UNet and every ControlNet run NHWC on both sides; tensors cross gloo in the default
(contiguous NCHW) layout and are converted on arrival.
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from impl.common.runtime.launch import RankContext, launch

from impl.swiftdiffusion import split_unet
from impl.swiftdiffusion.cache import LRUCache
from impl.swiftdiffusion.denoise import aggregate, controlnet_keep, denoise, new_scheduler, run_controlnet, to_channels_last
from impl.swiftdiffusion.models import build_bundle, request_inputs
from impl.common.execution import set_torch_threads

STOP, REQUEST, ECHO = -1, 1, 2


def _flat(d, m) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in (*d, m)])


def _unflat(buf, shapes):
    out, o = [], 0
    for s in shapes:
        n = 1
        for x in s:
            n *= x
        out.append(buf[o:o + n].view(*s))
        o += n
    return out[:-1], out[-1]


def _nhwc(x: torch.Tensor, on: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if on else x


def _server(ctx: RankContext, wl, save_dir: str, cache_size: int, channels_last: bool = False) -> dict:
    from diffusers import ControlNetModel

    def load(idx):
        cn = ControlNetModel.from_pretrained(f"{save_dir}/cn-{idx}").eval()
        if channels_last:
            to_channels_last(cn)
        return cn

    set_torch_threads(max(1, wl.torch_threads))
    cache = LRUCache(cache_size, "system.cn_cache")
    hdr = torch.zeros(4, dtype=torch.int64)
    n_tok, c = wl.text_len, wl.unet.cross_attention_dim
    served, nhwc = 0, []
    while True:
        dist.recv(hdr, 0)
        kind, cn_idx, steps, numel = (int(v) for v in hdr)
        if kind == STOP:
            return dict(hits=cache.hits, misses=cache.misses, cached=len(cache), capacity=cache_size, served=served,
                        nhwc=all(nhwc))
        x = torch.empty(2, wl.unet.in_channels, wl.unet.sample_size, wl.unet.sample_size)
        if kind == ECHO:
            for _ in range(steps):
                dist.recv(x, 0)
                dist.send(torch.zeros(numel), 0)
            continue
        cn = cache.get(cn_idx, lambda: load(cn_idx))
        nhwc.append(cn.conv_in.weight.is_contiguous(memory_format=torch.channels_last))
        f = 2 ** (len(cn.config.conditioning_embedding_out_channels) - 1)
        image = torch.empty(2, cn.config.conditioning_channels, wl.unet.sample_size * f, wl.unet.sample_size * f)
        emb = torch.empty(2, n_tok, c)
        dist.recv(image, 0)
        dist.recv(emb, 0)
        image_in = _nhwc(image, channels_last)
        t = torch.zeros(1)
        with torch.no_grad():
            for i in range(steps):
                if not controlnet_keep(i, steps, wl.control_guidance_start, wl.control_guidance_end):
                    continue
                dist.recv(x, 0)
                dist.recv(t, 0)
                d, m = run_controlnet(cn, _nhwc(x, channels_last), t[0], emb, image_in)
                dist.send(_flat(d, m), 0)
        served += 1


class RemoteControlNets:
    """The base worker's view of its servers for one request (``denoise``'s residual source)."""

    def __init__(self, servers, cn_idx, images, emb, steps, shapes, scales, aggregation):
        self.servers, self.shapes = servers, shapes
        self.scales, self.aggregation = scales, aggregation
        self.numel = sum(torch.Size(s).numel() for s in shapes)
        for r, ci, im in zip(servers, cn_idx, images):
            dist.send(torch.tensor([REQUEST, ci, steps, self.numel]), r)
            dist.send(torch.cat([im, im]).contiguous(), r)
            dist.send(emb.contiguous(), r)

    def start(self, x, t):
        tt = torch.tensor([float(t)])
        sends = []
        for r in self.servers:
            sends += [dist.isend(x.contiguous(), r), dist.isend(tt, r)]
        bufs = [torch.empty(self.numel) for _ in self.servers]
        recvs = [dist.irecv(b, r) for b, r in zip(bufs, self.servers)]
        return sends, recvs, bufs

    def finish(self, handle):
        sends, recvs, bufs = handle
        for w in (*sends, *recvs):
            w.wait()
        return aggregate([_unflat(b, self.shapes) for b in bufs], self.scales, self.aggregation)


def service_denoise(unet, scheduler, inp, wl, servers, cn_idx, scales, aggregation, channels_last: bool = False):
    emb = torch.cat([inp["uncond"], inp["cond"]])
    st = split_unet.down(unet, torch.cat([inp["noise"], inp["noise"]]), torch.tensor(1), emb)  # residual shapes
    shapes = [tuple(s.shape) for s in st.skips] + [tuple(st.sample.shape)]
    remote = RemoteControlNets(servers, cn_idx, inp["cn_images"], emb, wl.num_steps, shapes, scales, aggregation)
    return denoise(unet, scheduler, inp, wl.num_steps, wl.guidance_scale, residuals=remote,
                   guidance_start=wl.control_guidance_start, guidance_end=wl.control_guidance_end,
                   channels_last=channels_last)


def _time(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@torch.no_grad()
def _base(ctx: RankContext, wl, seed: int, k: int, scales, aggregation: str, channels_last: bool = False) -> dict:
    set_torch_threads(max(1, wl.torch_threads))
    b = build_bundle(wl, seed)
    servers = list(range(1, k + 1))
    cn_idx = list(range(k))
    local = [b.controlnets[f"cn-{i}"] for i in cn_idx]
    if channels_last:
        to_channels_last(b.unet, *local)
    svc_t, loc_t, diffs = [], [], []
    for r in range(wl.requests + 1):  # request 0 = warm-up (cold ControlNet loads on the servers)
        inp = request_inputs(wl, seed * 1000 + r, k, b)
        order = ("svc", "loc") if r % 2 == 0 else ("loc", "svc")
        res = {}
        for which in order:
            t0 = time.perf_counter()
            if which == "svc":
                res[which] = service_denoise(b.unet, b.scheduler, inp, wl, servers, cn_idx, scales, aggregation,
                                             channels_last)
            else:
                res[which] = denoise(b.unet, b.scheduler, inp, wl.num_steps, wl.guidance_scale, controlnets=local,
                                     scales=scales, aggregation=aggregation, split=False,
                                     guidance_start=wl.control_guidance_start, guidance_end=wl.control_guidance_end,
                                     channels_last=channels_last)
            dt = time.perf_counter() - t0
            if r > 0:
                (svc_t if which == "svc" else loc_t).append(dt)
        diffs.append(float((res["svc"] - res["loc"]).abs().max()))
        scale_ref = float(res["loc"].abs().max())
    # components of the bound at one mid step
    inp = request_inputs(wl, seed, k, b)
    x = _nhwc(torch.cat([inp["noise"]] * 2), channels_last)
    emb = torch.cat([inp["uncond"], inp["cond"]])
    t = new_scheduler(b.scheduler, wl.num_steps).timesteps[wl.num_steps // 2]
    reps = 5
    t_down = _time(lambda: split_unet.down(b.unet, x, t, emb), reps)
    st = split_unet.down(b.unet, x, t, emb)
    imgs = [_nhwc(torch.cat([im] * 2), channels_last) for im in inp["cn_images"]]
    t_cn = _time(lambda: [run_controlnet(cn, x, t, emb, im) for cn, im in zip(local[:1], imgs[:1])], reps)
    outs = [run_controlnet(cn, x, t, emb, im) for cn, im in zip(local, imgs)]
    d, m = aggregate(outs, scales, aggregation)
    t_rest = _time(lambda: split_unet.mid_up(b.unet, st, d, m), reps)
    numel = sum(s.numel() for s in st.skips) + st.sample.numel()
    n_echo = 10
    for r in servers[:1]:
        dist.send(torch.tensor([ECHO, 0, n_echo, numel]), r)
        t0 = time.perf_counter()
        buf = torch.empty(numel)
        for _ in range(n_echo):
            dist.send(x.contiguous(), r)
            dist.recv(buf, r)
        t_comm = (time.perf_counter() - t0) / n_echo
    for r in servers:
        dist.send(torch.tensor([STOP, 0, 0, 0]), r)
    return dict(service_s=svc_t, local_s=loc_t, max_abs_diff=max(diffs), ref_abs_max=scale_ref, t_down_s=t_down,
                t_cn_s=t_cn, t_rest_s=t_rest, t_comm_s=t_comm, steps=wl.num_steps, last_latents=res["svc"],
                nhwc=b.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last))


def _main(ctx: RankContext, wl, seed, k, scales, aggregation, save_dir, cache_size, channels_last=False):
    if ctx.rank == 0:
        return _base(ctx, wl, seed, k, scales, aggregation, channels_last)
    return _server(ctx, wl, save_dir, cache_size, channels_last)


def run_service(wl, seed: int, k: int, scales, aggregation: str = "sum", cache_size: int = 2,
                timeout_s: float = 900.0, channels_last: bool = False) -> dict:
    """Experiment A: returns the base worker's measurements and every server's cache counters."""
    with tempfile.TemporaryDirectory(prefix="mlsys-cn-") as d:
        build_bundle(wl, seed, save_dir=d)  # the servers' model store (same seeds as the base's)
        out = launch(_main, 1 + k, (wl, seed, k, list(scales[:k]), aggregation, d, cache_size, channels_last),
                     label="controlnet service", timeout_s=timeout_s)
    base = out.results[0]
    base["servers"] = out.results[1:]
    n = base["steps"]
    keep = sum(controlnet_keep(i, n, wl.control_guidance_start, wl.control_guidance_end) for i in range(n))
    td, tc, tr, tm = base["t_down_s"], base["t_cn_s"] * k, base["t_rest_s"], base["t_comm_s"]
    # Per-step bound of real experiment A (README.md), ControlNets on k servers at once: T_cn of one.
    base["bound"] = (td + tc + tr) / (max(td, base["t_cn_s"]) + tr + tm) if keep else 1.0
    return base
