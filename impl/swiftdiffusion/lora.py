"""LoRA files and the direct in-place merge of Katz (the authors' code), without PEFT module injection.

A LoRA file is what diffusers writes (``save_lora_weights``: ``unet.<module>.lora_A.weight`` /
``lora_B.weight`` plus the PEFT config as ``lora_adapter_metadata``), so the Diffusers baseline
loads the very same file with ``load_lora_weights``. :class:`TargetTable` maps every LoRA key
to the UNet weight it patches, built once per base model and checked against each file (a
target missing in the UNet, an A/B rank mismatch, a shape mismatch: one line naming the key).
:func:`merge` adds ``(alpha/r)·B@A`` to the weights in place; :func:`restore` copies the kept
pristine weights back (never subtracts: repeated fuse/unfuse drifts).
"""
from __future__ import annotations

import copy
import json
import pathlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from impl.common.api import ConfigError

TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
WEIGHT_NAME = "pytorch_lora_weights.safetensors"
PREFIX = "unet."


def lora_file(directory) -> pathlib.Path:
    return pathlib.Path(directory) / WEIGHT_NAME


def make_lora(unet, rank: int, seed: int, directory, alpha: Optional[float] = None,
              target_modules: Sequence[str] = TARGET_MODULES, dtype: torch.dtype = torch.float32) -> pathlib.Path:
    """A random LoRA made by PEFT on a copy of ``unet`` and saved the diffusers way, its tensors
    stored as ``dtype`` (fp16: as SD LoRAs ship, and as Katz' loader buffers hold them)."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    if rank < 1:
        raise ConfigError(f"workload.lora_ranks: a LoRA rank must be >= 1, got {rank}")
    torch.manual_seed(seed)
    u = copy.deepcopy(unet)
    cfg = LoraConfig(r=rank, lora_alpha=float(alpha if alpha is not None else rank), target_modules=list(target_modules),
                     init_lora_weights=False)
    u.add_adapter(cfg)
    sd = {k: v.to(device="cpu", dtype=dtype) for k, v in get_peft_model_state_dict(u).items()}
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(directory, unet_lora_layers=sd, unet_lora_adapter_metadata=cfg.to_dict(),
                                              weight_name=WEIGHT_NAME)
    return lora_file(directory)


def read_alpha_rank(path) -> tuple[float, int]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    raw = meta.get("lora_adapter_metadata")
    if raw is None:
        raise ConfigError(f"lora file {path}: no lora_adapter_metadata (alpha and r unknown)")
    m = json.loads(raw)
    return float(m[PREFIX + "lora_alpha"]), int(m[PREFIX + "r"])


@dataclass
class Site:
    module: str  # UNet module name, e.g. down_blocks.1.attentions.0....attn1.to_q
    weight: torch.Tensor  # the live weight (patched in place)
    pristine: torch.Tensor  # copy of the base weight, on the weight's device
    a_key: str
    b_key: str


@dataclass
class TargetTable:
    """LoRA key -> UNet weight, precomputed once for a base model (Katz' target-key table)."""

    sites: dict[str, Site] = field(default_factory=dict)

    @classmethod
    def build(cls, unet, target_modules: Sequence[str] = TARGET_MODULES) -> "TargetTable":
        t = cls()
        for name, mod in unet.named_modules():
            if isinstance(mod, torch.nn.Linear) and any(name.endswith("." + s) or name == s for s in target_modules):
                w = mod.weight.data
                pristine = w.detach().clone()  # where the weight lives (restore is a local copy)
                t.sites[name] = Site(name, w, pristine, f"{PREFIX}{name}.lora_A.weight", f"{PREFIX}{name}.lora_B.weight")
        return t

    def check(self, state: dict[str, torch.Tensor], rank: int, what: str) -> list[str]:
        """The sites ``state`` patches; one-line errors for keys, ranks and shapes."""
        mods = set()
        for k, v in state.items():
            if not k.startswith(PREFIX) or not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight")):
                raise ConfigError(f"{what}: key {k!r} is not a UNet LoRA weight (unet.<module>.lora_A/B.weight)")
            mod = k[len(PREFIX):].rsplit(".lora_", 1)[0]
            if mod not in self.sites:
                raise ConfigError(f"{what}: target {mod!r} does not exist in the UNet (or is not a LoRA target)")
            mods.add(mod)
        out = []
        for mod in sorted(mods):
            s = self.sites[mod]
            if s.a_key not in state or s.b_key not in state:
                raise ConfigError(f"{what}: target {mod!r} lacks lora_A or lora_B")
            A, B = state[s.a_key], state[s.b_key]
            if A.shape[0] != rank or B.shape[1] != rank:
                raise ConfigError(f"{what}: rank mismatch at {mod!r}: lora_A has {A.shape[0]} rows, lora_B "
                                  f"{B.shape[1]} columns, the file's r is {rank}")
            if (B.shape[0], A.shape[1]) != tuple(s.weight.shape):
                raise ConfigError(f"{what}: shape mismatch at {mod!r}: B@A is {B.shape[0]}x{A.shape[1]}, "
                                  f"the weight is {tuple(s.weight.shape)[0]}x{tuple(s.weight.shape)[1]}")
            out.append(mod)
        return out


@dataclass
class LoadedLoRA:
    """A LoRA's tensors (e.g. in preallocated shared memory) with its own scale alpha/r."""

    name: str
    state: dict[str, torch.Tensor]
    scale: float
    sites: list[str]


def load_direct(path, table: TargetTable, name: str, dtype=torch.float16, scale_override: Optional[float] = None,
                data: Optional[bytes] = None) -> LoadedLoRA:
    """Read a LoRA file (or its bytes) into plain tensors and check it against the table."""
    from safetensors.torch import load as st_load, load_file

    state = st_load(data) if data is not None else load_file(str(path))
    alpha, r = read_alpha_rank(path)
    sites = table.check(state, r, f"lora {name}")
    state = {k: v.to(dtype) for k, v in state.items()}
    return LoadedLoRA(name, state, scale_override if scale_override is not None else alpha / r, sites)


@torch.no_grad()
def merge(table: TargetTable, loras: Sequence[LoadedLoRA]) -> set[str]:
    """W += s_j · B_j @ A_j for every LoRA j, in place; returns the sites touched."""
    touched = set()
    for lo in loras:
        for mod in lo.sites:
            s = table.sites[mod]
            # the loaders' buffers are host memory: to the weight's device and dtype
            A = lo.state[s.a_key].to(device=s.weight.device, dtype=s.weight.dtype)
            B = lo.state[s.b_key].to(device=s.weight.device, dtype=s.weight.dtype)
            s.weight.add_(B @ A, alpha=lo.scale)
            touched.add(mod)
    return touched


@torch.no_grad()
def restore(table: TargetTable, touched) -> None:
    """Copy the pristine weights back (bit-identical; never W -= s·BA)."""
    for mod in touched:
        s = table.sites[mod]
        s.weight.copy_(s.pristine)


def check_pristine(table: TargetTable) -> bool:
    return all(torch.equal(s.weight, s.pristine) for s in table.sites.values())
