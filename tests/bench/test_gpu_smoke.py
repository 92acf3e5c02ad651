"""experiment=gpu_smoke: every job composes and types here; the jobs themselves run only where
CUDA is (.ci/gpu_smoke.sh), and skip here saying so."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser

from bench.app import preflight
from bench.gpu_smoke import format_rows, rows
from impl.common.systems import systems
from tests.conftest import REPO

CUDA = torch.cuda.is_available()


def smoke_sweep(conf: str = "pkg://conf") -> list[str]:
    """The smoke jobs experiment=gpu_smoke sweeps, expanded as Hydra's sweeper expands them."""
    exp = yaml.safe_load((REPO / "conf" / "experiment" / "gpu_smoke.yaml").read_text())
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(conf))
    override = OverridesParser.create(config_loader=loader).parse_overrides(
        [f"smoke={exp['hydra']['sweeper']['params']['smoke']}"])[0]
    return list(override.sweep_string_iterator())


def test_one_smoke_job_per_system_and_each_composes():
    # Nothing lists the smoke jobs: the sweep globs conf/smoke/ and the table names the systems.
    swept = smoke_sweep()
    assert swept == list(systems()) == sorted(p.stem for p in (REPO / "conf" / "smoke").glob("*.yaml"))
    assert [r[0] for r in rows([])] == swept
    assert preflight(["--multirun", "experiment=gpu_smoke"]) is None
    for s in swept:
        assert preflight(["experiment=gpu_smoke", f"smoke={s}"]) is None, s


def test_table_names_missing_and_failed_systems():
    recs = [{"experiment": "gpu_smoke", "run_id": "a", "created": "2026-01-01T00:00:00+00:00", "system": "adaptra",
             "status": "ok", "overrides": ["smoke=adaptra"], "info": {"device": "cuda", "backend": "nccl"},
             "duration_s": 12.0},
            {"experiment": "gpu_smoke", "run_id": "b", "created": "2026-01-01T00:00:01+00:00", "system": "fisedit",
             "status": "failed", "error": "workload.device: cuda requested but no GPU", "overrides": ["smoke=fisedit"],
             "duration_s": 1.0}]
    table = {r[0]: r for r in rows(recs)}
    assert table["adaptra"][1:3] == ["ok", "cuda/nccl"]
    assert table["fisedit"][1] == "failed" and "no GPU" in table["fisedit"][4]
    assert table["lobra"][1] == "missing"
    assert format_rows(list(table.values())).splitlines()[0].startswith("system")


@pytest.mark.real
@pytest.mark.skipif(not CUDA, reason="needs CUDA (torch.cuda.is_available() is false): run .ci/gpu_smoke.sh on a GPU host")
def test_gpu_smoke_runs_every_system_on_cuda(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    proc = subprocess.run(["bash", str(REPO / ".ci" / "gpu_smoke.sh"), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "cuda" in proc.stdout


def test_gpu_smoke_script_refuses_without_cuda():
    if CUDA:
        pytest.skip("CUDA present: the refusal is for hosts without one")
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    proc = subprocess.run(["bash", str(REPO / ".ci" / "gpu_smoke.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_smoke: no CUDA device visible (torch.cuda.is_available() is false); nothing run"
