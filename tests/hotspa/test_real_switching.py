"""HotSPa's switches and engine on 2 gloo ranks: plans cover every (needer, slice) once from an
owner; parameters survive a TP->DP->TP round trip bitwise; gradients accumulated across
strategies equal the single-process step; Adam runs once per step in the home layout; an empty
group does nothing; every sequence lands in one group, micro-batch and DP rank."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from impl.common.models.varlen_gpt import VarlenGPT
from impl.common.parallel.tensor_parallel import compute_shards, cut_state_dict
from impl.common.runtime.launch import launch
from impl.common.varlen.lengths import LengthDist
from impl.common.varlen.packing import check_packing
from impl.common.varlen.sampling import LengthStream
from impl.common.workloads.pipeline import ModelShape
from impl.hotspa.rank_trainer import RankTrainer, plan_step, schedule_order
from impl.hotspa.real import HotSPaRealJob, run_job, summarise
from impl.hotspa.strategy import GroupPlan, Strategy
from impl.hotspa.switching import HOME, Layouts, Piece, SwitchCache, check_switch, plan_switch

SHAPE = ModelShape(name="sw-test", num_layers=2, hidden=32, heads=4, ffn_hidden=48, vocab=64, seq_len=256)
SEED = 7
TP, DP = Strategy(1, 2, 1), Strategy(2, 1, 1)
LAYOUTS = Layouts(2, 2, SHAPE.num_layers)
SHAPES = {n: tuple(p.shape) for n, p in VarlenGPT(SHAPE, SEED).named_parameters()}
HOTSPA = GroupPlan((256, 128, 0), (TP, DP))
STATIC = GroupPlan((256, 0), (TP,))


@pytest.mark.parametrize("src,dst", list(itertools.permutations([HOME, "dp2tp1", "dp1tp2"], 2)))
def test_switch_plan_covers_every_needer_slice_once_from_an_owner(src, dst):
    sw = plan_switch(LAYOUTS, src, dst, SHAPES)
    assert check_switch(LAYOUTS, sw, SHAPES) == []


def test_gradient_reduce_sends_every_dp_partial_of_a_home_slice_to_its_owner_once():
    red = plan_switch(LAYOUTS, HOME, "dp2tp1", SHAPES).reversed()  # DP partials -> home owners, added
    for owner in range(2):
        for n in SHAPES:
            contrib = [(p.lo, p.hi, owner) for p in red.local.get(owner, []) if p.name == n]
            contrib += [(p.lo, p.hi, a) for (a, b), ps in red.pairs.items() if b == owner for p in ps if p.name == n]
            frac = (contrib[0][0], contrib[0][1])
            assert sorted(c[2] for c in contrib) == [0, 1] and all((c[0], c[1]) == frac for c in contrib), n
            assert frac == (owner / 2, (owner + 1) / 2)


def test_switch_checker_catches_a_missing_a_duplicated_and_a_wrong_sender_piece():
    sw = plan_switch(LAYOUTS, HOME, "dp2tp1", SHAPES)  # the all-gather: 1 -> 0 and 0 -> 1
    (pair, pieces), = [(k, v) for k, v in sw.pairs.items() if k == (1, 0)]
    dropped = dataclasses.replace(sw, pairs={**sw.pairs, pair: pieces[1:]})
    assert any("covered up to" in v or "gap" in v for v in check_switch(LAYOUTS, dropped, SHAPES))
    dup = dataclasses.replace(sw, pairs={**sw.pairs, pair: pieces + pieces[:1]})
    assert any("overlap" in v for v in check_switch(LAYOUTS, dup, SHAPES))
    p = pieces[0]
    wrong = dataclasses.replace(sw, pairs={**sw.pairs, pair: [Piece(p.name, p.lo - p.lo, p.hi - p.lo)] + pieces[1:]})
    assert any("holds only" in v for v in check_switch(LAYOUTS, wrong, SHAPES))


def test_home_to_dp_moves_half_of_every_tensor_and_dp_to_tp_moves_nothing():
    total = sum(torch.Size(s).numel() for s in SHAPES.values()) * 4
    gather = plan_switch(LAYOUTS, HOME, "dp2tp1", SHAPES)
    assert gather.summary["bytes_moved"] == total  # each rank receives the other half
    assert plan_switch(LAYOUTS, "dp2tp1", "dp1tp2", SHAPES).pairs == {}  # a DP replica holds every TP shard
    assert plan_switch(LAYOUTS, "dp1tp2", HOME, SHAPES).pairs == {}


def _round_trip(ctx):
    torch.set_num_threads(1)
    rank = ctx.rank
    full = {n: p.detach() for n, p in VarlenGPT(SHAPE, SEED).named_parameters()}
    cache = SwitchCache(LAYOUTS, rank, SHAPES)
    home = cut_state_dict(full, rank, 2)
    tp = {n: torch.full_like(v, float("nan")) for n, v in compute_shards(full, rank, 2).items()}
    dp = {n: torch.full_like(v, float("nan")) for n, v in full.items()}
    tp2 = {n: torch.full_like(v, float("nan")) for n, v in tp.items()}
    cache.params(HOME, "dp1tp2", home, tp)
    cache.params("dp1tp2", "dp2tp1", tp, dp)
    cache.params("dp2tp1", "dp1tp2", dp, tp2)
    dp_from_home = {n: torch.full_like(v, float("nan")) for n, v in full.items()}
    cache.params(HOME, "dp2tp1", home, dp_from_home)
    return {"tp": tp, "tp2": tp2, "dp": dp, "dp_home": dp_from_home, "want_tp": compute_shards(full, rank, 2)}


@pytest.mark.real
def test_params_bitwise_equal_after_a_tp_dp_tp_round_trip():
    out = launch(_round_trip, 2, label="round trip", timeout_s=120).results
    full = {n: p.detach() for n, p in VarlenGPT(SHAPE, SEED).named_parameters()}
    for r in out:
        for n in full:
            assert torch.equal(r["tp"][n], r["want_tp"][n]), n  # home -> TP compute
            assert torch.equal(r["tp2"][n], r["tp"][n]), n  # TP -> DP -> TP
            assert torch.equal(r["dp"][n], full[n]) and torch.equal(r["dp_home"][n], full[n]), n


def _job(lengths: LengthDist, plans=(HOTSPA, STATIC), policies=("hotspa", "hotspa_static"), rounds=3) -> HotSPaRealJob:
    return HotSPaRealJob(SHAPE, SEED, 2, 2, policies, plans, "align", 16, 1e-3, lengths, 10, rounds, 0, 1)


@pytest.mark.real
def test_engine_gradients_equal_the_single_process_step_and_adam_runs_once_in_home():
    job = _job(LengthDist(median=70, sigma=1.0, min_len=4, max_len=256))
    res = summarise(run_job(job, 300), job, 0, "hotspa", 1e-5)
    assert res.status == "ok", res.invalid_reasons
    checks = res.info["checks"]
    assert {(c["policy"], c["round"]) for c in checks} == {(p, r) for p in job.policies for r in range(3)}
    # accumulated across DP2 and TP2 (hotspa) and in static TP2 alike: the single-process gradient
    assert max(c["grad_err"] for c in checks) < 1e-5
    # Adam once, in the home layout, on the accumulated gradient: bitwise the full-model Adam
    assert max(c["param_err"] for c in checks) == 0.0
    assert res.info["optimizer_steps"] == {"hotspa": 3, "hotspa_static": 3}
    runs = [s["groups_run"] for s in res.info["steps"]["hotspa"]]
    assert [1, 0] in runs and all(r in ([1, 0], [1], [0]) for r in runs), runs  # short group first, home last
    assert res.info["switches_built"] >= 3  # home->DP, DP->TP, TP->home: built once, reused


@pytest.mark.real
def test_an_empty_group_runs_no_switch_no_compute_and_no_gradient():
    short = _job(LengthDist(median=30, sigma=0.5, min_len=4, max_len=128), plans=(HOTSPA,), policies=("hotspa",))
    res = summarise(run_job(short, 300), short, 0, "hotspa", 1e-5)
    assert res.status == "ok", res.invalid_reasons
    for s in res.info["steps"]["hotspa"]:
        assert s["groups_run"] == [1] and s["num_micro_batches"][0] == 0
        assert s["switches"] == 2  # params home -> DP, grads DP -> home; nothing for the empty TP group
    assert max(c["grad_err"] for c in res.info["checks"]) < 1e-5


def test_every_sequence_in_one_group_micro_batch_and_dp_rank_none_dropped():
    batch = LengthStream(LengthDist(median=60, sigma=1.2, min_len=1, max_len=256), 3).by_count(41)
    bp = plan_step(batch.ids, batch.lengths, HOTSPA, "align", 16)
    mbs = bp.all_micro_batches()
    check_packing(batch.ids, batch.lengths, [mb for mb in mbs if not mb.is_empty])
    assert bp.global_tokens == batch.num_tokens
    for g, s, ranks in bp.groups:
        assert len(ranks) == s.dp and len({len(r) for r in ranks}) == 1  # short ranks padded, not truncated
        for r in ranks:
            assert all(mb.num_tokens <= HOTSPA.boundaries[g] for mb in r)
    assert schedule_order(3) == [2, 1, 0]


def _placed(ctx, dtype: str):
    cache = SwitchCache(LAYOUTS, ctx.rank, SHAPES)
    eng = RankTrainer(SHAPE, SEED, ctx.rank, 2, HOTSPA, 1e-3, cache, SEED, ctx.device, dtype)
    return {"backend": ctx.backend, "device": str(ctx.device),
            "model": sorted({f"{p.device.type}/{p.dtype}" for m in eng.models.values() for p in m.parameters()}),
            "master": sorted({f"{p.device.type}/{p.dtype}" for p in eng.master.values()})}


@pytest.mark.real
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_models_sit_on_the_rank_device_in_the_job_dtype_master_in_fp32(dtype):
    out = launch(_placed, 2, (dtype,), label="placement", backend=None, timeout_s=120).results
    want = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    torch_name = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype]
    for r in out:
        assert r["backend"] == ("nccl" if want == "cuda" else "gloo")
        assert r["model"] == [f"{want}/{torch_name}"] and r["master"] == [f"{want}/torch.float32"]


@pytest.mark.real
def test_a_bf16_job_trains_through_the_same_functions_close_to_the_fp32_reference():
    job = dataclasses.replace(_job(LengthDist(median=70, sigma=1.0, min_len=4, max_len=256), plans=(HOTSPA,),
                                   policies=("hotspa",), rounds=2), dtype="bf16")
    res = summarise(run_job(job, 300), job, 0, "hotspa", 5e-2)
    assert res.info["dtype"] == "bf16" and res.info["rank_devices"][0] in ("cpu", "cuda:0")
    # bf16 compute, fp32 master and Adam: gradients within bf16 rounding of the fp32 reference,
    # and not bitwise (the compute really ran in bf16)
    errs = [c["grad_err"] for c in res.info["checks"]]
    assert 0.0 < max(errs) < 5e-2, errs
    assert res.info["optimizer_steps"] == {"hotspa": 2}


@pytest.mark.real
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_on_two_gpus_the_ranks_run_nccl_and_report_their_peak_memory():
    job = dataclasses.replace(_job(LengthDist(median=70, sigma=1.0, min_len=4, max_len=256), plans=(HOTSPA,),
                                   policies=("hotspa",), rounds=2), dtype="bf16")
    res = summarise(run_job(job, 300), job, 0, "hotspa", 5e-2)
    assert res.info["rank_devices"] == ["cuda:0", "cuda:1"]
    assert all(p > 0 for p in res.info["peak_memory_bytes_per_rank"]) and res.emulated == []
