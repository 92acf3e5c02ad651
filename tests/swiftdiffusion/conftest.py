import pytest
import torch

from impl.common.workloads.diffusion_serving import DiffusionServingWorkload
from impl.swiftdiffusion.models import build_bundle


def tiny_workload(**kw) -> DiffusionServingWorkload:
    wl = DiffusionServingWorkload(num_steps=6, requests=1, **kw)
    wl.unet.sample_size = 16
    return wl


@pytest.fixture(scope="session")
def wl():
    return tiny_workload()


@pytest.fixture(scope="session")
def bundle(wl):
    torch.set_num_threads(1)
    return build_bundle(wl, seed=0, num_controlnets=3)
