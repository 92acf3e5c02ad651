"""impl/<system>/paper.yaml: every system has one, every file loads, entries say where they come from, bad files fail in one
line naming the file and the field; matching our records to an entry."""
from __future__ import annotations

import copy
import pathlib
import re
import textwrap

import pytest

from bench.paper import PaperEntry, find_ours, load_paper, load_papers
from impl.common.api import ConfigError
from impl.common.systems import systems



def test_every_system_has_a_paper_file_with_sourced_entries():
    papers = load_papers()
    assert list(papers) == list(systems()) and len(papers) >= 9
    for name, paper in papers.items():
        assert paper.entry(paper.headline).kind == "paper", name
        for e in paper.entries:
            assert _followable(e.source), (name, e.name, e.source)
            assert e.unit and e.setting


ROOT = pathlib.Path(__file__).resolve().parents[2]


def _followable(source: str) -> bool:
    """A source a reader of the repository can follow: the paper (section, figure, table,
    abstract), the authors' artifact, or a file in the repository; then a provenance tag."""
    head = source.split()[0]
    where = head in ("paper", "artifact") or (ROOT / head.rstrip(",;:")).exists()
    return where and re.search(r"\[[A-Z]\]$", source.strip()) is not None


def write(tmp_path, body: str, name: str = "demo"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(body))
    return path


GOOD = """
system: demo
title: t
paper: demo paper
headline: a
reproduce: mlsys-bench experiment=demo/sim
entries:
- {name: a, value: 1.5, unit: x, setting: s, source: "paper §4 [P]",
   match: {experiment: demo/sim, system: adaptra, metric: iteration_time_s, vs: zb}}
- {name: b, value: 2.0, unit: s, setting: s, source: "paper §4 [P]"}
"""


@pytest.mark.parametrize("edit,expected", [
    (("value: 2.0", "value: fast"), r"demo\.yaml: entries\[1\]\.value: Value 'fast'"),
    (("unit: s,", "unti: s,"), r"demo\.yaml: entries\[1\]\.unti: Key 'unti' not in 'PaperEntry'"),
    (("name: b", "name: a"), r"demo\.yaml: entries\[1\] \(a\)\.name: duplicate entry name 'a'"),
    (("headline: a", "headline: zz"), r"demo\.yaml: headline: 'zz' is not the name of an entry"),
    (("vs: zb", "vs: zb, aggregate: median"), r"entries\[0\] \(a\)\.match\[0\]\.aggregate: 'median' is not one of"),
    (("value: 2.0", "value: 2.0, high: 1.0"), r"entries\[1\] \(b\)\.high: 1\.0 is below value 2\.0"),
])
def test_bad_paper_file_is_one_line_naming_file_and_field(tmp_path, edit, expected):
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ConfigError, match=expected) as info:
        load_paper(path)
    assert "\n" not in str(info.value)


def test_extra_entries_are_fine_and_one_match_mapping_is_a_list(tmp_path):
    body = GOOD + "- {name: c, value: 3, unit: ms, setting: s, source: 'paper §9 [P]'}\n"
    paper = load_paper(write(tmp_path, body))
    assert [e.name for e in paper.entries] == ["a", "b", "c"]
    assert len(paper.entries[0].match) == 1 and paper.entries[0].match[0].resolved_form == "ratio"


def rec(run_id, system, value, *, status="ok", created="2026-01-01T00:00:00+00:00", delay=0.06, mode="sim"):
    return {"run_id": run_id, "system": system, "status": status, "experiment": "demo/sim", "mode": mode,
            "workload": "w", "hardware": "h", "fault": f"f{delay}", "created": created,
            "config": {"fault": {"delay_s": delay}},
            "metrics": {"iteration_time_s": {"value": value, "unit": "s", "better": "lower"}} if status == "ok" else {}}


def entry(**match) -> PaperEntry:
    m = {"experiment": "demo/*", "system": "adaptra", "metric": "iteration_time_s", **match}
    return load_entry(m)


def load_entry(match) -> PaperEntry:
    from omegaconf import OmegaConf

    from bench.paper import Match
    return PaperEntry(name="e", value=1.0, unit="x", setting="s", source="paper §4 [P]",
                      match=[OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Match), match))])


def test_ours_is_times_better_in_the_same_setting_and_ignores_invalid_runs():
    records = [rec("z1", "zb", 2.0), rec("a1", "adaptra", 1.0),
               rec("a2", "adaptra", 0.01, status="invalid", created="2027-01-01T00:00:00+00:00"),
               rec("z2", "zb", 3.0, delay=0.03), rec("a3", "adaptra", 1.0, delay=0.03)]
    ours = find_ours(entry(vs="zb", where={"config.fault.delay_s": 0.06}), records)
    assert (ours.value, ours.run_ids, ours.mode, ours.excluded) == (2.0, ["a1", "z1"], "sim", {"invalid": 1})
    assert find_ours(entry(vs="zb", aggregate="mean"), records).value == pytest.approx(2.5)
    assert find_ours(entry(vs="zb", form="reduction", where={"config.fault.delay_s": 0.03}), records).value \
        == pytest.approx(1 - 1 / 3)
    many = find_ours(entry(), records)
    assert many.note == "newest of 2 settings"


def test_no_value_says_why():
    only_bad = [rec("a1", "adaptra", 1.0, status="invalid"), rec("a2", "adaptra", 1.0, status="failed")]
    assert find_ours(entry(), only_bad).note == "only 1 failed, 1 invalid run(s)"
    assert find_ours(entry(), []).note == "no run yet"
    assert find_ours(entry(vs="zb"), [rec("a1", "adaptra", 1.0)]).note == "no ok zb record in the same setting"
    assert find_ours(entry(mode="real"), [rec("a1", "adaptra", 1.0)]).note == "no run yet"
    e = copy.deepcopy(entry())
    e.match = []
    assert not find_ours(e, [rec("a1", "adaptra", 1.0)]).found
