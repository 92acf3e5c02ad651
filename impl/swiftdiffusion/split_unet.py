"""The diffusers ``UNet2DConditionModel`` forward split at the ControlNet residual seams (as
the authors' code splits it for its down and up CUDA graphs).

``down`` runs the embedding, ``conv_in`` and the down blocks and returns the hidden state and
the skips; ``mid_up`` adds the ControlNet residuals to the skips and the mid-block output and
runs the up blocks. The two halves are the reference forward's own statements, in its order,
so ``mid_up(down(x), D, M) == unet(x, down_block_additional_residuals=D,
mid_block_additional_residual=M)``; a test holds them equal at 1e-5 (fp32). Katz captures a
CUDA graph per half; the base worker overlaps ``down`` with the remote ControlNets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from impl.common.api import ConfigError


@dataclass
class DownState:
    """What the down half hands to the mid+up half (the split's "static placeholders")."""

    sample: torch.Tensor
    skips: tuple
    emb: torch.Tensor
    encoder_hidden_states: torch.Tensor
    upsample_needed: bool


def _check_supported(unet) -> None:
    c = unet.config
    if c.addition_embed_type == "image_hint":
        raise ConfigError("unet.addition_embed_type: image_hint UNets are not supported by the split forward")


def down(unet, sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor,
         added_cond_kwargs: Optional[dict] = None) -> DownState:
    _check_supported(unet)
    factor = 2 ** unet.num_upsamplers
    upsample_needed = any(d % factor for d in sample.shape[-2:])
    if unet.config.center_input_sample:
        sample = 2 * sample - 1.0
    t_emb = unet.get_time_embed(sample=sample, timestep=timestep)
    emb = unet.time_embedding(t_emb, None)
    class_emb = unet.get_class_embed(sample=sample, class_labels=None)
    if class_emb is not None:
        emb = torch.cat([emb, class_emb], dim=-1) if unet.config.class_embeddings_concat else emb + class_emb
    aug_emb = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states,
                                 added_cond_kwargs=added_cond_kwargs or {})
    emb = emb + aug_emb if aug_emb is not None else emb
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    encoder_hidden_states = unet.process_encoder_hidden_states(encoder_hidden_states=encoder_hidden_states,
                                                               added_cond_kwargs=added_cond_kwargs or {})
    sample = unet.conv_in(sample)
    skips = (sample,)
    for block in unet.down_blocks:
        if getattr(block, "has_cross_attention", False):
            sample, res = block(hidden_states=sample, temb=emb, encoder_hidden_states=encoder_hidden_states)
        else:
            sample, res = block(hidden_states=sample, temb=emb)
        skips += res
    return DownState(sample, skips, emb, encoder_hidden_states, upsample_needed)


def check_residuals(state: DownState, down_res: Optional[Sequence[torch.Tensor]],
                    mid_res: Optional[torch.Tensor]) -> None:
    if (down_res is None) != (mid_res is None):
        raise ConfigError("controlnet residuals: down and mid residuals must be given together")
    if down_res is None:
        return
    if len(down_res) != len(state.skips):
        raise ConfigError(f"controlnet residuals: {len(down_res)} down residuals for {len(state.skips)} UNet skips")
    for i, (r, s) in enumerate(zip(down_res, state.skips)):
        if r.shape != s.shape:
            raise ConfigError(f"controlnet residuals: down residual {i} has shape {tuple(r.shape)}, "
                              f"the UNet skip has {tuple(s.shape)}")


def mid_up(unet, state: DownState, down_res: Optional[Sequence[torch.Tensor]] = None,
           mid_res: Optional[torch.Tensor] = None) -> torch.Tensor:
    check_residuals(state, down_res, mid_res)
    emb, enc = state.emb, state.encoder_hidden_states
    skips = state.skips
    if down_res is not None:
        skips = tuple(s + r for s, r in zip(skips, down_res))
    sample = state.sample
    if unet.mid_block is not None:
        if getattr(unet.mid_block, "has_cross_attention", False):
            sample = unet.mid_block(sample, emb, encoder_hidden_states=enc)
        else:
            sample = unet.mid_block(sample, emb)
    if mid_res is not None:
        sample = sample + mid_res
    for i, block in enumerate(unet.up_blocks):
        last = i == len(unet.up_blocks) - 1
        res = skips[-len(block.resnets):]
        skips = skips[:-len(block.resnets)]
        upsample_size = skips[-1].shape[2:] if (not last and state.upsample_needed) else None
        if getattr(block, "has_cross_attention", False):
            sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res, encoder_hidden_states=enc,
                           upsample_size=upsample_size)
        else:
            sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res, upsample_size=upsample_size)
    if unet.conv_norm_out:
        sample = unet.conv_act(unet.conv_norm_out(sample))
    return unet.conv_out(sample)


def split_forward(unet, sample, timestep, encoder_hidden_states, down_res=None, mid_res=None,
                  added_cond_kwargs=None) -> torch.Tensor:
    return mid_up(unet, down(unet, sample, timestep, encoder_hidden_states, added_cond_kwargs), down_res, mid_res)
