"""The hybrid planner's memory rows (impl.common.parallel.cost.memory_model) are the step model's
memory terms: at the nominal layout every stage's row equals the step model's peak with one
micro-batch per 1F1B in-flight slot (impl.common.megatron.step.linear_memory), the end stages'
embedding, output layer and (pp > 1) the tied embedding's copy on the last stage included."""
from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from impl.common.hardware import load_hardware
from impl.common.megatron.derive import step_knobs
from impl.common.megatron.model import MegatronLayout, MegatronModel
from impl.common.megatron.step import linear_memory
from impl.common.parallel.cost import MB, memory_model
from impl.common.workloads.hybrid import HybridWorkload


def _wl(gpt: bool, pp: int):
    raw = OmegaConf.load("conf/workload/hybrid_32b_dp4tp2pp4.yaml")
    wl = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HybridWorkload), raw))
    # ffn_hidden 0: GPT, tied, on its own stack (the workload names the fused LLaMA one)
    model = dataclasses.replace(wl.model, ffn_hidden=0, megatron_stack="") if gpt else wl.model
    mem = dataclasses.replace(wl.memory, inflight_cap=0, headroom_mb=None)
    return dataclasses.replace(wl, model=model, pp=pp, dp=wl.num_gpus // (wl.tp * pp), memory=mem)


@pytest.mark.parametrize("gpt", [True, False])
@pytest.mark.parametrize("pp", [1, 4])
def test_rows_are_the_step_models_memory(gpt, pp):
    hw = load_hardware("a800-80g")
    wl = _wl(gpt, pp)
    rows = memory_model(wl, hw)
    m = MegatronModel.from_shape(wl.model)
    assert m.tied == gpt
    lay = MegatronLayout(dp=wl.dp, tp=wl.tp, pp=pp, mbs=1, gbs=wl.dp, context=wl.model.seq_len,
                         distributed_optimizer=True)
    tokens = wl.micro_batch_size * wl.model.seq_len
    step = [fixed + per * tokens for fixed, per in linear_memory(m, lay, step_knobs(hw))]
    L = wl.model.num_layers // pp
    for s in {0, pp - 1}:
        mine = rows.stage_mb(pp, s, L, 1.0) * MB
        if pp == 1 or (s == pp - 1 and gpt):
            assert mine == pytest.approx(step[s], rel=1e-9), s
        else:  # E is the larger end: the other end's row is an upper bound of its step memory
            assert mine >= step[s] * (1 - 1e-9), s
