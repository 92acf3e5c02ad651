"""system=harness/calibrate at toy sizes: it writes a valid HardwareProfile, atomically, and a plot."""
from __future__ import annotations

import math
import os
import pathlib

import pytest
from omegaconf import OmegaConf

from impl.common.api import ConfigError, JobContext, RunResult
from bench.calibrate.system import Calibrate, CalibrateConfig, resolve_output, write_profile_atomic
from impl.common.hardware import HardwareProfile

REPO = pathlib.Path(__file__).resolve().parents[2]

TINY = dict(matmul_sizes=[16, 32], dtypes=["fp32", "bf16"], warmup=1, repeats=3, min_repeats=2,
            max_seconds_per_measurement=0.5, mem_bw_bytes=1 << 20, comm_procs=2,
            p2p_sizes_bytes=[8, 4096, 65536], allreduce_sizes_bytes=[8, 65536], comm_timeout_s=60.0,
            device="cpu")


def make_job(out_dir: pathlib.Path) -> JobContext:
    return JobContext(mode="real", seed=0, experiment="test", workload=None, workload_name="demo",
                      hardware=HardwareProfile(), hardware_name="none", fault=None, fault_name="none",
                      out_dir=out_dir, show_progress=False)


def load_profile(path: pathlib.Path) -> HardwareProfile:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareProfile), OmegaConf.load(path)))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    target = root / "hw" / "local.yaml"  # absolute path; the folder does not exist yet
    out_dir = root / "run"
    result = Calibrate(CalibrateConfig(**TINY, output=str(target)), "calibrate").run(make_job(out_dir))
    return result, target, out_dir


@pytest.mark.real
def test_profile_written_and_valid(calibrated):
    result, target, _ = calibrated
    assert isinstance(result, RunResult) and result.status == "ok"
    assert result.info["output"] == str(target)
    hw = load_profile(target)
    assert hw.name == "local" and hw.measured is True
    assert hw.source.startswith("measured by system=harness/calibrate on ")
    assert hw.mfu == 1.0 and hw.comm_efficiency == 1.0
    assert set(hw.peak_flops) == {"fp32", "bf16"}
    assert set(hw.diffusion.conv_flops) == {"fp32", "bf16"} and all(v > 0 for v in hw.diffusion.conv_flops.values())
    for rates in (hw.diffusion.conv_window_flops, hw.diffusion.window_gather_bytes_per_s, hw.diffusion.window_scatter_bytes_per_s, hw.diffusion.attn_flops,
                  hw.diffusion.cell_gather_bytes_per_s, hw.diffusion.cell_scatter_bytes_per_s, hw.diffusion.token_gather_bytes_per_s,
                  hw.diffusion.token_scatter_bytes_per_s, hw.diffusion.linear_flops, hw.diffusion.activation_bytes_per_s, hw.diffusion.elementwise_bytes_per_s):
        assert set(rates) == {"fp32", "bf16"} and all(v > 0 for v in rates.values())
    assert 0 < hw.diffusion.host_dispatch_s < 1e-3  # CPU host: one tiny call, measured
    for value in [*hw.peak_flops.values(), hw.memory_bytes, hw.memory_bw_bytes_per_s,
                  hw.intra_node_bw_bytes_per_s, hw.intra_node_latency_s, hw.inter_node_bw_bytes_per_s,
                  hw.inter_node_latency_s, hw.host_link_bw_bytes_per_s, hw.host_mem_bw_bytes_per_s,
                  hw.allreduce_bw_bytes_per_s, hw.allreduce_latency_s]:
        assert value is not None and math.isfinite(value) and value > 0
    assert hw.gpus_per_node >= 1
    text = target.read_text()
    assert "MEASURED ACHIEVABLE" in text  # the header comment says what these numbers are


@pytest.mark.real
def test_write_is_atomic_no_temp_left(calibrated):
    _, target, _ = calibrated
    assert sorted(p.name for p in target.parent.iterdir()) == ["local.yaml"]


@pytest.mark.real
def test_metrics_and_plot(calibrated):
    result, target, out_dir = calibrated
    m = result.metrics
    expected = {"matmul_fp32_flops": ("FLOP/s", "higher"), "matmul_bf16_flops": ("FLOP/s", "higher"),
                "mem_bw_bytes_per_s": ("B/s", "higher"), "host_mem_bw_bytes_per_s": ("B/s", "higher"),
                "host_link_bw_bytes_per_s": ("B/s", "higher"), "p2p_latency_s": ("s", "lower"),
                "p2p_bw_bytes_per_s": ("B/s", "higher"), "allreduce_latency_s": ("s", "lower"),
                "allreduce_bw_bytes_per_s": ("B/s", "higher")}
    assert set(expected) <= set(m)
    for name, (unit, better) in expected.items():
        assert (m[name].unit, m[name].better) == (unit, better), name
        assert math.isfinite(m[name].value) and m[name].value > 0, name
        assert m[name].n >= TINY["min_repeats"], name
    # The profile holds the metrics (rounded to 4 significant digits).
    hw = load_profile(target)
    assert hw.peak_flops["fp32"] == pytest.approx(m["matmul_fp32_flops"].value, rel=1e-3)
    assert hw.intra_node_latency_s == pytest.approx(m["p2p_latency_s"].value, rel=1e-3)
    assert hw.allreduce_bw_bytes_per_s == pytest.approx(m["allreduce_bw_bytes_per_s"].value, rel=1e-3)
    # CPU-only: the host link is a stand-in, and the record must say so.
    assert any("host_link" in e for e in result.emulated)
    assert result.artifacts == ["calibrate_p2p.png"]
    png = out_dir / result.artifacts[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(result.info["p2p_one_way_s"]) == {"8", "4096", "65536"}


def test_relative_output_resolves_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_output("conf/hardware/local.yaml") == tmp_path / "conf" / "hardware" / "local.yaml"
    assert resolve_output(str(tmp_path / "x.yaml")) == tmp_path / "x.yaml"


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "local.yaml"
    target.write_text("old\n")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    hw = HardwareProfile(name="local", source="test", measured=True, peak_flops={"fp32": 1.0})
    with pytest.raises(OSError, match="disk full"):
        write_profile_atomic(hw, target, "# header\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["local.yaml"]


def test_system_yaml_validates_against_config():
    node = OmegaConf.load(REPO / "conf" / "system" / "harness" / "calibrate.yaml")
    assert node._target_ == "bench.calibrate.system.Calibrate" and "name" not in node  # the stem names it
    data = {k: v for k, v in OmegaConf.to_container(node).items() if k not in ("_target_", "name")}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Calibrate.Config), data))
    assert cfg == CalibrateConfig()  # the yaml states the defaults
    assert Calibrate.modes == ("real",)


@pytest.mark.parametrize("bad, field", [({"dtypes": ["fp64"]}, "system.dtypes"),
                                        ({"comm_procs": 1}, "system.comm_procs"),
                                        ({"p2p_sizes_bytes": []}, "system.p2p_sizes_bytes"),
                                        ({"device": "tpu"}, "system.device"),
                                        ({"threads": -1}, "system.threads"),
                                        ({"host_malloc": "jemalloc"}, "system.host_malloc"),
                                        ({"repeats": 1, "min_repeats": 3}, "system.repeats")])
def test_bad_knobs_fail_with_one_line_naming_the_field(bad, field):
    with pytest.raises(ConfigError) as err:
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Calibrate.Config), bad))
    assert str(err.value).startswith(field + ":") and "\n" not in str(err.value)


def test_weights_evictor_runs_untimed_before_every_timed_sample_only():
    import torch

    from bench.calibrate import system as cal

    cfg = CalibrateConfig(warmup=2, repeats=4, min_repeats=4)
    log = []
    samples = cal._timed_samples(lambda: log.append("call"), lambda: None, cfg, lambda: log.append("before"))
    assert len(samples) == 4
    assert log == ["call", "call"] + ["before", "call"] * 4  # warm-up calls are not preceded
    x = torch.randn(8)
    keep = x.clone()
    evict = cal.weights_evictor(torch.device("cpu"), x)
    evict()
    assert torch.equal(x, keep)  # the input is only read back, never written
    assert cal.weights_evictor(torch.device("meta"), x) is None  # GPUs (any non-CPU device): not evicted


def test_median_profile_takes_each_measured_number_s_median(tmp_path):
    from bench.calibrate.system import median_profile

    paths = []
    for i, (flops, bw) in enumerate([(1e11, 3e9), (3e11, 1e9), (2e11, 2e9)]):
        prof = HardwareProfile(name="local", source=f"run {i}", measured=True, peak_flops={"fp32": flops},
                               intra_node_bw_bytes_per_s=bw, gpus_per_node=1)
        paths.append(tmp_path / f"c{i}.yaml")
        write_profile_atomic(prof, paths[-1], "")
    median_profile(paths, tmp_path / "m.yaml")
    m = OmegaConf.load(tmp_path / "m.yaml")
    assert m.peak_flops.fp32 == 2e11 and m.intra_node_bw_bytes_per_s == 2e9 and m.gpus_per_node == 1
    assert m.source.startswith("median of 3 calibrations") and m.name == "local"
    # a count is not measured: profiles that disagree on it are not merged
    write_profile_atomic(HardwareProfile(name="local", measured=True, peak_flops={"fp32": 1e11},
                                         intra_node_bw_bytes_per_s=1e9, gpus_per_node=2), tmp_path / "c9.yaml", "")
    with pytest.raises(ConfigError, match=r"^calibrate: profiles disagree on gpus_per_node"):
        median_profile(paths + [tmp_path / "c9.yaml"], tmp_path / "m2.yaml")
