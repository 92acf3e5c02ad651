"""The system page's "What the claims hinge on": a tornado chart and a table per claim, the table's
figures bench.hinges.analyze()'s own, a missed claim's "holds at" or "none within range"."""
from __future__ import annotations

import copy
import html
import html.parser

import pytest

from bench.hinges import Display, HingeInput, Swing, analyze, value_text
from bench.paper import load_paper
from impl.common.systems import paper_file
from bench.record import write_record
from bench.report.build import build_report, fmt
from bench.report.hinge_section import HingeRow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ANCHOR = "hinges-hotspa_hinges-matrix_max_band"


class Table(html.parser.HTMLParser):
    """The body rows of one table (by id): per cell its text and its data-value."""

    def __init__(self, table_id: str):
        super().__init__()
        self.table_id, self.inside, self.rows = table_id, False, []
        self.cell = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.inside = a.get("id") == self.table_id
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag == "td":
            self.cell = {"text": "", "value": a.get("data-value")}
            self.rows[-1].append(self.cell)

    def handle_endtag(self, tag):
        if tag == "td" and self.cell is not None:
            self.cell["text"] = self.cell["text"].strip()
            self.cell = None
        elif tag == "table":
            self.inside = False

    def handle_data(self, data):
        if self.cell is not None:
            self.cell["text"] += data


def table(text: str, table_id: str) -> dict[str, list[dict]]:
    p = Table(table_id)
    p.feed(text)
    rows = [r for r in p.rows if r]  # the header row has th cells only
    return {r[0]["text"]: r for r in rows}


@pytest.fixture(scope="module")
def hotspa():
    return {"hotspa": load_paper(paper_file("hotspa"))}  # the one paper the records name


@pytest.fixture(scope="module")
def claim(report_results, hotspa):
    [ch] = analyze(report_results["hinges"], hotspa)
    return ch


def test_the_system_page_has_the_section_its_chart_and_a_header_link(site):
    text = (site / "hotspa.html").read_text()
    assert '<h2 id="hinges">What the claims hinge on</h2>' in text
    assert 'href="#hinges"' in text.split('<h2 id="paper-vs-ours">')[0]  # the header links to it
    src = f"fig/hotspa/{ANCHOR}.png"
    assert f'src="{src}"' in text and (site / src).read_bytes()[:8] == PNG_MAGIC
    assert f'id="{ANCHOR}"' in text and "simulated" in text.split(f'id="{ANCHOR}"')[1].split("</h3>")[0]
    # A page without hinge records has no such section.
    assert 'id="hinges"' not in (site / "adaptra.html").read_text()


def test_the_table_holds_analyze_figures_at_each_end(site, claim):
    rows = table((site / "hotspa.html").read_text(), f"{ANCHOR}-table")
    assert set(rows) == {sw.input.name for sw in claim.swings}
    for sw in claim.swings:
        cells = rows[sw.input.name]
        lo, hi = cells[3], cells[4]
        assert float(lo["value"]) == sw.ends[0] and float(hi["value"]) == sw.ends[1]
        assert lo["text"] == fmt(sw.ends[0], "x") and hi["text"] == fmt(sw.ends[1], "x")
        assert cells[2]["text"] == ", ".join(value_text(sw.input, v) for v in sw.values)
        assert html.unescape(cells[6]["text"]) == sw.input.source
    # Widest reach (the figures over the range and the as-composed one) on top: sequence parallelism
    # off moves the figure 2.0x -> 1.2x with one value, so it sits under bandwidth and above the rest.
    assert list(rows)[:2] == ["inter-node bandwidth per NIC", "sequence parallelism [R]"]


def test_a_missed_claim_says_where_it_would_hold_or_none_within_range(site, claim):
    assert claim.state == "below" and claim.base == pytest.approx(2.0)
    rows = table((site / "hotspa.html").read_text(), f"{ANCHOR}-table")
    holds = {name: html.unescape(cells[5]["text"]) for name, cells in rows.items()}
    for sw in claim.swings:
        want = f"{sw.holds_side} {value_text(sw.input, sw.holds_at)}" if sw.holds_in_range else "none within range"
        assert holds[sw.input.name] == want
    bw = next(sw for sw in claim.swings if sw.input.name.startswith("inter-node"))
    assert bw.holds_in_range and 12.5e9 < bw.holds_at < 50e9 and holds[bw.input.name].startswith(">= ")
    assert holds["per-iteration overhead"] == holds["sequence parallelism [R]"] == "none within range"


def test_a_fraction_claim_shows_percent_and_a_missing_figure_says_so():
    inp = HingeInput(name="n", key="k", values=[1, 2], display=Display(), source="s")
    row = HingeRow(Swing(inp, [1, 2], [0.35, 0.5]), "fraction", "in band")
    assert (row.low_text, row.high_text, row.holds_text) == ("35%", "50%", "in band as composed")
    row = HingeRow(Swing(inp, [1, 2], [None, 0.5]), "fraction", "below")
    assert (row.low_text, row.holds_text) == ("no ok run", "none within range")


def test_a_bad_declaration_is_named_on_its_page_and_costs_nothing_else(report_results, hotspa, tmp_path):
    results = tmp_path / "runs"
    for rec in report_results["hinges"]:
        bad = copy.deepcopy(rec)
        bad["config"]["hinges"]["claims"] = ["no_such_claim"]
        write_record(results, bad)
    build_report(results, tmp_path / "site", hotspa)
    text = html.unescape((tmp_path / "site" / "hotspa.html").read_text())
    assert "hinges not read: hotspa/hinges: hinges.claims: 'no_such_claim' is not an entry" in text
    assert 'id="hinges"' not in text and 'id="records"' in text
