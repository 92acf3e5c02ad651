"""CaraServe's cold start with the model on a device apart from the host adapters (README "On a GPU").

The bug seen on an H200: the pinned host adapters met activations on cuda in the device path.
These tests keep the model's "device" genuinely apart from the host adapters, so any host tensor
that reaches the device path (or any device activation that reaches the CPU path unconverted)
fails as it did there:
- ``cpu-fp64``: the model runs in float64 on the CPU; the host adapters are separate fp32
  buffers. torch refuses an fp32 weight against fp64 activations exactly as it refuses a host
  weight against cuda activations, so the engine must copy each group into the model's format
  (the loader), and the CPU path must bring the activations to its own fp32 and the delta back.
- ``cuda-fp32`` / ``cuda-bf16``: the real thing, skipped without CUDA.

Tolerances (the CPU path computes in fp32 on the host, the device path in the model's dtype):
fp64 device vs fp32 CPU deltas 1e-6 absolute on logits of magnitude ~1; cuda fp32 1e-4 (TF32 and
kernel order); cuda bf16 2e-2 relative to the logits' scale (our [R] fp16/bf16 GPU tolerance, impl/caraserve/README.md).
"""
from __future__ import annotations

import copy

import pytest
import torch

import impl.common.llm.serving_engine as engine_mod
from impl.caraserve.cpu_prefill import CPULoRAWorker
from impl.common.llm.serving_engine import EngineRequest, ServingEngine, run_alone
from impl.common.llm.forward import InlineCPU
from impl.common.llm.lora import HostAdapter
from impl.caraserve.policies import serving
from impl.common.llm.scheduler import SchedulerConfig
from tests.support.inprocess import run_job

PROMPT = [5 + (11 * i) % 250 for i in range(23)]

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TARGETS = [
    pytest.param("cpu", torch.float64, 1e-6, id="cpu-fp64"),
    pytest.param("cuda", torch.float32, 1e-4, id="cuda-fp32", marks=_cuda),
    pytest.param("cuda", torch.bfloat16, 2e-2, id="cuda-bf16", marks=_cuda),
]


def _host(ads: dict, device: str) -> dict:
    """Host adapters in their own fp32 buffers (pinned for a CUDA device), apart from the model."""
    return {k: HostAdapter(v.name, v.rank, v.scale, {s: t.clone() for s, t in v.A.items()},
                           {s: t.clone() for s, t in v.B.items()}).pin(device) for k, v in ads.items()}


def _setup(tiny, device, dtype):
    base, ads = tiny
    model = copy.deepcopy(base).to(device, dtype)
    host = _host(ads, device)
    resident = {k: v.to(device, dtype) for k, v in host.items()}
    assert all(t.device.type == device and t.dtype == dtype for t in resident["a64"].A.values())
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in host["a64"].A.values())
    return model, host, resident


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, dtype) -> None:
    a, b = a.double().cpu(), b.double().cpu()
    if dtype == torch.bfloat16:  # relative to the logits' scale
        assert (a - b).abs().max().item() <= tol * b.abs().max().item()
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


@pytest.mark.parametrize("device,dtype,tol", TARGETS)
def test_cpu_path_at_any_switch_layer_equals_the_resident_path(tiny, device, dtype, tol):
    model, host, resident = _setup(tiny, device, dtype)
    ref = run_alone(model, resident, "a64", PROMPT, 3)
    assert ref[0].device.type == device and ref[0].dtype == dtype
    cpu = InlineCPU(host)  # the CPU path holds the host adapters, fp32
    L = model.config.num_hidden_layers
    for switch in range(1, L + 1):
        got = run_alone(model, resident, "a64", PROMPT, 3, switch_layer=switch, cpu=cpu)
        _close(got[0], ref[0], tol, dtype)
        if dtype != torch.bfloat16:
            assert got[1] == ref[1]
    assert cpu.jobs == 2 * sum(range(1, L + 1))
    base_only = run_alone(model, resident, None, PROMPT, 1)[0]
    assert (base_only - ref[0]).abs().max().item() > 100 * tol  # the adapter matters at this tolerance


@pytest.mark.parametrize("device,dtype,tol", TARGETS)
def test_engine_cold_prefill_on_the_cpu_path_equals_the_resident_prefill(tiny, device, dtype, tol, monkeypatch):
    """Through the serving engine, as caraserve/real.py runs it: host adapters apart from the
    model, the loader copying group by group (emulated slow, so the first group is still on the
    way), the cold prefill's first layers on the CPU path, then the same prompt resident."""
    model, host, resident = _setup(tiny, device, dtype)
    ref = run_alone(model, resident, "a32", PROMPT, 1)[0]
    seen = []
    orig = engine_mod.ragged_forward

    def spy(m, items, batch=None, cpu=None, **kw):
        out = orig(m, items, batch, cpu, **kw)
        seen.append((out.clone(), cpu is not None))
        return out

    monkeypatch.setattr(engine_mod, "ragged_forward", spy)
    eng = ServingEngine(model, host, SchedulerConfig(policy=serving("caraserve"), pool_slots=2, load_groups=2),
                        seconds_for=lambda a: 0.3, device=device)
    try:
        cold = eng.serve([EngineRequest(0, 0.0, "a32", list(PROMPT), 1)])
        eng.loader.wait("a32")
        warm = eng.serve([EngineRequest(1, 0.0, "a32", list(PROMPT), 1)])
        assert [a for a, _ in eng.loader.times] == ["a32"]
        copies = eng.loader.dev["a32"]
        assert all(a.device.type == device and a.dtype == dtype for a, _ in copies["q_proj"])
    finally:
        eng.close()
    assert cold.cpu_layers >= 1 and warm.cpu_layers == 0
    (cold_logits, _), (warm_logits, _) = seen
    _close(cold_logits, ref, tol, dtype)
    _close(warm_logits, ref, tol, dtype)


@pytest.mark.real
def test_cpu_worker_process_serves_a_device_apart_from_its_host_adapters(tiny, tmp_path):
    model, host, resident = _setup(tiny, "cpu", torch.float64)
    ref = run_alone(model, resident, "a16", PROMPT, 2)
    with CPULoRAWorker(host, tmp_path, max_rows=64) as w:
        assert not (tmp_path / "cpu_worker_adapters.safetensors").exists()  # the worker holds its copy
        got = run_alone(model, resident, "a16", PROMPT, 2, switch_layer=2, cpu=w)
        assert w.jobs == 4
    _close(got[0], ref[0], 1e-6, torch.float64)
    assert got[1] == ref[1]


def test_host_adapters_in_the_device_path_fail_in_one_line(tiny):
    model, host, _ = _setup(tiny, "cpu", torch.float64)
    with pytest.raises(RuntimeError, match=r"^LoRA device path: adapter 'a16' q_proj layer 0 is torch.float32 on cpu, "
                                           r"the activations torch.float64 on cpu"):
        run_alone(model, host, "a16", PROMPT, 1)


def test_real_job_runs_where_the_execution_says(tmp_path):
    """run_real on a CPU job: the device and dtype come from JobContext.execution (CPU, fp32),
    the three policies interleave, and the record has the metrics the gpu_7b paper rows read."""
    res = run_job(["system=caraserve/caraserve", "workload=serving_tiny", "mode=real", "workload.trace.num_requests=4",
                   "system.interleave=[caraserve,ondmd,cached]", "+system.cpu_workers=0", "+system.plots=false",
                   "+workload.slo_reference=isolated"], tmp_path)
    info = res.info
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["adapter_source"] == "peft"
    assert info["load_s_measured"] is False and info["load_s_by_rank"]
    m = res.metrics
    for p in ("caraserve", "ondmd"):
        assert m[f"{p}_ttft_over_cached"].unit == "fraction" and f"{p}_latency_over_cached" in m
    assert all(f"{p}_prefill_iter_mean_s" in m for p in ("caraserve", "ondmd", "cached"))
    assert not any(k.startswith("load_s_r") for k in m)  # emulated copies are no load-time measurement
    assert res.emulated  # the CPU job's H2D copy is emulated, and says so


@pytest.mark.real
def test_gpu_preset_settings_run_on_a_cpu_job_in_bf16(tmp_path):
    """gpu/caraserve_7b's own path on a tiny model, short of CUDA: random adapters drawn on the
    job's device, a bf16 model and bf16 host stacks, the CPU worker computing in fp32 from them,
    per-layer load groups, the three policies interleaved."""
    import pathlib

    from omegaconf import OmegaConf

    from bench.config import compose_config
    from bench.validate import typed_job
    from impl.common.api import JobContext
    from impl.common.execution import Execution

    cfg = compose_config(["system=caraserve/caraserve", "workload=serving_tiny", "mode=real", "workload.trace.num_requests=4",
                          "system.interleave=[caraserve,ondmd,cached]", "+system.adapter_source=random",
                          "+system.plots=false", "+system.load_groups=2", "+workload.slo_reference=isolated"])
    job = typed_job(cfg)
    assert OmegaConf.select(cfg, "system.adapter_source") == "random"
    ctx = JobContext(mode="real", seed=0, experiment="test", workload=job.workload, workload_name="w",
                     hardware=job.hardware, hardware_name=job.hardware.name, fault=job.fault, fault_name="f",
                     out_dir=pathlib.Path(tmp_path), show_progress=False,
                     execution=Execution(device="cpu", dtype="bf16"))
    res = job.system.run(ctx)
    assert res.info["device"] == "cpu" and res.info["dtype"] == "bfloat16" and res.info["adapter_source"] == "random"
    assert "cpu_worker_jobs" in res.info and res.info["isolated_cpu_prefills"]
    assert any(p["cpu_layers"] >= 1 for p in res.info["isolated_cpu_prefills"])  # rank 8 may load first
    assert not list(pathlib.Path(tmp_path).glob("*.safetensors"))
