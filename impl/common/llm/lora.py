"""Multi-LoRA adapters: created, saved and loaded with ``peft``; held in host memory as plain
per-site stacks; applied to a batch by a :class:`LoRABatch` with one of the reference kernels.

An adapter's weights for site ``s`` are ``A[s]`` [L, r, d_in] and ``B[s]`` [L, d_out, r] (L =
layers), scale = alpha / r (alpha / sqrt(r) with rsLoRA), exactly what PEFT computes.
"""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from impl.common.api import ConfigError
from impl.common.llm import kernels as K
from impl.common.llm.model import SITES

KERNELS = ("sgmv", "bgmv", "bgmv_punica", "mbgmv")


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float = 0.0  # 0 = 2 * rank
    use_rslora: bool = False

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha or 2 * self.rank)


@dataclass
class HostAdapter:
    """One adapter's weights in host memory (optionally pinned), per site stacked over layers."""

    name: str
    rank: int
    scale: float
    A: dict[str, torch.Tensor]  # site -> [L, r, d_in]
    B: dict[str, torch.Tensor]  # site -> [L, d_out, r]

    @property
    def num_layers(self) -> int:
        return next(iter(self.A.values())).shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.A, self.B) for t in d.values())

    def layer(self, site: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A[site][layer], self.B[site][layer]

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.A.values())).dtype

    def pin(self, device) -> "HostAdapter":
        """Page-lock the host stacks when they are copied to a CUDA ``device`` (the job's
        :class:`~impl.common.execution.Execution` says which): a ``non_blocking`` H2D copy from
        pageable memory is synchronous. On a CPU job nothing changes."""
        if torch.device(device).type == "cuda":
            self.A = {s: t.pin_memory() for s, t in self.A.items()}
            self.B = {s: t.pin_memory() for s, t in self.B.items()}
        return self

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "HostAdapter":
        """The adapter with every stack on ``device`` in ``dtype`` (a resident copy for the
        device path); ``self`` when both already match, so a CPU fp32 job keeps its tensors."""
        dev = torch.device(device) if device is not None else next(iter(self.A.values())).device
        dt = dtype or self.dtype
        if all(t.device == dev and t.dtype == dt for d in (self.A, self.B) for t in d.values()):
            return self
        return HostAdapter(name=self.name, rank=self.rank, scale=self.scale,
                           A={s: t.to(dev, dt) for s, t in self.A.items()},
                           B={s: t.to(dev, dt) for s, t in self.B.items()})


def layer_groups(num_layers: int, groups: int) -> list[range]:
    """Contiguous layer groups in order (the loader's unit of transfer)."""
    if not 1 <= groups <= num_layers:
        raise ConfigError(f"system.load_groups must be in 1..{num_layers} (layers), got {groups}")
    base, extra = divmod(num_layers, groups)
    out, start = [], 0
    for g in range(groups):
        n = base + (1 if g < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def group_of_layer(num_layers: int, groups: int) -> list[int]:
    out = []
    for g, r in enumerate(layer_groups(num_layers, groups)):
        out += [g] * len(r)
    return out


# ---- peft ----------------------------------------------------------------------------------
def make_peft_model(model, specs: Sequence[AdapterSpec], seed: int = 0):
    """Wrap ``model`` in a PeftModel with one LoRA adapter per spec (``init_lora_weights=False``,
    so B is nonzero: a zero-B adapter equals the base model and proves nothing)."""
    from peft import LoraConfig, get_peft_model

    if not specs:
        raise ConfigError("workload.adapters.num_adapters must be >= 1")

    def cfg(spec: AdapterSpec):
        return LoraConfig(r=spec.rank, lora_alpha=spec.lora_alpha, target_modules=list(SITES), lora_dropout=0.0,
                          bias="none", init_lora_weights=False, use_rslora=spec.use_rslora)

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, cfg(specs[0]), adapter_name=specs[0].name)
        for spec in specs[1:]:
            peft_model.add_adapter(spec.name, cfg(spec))
    return peft_model.eval()


def save_adapters(peft_model, directory: pathlib.Path) -> pathlib.Path:
    """PEFT's own format (``save_pretrained``): one sub-folder per named adapter."""
    directory = pathlib.Path(directory)
    peft_model.save_pretrained(str(directory))
    return directory


def load_peft_model(base_model, directory: pathlib.Path, names: Sequence[str]):
    """Load adapters saved by :func:`save_adapters` with PEFT's API."""
    from peft import PeftModel

    directory = pathlib.Path(directory)

    def where(name):  # PEFT writes a non-"default" adapter into a sub-folder named after it
        sub = directory / name
        return str(sub if (sub / "adapter_config.json").exists() else directory)

    pm = PeftModel.from_pretrained(base_model, where(names[0]), adapter_name=names[0])
    for name in names[1:]:
        pm.load_adapter(where(name), adapter_name=name)
    return pm.eval()


def adapters_from_peft(peft_model, names: Optional[Sequence[str]] = None) -> dict[str, HostAdapter]:
    """Copy each adapter's A/B out of the PEFT modules into host stacks (contiguous clones)."""
    from peft.tuners.lora import LoraLayer

    per: dict[str, dict[str, dict[int, tuple]]] = {}
    scales: dict[str, float] = {}
    ranks: dict[str, int] = {}
    for mod_name, mod in peft_model.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        parts = mod_name.split(".")
        site = parts[-1]
        layer = int(parts[parts.index("layers") + 1])
        for name in mod.lora_A.keys():
            if names is not None and name not in names:
                continue
            A = mod.lora_A[name].weight.detach().float().clone()
            B = mod.lora_B[name].weight.detach().float().clone()
            per.setdefault(name, {}).setdefault(site, {})[layer] = (A, B)
            scales[name] = float(mod.scaling[name])
            ranks[name] = int(mod.r[name])
    out = {}
    for name in (names or sorted(per)):
        if name not in per:
            raise ConfigError(f"adapter {name!r} is not in the PEFT model (have: {', '.join(sorted(per))})")
        sites = per[name]
        A = {s: torch.stack([sites[s][l][0] for l in sorted(sites[s])]).contiguous() for s in SITES}
        B = {s: torch.stack([sites[s][l][1] for l in sorted(sites[s])]).contiguous() for s in SITES}
        out[name] = HostAdapter(name=name, rank=ranks[name], scale=scales[name], A=A, B=B)
    return out


def random_adapters(shape, specs: Sequence[AdapterSpec], seed: int = 0, device=None,
                    dtype: torch.dtype = torch.float32) -> dict[str, HostAdapter]:
    """Seeded random adapters straight into the host stacks, without PEFT: the distribution of
    PEFT's ``init_lora_weights=False`` (both matrices keep ``nn.Linear``'s init, uniform within
    +-1/sqrt(fan_in)) and its scale (alpha / r), drawn on ``device`` (fast for a 7B-shaped model)
    and returned on the host in ``dtype``. For models too large for PEFT's copy-save-load round
    trip (:func:`make_peft_model`), which the small configurations keep."""
    from impl.common.llm.model import llama_config

    cfg = llama_config(shape)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d_q, d_kv, d = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.hidden_size
    dims = {"q_proj": (d, d_q), "k_proj": (d, d_kv), "v_proj": (d, d_kv), "o_proj": (d_q, d)}
    L = cfg.num_hidden_layers
    gen = torch.Generator(device=device or "cpu")
    gen.manual_seed(seed)

    def uniform(shape_, fan_in):
        t = torch.empty(shape_, device=device or "cpu")
        return t.uniform_(-1.0, 1.0, generator=gen).mul_(fan_in ** -0.5).to("cpu", dtype)

    out = {}
    for spec in specs:
        r = spec.rank
        out[spec.name] = HostAdapter(
            name=spec.name, rank=r, scale=scale_of(spec),
            A={s: uniform((L, r, dims[s][0]), dims[s][0]) for s in SITES},
            B={s: uniform((L, dims[s][1], r), r) for s in SITES})
    return out


# ---- batch application ---------------------------------------------------------------------
@dataclass
class LoRABatch:
    """Which adapter each token row uses, and how the delta is computed.

    ``row_adapter``: [T] int slot index into ``adapters`` (-1 = no LoRA).
    ``segments``: (slot, n_rows) per request, in row order (prefill/SGMV view of the same rows).
    ``kernel``: sgmv | bgmv | bgmv_punica | mbgmv.
    ``cpu_layers``: slot -> set of layers whose delta comes from the CPU path (CaraServe).
    ``cpu_fn(layer, group_sites, x_rows, slot) -> list[delta]``: the CPU path (None = not used).
    ``device_check(slot, layer)``: raises if the slot's layer is not resident (no use before load).
    """

    adapters: list[HostAdapter]
    row_adapter: torch.Tensor
    segments: list[tuple[int, int]]
    kernel: str = "sgmv"
    cpu_layers: dict[int, set] = field(default_factory=dict)
    cpu_submit: Optional[Callable] = None
    device_check: Optional[Callable] = None
    device_weights: Optional[Callable] = None  # (slot, site, layer) -> (A, B) on the device

    def _w(self, slot: int, site: str, layer: int):
        if self.device_weights is not None:
            return self.device_weights(slot, site, layer)
        return self.adapters[slot].layer(site, layer)

    def apply(self, layer: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the device-path deltas of ``site`` at ``layer`` into ``y`` (rows on the CPU path skipped)."""
        idx = self.row_adapter
        if self.cpu_layers:
            idx = idx.clone()
            for a, layers in self.cpu_layers.items():
                if layer in layers:
                    idx[idx == a] = -1
        used = sorted(a for a in set(idx.tolist()) if a >= 0)
        if not used:
            return y
        if self.device_check is not None:
            for a in used:
                self.device_check(a, layer)
        ws = {a: self._w(a, site, layer) for a in used}
        for a in used:
            w = ws[a][0]
            if w.device != x.device or w.dtype != x.dtype:
                raise RuntimeError(f"LoRA device path: adapter {self.adapters[a].name!r} {site} layer {layer} is "
                                   f"{w.dtype} on {w.device}, the activations {x.dtype} on {x.device} (give the "
                                   f"batch resident copies, HostAdapter.to, or device_weights)")
        n = len(self.adapters)
        scales = [self.adapters[a].scale for a in range(n)]
        if self.kernel == "sgmv":
            As = [ws[a][0] if a in ws else None for a in range(n)]
            Bs = [ws[a][1] if a in ws else None for a in range(n)]
            seg_idx = [a if a in ws else -1 for a, _ in self.segments]
            return K.sgmv(y, x, As, Bs, scales, seg_idx, [ln for _, ln in self.segments])
        if self.kernel == "mbgmv":
            As = [ws[a][0] if a in ws else None for a in range(n)]
            Bs = [ws[a][1] if a in ws else None for a in range(n)]
            return K.mbgmv(y, x, As, Bs, scales, idx)
        # bgmv: one stack padded to the batch's max rank; remap slots to stack positions.
        # The row index and scales live where x does (a CUDA batch must not meet host tensors).
        pos = {a: i for i, a in enumerate(used)}
        A, B = K.stack_padded([ws[a][0] for a in used], [ws[a][1] for a in used])
        sidx = torch.tensor([pos.get(int(a), -1) for a in idx.tolist()], dtype=torch.long, device=x.device)
        s = torch.tensor([self.adapters[a].scale for a in used], dtype=x.dtype, device=x.device)
        return K.bgmv(y, x, A, B, sidx, s)


def merge_adapter(model, adapter: HostAdapter) -> dict:
    """W += s * B @ A on q/k/v/o of every layer. Returns the saved weights (restore = copy back)."""
    saved = {}
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            for site in SITES:
                lin = getattr(layer.self_attn, site)
                saved[(l, site)] = lin.weight.detach().clone()
                A, B = (t.to(lin.weight.device, lin.weight.dtype) for t in adapter.layer(site, l))
                lin.weight.add_((B @ A) * adapter.scale)
    return saved


def unmerge_adapter(model, saved: dict) -> None:
    """Restore the saved weights exactly: copy back, never subtract."""
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            for site in SITES:
                lin = getattr(layer.self_attn, site)
                lin.weight.copy_(saved[(l, site)])


def rank_bytes_paper(d_model: int, num_layers: int, rank: int, sites: int = 4, bytes_per_el: int = 2,
                     d_kv: Optional[int] = None) -> int:
    """Adapter bytes at paper scale: layers * sites * 2 * d * r * 2 B (impl/caraserve/README.md)."""
    return num_layers * sites * 2 * d_model * rank * bytes_per_el


def scale_of(spec: AdapterSpec) -> float:
    return spec.lora_alpha / (math.sqrt(spec.rank) if spec.use_rslora else spec.rank)
