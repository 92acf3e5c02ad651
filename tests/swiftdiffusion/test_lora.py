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


@pytest.mark.parametrize("n_cn", [0, 1, 2])
def test_diffusers_pipeline_baseline_equals_sync_merge_and_weights_stay_pristine(wl, bundle, tmp_path, n_cn):
    """The full pipeline API (load_lora_weights / set_adapters / fuse_lora, then unfuse / unload)
    against our synchronous direct merge, request by request with different LoRAs."""
    import dataclasses

    from impl.swiftdiffusion.bal_run import storage_for, sync_request
    from impl.swiftdiffusion.diffusers_pipeline import build_pipeline, pipeline_request, weight_drift

    w = dataclasses.replace(wl, num_steps=3, lora_paper_bytes=1e5, remote_latency_s=0.0)
    unet = copy.deepcopy(bundle.unet)
    ids = list(bundle.controlnets)[:n_cn]
    pipe = build_pipeline(bundle, w, 0, ids)
    kinds = {0: "StableDiffusionPipeline", 1: "StableDiffusionControlNetPipeline",
             2: "StableDiffusionControlNetPipeline"}
    assert type(pipe).__name__ == kinds[n_cn]
    if n_cn == 2:
        assert type(pipe.controlnet).__name__ == "MultiControlNetModel"
    pipe_w0 = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    table = TargetTable.build(unet)
    paths = [str(make_lora(unet, r, 20 + i, tmp_path / f"l{i}", alpha=2.0 * r, dtype=torch.float16))
             for i, r in enumerate([8, 4, 16])]
    storage = storage_for(w)
    cns, scales = [bundle.controlnets[k] for k in ids], [0.5, 0.8][:n_cn]
    timings = {}
    for req, idx in enumerate([[0, 1], [2], [1, 2]]):
        inp = request_inputs(w, 40 + req, n_cn, bundle)
        run = lambda h: denoise(unet, bundle.scheduler, inp, w.num_steps, w.guidance_scale,  # noqa: E731
                                controlnets=cns, scales=scales, before_step=h)
        ref = sync_request(table, storage, paths, idx, run, w.lora_paper_bytes)
        assert check_pristine(table)  # ours: restored by copy after every request
        out = pipeline_request(pipe, storage, paths, idx, w, inp, scales, tmp_path / "cache", timings)
        # Same fp16 LoRA values, same fp32 kernels: the first request is bit-equal. diffusers'
        # unfuse subtracts the delta back, so later requests start from drifted weights (~1e-7 abs)
        # and differ by ~2e-6 relative: the bound is the project's fp32 tolerance, 1e-5.
        if req == 0:
            assert torch.equal(out, ref)
        assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
        assert not torch.allclose(out, run(None), atol=1e-4)  # the LoRAs are applied
        # diffusers unfuses by subtraction: close to, not necessarily equal to, the base weights
        assert weight_drift(pipe.unet, pipe_w0) <= 1e-5
        assert not any("lora" in k for k in pipe.unet.state_dict())  # unloaded
    assert len(timings["pipeline_load_fuse_s"]) == 3
