import numpy as np
import pytest
import torch
from skimage.filters import threshold_otsu

from impl.common.api import ConfigError
from impl.fisedit.cache import ActivationCache, CacheMiss
from impl.fisedit.mask import (capture_mask, check_mask, check_pool_factors, difference_map, layer_mask, offline_mask,
                               opening, otsu_mask)


def _planted(seed=0, H=32, W=32, steps=4):
    g = torch.Generator().manual_seed(seed)
    region = torch.zeros(H, W, dtype=torch.bool)
    region[8:20, 10:26] = True
    zo = [torch.randn(1, 4, H, W, generator=g) for _ in range(steps)]
    ze = [z + 0.05 * torch.randn(1, 4, H, W, generator=g) + 1.0 * region * torch.randn(1, 4, H, W, generator=g)
          for z in zo]
    return ze, zo, region


def test_otsu_threshold_equals_scikit_image_reference():
    ze, zo, _ = _planted()
    S = difference_map(ze, zo)
    m, t = otsu_mask(S)
    assert t == float(threshold_otsu(S))
    assert np.array_equal(m, opening(S > threshold_otsu(S)))


def test_planted_region_iou_and_determinism():
    ze, zo, region = _planted()
    m1, info = capture_mask(ze, zo)
    m2, _ = capture_mask(ze, zo)
    assert torch.equal(m1, m2)
    iou = float((m1 & region).sum()) / float((m1 | region).sum())
    assert iou >= 0.9, iou


def test_opening_removes_isolated_specks():
    S = np.zeros((16, 16), dtype=np.uint8)
    S[3, 3] = 255
    S[8:12, 8:12] = 200
    m, _ = otsu_mask(S)
    assert not m[3, 3] and m[8:12, 8:12].all()
    assert offline_mask(S)[8:12, 8:12].all() and not offline_mask(S)[3, 3]


def test_layer_masks_by_max_pooling():
    m = torch.zeros(8, 8, dtype=torch.bool)
    m[5, 2] = True
    l4 = layer_mask(m, (4, 4))
    assert l4[2, 1] and int(l4.sum()) == 1
    assert int(layer_mask(m, (2, 2)).sum()) == 1


def test_bad_pool_factor_and_mask_shape_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"latent 18x18 is not divisible by pool factor\(s\) 4"):
        check_pool_factors((18, 18), [1, 2, 4])
    with pytest.raises(ConfigError, match="mask shape"):
        check_mask(torch.ones(8, 8), (16, 16))


def test_cache_steps_never_misalign():
    c = ActivationCache()
    c.begin_step(0)
    c.put(0, "a", torch.ones(2))
    with pytest.raises(RuntimeError, match="misaligned"):
        c.put(1, "a", torch.ones(2))
    c.end_step(0)
    with pytest.raises(CacheMiss):
        c.get(1, "a")
    with pytest.raises(RuntimeError, match="twice"):
        c.begin_step(0)


def test_cache_from_another_seed_or_scheduler_is_rejected():
    c = ActivationCache(meta={"seed": 0, "scheduler": "S:1", "timesteps": [3, 2], "latent_shape": (1, 4, 8, 8)})
    with pytest.raises(ConfigError, match="recorded with seed 0"):
        c.check_compatible(seed=1, scheduler="S:1", timesteps=[3, 2], latent_shape=(1, 4, 8, 8))
    with pytest.raises(ConfigError, match="scheduler"):
        c.check_compatible(seed=0, scheduler="T:2", timesteps=[3, 2], latent_shape=(1, 4, 8, 8))
