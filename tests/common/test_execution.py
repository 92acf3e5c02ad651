"""One device decision per job (impl.common.execution): placements and their labels, the record's
info.execution / device / backend and hardware label, gpu/* presets refused without CUDA, and a
failed job's record naming its traceback."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from bench.app import preflight
from bench.gpu_check import GPU_PRESETS, format_table, status_rows
from bench.gpu_smoke import where
from bench.record import load_records, validate
from impl.common.api import ConfigError
from impl.common.execution import Execution, ExecutionConfig, hardware_label, resolve, summarize
from tests.conftest import REPO, TEST_ARGS, run_bench

CUDA = torch.cuda.is_available()


def test_placement_labels_say_where_ranks_run_and_why():
    cpu = Execution(device="cpu", gpus=0)
    assert cpu.placement(4).label == "cpu/gloo: no GPU"
    one_gpu = Execution(device="cuda", gpus=1, gpu_name="H200")
    assert one_gpu.placement(4).label == "cpu/gloo: 1 GPU < 4 ranks"
    assert one_gpu.placement(1).label == "cuda/nccl: 1 ranks on 1 GPUs"
    assert one_gpu.single().label == "cuda"
    eight = Execution(device="cuda", gpus=8)
    assert eight.placement(4).backend == "nccl"
    assert eight.placement(4, ranks_use_gpu=False).label == "cpu/gloo: this system's ranks run on the CPU"
    asked_cpu = Execution(device="cpu", gpus=2)
    assert asked_cpu.placement(2).label == "cpu/gloo: execution.device=cpu"
    with pytest.raises(ConfigError, match=r"^execution.backend: nccl needs 4 visible GPUs, found 1$"):
        one_gpu.placement(4, backend="nccl")


def test_dtype_and_config_errors_are_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"^workload.dtype: fp16 needs a CUDA device"):
        Execution(device="cpu").torch_dtype("fp16")
    with pytest.raises(ConfigError, match=r"^execution.dtype: fp16 needs a CUDA device"):
        Execution(device="cpu", dtype="fp16").torch_dtype("fp32")
    assert Execution(device="cpu", dtype="bf16").torch_dtype("fp32") == torch.bfloat16
    assert Execution(device="cpu").torch_dtype(None) == torch.float32
    for field, bad in (("device", "tpu"), ("dtype", "fp8"), ("backend", "mpi")):
        with pytest.raises(ConfigError, match=rf"^execution.{field}: unknown value"):
            ExecutionConfig(**{field: bad})
    if not CUDA:
        with pytest.raises(ConfigError, match=r"^execution.device: cuda requested but no CUDA device is visible"):
            resolve(ExecutionConfig(device="cuda"))


def test_hardware_label_follows_the_placements():
    ex = Execution(device="cuda", gpus=1, gpu_name="NVIDIA H200", cores=16)
    assert hardware_label(summarize(ex, [])) == "local-cuda[NVIDIA H200]"
    gloo = summarize(ex, [ex.placement(4)])
    assert (gloo["device"], gloo["backend"]) == ("cpu", "gloo")
    assert hardware_label(gloo) == "local-cpu[16 cores; 1 GPU < 4 ranks]"
    assert hardware_label(summarize(Execution(device="cpu", cores=2), [])) == "local-cpu[2 cores]"


@pytest.mark.real
def test_two_rank_real_job_on_a_cpu_host_records_cpu_gloo(tmp_path):
    proc = run_bench(["system=echo_a", "mode=real", "+system.ranks=2", "execution=cpu", *TEST_ARGS,
                      f"results_dir={tmp_path}", "experiment_name=gpu_smoke"])
    assert proc.returncode == 0, proc.stderr
    (rec,) = load_records(tmp_path)
    validate(rec)
    info = rec["info"]
    assert (info["device"], info["backend"]) == ("cpu", "gloo")
    assert info["execution"]["placements"] == [
        {"device": "cpu", "backend": "gloo", "ranks": 2, "gpus": info["execution"]["decision"]["gpus"],
         "reason": "no GPU" if not CUDA else "execution.device=cpu"}]
    assert rec["hardware"].startswith("local-cpu[")
    assert where(rec).startswith("cpu/gloo: ")  # the smoke table's device column
    assert f"ran on: {where(rec)}" in proc.stdout  # the console line


def test_sim_job_ignores_a_cuda_request_and_records_no_placement(tmp_path):
    proc = run_bench(["system=echo_a", "execution=cuda", *TEST_ARGS, f"results_dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr
    (rec,) = load_records(tmp_path)
    assert rec["hardware"] == "test_hw" and "execution" not in rec["info"]


def test_crashing_job_record_names_its_traceback(tmp_path):
    proc = run_bench(["system=echo_a", "fault=kill_only_worker", *TEST_ARGS, f"results_dir={tmp_path}"])
    assert proc.returncode == 1
    (rec,) = load_records(tmp_path)
    validate(rec)
    log = pathlib.Path(rec["error_log"])
    assert log == tmp_path / rec["run_id"] / "error.log" and log.read_text().startswith("Traceback")
    assert rec["error_frames"][-1].startswith("tests/support/systems.py:") and rec["error_frames"][-1].endswith(" in run")
    assert f"traceback: {log}" in proc.stdout


def test_multirun_failure_lines_print_the_traceback_path(tmp_path):
    proc = run_bench(["--multirun", "system=echo_a", "fault=none,kill_only_worker", *TEST_ARGS,
                      f"results_dir={tmp_path}"])
    assert proc.returncode == 1
    (failed,) = [r for r in load_records(tmp_path) if r["status"] == "failed"]
    assert f"echo_a: traceback in {failed['error_log']}" in proc.stdout


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_is_refused_in_preflight_without_cuda(preset):
    assert (REPO / "conf" / "experiment" / "gpu" / f"{preset}.yaml").exists()
    if CUDA:
        pytest.skip("CUDA present: the refusal is for hosts without one")
    err = preflight(["--multirun", f"experiment=gpu/{preset}"])
    assert err == ("execution.device: cuda requested but no CUDA device is visible "
                   "(torch.cuda.is_available() is false)")
    assert preflight([f"experiment=gpu/{preset}", "execution=cpu"]) is None  # it composes and types


def test_gpu_check_refuses_without_cuda():
    if CUDA:
        pytest.skip("CUDA present: the refusal is for hosts without one")
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    proc = subprocess.run(["bash", str(REPO / ".ci" / "gpu_check.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_check: no CUDA device visible (torch.cuda.is_available() is false); nothing run"


def test_gpu_check_table_counts_ok_failed_and_missing_presets():
    recs = [{"experiment": f"gpu/{GPU_PRESETS[0]}", "run_id": "a", "created": "2026-01-01T00:00:00+00:00",
             "system": "fisedit", "status": "ok", "info": {"execution": {"label": "cuda"}}},
            {"experiment": f"gpu/{GPU_PRESETS[1]}", "run_id": "b", "created": "2026-01-01T00:00:01+00:00",
             "system": "fisedit", "status": "failed", "error": "boom"}]
    rows, bad = status_rows(recs)
    assert rows[0][2:] == ["1/1 ok", "-", "cuda"]
    assert rows[1][2] == "0/1 ok" and rows[1][4] == "boom"
    assert bad == list(GPU_PRESETS[1:])
    assert format_table(rows).splitlines()[0].split() == ["system", "metric", "ours", "paper", "device/backend"]


def test_threads_are_set_in_one_place():
    """torch's thread count is set only by impl.common.execution.set_torch_threads (each worker
    process calls it with the count its job's execution decision gave it)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    setters = [str(p.relative_to(root)) for pkg in ("impl", "bench", "faults") for p in (root / pkg).rglob("*.py")
               if "set_num_threads(" in p.read_text(encoding="utf-8")]
    assert setters == ["impl/common/execution.py"], setters


GPU8 = ("adaptra", "ckpt_recovery", "hotspa", "hydraulis", "lobra", "malleus")


@pytest.mark.parametrize("system", GPU8)
def test_every_gpu8_preset_is_refused_in_one_line_naming_the_missing_gpus(system):
    assert (REPO / "conf" / "experiment" / "gpu8" / f"{system}.yaml").exists()
    if torch.cuda.device_count() >= 8:
        pytest.skip("8 GPUs present: the refusal is for smaller hosts")
    err = preflight([f"experiment=gpu8/{system}"])
    n = torch.cuda.device_count()
    assert err == (f"execution.min_gpus: this job needs 8 GPUs on one node, {n} visible "
                   f"(torch.cuda.device_count()); execution=estimate runs its rank 0 on any host")


def test_gpu8_presets_exit_non_zero_with_the_refusal_line_on_a_smaller_host(tmp_path):
    if torch.cuda.device_count() >= 8:
        pytest.skip("8 GPUs present")
    proc = run_bench(["experiment=gpu8/lobra", f"results_dir={tmp_path}"])
    assert proc.returncode != 0 and "execution.min_gpus: this job needs 8 GPUs" in proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("record.json"))  # refused before any work


def test_a_rank0_scope_is_refused_for_a_system_without_a_rank0_builder():
    err = preflight(["experiment=gpu8/malleus", "execution=estimate"])
    assert err == "execution.ranks: system 'malleus' has no rank-0 builder (execution=estimate / rank0 run hotspa and lobra)"
    assert ExecutionConfig(ranks="estimate").ranks == "estimate"
    with pytest.raises(ConfigError, match="execution.ranks"):
        ExecutionConfig(ranks="some")
