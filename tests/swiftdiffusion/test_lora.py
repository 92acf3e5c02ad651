import copy
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from impl.common.api import ConfigError
from impl.swiftdiffusion.bal import PatchPolicy, bal_request, check_k, expected_patch_step
from impl.swiftdiffusion.denoise import denoise
from impl.swiftdiffusion.lora import TargetTable, check_pristine, load_direct, make_lora, merge, restore
from impl.swiftdiffusion.models import request_inputs


@pytest.fixture(scope="module")
def loras(bundle, tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return [make_lora(bundle.unet, r, 7 + i, d / f"l{i}", alpha=a) for i, (r, a) in enumerate([(8, 16.0), (4, 2.0)])]


def _fwd(unet, x):
    return unet(x, torch.tensor(400), encoder_hidden_states=torch.ones(1, 16, 32) * 0.1).sample


@torch.no_grad()
def test_merged_two_loras_equal_peft_unmerged_and_restore_is_bit_identical(bundle, loras):
    unet = copy.deepcopy(bundle.unet)
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    base = _fwd(unet, x)
    peft = copy.deepcopy(unet)
    for i, p in enumerate(loras):
        peft.load_lora_adapter(str(p.parent), prefix="unet", adapter_name=f"a{i}", weight_name=p.name)
    peft.set_adapters(["a0", "a1"], [1.0, 1.0])
    ref = _fwd(peft, x)  # PEFT's unmerged LoRA layers, each adapter at its own alpha/r
    table = TargetTable.build(unet)
    ls = [load_direct(p, table, f"l{i}", dtype=torch.float32) for i, p in enumerate(loras)]
    assert [lo.scale for lo in ls] == [2.0, 0.5]
    touched = merge(table, ls)
    out = _fwd(unet, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, base, atol=1e-4)  # the LoRAs change the output
    one = copy.deepcopy(peft)
    one.set_adapters(["a0"], [1.0])
    assert not torch.allclose(_fwd(one, x), ref, atol=1e-4)  # both LoRAs are applied
    restore(table, touched)
    assert check_pristine(table)
    assert torch.equal(_fwd(unet, x), base)


@torch.no_grad()
def test_no_lora_request_after_many_lora_requests_equals_pristine(wl, bundle, loras):
    unet = copy.deepcopy(bundle.unet)
    table = TargetTable.build(unet)
    inp = request_inputs(wl, 5, 0, bundle)
    pristine = denoise(unet, bundle.scheduler, inp, 3, 7.5)
    for n in range(4):
        lo = [load_direct(loras[n % 2], table, "x")] + ([load_direct(loras[1], table, "y")] if n == 3 else [])
        touched = merge(table, lo)
        assert not torch.equal(denoise(unet, bundle.scheduler, inp, 3, 7.5), pristine)
        restore(table, touched)
    assert torch.equal(denoise(unet, bundle.scheduler, inp, 3, 7.5), pristine)


def test_bad_lora_files_are_one_line(bundle, loras, tmp_path):
    table = TargetTable.build(bundle.unet)
    sd = load_file(str(loras[0]))
    from safetensors import safe_open
    with safe_open(str(loras[0]), "pt") as f:
        meta = f.metadata()
    k = next(k for k in sd if k.endswith("lora_A.weight"))
    bad = dict(sd)
    bad[k.replace("to_q", "to_zz").replace("to_k", "to_zz").replace("to_v", "to_zz")] = bad.pop(k)
    save_file(bad, str(tmp_path / "missing.safetensors"), metadata=meta)
    with pytest.raises(ConfigError, match=r"lora m: target '.*to_zz.*' does not exist in the UNet"):
        load_direct(tmp_path / "missing.safetensors", table, "m")
    bad = dict(sd)
    bad[k] = bad[k][:3]
    save_file(bad, str(tmp_path / "rank.safetensors"), metadata=meta)
    with pytest.raises(ConfigError, match=r"lora r: rank mismatch at .*lora_A has 3 rows, lora_B 8 columns, the file's r is 8"):
        load_direct(tmp_path / "rank.safetensors", table, "r")
    with pytest.raises(ConfigError, match=r"system.k \(patch step bound K\) must be >= 0, got -1"):
        check_k(-1)


class FakeLoaders:
    """Loads finish before the given steps (deterministic stand-in for the loader processes)."""

    def __init__(self, done_at):
        self.done_at, self.step, self.waited = done_at, 0, False

    def all_done(self):
        return self.step >= self.done_at

    def wait_all(self):
        self.waited = not self.all_done()
        self.step = max(self.step, self.done_at)


@pytest.mark.parametrize("done_at,k", [(3, 10), (12, 5), (0, 0), (4, 4), (7, 0)])
def test_patch_step_is_min_first_loaded_and_k(done_at, k):
    f = FakeLoaders(done_at)
    pol = PatchPolicy(k, f.all_done, f.wait_all, lambda: {"w"})
    for i in range(20):
        f.step = max(f.step, i)
        pol.before_step(i)
    assert pol.patched_at == expected_patch_step(pol.first_all_done, k) == min(done_at, k)
    assert f.waited == (done_at > k)
