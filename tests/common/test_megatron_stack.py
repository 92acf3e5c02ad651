"""The kernel stack as data (impl/common/megatron/stack.py): read from Megatron's printed
arguments, carried by the model, named by a workload, and what it changes in the step model."""
from __future__ import annotations

import pathlib

import pytest

from impl.common.api import ConfigError
from impl.common.megatron import activations as act
from impl.common.megatron import step
from impl.common.megatron.model import MegatronLayout, MegatronModel, padded_vocab
from impl.common.megatron.runs import load_runs
from impl.common.megatron.stack import (MEGATRON_GPT_FORK, MEGATRON_LLAMA_FORK, MEGATRON_LLAMA_FUSED, AttentionImpl,
                                        GradDtype, KernelStack, stack_from_args)
from impl.common.workloads.pipeline import ModelShape

RUNS = pathlib.Path(__file__).resolve().parents[2] / "impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz"
LLAMA_ARGS = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
              "untie_embeddings_and_output_weights": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
              "use_flash_attn": True, "use_distributed_optimizer": True, "bf16": True, "transformer_impl": "local",
              "make_vocab_size_divisible_by": 128}
LLAMA_7B = dict(arch="llama", num_layers=32, hidden=4096, ffn_hidden=11008, heads=32, vocab=32000)


def test_the_february_gpt_launches_ran_the_gpt_fork_stack():
    launches = [la for la in load_runs(RUNS) if la.model is not None]
    assert launches and {la.model.stack.name for la in launches} == {"megatron_gpt_fork"}
    assert all(la.layout.distributed_optimizer for la in launches)


def test_printed_llama_arguments_are_the_llama_fork_and_te_is_fused():
    assert stack_from_args(LLAMA_ARGS) is MEGATRON_LLAMA_FORK
    assert stack_from_args({**LLAMA_ARGS, "transformer_impl": "transformer_engine"}) is MEGATRON_LLAMA_FUSED
    # The deprecated rotary flag means rope too (arguments.py turns it into position_embedding_type).
    old = {k: v for k, v in LLAMA_ARGS.items() if k != "position_embedding_type"}
    assert stack_from_args({**old, "use_rotary_position_embeddings": True}) is MEGATRON_LLAMA_FORK


def test_absent_arguments_take_the_forks_defaults():
    s = stack_from_args({})
    assert (s.norm, s.hidden_dropout, s.untie_embeddings, s.vocab_divisible_by) == ("layernorm", 0.1, False, 128)
    assert s.attention == AttentionImpl.UNFUSED and not s.distributed_optimizer and s.grad_accum_dtype == GradDtype.BF16
    m = MegatronModel(arch="gpt", stack=s)
    with pytest.raises(ConfigError, match="stack.attention"):
        act.layer_bytes(m, 1)


def test_bad_stack_input_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"^stack\.norm:"):
        KernelStack(norm="batchnorm")
    with pytest.raises(ConfigError, match=r"^model\.stack:"):
        MegatronModel(arch="gpt", stack=MEGATRON_LLAMA_FORK)
    shape = ModelShape(num_layers=2, hidden=64, heads=4, ffn_hidden=176, vocab=256, seq_len=64)
    with pytest.raises(ConfigError, match=r"^megatron_stack: unknown stack 'nope'"):
        MegatronModel.from_shape(shape, stack="nope")
    assert MegatronModel.from_shape(shape, stack="megatron_llama_fused").stack is MEGATRON_LLAMA_FUSED
    assert MegatronModel.from_shape(shape).stack is MEGATRON_LLAMA_FORK
    named = ModelShape(num_layers=2, hidden=64, heads=4, ffn_hidden=176, vocab=256, seq_len=64,
                       megatron_stack="megatron_llama_fused")
    assert MegatronModel.from_shape(named).stack is MEGATRON_LLAMA_FUSED
    assert MegatronModel.from_shape(named, stack="megatron_llama_fork").stack is MEGATRON_LLAMA_FORK
    with pytest.raises(ConfigError, match=r"^model\.megatron_stack: unknown stack 'x'"):
        MegatronModel.from_shape(ModelShape(megatron_stack="x"))
    assert MegatronModel.from_shape(ModelShape()).stack is MEGATRON_GPT_FORK


def test_untied_output_layer_sits_on_the_last_stage():
    m = MegatronModel(**LLAMA_7B)
    v, h = padded_vocab(32000, 2), 4096
    first, *_, last = m.params_per_rank(2, 4)
    layers = 8 * m.layer_params_per_tp_rank(2)
    assert first == layers + v // 2 * h and last == layers + h + v // 2 * h
    assert sum(m.params_per_rank(1, 1)) == 32 * m.layer_params_per_tp_rank(1) + 2 * v * h + h


def test_bf16_gradient_accumulation_holds_two_bytes_less_per_parameter():
    lay = MegatronLayout(dp=1, tp=2, pp=2, mbs=1, gbs=8, context=2048)
    fp32 = MegatronModel(**LLAMA_7B)
    bf16 = MegatronModel(**LLAMA_7B, stack=MEGATRON_LLAMA_FORK.with_(grad_accum_dtype="bf16"))
    from impl.common.hardware import load_hardware

    hw = load_hardware("h100-megatron")
    a, b = step.price(fp32, lay, hw), step.price(bf16, lay, hw)
    saved = [x - y for x, y in zip(a.peak_allocated_bytes, b.peak_allocated_bytes)]
    assert saved == pytest.approx([2.0 * p for p in fp32.params_per_rank(2, 2)], rel=1e-9)
    assert a.iteration_s == pytest.approx(b.iteration_s)
