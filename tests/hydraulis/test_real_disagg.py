"""Hydraulis' optimization–propagation disaggregation on 2 gloo ranks (README "Real mode"): gradients
of heterogeneous replicas (checkpointed A + plain B, a TP2 replica, A + idle) returned to the
ZeRO-1 optimizer layout equal the single-process gradient of the same batch; the master shards
survive the optimizer -> compute -> optimizer round trip bitwise under every strategy and stay
on the single-process trajectory across strategy switches; an idle replica is named in the
reduction, never summed as zeros; a micro-batch above its kind's cap is a one-line error."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from impl.common.models.varlen_gpt import VarlenGPT, micro_batch_tensors
from impl.common.parallel.tensor_parallel import join_state_dicts
from impl.common.runtime.launch import launch
from impl.common.varlen.packing import MicroBatch
from impl.common.workloads.pipeline import ModelShape
from impl.hydraulis.disagg import OptimizerLayout, Strategy, compute_copy, reduce_pieces, to_optimizer_layout
from impl.hydraulis.real.config import ReplicaKind
from impl.hydraulis.real.replica import CapExceeded, ReplicaModel, check_cap

SHAPE = ModelShape(name="hyd-test", num_layers=2, hidden=32, heads=4, ffn_hidden=48, vocab=64, seq_len=128)
SEED = 5
LR = 1e-2
A, B = ReplicaKind("A", True, 128, 1), ReplicaKind("B", False, 64, 1)
T = ReplicaKind("T", False, 128, 2)
LENGTHS = [100, 37, 60, 9, 23, 51, 4, 64]  # 348 tokens
IDS = list(range(len(LENGTHS)))


def _mb(idx):
    return MicroBatch(tuple(IDS[i] for i in idx), tuple(LENGTHS[i] for i in idx), sum(LENGTHS[i] for i in idx))


# (strategy, kinds, micro-batches per replica): heterogeneous, TP2, one idle replica, homogeneous
STEPS = [
    (Strategy((1, 1)), (A, B), [[[0], [2, 4]], [[1, 6, 3], [5], [7]]]),
    (Strategy((2,)), (T,), [[[0, 6], [2, 1, 4], [5, 7, 3]]]),
    (Strategy((1, 1)), (A, B), [[[0, 3], [1, 5], [2, 4, 6], [7]], []]),
    (Strategy((1, 1)), (A, A), [[[0, 3], [4, 6]], [[1, 2], [5, 7]]]),
]


def _full():
    return {n: p.detach().clone() for n, p in VarlenGPT(SHAPE, SEED).named_parameters()}


def _gather_dict(d):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, d)
    return out


def _rank(ctx):
    torch.set_num_threads(1)
    rank = ctx.rank
    layout = OptimizerLayout(_full(), rank, 2, LR)
    models = {}
    rows = []
    for strategy, kinds, plan in STEPS:
        before = layout.state()
        full = layout.gather()
        r, t = strategy.place(rank)
        kind = kinds[r]
        key = (kind.name, kind.tp)
        if key not in models:
            models[key] = ReplicaModel(SHAPE, SEED, kind, t)
        m = models[key]
        m.load(compute_copy(full, strategy, rank))
        back = to_optimizer_layout(m.weights(), strategy, rank, layout.shapes)
        round_trip = all(torch.equal(back[n], before[n]) for n in before)
        mbs = [_mb(i) for i in plan[r]]
        active = [bool(p) for p in plan]
        if mbs:
            run = m.run(mbs, sum(LENGTHS), f"replica {r}")
            grads, loss = m.grads(), run.loss
        else:
            grads, loss = None, 0.0
        log = layout.reduce(grads, strategy, active)
        shard_grads = {n: p.grad.clone() for n, p in layout.params.items()}
        layout.step()
        rows.append({"before": before, "grads": shard_grads, "after": layout.state(), "round_trip": round_trip,
                     "excluded": log.excluded, "sent": log.sent_bytes, "loss": loss if t == 0 else 0.0})
    return rows


def _rel(got, ref):
    return max(float((got[n] - ref[n]).abs().max()) / max(float(ref[n].abs().max()), 1e-30) for n in ref)


@pytest.fixture(scope="module")
def runs():
    return launch(_rank, 2, label="hydraulis disagg test", timeout_s=240).results


@pytest.mark.real
def test_gradients_of_heterogeneous_replicas_equal_the_single_process_gradient(runs):
    ref = VarlenGPT(SHAPE, SEED)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    mb = _mb(range(len(LENGTHS)))
    for k in range(len(STEPS)):
        before = join_state_dicts([runs[0][k]["before"], runs[1][k]["before"]])
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(before[n])
        opt.zero_grad(set_to_none=True)
        out = ref(*micro_batch_tensors(mb, SHAPE.vocab, SEED), global_tokens=sum(LENGTHS))
        out.backward()
        loss = float(out.detach())
        want = {n: p.grad for n, p in ref.named_parameters()}
        got = join_state_dicts([runs[0][k]["grads"], runs[1][k]["grads"]])
        assert _rel(got, want) < 1e-5, f"step {k} ({STEPS[k][0]})"
        # the loss is normalised by the step's global token count: the replicas' parts add up
        assert abs(sum(r[k]["loss"] for r in runs) - loss) / loss < 1e-5
        # one Adam step in the optimizer layout on those gradients = the full-model Adam step
        for n, p in ref.named_parameters():
            p.grad = got[n].clone()
        opt.step()
        after = join_state_dicts([runs[0][k]["after"], runs[1][k]["after"]])
        assert _rel(after, {n: p.detach() for n, p in ref.named_parameters()}) == 0.0, f"step {k}"


@pytest.mark.real
def test_optimizer_layout_params_survive_every_strategy_switch_bitwise(runs):
    for k in range(len(STEPS)):
        assert runs[0][k]["round_trip"] and runs[1][k]["round_trip"], f"step {k}"
        if k:  # nothing but the optimizer step moves the master shards between steps
            for r in runs:
                assert all(torch.equal(r[k]["before"][n], r[k - 1]["after"][n]) for n in r[k]["before"])
    assert _rel(join_state_dicts([runs[0][0]["before"], runs[1][0]["before"]]), _full()) == 0.0


@pytest.mark.real
def test_an_idle_replica_is_excluded_from_the_reduction_and_tp2_moves_no_gradient(runs):
    assert [r[2]["excluded"] for r in runs] == [[1], [1]]
    # rank 1 idle sends nothing; rank 0 sends rank 1's half, as in an all-active step
    assert runs[1][2]["sent"] == 0 and runs[0][2]["sent"] == runs[0][0]["sent"] > 0
    assert runs[0][1]["sent"] == 0 and runs[1][1]["sent"] == 0  # TP2: every rank already holds its shard
    assert all(r[0]["excluded"] == [] and r[0]["sent"] > 0 for r in runs)


def test_reduce_pieces_is_a_reduce_scatter_for_dp_and_local_for_tp():
    half, one = Fraction(1, 2), Fraction(1)
    assert reduce_pieces(Strategy((1, 1)), [True, True]) == {(0, 0): (0, half), (0, 1): (half, one),
                                                               (1, 0): (0, half), (1, 1): (half, one)}
    assert reduce_pieces(Strategy((2,)), [True]) == {(0, 0): (0, half), (1, 1): (half, one)}
    assert reduce_pieces(Strategy((1, 1)), [True, False]) == {(0, 0): (0, half), (0, 1): (half, one)}


def test_a_micro_batch_above_its_kind_cap_is_a_one_line_error_not_clipped():
    check_cap(B, [_mb([2, 6])], "replica 1")  # 64 tokens == cap: fine
    with pytest.raises(CapExceeded) as e:
        check_cap(B, [_mb([2, 6]), _mb([0])], "replica 1")
    assert str(e.value) == ("replica 1: micro-batch 1 holds 100 tokens > replica kind 'B' cap 64 "
                            "(a memory limit: never clipped)")
