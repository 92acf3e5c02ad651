"""Every datasheet profile in conf/hardware validates against HardwareProfile and agrees with
itself, with its sibling GPUs and with the figures the systems' READMEs quote."""
from __future__ import annotations

import dataclasses
import math
import pathlib

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from impl.common.hardware import HardwareProfile

REPO = pathlib.Path(__file__).resolve().parents[2]
HW_DIR = REPO / "conf" / "hardware"
PROFILE_PATHS = sorted(p for p in HW_DIR.glob("*.yaml") if not p.name.startswith("local"))  # local*: calibrated
GPU_PROFILES = ["a100-40g", "a100-80g", "a800-80g", "a10", "h100-sxm", "h800", "h200", "titan-rtx"]
KNOWN_DTYPES = {"fp32", "tf32", "fp16", "bf16", "fp8"}
POSITIVE = ["memory_bytes", "memory_bw_bytes_per_s", "gpus_per_node", "intra_node_bw_bytes_per_s",
            "intra_node_latency_s", "inter_node_bw_bytes_per_s", "inter_node_latency_s",
            "host_link_bw_bytes_per_s", "host_mem_bw_bytes_per_s", "mfu", "comm_efficiency"]
GiB = 2**30


def load(path: pathlib.Path) -> HardwareProfile:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareProfile), OmegaConf.load(path)))


def profile(name: str) -> HardwareProfile:
    return load(HW_DIR / f"{name}.yaml")


def test_all_expected_profiles_exist():
    names = {p.stem for p in PROFILE_PATHS}
    assert set(GPU_PROFILES) | {"cpu-2core"} <= names


@pytest.mark.parametrize("path", PROFILE_PATHS, ids=lambda p: p.stem)
def test_profile_validates_and_is_complete(path):
    raw = OmegaConf.load(path)
    # Every field written out explicitly: nothing silently falls back to a dataclass default.
    assert set(raw.keys()) == {f.name for f in dataclasses.fields(HardwareProfile)}
    hw = load(path)
    assert hw.name == path.stem
    assert hw.measured is False
    assert hw.source and hw.source != "???"
    assert hw.peak_flops and set(hw.peak_flops) <= KNOWN_DTYPES
    assert "fp32" in hw.peak_flops
    for dtype, value in hw.peak_flops.items():
        assert math.isfinite(value) and value > 0, dtype
    for name in POSITIVE:
        value = getattr(hw, name)
        assert math.isfinite(value) and value > 0, name
    assert 0 < hw.mfu <= 1 and 0 < hw.comm_efficiency <= 1
    assert hw.allreduce_bw_bytes_per_s is None and hw.allreduce_latency_s is None  # datasheet, not measured
    assert float(hw.memory_bytes).is_integer()


@pytest.mark.parametrize("path", PROFILE_PATHS, ids=lambda p: p.stem)
def test_profile_cites_its_sources_in_a_comment(path):
    comments = [ln for ln in path.read_text().splitlines() if ln.lstrip().startswith("#")]
    assert any("source" in ln.lower() for ln in comments), "needs a '# Sources' comment block"
    assert any("https://" in ln for ln in comments), "needs at least one URL in the comments"


def test_unknown_key_is_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((HW_DIR / "a100-80g.yaml").read_text() + "nvlink_gbps: 600\n")
    with pytest.raises(ConfigKeyError):
        load(bad)


@pytest.mark.parametrize("path", PROFILE_PATHS, ids=lambda p: p.stem)
def test_profile_sections_are_typed(path):
    # the diffusion engines' rates and the step model's inputs are sections of their own
    from impl.common.hardware import DiffusionRates, MegatronSection, load_hardware

    raw = OmegaConf.load(path)
    assert set(raw["megatron"].keys()) == {f.name for f in dataclasses.fields(MegatronSection)}
    hw = load_hardware(str(path))
    assert isinstance(hw.diffusion, DiffusionRates) and isinstance(hw.megatron, MegatronSection)
    assert hw.megatron.carried_from and (HW_DIR / f"{hw.megatron.carried_from}.yaml").is_file()


def test_a_flat_diffusion_rate_is_one_line_naming_its_new_place(tmp_path):
    from impl.common.api import ConfigError
    from impl.common.hardware import load_hardware

    old = tmp_path / "old.yaml"
    old.write_text((HW_DIR / "a100-80g.yaml").read_text().replace("diffusion: {}", "conv_flops: {fp32: 1.0e12}"))
    with pytest.raises(ConfigError, match=r"hardware\.conv_flops: moved to hardware\.diffusion\.conv_flops") as e:
        load_hardware(str(old))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_gpu_dtype_ordering(name):
    hw = profile(name)
    f = hw.peak_flops
    assert f["fp16"] > f["fp32"]
    if "bf16" in f:
        assert f["bf16"] == f["fp16"]
    if "tf32" in f:
        assert f["fp32"] < f["tf32"] < f["fp16"]
    if "fp8" in f:
        assert f["fp8"] == pytest.approx(2 * f["fp16"], rel=1e-3)
    # Intra-node links beat the network per GPU; HBM/GDDR beats every link.
    assert hw.intra_node_bw_bytes_per_s > hw.inter_node_bw_bytes_per_s
    assert hw.memory_bw_bytes_per_s > hw.intra_node_bw_bytes_per_s
    assert hw.intra_node_latency_s <= hw.inter_node_latency_s
    assert hw.flops("fp16") == pytest.approx(f["fp16"] * hw.mfu)


def test_sibling_profiles_differ_only_where_expected():
    assert_same_except("h800", "h100-sxm", {"intra_node_bw_bytes_per_s"})
    assert_same_except("a800-80g", "a100-80g", {"intra_node_bw_bytes_per_s"})
    assert_same_except("a100-40g", "a100-80g", {"memory_bytes", "memory_bw_bytes_per_s"})
    assert_same_except("h200", "h100-sxm", {"memory_bytes", "memory_bw_bytes_per_s"})


def assert_same_except(a: str, b: str, differing: set[str]) -> None:
    pa, pb = profile(a), profile(b)
    skip = {"name", "source"} | differing
    for f in dataclasses.fields(HardwareProfile):
        if f.name not in skip:
            assert getattr(pa, f.name) == getattr(pb, f.name), f"{a} vs {b}: {f.name}"
    for name in differing:
        assert getattr(pa, name) != getattr(pb, name), f"{a} vs {b}: {name} should differ"


def test_datasheet_headlines():
    # Bidirectional NVLink headlines / 2 = the per-direction figure stored.
    assert profile("a100-80g").intra_node_bw_bytes_per_s * 2 == 600e9
    assert profile("a800-80g").intra_node_bw_bytes_per_s * 2 == 400e9
    assert profile("h100-sxm").intra_node_bw_bytes_per_s * 2 == 900e9
    assert profile("h800").intra_node_bw_bytes_per_s * 2 == 400e9
    assert profile("h200").intra_node_bw_bytes_per_s * 2 == 900e9
    assert profile("a100-40g").memory_bytes == 40 * GiB
    assert profile("a100-80g").memory_bytes == 80 * GiB
    assert profile("h200").memory_bytes == 141 * GiB
    assert profile("h200").memory_bw_bytes_per_s > profile("h100-sxm").memory_bw_bytes_per_s
    assert profile("a10").peak_flops["fp16"] == 125e12
    assert profile("titan-rtx").peak_flops["fp16"] == pytest.approx(130e12, rel=0.01)
    assert profile("titan-rtx").memory_bw_bytes_per_s == 672e9


def test_consistent_with_adaptra_spec_section_6():
    # ADAPTRA's sim profiles [R] (impl/adaptra/README.md):
    # "A100 312 TF, NVLink 600 GB/s, IB 200 Gb/s, PCIe4 25 GB/s; H100 989 TF, 900 GB/s,
    #  400 Gb/s, PCIe5 50 GB/s; H800 = H100 with NVLink 400 GB/s" at MFU 0.4.
    cases = [("a100-80g", 312e12, 600e9, 200e9 / 8, 25e9), ("h100-sxm", 989e12, 900e9, 400e9 / 8, 50e9),
             ("h800", 989e12, 400e9, 400e9 / 8, 50e9)]
    for name, tf, nvlink_bidir, ib, pcie_achieved in cases:
        hw = profile(name)
        assert hw.mfu == 0.4
        assert hw.peak_flops["bf16"] == pytest.approx(tf, rel=1e-3), name
        assert 2 * hw.intra_node_bw_bytes_per_s == pytest.approx(nvlink_bidir), name
        assert hw.inter_node_bw_bytes_per_s == pytest.approx(ib), name
        # The quoted PCIe figure is an achievable rate: comm_efficiency x the per-direction peak.
        assert hw.comm_efficiency * hw.host_link_bw_bytes_per_s == pytest.approx(pcie_achieved, rel=0.03), name


def test_old_bus_bandwidth_knob_is_one_line_naming_the_new_field(tmp_path):
    from impl.common.api import ConfigError
    from impl.common.hardware import load_hardware

    p = tmp_path / "old.yaml"
    p.write_text("name: old\nmegatron:\n  knobs:\n    intra_node_bus_bw_bytes_per_s: 4.5e11\n")
    with pytest.raises(ConfigError, match="intra_node_comm_efficiency") as e:
        load_hardware(str(p))
    assert "\n" not in str(e.value)
