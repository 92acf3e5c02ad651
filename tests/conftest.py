from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
TEST_CONF = REPO / "tests" / "conf"
# Harness tests run tiny systems from tests/conf against a made-up hardware profile.
TEST_ARGS = ["hardware=test_hw", "workload=demo", f"hydra.searchpath=[file://{TEST_CONF}]"]


def run_bench(args, *, env_extra=None, cwd=None, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("WANDB_MODE", "disabled")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True,
                          env=env, cwd=cwd or REPO, timeout=timeout)


@pytest.fixture
def bench_cli():
    return run_bench


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module's tests: 1 torch thread (same kernels, same bits as the 1-thread workers; on
    2 shared cores idle OpenMP threads also spin and steal a worker's core), restored after."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
