"""Engine invariants on a real diffusers UNet (impl/fisedit/README.md, "Correctness invariants")."""
import pytest
import torch

from impl.common.errors import ConfigError
from impl.fisedit.cache import ActivationCache
from impl.fisedit.mask import synthetic_mask
from impl.fisedit.schedules import EDIT_SCHEDULES

N = 4


def test_all_zeros_mask_returns_cached_eps_bitwise(pipe):
    orig = pipe.record("a cat", seed=0, num_steps=N, decode=False)
    z = torch.zeros(16, 16, dtype=torch.bool)
    ed = pipe.edit("a dog", seed=0, num_steps=N, cache=orig.cache, schedule="supplied", mask_steps=1, mask=z,
                   decode=False)
    for i, ph in enumerate(ed.phases):
        if ph == "sparse":
            assert torch.equal(ed.eps[i], orig.eps[i]), f"step {i}"
            assert torch.equal(ed.latents[i], orig.latents[i])
    assert ed.phases == ["sparse"] * (N - 1) + ["dense"]


@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_all_ones_mask_exact_mode_equals_dense_edit(pipe, engine):
    if engine != pipe.state.engine:
        pipe.set_engine(engine)
    # the fast engine would plan a fully covered map dense (dense_tile_fraction 1.0): force its
    # sparse path so the gathers and scatters are what is checked
    pipe.state.dense_tile_fraction = 1.01
    pipe.state.exact = True
    orig = pipe.record("a cat", seed=0, num_steps=N, decode=False)
    ones = torch.ones(16, 16, dtype=torch.bool)
    pipe.state.counts.clear()
    ed = pipe.edit("a dog", seed=0, num_steps=N, cache=orig.cache, schedule="supplied", mask_steps=1, mask=ones,
                   dense_fallback_ratio=1.0, decode=False)
    assert pipe.state.counts["sparse_conv"] > 0 and pipe.state.counts["sparse_attention"] > 0
    dense = pipe.dense("a dog", seed=0, num_steps=N, decode=False)
    for a, b in zip(ed.eps, dense.eps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unchanged_prompt_reproduces_original(pipe):
    pipe.guidance = 1.0
    orig = pipe.record("a cat", seed=0, num_steps=N, decode=False)
    m = synthetic_mask((16, 16), 0.2, seed=1)
    ed = pipe.edit("a cat", seed=0, num_steps=N, cache=orig.cache, schedule="supplied", mask_steps=1, mask=m,
                   decode=False)
    for a, b in zip(ed.eps, orig.eps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # per-step eps agree to 1e-5; the solver's x0 = (z - sigma*eps)/alpha amplifies last-bit
    # differences of the patch convs by 1/alpha on the way to the final latent
    torch.testing.assert_close(ed.latent, orig.latent, rtol=1e-4, atol=1e-4)


def test_recorded_entries_equal_fresh_recompute_and_roundtrip(pipe, tmp_path):
    a = pipe.record("a cat", seed=0, num_steps=2, decode=False).cache
    b = pipe.record("a cat", seed=0, num_steps=2, decode=False).cache
    assert a.entries.keys() == b.entries.keys()
    for s in a.entries:
        assert a.entries[s].keys() == b.entries[s].keys()
        for k in a.entries[s]:
            assert torch.equal(a.entries[s][k], b.entries[s][k]), (s, k)
    c = ActivationCache.load(a.save(tmp_path / "cache.pt"))
    for s in a.entries:
        for k in a.entries[s]:
            assert torch.equal(a.entries[s][k], c.entries[s][k])
    assert c.meta["seed"] == 0 and c.nbytes == a.nbytes


def test_budget_drops_whole_steps_and_edit_runs_them_dense(pipe):
    full = pipe.record("a cat", seed=0, num_steps=3, decode=False).cache
    per_step = full.step_bytes(0)
    small = pipe.record("a cat", seed=0, num_steps=3, budget_bytes=per_step * 1.5, decode=False).cache
    assert list(small.entries) == [0] and small.skipped_steps == [1, 2]
    ed = pipe.edit("a dog", seed=0, num_steps=3, cache=small, schedule="supplied", mask_steps=1,
                   mask=synthetic_mask((16, 16), 0.1), decode=False)
    assert ed.phases == ["sparse", "dense", "dense"]


def test_online_schedule_captures_mask_then_goes_sparse(pipe):
    orig = pipe.record("a cat", seed=0, num_steps=N, decode=False)
    ed = pipe.edit("a dog", seed=0, num_steps=N, cache=orig.cache, schedule="online", mask_steps=2,
                   dense_fallback_ratio=1.0, decode=False)
    assert ed.phases[:2] == ["dense", "dense"]
    assert ed.mask is not None and ed.mask_info["method"] == "otsu"
    assert set(ed.phases[2:]) == {"sparse"}


def test_unknown_schedule_is_one_line_naming_the_known_ones(pipe):
    orig = pipe.record("a cat", seed=0, num_steps=2, decode=False)
    with pytest.raises(ConfigError) as err:
        pipe.edit("a dog", seed=0, num_steps=2, cache=orig.cache, schedule="offline", mask_steps=1, decode=False)
    assert str(err.value) == "schedule: unknown value 'offline' (one of: supplied, online)"


def test_online_mask_override_replaces_the_captured_mask(pipe):
    orig = pipe.record("a cat", seed=0, num_steps=N, decode=False)
    m = synthetic_mask((16, 16), 0.2, seed=3)
    ed = pipe.edit("a dog", seed=0, num_steps=N, cache=orig.cache, schedule="online", mask_steps=2,
                   dense_fallback_ratio=1.0, decode=False, **EDIT_SCHEDULES.get("online").mask_args(m))
    assert torch.equal(ed.mask, m) and ed.mask_info["override_ratio"] == float(m.float().mean())
    sup = pipe.edit("a dog", seed=0, num_steps=N, cache=orig.cache, schedule="supplied", mask_steps=2,
                    decode=False, **EDIT_SCHEDULES.get("supplied").mask_args(m))
    assert sup.phases == ["sparse"] * (N - 2) + ["dense"] * 2


def test_large_mask_falls_back_to_dense_and_says_so(pipe):
    orig = pipe.record("a cat", seed=0, num_steps=2, decode=False)
    ed = pipe.edit("a dog", seed=0, num_steps=2, cache=orig.cache, schedule="supplied", mask_steps=1,
                   mask=synthetic_mask((16, 16), 0.8), dense_fallback_ratio=0.5, decode=False)
    assert ed.dense_fallback and set(ed.phases) == {"dense"}


def test_dense_edit_loop_equals_stock_diffusers_pipeline(pipe):
    from impl.common.diffusion.pipelines import sd_pipeline
    from impl.fisedit.real import stock_unet

    d = pipe.dense("a dog", seed=0, num_steps=3, decode=False)
    with stock_unet(pipe):
        sd = sd_pipeline(pipe.c)
        lat = sd(prompt="a dog", negative_prompt="", num_inference_steps=3, latents=pipe.initial_latent(0),
                 height=128, width=128, output_type="latent", guidance_scale=pipe.guidance).images
    assert torch.equal(lat, d.latent)
