"""The Megatron-LM step model (impl/common/megatron): exact parameter counts against the H100
runs file, monotone memory and time, pack equal to pad where they must agree, the runs-file
parser's one-line errors, and the fit recovering knobs it generated."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.common.hardware import MegatronKnobs, load_hardware
from impl.common.megatron import MegatronLayout, MegatronModel, pack_work, pad_work, padded_vocab, price
from impl.common.megatron import fit as megafit
from impl.common.megatron.step import features, theta_of
from impl.common.megatron.runs import load_runs, parse_line

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]

RUNS = REPO / "impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz"
HOLDOUT = REPO / "impl/common/megatron/data/megatron_h100_holdout.jsonl.gz"
GPT7B = MegatronModel(arch="gpt", num_layers=32, hidden=4096, ffn_hidden=16384, heads=32, vocab=50257,
                      max_position_embeddings=4096)


@pytest.fixture(scope="module")
def launches():
    return load_runs(RUNS)


@pytest.fixture(scope="module")
def hw():
    return load_hardware("h100-megatron")


@pytest.mark.parametrize("runs", [RUNS, HOLDOUT], ids=["february", "holdout"])
def test_param_counts_equal_megatron_printed_counts(runs, launches):
    layouts = set()
    checked = 0
    archs = set()
    for la in (launches if runs == RUNS else load_runs(runs)):
        if not la.printed_params or la.model is None or la.layout is None:
            continue
        counts = la.model.params_per_rank(la.layout.tp, la.layout.pp)
        for (t, p), n in la.printed_params.items():
            assert counts[p] == n, (la.id, t, p)
            checked += 1
        layouts.add((la.model.name, la.layout.tp, la.layout.pp, la.layout.context))
        archs.add(la.model.arch)
        if la.printed_padded_vocab:
            assert padded_vocab(la.model.vocab, la.layout.tp) == la.printed_padded_vocab, la.id
    assert len(layouts) >= 5 and checked >= 100
    # The held-out file's LLaMA launches (RMSNorm, SwiGLU, untied output layer) are checked too.
    assert archs == ({"gpt"} if runs == RUNS else {"gpt", "llama"})


def test_llama_counts_match_published_totals():
    # LLaMA-2 7B (6,738,415,616) and 70B with grouped-query attention (68,976,648,192).
    l7 = MegatronModel(arch="llama", num_layers=32, hidden=4096, ffn_hidden=11008, heads=32, vocab=32000)
    l70 = MegatronModel(arch="llama", num_layers=80, hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8, vocab=32000)
    assert l7.total_params() == 6_738_415_616
    assert l70.total_params() == 68_976_648_192
    # TP shards add up to the whole model plus the norms every TP rank keeps whole and the
    # embedding and head rows of the vocabulary padded to a multiple of 128 x tp (32000 -> 32768).
    h, L, tp = 8192, 80, 8
    extra = (tp - 1) * (L * 2 * h + h) + 2 * h * (padded_vocab(32000, tp) - padded_vocab(32000, 1))
    assert padded_vocab(32000, tp) == 32768
    assert sum(l70.params_per_rank(tp, 4)) * tp - l70.total_params() == extra
    assert sum(l7.params_per_rank(1, 4)) == l7.total_params()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (8, 1), (1, 8)])
def test_memory_and_time_grow_with_context_and_mbs(hw, tp, pp):
    base = MegatronLayout(dp=8 // (tp * pp) or 1, tp=tp, pp=pp, mbs=1, gbs=64, context=4096)
    for mode in ("pad", "pack"):
        prev = None
        for ctx, mbs in ((2048, 1), (4096, 1), (4096, 2), (8192, 2)):
            lay = base.with_(context=ctx, mbs=mbs, mode=mode)
            model = dataclasses.replace(GPT7B, max_position_embeddings=ctx)
            work = pad_work(lay) if mode == "pad" else pack_work(lay, np.full((2, 3, lay.gbs), ctx * 0.5))
            est = price(model, lay, hw, work)
            if prev is not None:
                assert est.max_peak_allocated_bytes > prev.max_peak_allocated_bytes, (mode, ctx, mbs)
                if mbs == prev_mbs:
                    assert est.iteration_s > prev.iteration_s, (mode, ctx, mbs)
            prev, prev_mbs = est, mbs


def test_pack_of_full_documents_prices_as_pad(hw):
    """Packing documents that all fill the context is padding: same time and memory."""
    lay = MegatronLayout(dp=2, tp=2, pp=2, mbs=2, gbs=32, context=4096, mode="pack")
    docs = np.full((3, 4, lay.gbs), 4096.0)
    a = price(GPT7B, lay, hw, pack_work(lay, docs))
    b = price(GPT7B, lay.with_(mode="pad"), hw, pad_work(lay))
    assert a.iteration_s == pytest.approx(b.iteration_s, rel=1e-12)
    assert a.peak_allocated_bytes == pytest.approx(b.peak_allocated_bytes, rel=1e-12)


def test_planner_microbatches_price_as_the_layout_they_fill(hw):
    """A planner's per-rank packed rows: full-context rows equal pad mode; a rank short of rows
    is padded with empty ones that cost nothing (same time as its siblings' longest rank)."""
    from impl.common.megatron import work_from_microbatches

    lay = MegatronLayout(dp=2, tp=2, pp=2, mbs=1, gbs=8, context=4096)
    full = work_from_microbatches([[[4096]] * 4, [[4096]] * 4], lm_head_rows="grid", context=4096)
    assert price(GPT7B, lay, hw, full).iteration_s == pytest.approx(price(GPT7B, lay, hw).iteration_s, rel=1e-12)
    short = work_from_microbatches([[[4096]] * 4, [[4096]] * 3], lm_head_rows="grid", context=4096)
    assert price(GPT7B, lay, hw, short).iteration_s == pytest.approx(price(GPT7B, lay, hw).iteration_s, rel=1e-12)
    with pytest.raises(ConfigError, match="lm_head_rows: unknown"):
        work_from_microbatches([[[1]]], lm_head_rows="pad")


def test_seq_cost_bridge_is_the_step_model_for_one_micro_batch(hw):
    """Planners price micro-batches through a·Σs²+b·s+c: on a calibrated profile those terms are
    the step model's chord between context/2 and 2 x context tokens (the table-priced kernels are
    not affine in the rows: within 6% on one packed row of two documents, slowest stage,
    per-iteration terms excluded; exact at a single document of the context), and the harness's
    varlen cost model is them, on a datasheet profile too (one path: its knobs carried from the fit)."""
    from impl.common.cost.varlen_model import StrategyLayout, seq_cost
    from impl.common.megatron import work_from_microbatches
    from impl.common.megatron.step import features, seq_cost_terms, theta_of
    from impl.common.workloads.pipeline import ModelShape

    lay = MegatronLayout(dp=1, tp=4, pp=2, mbs=1, gbs=1, context=8192)
    a, b, c = seq_cost_terms(GPT7B, lay, hw)
    docs = [3000, 1500]
    F = features(GPT7B, lay, hw, work_from_microbatches([[docs]]))
    t = (F.T[0, 0, 0] @ theta_of(hw, hw.megatron.knobs)).max()
    assert a * sum(x * x for x in docs) + b * sum(docs) + c == pytest.approx(t, rel=0.06)
    one = features(GPT7B, lay, hw, work_from_microbatches([[[8192]]]))
    t1 = (one.T[0, 0, 0] @ theta_of(hw, hw.megatron.knobs)).max()
    assert a * 8192 ** 2 + b * 8192 + c == pytest.approx(t1, rel=1e-9)
    shape = ModelShape(name="l7", num_layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq_len=4096)
    fitted, datasheet = seq_cost(shape, StrategyLayout(2, 4, 1), hw), seq_cost(shape, StrategyLayout(2, 4, 1), load_hardware("h100-sxm"))
    assert fitted.source == "megatron-step"
    assert (datasheet.a, datasheet.b, datasheet.c) == pytest.approx((fitted.a, fitted.b, fitted.c), rel=1e-12)
    # A 5% slower GEMM table moves the price (the table, not an efficiency constant, decides it).
    slow = hw.with_megatron(knobs=dataclasses.replace(hw.megatron.knobs, gemm_time_factor=1.05 * hw.megatron.knobs.gemm_time_factor))
    assert seq_cost(shape, StrategyLayout(2, 4, 1), slow).b > 1.02 * fitted.b


def test_hybrid_cost_model_layer_time_is_the_step_models_on_every_profile():
    """Malleus' and the checkpoint systems' per-layer cost: the step model's layer terms (a
    pipeline stage of n layers costs n of them plus its edges), on a datasheet profile the same
    as on the profile the fit carried to it."""
    from types import SimpleNamespace

    from impl.common.megatron.step import layer_time_s
    from impl.common.parallel.cost import HybridCostModel
    from impl.common.workloads.pipeline import ModelShape

    shape = ModelShape(name="l7", num_layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq_len=4096)
    wl = SimpleNamespace(model=shape, micro_batch_size=1, dtype="bf16", tp=4)
    cal, ds = load_hardware("a800-80g-megatron"), load_hardware("a800-80g")
    hc = HybridCostModel.build(wl, cal)
    m = MegatronModel.from_shape(shape)
    assert hc.layer_time_s(4) == pytest.approx(layer_time_s(m, 4, 4096.0, 4096.0 ** 2, cal), rel=1e-12)
    lay = MegatronLayout(dp=1, tp=4, pp=4, mbs=1, gbs=1, context=4096)
    stage1 = (features(m, lay, cal).T[0, 0, 0, 1] @ theta_of(cal, cal.megatron.knobs))  # a middle stage: 8 layers + p2p
    assert stage1 > 8 * hc.layer_time_s(4)
    hd = HybridCostModel.build(wl, ds)
    assert hd.layer_time_s(4) == pytest.approx(hc.layer_time_s(4), rel=1e-12)
    # one GPU's NVLink flow at the step model's intra-node efficiency
    assert hd.intra_bw_bytes_per_s == pytest.approx(cal.intra_node_bw_bytes_per_s * cal.megatron.knobs.intra_node_comm_efficiency)
    with pytest.raises(ConfigError, match="workload.dtype: fp32"):  # the step model prices bf16 steps only
        HybridCostModel.build(SimpleNamespace(**{**vars(wl), "dtype": "fp32"}), ds)


def test_pipeline_stage_costs_take_the_step_models_layer():
    from impl.common.cost.transformer import stage_costs
    from impl.common.megatron.step import F_ATTN, F_ELEM, F_GEMM, F_LAYERS, layer_terms
    from impl.common.workloads.pipeline import ModelShape

    hw = load_hardware("h800-megatron")
    shape = ModelShape(name="g7", num_layers=32, hidden=4096, heads=32, ffn_mult=4, vocab=50304, seq_len=2048)
    sc = stage_costs(shape, 4, 2, "fp16", 2, hw)
    f = layer_terms(MegatronModel.from_shape(shape), 2, 4096.0, 2 * 2048.0 ** 2, hw, 8)
    th = theta_of(hw, hw.megatron.knobs)
    per_layer = sum(f[k] * th[k] for k in (F_GEMM, F_ELEM, F_ATTN, F_LAYERS))
    assert sc.tw_s[0] == pytest.approx(8 * per_layer / 3, rel=1e-12)
    assert sc.tf_s[0] > sc.tw_s[0] and sc.tb_s == sc.tf_s
    assert stage_costs(shape, 4, 2, "fp16", 2, load_hardware("h800")) == sc
    with pytest.raises(ConfigError, match="workload.dtype: fp32"):
        stage_costs(shape, 4, 2, "fp32", 2, hw)


def test_derived_profiles_scale_links_and_keep_headroom():
    h100, a800, a100 = (load_hardware(n) for n in ("h100-megatron", "a800-80g-megatron", "a100-40g-megatron"))
    for d, ds in ((a800, "a800-80g"), (a100, "a100-40g")):
        raw = load_hardware(ds)
        assert d.megatron.knobs.gemm_time_factor == h100.megatron.knobs.gemm_time_factor
        assert d.megatron.kernels is not None and len(d.megatron.kernels.gemm) == len(h100.megatron.kernels.gemm)
        # link efficiencies carried unchanged: the target's own links price its collectives
        assert d.megatron.knobs.intra_node_comm_efficiency == h100.megatron.knobs.intra_node_comm_efficiency
        assert d.megatron.knobs.inter_node_comm_efficiency == h100.megatron.knobs.inter_node_comm_efficiency
        assert d.intra_node_bw_bytes_per_s == raw.intra_node_bw_bytes_per_s
        assert raw.memory_bytes - d.megatron.knobs.allocatable_bytes == \
            pytest.approx(h100.memory_bytes - h100.megatron.knobs.allocatable_bytes)
        assert d.calibration["derived_from"] == "h100-megatron"


def test_step_profile_follows_every_override_of_the_same_profile():
    from impl.common.megatron.derive import step_knobs, step_profile
    from impl.common.megatron.step import layer_time_s

    h800 = load_hardware("h800")
    m = MegatronModel(num_layers=32, hidden=4096, ffn_hidden=11008, heads=32, vocab=32000)
    carried = step_knobs(h800)
    t = {}
    for lo in (0.001, 0.003):  # the same profile name with fitted knobs but no tables of its own
        hw = h800.with_megatron(knobs=dataclasses.replace(carried, layer_overhead_s=lo))
        assert step_knobs(hw).layer_overhead_s == lo
        t[lo] = layer_time_s(m, 1, 4096.0, 4096.0 ** 2, hw)
    assert t[0.003] > t[0.001]
    slow = h800.with_megatron(kernels=dataclasses.replace(
        step_profile(h800).megatron.kernels, gemm=[dataclasses.replace(g, s=[2 * x for x in g.s]) for g in step_profile(h800).megatron.kernels.gemm]))
    assert step_profile(slow).megatron.kernels.gemm[0].s[0] == 2 * step_profile(h800).megatron.kernels.gemm[0].s[0]


def test_a_profile_carried_from_itself_is_one_line():
    from impl.common.megatron.derive import step_profile

    with pytest.raises(ConfigError, match="megatron.carried_from must name a fitted profile"):
        step_profile(dataclasses.replace(load_hardware("h800").with_megatron(carried_from="loop-a"), name="loop-a"))


def test_sequence_parallel_and_recompute_trade_memory_for_time(hw):
    lay = MegatronLayout(dp=1, tp=8, pp=1, mbs=1, gbs=16, context=8192)
    plain = price(GPT7B, lay, hw)
    sp = price(GPT7B, lay.with_(sequence_parallel=True), hw)
    full = price(GPT7B, lay.with_(recompute="full"), hw)
    assert sp.max_peak_allocated_bytes < plain.max_peak_allocated_bytes
    assert full.max_peak_allocated_bytes < plain.max_peak_allocated_bytes
    assert full.iteration_s > plain.iteration_s


def test_impossible_layouts_fail_with_one_line():
    with pytest.raises(ConfigError, match=r"layout.pp: 3 stages cannot split 32 layers"):
        GPT7B.params_per_rank(1, 3)
    with pytest.raises(ConfigError, match=r"layout.gbs: 10 is not a multiple of dp x mbs = 4"):
        MegatronLayout(dp=2, mbs=2, gbs=10)
    with pytest.raises(ConfigError, match=r"layout.mode: unknown 'padded'"):
        MegatronLayout(mode="padded")


def _good_line() -> dict:
    with RUNS.open("rb") as fh:
        import gzip

        for text in gzip.open(fh, "rt"):
            rec = json.loads(text)
            if rec["status"] == "ok" and rec["effective"]["mode"] == "pack":
                return rec
    raise AssertionError("no ok pack line")


@pytest.mark.parametrize("mutate,where", [
    (lambda r: "not json", "json"),
    (lambda r: {**r, "status": "done"}, "status"),
    (lambda r: {**r, "effective": {**r["effective"], "tp": "2"}}, "effective.tp"),
    (lambda r: {**r, "effective": {**r["effective"], "mode": "packed"}}, "effective.mode"),
    (lambda r: {**r, "summary": {**r["summary"], "median_ms_excl_first": -3}}, "summary.median_ms_excl_first"),
    (lambda r: {**r, "config": {**r["config"], "hidden_size": None}}, "config.hidden_size"),
])
def test_bad_runs_line_is_one_line_naming_line_and_field(tmp_path, mutate, where):
    rec = _good_line()
    bad = mutate(rec)
    f = tmp_path / "runs.jsonl"
    f.write_text(json.dumps(rec) + "\n" + (bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
    with pytest.raises(ConfigError) as e:
        load_runs(f)
    msg = str(e.value)
    assert "\n" not in msg and f"{f}:2: {where}:" in msg


def test_fit_recovers_the_knobs_that_generated_the_measurements(launches, hw):
    """Measurements made by the model itself with known knobs: the fit finds knobs that
    reproduce them (time and memory within 1%), on launches of both modes."""
    truth = dataclasses.replace(MegatronKnobs(), gemm_time_factor=1.2, attn_time_factor=1.4, elementwise_time_factor=1.5,
                                intra_node_comm_efficiency=0.6, inter_node_comm_efficiency=0.5,
                                layer_overhead_s=5e-4, iteration_overhead_s=0.3, activation_factor=1.1,
                                logits_bytes=12.0, memory_overhead_bytes=1e9,
                                allocatable_bytes=70e9)
    base = hw.with_megatron(knobs=None)  # keeps the kernel tables
    sub = [la for la in launches if la.layout and la.model and not la.skip_reason][::6]
    priced = [p for p in megafit.featurize(sub, base) if p.feats is not None]
    for p in priced:
        r = megafit.predict(p, base, truth)
        p.launch = dataclasses.replace(p.launch, measured_iteration_ms=r["predicted_iteration_ms_if_run"],
                                       measured_peak_allocated_mb=r["predicted_peak_allocated_mb_printed_ranks"],
                                       status="ok" if r["predicted_fits"] else "oom")
    knobs, _ = megafit.fit(priced, base)
    table = megafit.error_table([megafit.predict(p, base, knobs) for p in priced])
    assert table["pad_time"]["p90_abs"] < 0.01 and table["pack_time"]["p90_abs"] < 0.01
    assert table["memory"]["p90_abs"] < 0.01
    assert table["verdict"]["accuracy"] >= 0.99
