"""`results/` at the top level: the default results directory and its README's pandas recipe."""
from __future__ import annotations

import re

from bench.config import compose_config
from bench.record import write_record
from tests.speed.test_harness_speed import typical_record
from tests.conftest import REPO

README = REPO / "results" / "README.md"


def test_default_results_dir_is_results_runs_and_git_ignored():
    assert compose_config([]).results_dir == "results/runs"
    assert "results/runs/" in (REPO / ".gitignore").read_text().splitlines()
    assert README.exists()


def test_readme_pandas_recipe_reads_ok_records_only(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "results" / "runs"
    for i, status in enumerate(("ok", "failed", "invalid", "ok")):
        rec = typical_record(i)
        rec.update(status=status, error="boom" if status == "failed" else None,
                   invalid_reasons=["host contended: ..."] if status == "invalid" else [])
        write_record(runs, rec)
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(code.strip().splitlines()) == 3
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the README's own lines, as a user pastes them
    df = scope["df"]
    ok = df[df.status == "ok"]
    assert list(ok.index) == [0, 3] and set(df.status) == {"ok", "failed", "invalid"}
    assert ok["metrics.iteration_time_s.value"].tolist() == [typical_record(i)["metrics"]["iteration_time_s"]["value"] for i in (0, 3)]
    printed = capsys.readouterr().out.splitlines()
    assert printed and "mode" in printed[0]
