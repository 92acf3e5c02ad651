"""A tenth system is its own package and yamls, and nothing else.

A copy of the harness gets a toy system: ``impl/toy/`` (a ``System`` and its ``paper.yaml``),
``conf/system/toy/toy.yaml`` and ``conf/smoke/toy.yaml``, written here and nowhere else. Then,
each in a subprocess on the copy (so what runs is exactly the files there): the app composes and
runs it, the GPU smoke sweeps it and its table has a row for it, the import contracts hold it to
the rules of every system, and the report gives it a page with its paper's number beside ours.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.tree.test_layering import _lint

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ("bench", "faults", "impl", "conf", "pyproject.toml")

TOY = {
    "impl/toy/__init__.py": "",
    "impl/toy/system.py": '''
        """The smallest system: one step of a fixed length, in either mode."""
        from __future__ import annotations

        from dataclasses import dataclass

        from impl.common.api import JobContext, Metric, RunResult, System


        class Toy(System):
            @dataclass
            class Config:
                step_s: float = 0.25

            def run(self, job: JobContext) -> RunResult:
                return RunResult(metrics={"iteration_time_s": Metric.scalar(self.cfg.step_s, "s", "lower")})
        ''',
    "impl/toy/paper.yaml": '''
        system: toy
        title: Toy
        paper: "a toy paper, arXiv 0000.00000"
        headline: step
        reproduce: mlsys-bench system=toy/toy
        entries:
        - {name: step, value: 0.2, high: 0.3, unit: s, setting: "one step", source: "paper Table 1 [P]",
           match: {experiment: "*", system: toy, metric: iteration_time_s, mode: sim}}
        ''',
    # `name` is the record's name; once the harness derives it from the file's path it can go
    "conf/system/toy/toy.yaml": '''
        _target_: impl.toy.system.Toy
        name: toy
        step_s: 0.25
        ''',
    "conf/smoke/toy.yaml": '''
        # @package _global_
        defaults:
          - override /system: toy/toy
        ''',
}


def _env(tree: pathlib.Path) -> dict:
    return {"PYTHONPATH": str(tree), "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin:/bin"]),
            "HOME": str(tree), "WANDB_MODE": "disabled"}


def _py(tree: pathlib.Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=tree, env=_env(tree), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> pathlib.Path:
    """The harness as it is plus the toy's files: none of them exists in the repository, so the toy
    needs nothing the repository would have to change."""
    root = tmp_path_factory.mktemp("toy_tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in HARNESS:
        src = ROOT / name
        (shutil.copytree(src, root / name, ignore=ignore) if src.is_dir() else shutil.copy(src, root / name))
    for rel, body in TOY.items():
        assert not (ROOT / rel).exists(), f"{rel} is in the repository: the toy must be new files only"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(body).lstrip())
    return root


@pytest.fixture(scope="module")
def toy_run(tree) -> pathlib.Path:
    results = tree / "results" / "runs"
    out = _py(tree, "-m", "bench", "system=toy/toy", "mode=sim", f"results_dir={results}", "progress=false")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return results


def test_the_app_composes_and_runs_the_toy(tree, toy_run):
    records = [json.loads(p.read_text()) for p in toy_run.rglob("record.json")]
    assert [(r["system"], r["status"], r["mode"]) for r in records] == [("toy", "ok", "sim")]
    assert records[0]["metrics"]["iteration_time_s"]["value"] == 0.25
    out = _py(tree, "-m", "bench", "--help")
    # the system group's options by paper folder (Hydra's own listing says `system/toy: toy`)
    assert out.returncode == 0 and re.search(r"^\s*(system/)?toy: toy$", out.stdout, re.M), out.stdout[-2000:]


_SMOKE = """
import json, sys, yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser
from bench.app import preflight
from bench.gpu_smoke import rows
from bench.paper import load_papers
from impl.common.systems import systems

exp = yaml.safe_load(open("conf/experiment/gpu_smoke.yaml"))
loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://conf"))
sweep = OverridesParser.create(config_loader=loader).parse_overrides(
    ["smoke=" + exp["hydra"]["sweeper"]["params"]["smoke"]])[0]
print(json.dumps({"systems": list(systems()), "papers": list(load_papers()), "table": [r[0] for r in rows([])],
                  "swept": list(sweep.sweep_string_iterator()),
                  "preflight": preflight(["experiment=gpu_smoke", "smoke=toy"])}))
"""


def test_the_smoke_sweep_and_its_table_pick_up_the_toy(tree):
    out = _py(tree, "-c", _SMOKE)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert "toy" in got["systems"] and got["papers"] == got["systems"]
    assert got["table"] == got["swept"] == got["systems"]
    assert got["preflight"] is None


def test_the_import_contracts_hold_the_toy_to_the_rules(tree):
    out = _lint(tree)
    assert out.returncode == 0, out.stdout + out.stderr
    planted = tree / "impl" / "toy" / "planted.py"
    planted.write_text("from impl.adaptra import builder\n")
    try:
        out = _lint(tree)
    finally:
        planted.unlink()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "impl.toy.planted -> impl.adaptra.builder" in out.stdout


def test_the_report_gives_the_toy_a_page_beside_its_paper(tree, toy_run):
    site = tree / "site"
    out = _py(tree, "-m", "bench.report", "--results", str(toy_run), "--out", str(site))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert 'href="toy.html"' in (site / "index.html").read_text()
    page = (site / "toy.html").read_text()
    assert "a toy paper, arXiv 0000.00000" in page and "0.2-0.3 s" in page and "0.25" in page
