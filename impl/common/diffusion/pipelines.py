"""Stable-Diffusion-shaped components from configs, random weights, no download.

Every component is a real library class (``UNet2DConditionModel``, ``AutoencoderKL``,
``ControlNetModel``, ``CLIPTextModel``, a diffusers scheduler). :func:`build_components` builds
them from a :class:`UNetShape`, saves them with ``save_pretrained`` and reloads them with
``from_pretrained`` so that the objects a system runs are the ones a user would load.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import string
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, List, Optional

import torch

from impl.common.api import ConfigError


@dataclass
class UNetShape:
    """``UNet2DConditionModel`` kwargs that matter for cost and speed (defaults: the tiny UNet of
    FISEdit's real CPU runs)."""

    sample_size: int = 48
    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: List[int] = field(default_factory=lambda: [32, 64, 64])
    layers_per_block: int = 1
    down_block_types: List[str] = field(default_factory=lambda: ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"])
    up_block_types: List[str] = field(default_factory=lambda: ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"])
    cross_attention_dim: int = 32
    # diffusers' name for the number of attention heads: one int, or one per block (SD 2.1:
    # [5, 10, 20, 20], i.e. head dim 64).
    attention_head_dim: Any = 8
    norm_num_groups: int = 8
    use_linear_projection: bool = False

    def kwargs(self) -> dict:
        d = asdict(self)
        for k in ("block_out_channels", "down_block_types", "up_block_types"):
            d[k] = tuple(d[k])
        if isinstance(d["attention_head_dim"], (list, tuple)):
            d["attention_head_dim"] = tuple(int(h) for h in d["attention_head_dim"])
        return d

    def pool_factors(self) -> list[int]:
        """Down-sampling factors of the UNet's resolutions relative to the latent (1, 2, 4, ...)."""
        return [2 ** i for i in range(len(self.block_out_channels))]


# SD 2.1 (768-v) UNet, for the cost model at paper scale (FISEdit's setting, arXiv 2305.17423).
SD21_UNET = UNetShape(sample_size=96, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2,
                      down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                      up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
                      cross_attention_dim=1024, attention_head_dim=64, norm_num_groups=32,
                      use_linear_projection=True)
SD21_ATTENTION_HEAD_DIM = [5, 10, 20, 20]  # SD 2.1 config lists heads per block (head dim 64)


SCHEDULERS = ("dpm_multistep", "ddim", "euler", "pndm")


def build_scheduler(name: str = "dpm_multistep", **overrides):
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler, PNDMScheduler

    classes = {"dpm_multistep": DPMSolverMultistepScheduler, "ddim": DDIMScheduler,
               "euler": EulerDiscreteScheduler, "pndm": PNDMScheduler}
    if name not in classes:
        raise ConfigError(f"workload.scheduler: unknown scheduler {name!r} (one of: {', '.join(SCHEDULERS)})")
    kw = {"steps_offset": 1} if name in ("dpm_multistep", "ddim", "pndm", "euler") else {}
    kw.update(overrides)  # steps_offset=1 as in SD's scheduler configs (silences diffusers' deprecation)
    return classes[name](**kw)


def scheduler_fingerprint(scheduler) -> str:
    """Class + config digest: two runs can share a cache only when this matches."""
    cfg = {k: v for k, v in dict(scheduler.config).items() if not k.startswith("_")}
    raw = type(scheduler).__name__ + json.dumps(cfg, sort_keys=True, default=str)
    return f"{type(scheduler).__name__}:{hashlib.sha1(raw.encode()).hexdigest()[:12]}"


def build_tokenizer(model_max_length: int = 77):
    """A CLIP BPE tokenizer built in memory: byte-level characters, no merges (no files, no download)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    chars = string.ascii_lowercase + string.digits + string.punctuation
    for c in chars:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def build_text_encoder(hidden_size: int, vocab_size: int, seed: int, max_positions: int = 77):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                         num_attention_heads=max(1, hidden_size // 16), vocab_size=vocab_size,
                         max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return CLIPTextModel(cfg).eval()


def build_unet(shape: UNetShape, seed: int, attention_head_dim=None):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    kw = shape.kwargs()
    if attention_head_dim is not None:
        kw["attention_head_dim"] = attention_head_dim
    try:
        return UNet2DConditionModel(**kw).eval()
    except (ValueError, AssertionError) as exc:
        raise ConfigError(f"workload.unet: diffusers rejected the UNet shape ({' '.join(str(exc).split())})") from None


def build_vae(seed: int, latent_channels: int = 4, width: int = 16, blocks: int = 4):
    """A tiny ``AutoencoderKL`` with ``blocks`` blocks: 2**(blocks - 1) down-sampling (SD's 8x at 4)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
                         block_out_channels=(width,) * blocks, layers_per_block=1, norm_num_groups=min(8, width),
                         sample_size=64).eval()


def build_controlnet(unet, seed: int, conditioning_embedding_out_channels=(8, 16, 32, 64)):
    """``ControlNetModel.from_unet`` reseeded. The conditioning embedding down-samples by
    2**(len(channels) - 1): (8, 16, 32, 64) matches the tiny VAE's 8x, so a diffusers
    ControlNet pipeline's pixel-space control image fits."""
    from diffusers import ControlNetModel

    torch.manual_seed(seed)
    cn = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=tuple(conditioning_embedding_out_channels))
    # from_unet copies the UNet's weights and zero-initialises the zero convs (a fresh
    # ControlNet adds nothing): perturb every weight so that residuals are non-zero and
    # ControlNets of different seeds differ, as trained ones do.
    with torch.no_grad():
        for p in cn.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return cn.eval()


@dataclass
class Components:
    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    scheduler: Any
    directory: Optional[pathlib.Path] = None

    def sd_kwargs(self) -> dict:
        return dict(unet=self.unet, vae=self.vae, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
                    scheduler=self.scheduler, safety_checker=None, feature_extractor=None,
                    requires_safety_checker=False)


def build_components(shape: UNetShape, seed: int, scheduler: str = "dpm_multistep", *, save_dir=None,
                     roundtrip: bool = True, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Components:
    """Build SD-shaped components with random weights (seeded), optionally through a save/load round trip."""
    tok = build_tokenizer()
    # On a GPU the weights are drawn there (a CPU init of an SD-sized UNet takes seconds per
    # job) and the save/load round trip, a check of the host-side path, is left to CPU runs.
    on_host = torch.device(device).type == "cpu"
    with contextlib.nullcontext() if on_host else torch.device(device):
        unet = build_unet(shape, seed)
        text = build_text_encoder(shape.cross_attention_dim, len(tok), seed + 1)
        vae = build_vae(seed + 2, latent_channels=shape.in_channels)
    sched = build_scheduler(scheduler)
    comps = Components(unet=unet, vae=vae, text_encoder=text, tokenizer=tok, scheduler=sched)
    if roundtrip and on_host:
        comps = _roundtrip(comps, save_dir)
    for m in (comps.unet, comps.vae, comps.text_encoder):
        m.to(device=device, dtype=dtype)
        m.requires_grad_(False)
    return comps


def _roundtrip(c: Components, save_dir) -> Components:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    tmp = None
    if save_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="mlsys-sd-")
        save_dir = tmp.name
    root = pathlib.Path(save_dir)
    c.unet.save_pretrained(root / "unet")
    c.vae.save_pretrained(root / "vae")
    c.text_encoder.save_pretrained(root / "text_encoder")
    c.tokenizer.save_pretrained(root / "tokenizer")
    c.scheduler.save_pretrained(root / "scheduler")
    out = Components(unet=UNet2DConditionModel.from_pretrained(root / "unet").eval(),
                     vae=AutoencoderKL.from_pretrained(root / "vae").eval(),
                     text_encoder=CLIPTextModel.from_pretrained(root / "text_encoder").eval(),
                     tokenizer=CLIPTokenizer.from_pretrained(root / "tokenizer"),
                     scheduler=type(c.scheduler).from_pretrained(root / "scheduler"),
                     directory=None if tmp else root)
    if tmp is not None:
        tmp.cleanup()
    return out


@torch.no_grad()
def encode_prompts(comps: Components, prompts: list[str]) -> torch.Tensor:
    tok = comps.tokenizer(prompts, padding="max_length", max_length=comps.tokenizer.model_max_length,
                          truncation=True, return_tensors="pt")
    dev = next(comps.text_encoder.parameters()).device
    return comps.text_encoder(tok.input_ids.to(dev))[0]


def sd_pipeline(comps: Components, kind: str = "text2img"):
    """A stock diffusers pipeline over the components: text2img | img2img | inpaint."""
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline, StableDiffusionPipeline

    cls = {"text2img": StableDiffusionPipeline, "img2img": StableDiffusionImg2ImgPipeline,
           "inpaint": StableDiffusionInpaintPipeline}[kind]
    pipe = cls(**comps.sd_kwargs())
    pipe.set_progress_bar_config(disable=True)
    return pipe
