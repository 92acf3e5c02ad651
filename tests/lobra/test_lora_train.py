"""Multi-task LoRA training path (the authors' row-split LoRA, Hetu `python/hetu/peft/lora`): fused row-split == peft set_adapter, adapter
independence, frozen base, per-task global-token normalisation, checkpointing."""
import pytest
import torch

from impl.common.api import ConfigError
from impl.common.llm.lora_train import MultiTaskLoRA, Sample, task_token_counts
from impl.common.workloads.pipeline import ModelShape

SHAPE = ModelShape(name="t", num_layers=2, hidden=32, heads=4, ffn_hidden=48, vocab=300, seq_len=128)
TASKS = ["T1", "T2", "T3"]
SAMPLES = [Sample("T1", 0, 20), Sample("T2", 0, 33), Sample("T1", 1, 7), Sample("T3", 0, 40), Sample("T2", 1, 12)]


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def model():
    return MultiTaskLoRA(SHAPE, TASKS, init_b_zero=False, seed=0, lr=1e-2)


def run(m, batches, G, mode="fused"):
    m.zero_grad()
    losses = {}
    for pad, mb in batches:
        for t, v in m.micro_batch(mb, pad, G, mode).items():
            losses[t] = losses.get(t, 0.0) + v
    return losses, m.adapter_grads()


def test_fused_equals_single_task_set_adapter(model):
    G = task_token_counts(SAMPLES)
    lf, gf = run(model, [(48, SAMPLES)], G, "fused")
    per_task = [(max(s.length for s in SAMPLES if s.task == t), [s for s in SAMPLES if s.task == t]) for t in TASKS]
    ls, gs = run(model, per_task, G, "single")
    for t in TASKS:
        assert lf[t] == pytest.approx(ls[t], rel=1e-5)
        assert rel(gf[t], gs[t]) < 1e-5
        assert gf[t].abs().max() > 0


def test_adapter_independence_add_remove_other_tasks(model):
    G = task_token_counts(SAMPLES)
    _, with_others = run(model, [(48, SAMPLES)], G)
    alone = [s for s in SAMPLES if s.task == "T1"]
    _, only = run(model, [(48, alone)], G)
    assert rel(only["T1"], with_others["T1"]) < 1e-6
    # adapters without rows in the micro-batch get exactly zero gradient
    assert not model.has_grad("T2") and not model.has_grad("T3")
    assert torch.count_nonzero(only["T2"]) == 0 and torch.count_nonzero(only["T3"]) == 0


def test_loss_normalised_by_global_task_tokens_independent_of_dispatch(model):
    G = task_token_counts(SAMPLES)
    l1, g1 = run(model, [(48, SAMPLES)], G)
    # another dispatch: three micro-batches with other padding (two "replicas" summed)
    l2, g2 = run(model, [(33, SAMPLES[:2]), (40, SAMPLES[2:4]), (16, SAMPLES[4:])], G)
    for t in TASKS:
        assert l1[t] == pytest.approx(l2[t], rel=1e-5)
        assert rel(g1[t], g2[t]) < 1e-5
    # the reported per-task loss is that task's mean token CE
    assert all(3.0 < l1[t] < 8.0 for t in TASKS)


def test_base_frozen_bit_identical_after_steps(model):
    before = model.base_state()
    G = task_token_counts(SAMPLES)
    a0 = model.adapter_state()
    for _ in range(2):
        run(model, [(48, SAMPLES)], G)
        model.step()
    assert all(not p.requires_grad and p.grad is None for p in model.base_params.values())
    assert all(torch.equal(before[n], p) for n, p in model.base_params.items())
    a1 = model.adapter_state()
    assert all(not torch.equal(a0[t], a1[t]) for t in TASKS)


def test_checkpointing_same_grads():
    G = task_token_counts(SAMPLES)
    plain = MultiTaskLoRA(SHAPE, TASKS, init_b_zero=False, seed=3)
    ckpt = MultiTaskLoRA(SHAPE, TASKS, init_b_zero=False, seed=3, checkpoint=True)
    _, g1 = run(plain, [(48, SAMPLES)], G)
    _, g2 = run(ckpt, [(48, SAMPLES)], G)
    for t in TASKS:
        assert rel(g2[t], g1[t]) < 1e-5


def test_bad_inputs_one_line(model):
    with pytest.raises(ConfigError, match="single-task mode got tasks"):
        model.micro_batch(SAMPLES, 48, task_token_counts(SAMPLES), "single")
    with pytest.raises(ConfigError, match="pad_len 16"):
        model.micro_batch(SAMPLES, 16, task_token_counts(SAMPLES))
    with pytest.raises(ConfigError, match="workload.tasks: a multi-task LoRA job needs >= 1 task"):
        MultiTaskLoRA(SHAPE, [])
