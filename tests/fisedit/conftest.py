import pytest
import torch

from impl.common.diffusion.pipelines import UNetShape, build_components

# The tiny UNet of conf/workload/diffusion_edit_tiny.yaml at a 16^2 latent: pool factors 1, 2, 4;
# thresholds (H/4)^2 = 16 cells for conv/linear and (H/2)^2 = 64 for attention, so both sparse and
# dense attention run.
TINY = UNetShape(sample_size=16)


@pytest.fixture(scope="session")
def comps():
    torch.set_num_threads(1)
    return build_components(TINY, seed=0, roundtrip=False)


@pytest.fixture()
def pipe(comps):
    from impl.fisedit.sparse_modules import uninstall
    from impl.fisedit.pipeline import FISEditPipeline

    p = FISEditPipeline(comps, guidance_scale=7.5)
    yield p
    uninstall(comps.unet)
