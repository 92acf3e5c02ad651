"""bench.fidelity.fork_logs on small synthetic Megatron-LM log snippets: a GPT and a LLaMA launch,
iteration reports, memory reports, an out-of-memory message, a two-node launch, and the held-out
check of mlsys-bench-runs on a few lines of the shipped held-out file."""
from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from bench import megatron_runs
from bench.fidelity import fork_logs as fl
from impl.common.api import ConfigError
from impl.common.megatron.runs import load_runs, parse_line

REPO = pathlib.Path(__file__).resolve().parents[2]
HOLDOUT = REPO / "impl/common/megatron/data/megatron_h100_holdout.jsonl.gz"
FEB = REPO / "impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz"


def _args(**kv) -> str:
    rows = "".join(f"  {k} {'.' * max(3, 48 - len(k))} {v}\n" for k, v in kv.items())
    return f"------------------------ arguments ------------------------\n{rows}-------------------- end of arguments ---------------------\n"


def _start(t: str) -> str:
    return (f"[{t},100] torch.distributed.run: [WARNING] \n"
            f"[{t},100] torch.distributed.run: [WARNING] *****************************************\n")


def _iter(i: int, ms: float, loss: float) -> str:
    return (f" iteration       {i}/      30 | consumed samples:         {i * 64} | elapsed time per iteration (ms): {ms} | "
            f"learning rate: 1.0E-06 | global batch size:    64 | lm loss: {loss:E} | loss scale: 1.0 | grad norm: 2.500 | "
            f"number of skipped iterations:   0 | number of nan iterations:   0 |\n")


def _mem(rank: int, alloc: float, peak: float) -> str:
    return (f"[Rank {rank}] (after 10 iterations) memory (MB) | allocated: {alloc} | max allocated: {peak} | "
            f"reserved: {peak + 100} | max reserved: {peak + 100}\n")


COMMON = dict(bf16=True, data_parallel_size=2, global_batch_size=64, micro_batch_size=2, seq_length=4096,
              max_position_embeddings=4096, pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
              world_size=8, sequence_parallel=True, recompute_granularity=None, use_flash_attn=True,
              use_distributed_optimizer=True, make_vocab_size_divisible_by=128, train_iters=30, lr=0.00015,
              json_file="/data/web/refinedweb0.json", tokenizer_type="GPT2BPETokenizer")
GPT_ARGS = dict(COMMON, num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, swiglu=False,
                normalization="LayerNorm", untie_embeddings_and_output_weights=False, sequence_packing=False,
                hidden_dropout=0.1)
LLAMA_ARGS = dict(COMMON, num_layers=4, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8, swiglu=True,
                  normalization="RMSNorm", untie_embeddings_and_output_weights=True, sequence_packing=True,
                  group_query_attention=True, num_query_groups=2, position_embedding_type="rope", hidden_dropout=0.0)


def gpt_log() -> str:
    return (_start("2024-03-12 01:00:00") + _args(**GPT_ARGS)
            + "setting number of micro-batches to constant 16\n"
            + " > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)\n"
            + " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 1234\n"
            + " > number of parameters on (tensor, pipeline) model parallel rank (1, 1): 5678\n"
            + _iter(10, 900.5, 10.9) + _mem(0, 100.0, 2000.5) + _mem(4, 90.0, 1500.25)
            + _iter(20, 800.0, 10.5) + _iter(30, 820.0, 10.1)
            + "[after training is done] datetime: 2024-03-12 01:10:00 \n")


def llama_oom_log() -> str:
    return (_start("2024-03-12 02:00:00") + _args(**LLAMA_ARGS)
            + " > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)\n"
            + "rank 0: {'packing_seq_len': {'128': 1, '4096': 2, '>4k': 0}, 'real_seq_len': {'128': 3, '4096': 1, '>4k': 0}}"
              "[after training is done] datetime: x\n"
            + "Traceback (most recent call last):\n"
            + "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 128.00 MiB. GPU 3 has a total capacty of "
              "79.11 GiB of which 125.50 MiB is free. Process 1 has 78.97 GiB memory in use. Of the allocated memory "
              "74.76 GiB is allocated by PyTorch, and 955.83 MiB is reserved by PyTorch but unallocated. If reserved\n")


def test_gpt_launch_every_field():
    rec = fl.launch_record(fl.split_launches("logs/gpt/x.log", gpt_log()), branch="llama", commit="c0ffee", rid="H1")
    assert set(rec) == set(json.loads(gzip.open(FEB, "rt").readline()))  # the February schema
    assert rec["status"] == "ok" and rec["start_time"] == "2024-03-12 01:00:00" and rec["num_nodes"] == 1
    # A toy size has no model name (neither a known size nor a file name that says one).
    assert rec["effective"] == {"arch": "gpt", "dp": 2, "gbs": 64, "gpus": 8, "mbs": 2, "mode": "pad", "model": None,
                                "model_dims": "L4-h256-ffn1024-heads8", "pp": 2, "recompute": None, "seq_length": 4096,
                                "sequence_parallel": True, "tp": 2}
    cfg = rec["config"]
    assert cfg["num_layers"] == 4 and cfg["bf16"] is True and cfg["recompute_granularity"] is None
    assert cfg["lr"] == 0.00015 and cfg["tokenizer_type"] == "GPT2BPETokenizer"
    assert (cfg["padded_vocab_size"], cfg["tokenizer_vocab_size"], cfg["num_microbatches"]) == (50432, 50257, 16)
    assert cfg["dataset_file"] == "refinedweb0.json"
    assert [r["iteration"] for r in rec["iterations"]] == [10, 20, 30]
    assert rec["iterations"][0] == {"elapsed_ms": 900.5, "grad_norm": 2.5, "iteration": 10, "lm_loss": 10.9,
                                    "nan": 0, "skipped": 0}
    s = rec["summary"]
    assert s["first_report_ms"] == 900.5 and s["median_ms_excl_first"] == 810.0 and s["n_reports"] == 3
    assert s["tokens_per_iter"] == 64 * 4096 and s["last_lm_loss"] == pytest.approx(10.1)
    assert rec["max_allocated_mb_max_over_ranks"] == 2000.5 and len(rec["memory_per_rank"]) == 2
    assert rec["memory_per_rank"][1] == {"after_iters": 10, "allocated_mb": 90.0, "max_allocated_mb": 1500.25,
                                         "max_reserved_mb": 1600.25, "rank": 4, "reserved_mb": 1600.25}
    assert rec["params_per_tp_pp_rank"] == {"0,0": 1234, "1,1": 5678}
    assert rec["oom_events"] == [] and rec["error_kinds"] is None
    assert rec["source"] == {"branch": "llama", "commit": "c0ffee", "paths": ["logs/gpt/x.log"], "repo": "Sakura-gh/Megatron-LM"}


def test_llama_launch_oom_and_histogram():
    rec = fl.launch_record(fl.split_launches("logs/llama/y.log", llama_oom_log()), branch="llama", commit="c")
    assert rec["status"] == "oom"
    assert rec["effective"]["arch"] == "llama" and rec["effective"]["mode"] == "pack"
    assert rec["effective"]["model_dims"] == "L4-h256-ffn688-heads8-kv2"
    assert rec["config"]["num_query_groups"] == 2 and rec["config"]["untie_embeddings_and_output_weights"] is True
    assert rec["oom_events"] == [{"allocated_by_pytorch_gib": 74.76, "free_mib": 125.5, "gpu_local_index": 3, "node": None,
                                  "process_in_use_gib": 78.97, "rank": None, "reserved_unallocated_mib": 955.83,
                                  "total_capacity_gib": 79.11, "tried_to_allocate_mib": 128.0}]
    assert "oom" in rec["error_kinds"] and rec["error_line"].startswith("torch.cuda.OutOfMemoryError")
    h = rec["seq_len_histogram"]
    assert h["ranks_printed"] == [0] and h["rank0_or_first"]["real_seq_len"] == {"128": 3, "4096": 1, ">4k": 0}


def test_loader_builds_the_llama_model_from_the_printed_config():
    rec = fl.launch_record(fl.split_launches("logs/llama/y.log", llama_oom_log()), branch="llama", commit="c", rid="L1")
    la = parse_line(json.dumps(rec), 1, "t")
    m = la.model
    assert (m.arch, m.num_layers, m.hidden, m.ffn_hidden, m.heads, m.kv_heads) == ("llama", 4, 256, 688, 8, 2)
    assert not m.tied and m.vocab == 50257 and la.printed_padded_vocab == 50432


def test_two_node_pair_is_one_launch():
    # Node 0 prints the arguments and its ranks' memory; node 1 (the last stage) the iteration reports.
    node0 = _start("2024-03-12 03:00:05") + _args(**dict(GPT_ARGS, world_size=16, data_parallel_size=4)) + _mem(0, 1.0, 300.0)
    node1 = _start("2024-03-12 03:00:03") + _iter(10, 500.0, 10.0) + _iter(20, 450.0, 9.9) + _mem(8, 2.0, 400.0) + \
        "[after training is done] datetime: x\n"
    files = {"logs/gpt/gpt_megatron_gpus16_7b_seqlen4096_gbs64_mbs2_dp4_tp2_pp2_pad_sp_node0.log": node0,
             "logs/gpt/gpt_megatron_gpus16_7b_seqlen4096_gbs64_mbs2_dp4_tp2_pp2_pad_sp_node1.log": node1}
    res = fl.normalise(files, branch="llama", commit="c")
    assert (res.known, res.repeated, len(res.records)) == (0, 0, 1)
    r = res.records[0]
    assert r["num_nodes"] == 2 and r["status"] == "ok" and r["start_time"] == "2024-03-12 03:00:03"
    assert len(r["source"]["paths"]) == 2 and r["effective"]["gpus"] == 16 and r["effective"]["dp"] == 4
    assert [m["rank"] for m in r["memory_per_rank"]] == [0, 8] and r["max_allocated_mb_max_over_ranks"] == 400.0
    assert [i["iteration"] for i in r["iterations"]] == [10, 20]


def test_printed_arguments_win_over_the_file_name():
    # The name says mbs 8 and pack; the launch printed mbs 2 and pad.
    files = {"logs/gpt/gpt_megatron_gpus8_7b_seqlen4096_gbs64_mbs8_dp2_tp2_pp2_pack_sp.log": gpt_log()}
    (r,) = fl.normalise(files, branch="llama", commit="c").records
    assert r["effective"]["mbs"] == 2 and r["effective"]["mode"] == "pad"


def test_no_arguments_layout_from_the_name_and_known_launches_excluded():
    files = {"logs/llama/llama_megatron_gpus8_7b_seqlen8192_gbs512_mbs1_dp2_tp2_pp2_pad_nosp.log":
             _start("2024-03-12 04:00:00") + _iter(10, 5.0, 1.0) + _iter(20, 5.0, 1.0)}
    (r,) = fl.normalise(files, branch="llama", commit="c").records
    assert r["effective"]["arch"] == "llama" and r["effective"]["model_dims"] is None
    assert r["effective"]["sequence_parallel"] is False and r["status"] == "incomplete"
    assert set(r["config"]) == set(fl.NO_ARGS_CONFIG_KEYS)
    known = dict(r, start_time="2024-03-12 04:01:00", iterations=[])
    res = fl.normalise(files, branch="llama", commit="c", exclude=[known])
    assert (res.records, res.known) == ([], 1)
    far = dict(known, start_time="2024-03-13 04:00:00")
    assert fl.normalise(files, branch="llama", commit="c", exclude=[far]).known == 0


def test_appended_launches_split():
    text = gpt_log() + llama_oom_log()
    segs = fl.split_launches("tmp_for_test_logs/t.log", text)
    assert len(segs) == 2 and segs[1].torchrun_time == "2024-03-12 02:00:00"


PREAMBLE = ("local_ip = 10.0.0.2, master_ip = 10.0.0.1, nodes_num = 2, gpus_num = 16, node_rank = 1\n"
            "use llama 13b model, gpu_num=16, seq_len = 8192, DP=2, MP=4, PP=2, GBS=512, MBS=1\n"
            "use sequence-packing\n")


def test_launch_script_echo_starts_a_launch_and_gives_its_layout():
    # The echo before torchrun belongs to the launch that follows, not to the one before it; a
    # launch that printed no arguments takes its layout from it, its OOM events the node's address.
    oom = ("rank 5 catch CUDA out of memory. Tried to allocate 1.50 GiB. GPU 5 has a total capacty of 79.11 GiB of "
           "which 20.00 MiB is free. Process 7 has 79.00 GiB memory in use. Of the allocated memory 70.00 GiB is "
           "allocated by PyTorch, and 2.00 GiB is reserved by PyTorch but unallocated.\n")
    text = gpt_log() + PREAMBLE + _start("2024-03-12 05:00:00") + oom
    segs = fl.split_launches("tmp_for_test_logs/t.log", text)
    assert len(segs) == 2 and not any("local_ip" in t for _, t in segs[0].lines)
    rec = fl.launch_record([segs[1]], branch="b", commit="c")
    assert rec["effective"] == {"arch": "llama", "dp": 2, "gbs": 512, "gpus": 16, "mbs": 1, "mode": "pack", "model": "13b",
                                "model_dims": None, "pp": 2, "recompute": None, "seq_length": 8192,
                                "sequence_parallel": False, "tp": 4}
    assert rec["status"] == "oom" and rec["num_nodes"] == 2
    assert rec["oom_events"] == [{"allocated_by_pytorch_gib": 70.0, "free_mib": 20.0, "gpu_local_index": 5,
                                  "node": "10.0.0.2", "process_in_use_gib": 79.0, "rank": 5,
                                  "reserved_unallocated_mib": 2048.0, "total_capacity_gib": 79.11,
                                  "tried_to_allocate_mib": 1536.0}]


def test_prints_that_share_a_line():
    # Ranks print at once: memory reports, parameter counts, an OOM message and rank 0's last
    # line land on one line, or behind another rank's text.
    text = (gpt_log().replace("[after training is done] datetime: 2024-03-12 01:10:00 \n", "")
            + "[Rank 1] (after 10 iterations) memory (MB) | allocated: 1.0 | max allocated: 2.0 | reserved: 3.0 | max reserved: 3.0"
              "[Rank 2] (after 10 iterations) memory (MB) | allocated: 1.0 | max allocated: 2500.0 | reserved: 3.0 | max reserved: 3.0\n"
            + " > number of parameters on (tensor, pipeline) model parallel rank (0, 1): 11 > number of parameters on "
              "(tensor, pipeline) model parallel rank (1, 0): 12\n"
            + "rank 3: {'packing_seq_len': {'128': 1}, 'real_seq_len': {'128': 2}}[after training is done] datetime: x\n")
    rec = fl.launch_record(fl.split_launches("logs/gpt/s.log", text), branch="b", commit="c")
    assert [m["rank"] for m in rec["memory_per_rank"]] == [0, 1, 2, 4] and rec["max_allocated_mb_max_over_ranks"] == 2500.0
    assert rec["params_per_tp_pp_rank"] == {"0,0": 1234, "0,1": 11, "1,0": 12, "1,1": 5678}
    assert rec["status"] == "ok" and rec["seq_len_histogram"]["ranks_printed"] == [3]
    oom = ("torch.cuda.OutOfMemoryError:     pretrain(x,CUDA out of memory. Tried to allocate 1.25 GiB. GPU 2 has a total "
           "capacty of 79.11 GiB of which 547.50 MiB is free. Process 1 has 78.5 GiB memory in use. Of the allocated memory "
           "70.00 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated.\n")
    rec = fl.launch_record(fl.split_launches("logs/gpt/o.log", gpt_log() + oom + oom), branch="b", commit="c")
    assert rec["status"] == "oom" and len(rec["oom_events"]) == 1 and rec["oom_events"][0]["gpu_local_index"] == 2


def test_cut_by_the_time_limit_or_reaching_the_last_iteration():
    cut = gpt_log().replace("[after training is done] datetime: 2024-03-12 01:10:00 \n", "")
    # Another node's log: no rank 0 print, but the reports reach train_iters (30/30).
    assert fl.launch_record(fl.split_launches("a.log", cut), branch="b", commit="c")["status"] == "ok"
    short = cut.replace(_iter(30, 820.0, 10.1), "")
    assert fl.launch_record(fl.split_launches("a.log", short), branch="b", commit="c")["status"] == "incomplete"
    killed = short + "Traceback (most recent call last):\nReceived SIGTERM\n"
    assert fl.launch_record(fl.split_launches("a.log", killed), branch="b", commit="c")["status"] == "incomplete"
    crashed = short + "Traceback (most recent call last):\ntorch.distributed.DistBackendError: NCCL error in: x\n"
    rec = fl.launch_record(fl.split_launches("a.log", crashed), branch="b", commit="c")
    assert rec["status"] == "error" and rec["error_kinds"] == ["nccl_error", "python_exception"]


def test_a_launch_logged_twice_is_kept_once():
    # The fork's test logs repeat launches that have files of their own: the richer log is kept.
    own = {"logs/gpt/gpt_megatron_gpus8_7b_seqlen4096_gbs64_mbs2_dp2_tp2_pp2_pad_sp.log": gpt_log()}
    both = dict(own, **{"tmp_for_test_logs/test_gpt_gpus8_pad_sp.log": gpt_log() + llama_oom_log()})
    res = fl.normalise(both, branch="b", commit="c")
    assert (len(res.records), res.repeated) == (2, 1)
    assert sorted(r["source"]["paths"][0] for r in res.records) == [
        "logs/gpt/gpt_megatron_gpus8_7b_seqlen4096_gbs64_mbs2_dp2_tp2_pp2_pad_sp.log", "tmp_for_test_logs/test_gpt_gpus8_pad_sp.log"]
    # A repeat without iteration reports is matched by torchrun's start time (within seconds).
    bare = _start("2024-03-12 01:00:02") + "[Rank 0] (after 10 iterations) memory (MB) | allocated: 1.0 | max allocated: 2.0 | reserved: 3.0 | max reserved: 3.0\n"
    assert fl.normalise(dict(own, **{"tmp_for_test_logs/x.log": bare}), branch="b", commit="c").repeated == 1
    later = bare.replace("01:00:02", "01:02:00")
    assert fl.normalise(dict(own, **{"tmp_for_test_logs/x.log": later}), branch="b", commit="c").repeated == 0


@pytest.mark.parametrize("bad, what", [
    (" iteration       10/      30 | consumed samples: 1 | elapsed time per iteration (ms): fast | lm loss: 1.0 |\n", "iteration"),
    ("[Rank 0] (after 10 iterations) memory (MB) | allocated: lots\n", "memory"),
    ("rank 0: {'packing_seq_len': {'128': 1}\n", "seq_len_histogram"),
])
def test_malformed_line_one_line_error(bad, what):
    text = gpt_log() + bad
    line = text.count("\n")
    with pytest.raises(ConfigError) as e:
        fl.launch_record(fl.split_launches("logs/gpt/bad.log", text), branch="b", commit="c")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"logs/gpt/bad.log:{line}: {what}")


def test_malformed_argument_line():
    text = gpt_log().replace("  bf16 ", "  bf16 .\n  hidden_size ", 1)
    with pytest.raises(ConfigError, match=r"^logs/gpt/a\.log:\d+: arguments"):
        fl.launch_record(fl.split_launches("logs/gpt/a.log", text), branch="b", commit="c")


def test_holdout_check_on_a_few_lines(tmp_path):
    lines = gzip.open(HOLDOUT, "rt").read().splitlines()
    pick = [t for t in lines if '"arch": "llama"' in t and '"status": "ok"' in t][:3] + \
        [t for t in lines if '"arch": "gpt"' in t and '"status": "ok"' in t and '"mode": "pad"' in t][:2]
    small = tmp_path / "few.jsonl"
    small.write_text("\n".join(pick) + "\n")
    s = megatron_runs.run_pricing(str(small), "h100-megatron", tmp_path / "out", None, holdout=True)
    assert s["held_out"] and set(s["tables_by_arch"]) == {"all", "gpt", "llama"}
    assert s["tables_by_arch"]["llama"]["verdict"]["n"] == 3 and s["tables_by_arch"]["gpt"]["pad_time"]["n"] == 2
    preds = [json.loads(t) for t in (tmp_path / "out/predictions.jsonl").read_text().splitlines()]
    assert sorted(p["arch"] for p in preds) == ["gpt", "gpt", "llama", "llama", "llama"]
    # The same launches priced without --holdout: the same predictions (no knob moved).
    plain = megatron_runs.run_pricing(str(small), "h100-megatron", tmp_path / "plain", None)
    assert plain["table"] == s["table"] == s["tables_by_arch"]["all"]
    with pytest.raises(ConfigError, match="--holdout: .* fitted on"):
        megatron_runs.run_pricing(str(FEB), "h100-megatron", tmp_path / "feb", None, holdout=True)
    with pytest.raises(ConfigError, match="--folds would re-fit"):
        megatron_runs.run_pricing(str(small), "h100-megatron", tmp_path / "f", 2, holdout=True)


def test_shipped_holdout_file_loads_both_archs():
    launches = load_runs(HOLDOUT)
    archs = {la.model.arch for la in launches if la.model}
    assert archs == {"gpt", "llama"}
    assert all(la.id.startswith("H") for la in launches)


def test_compare_counts_fields_that_differ():
    rec = fl.launch_record(fl.split_launches("logs/gpt/x.log", gpt_log()), branch="b", commit="c")
    matched, differ = fl.compare([rec], [rec])
    assert matched == 1 and not any(differ.values())
    other = dict(rec, status="incomplete", oom_events=[{"x": 1}])
    matched, differ = fl.compare([rec], [other])
    assert matched == 1 and {k for k, n in differ.items() if n} == {"status", "oom_events"}
    assert fl.compare([rec], [dict(rec, iterations=[], start_time="2020-01-01 00:00:00")])[0] == 0
