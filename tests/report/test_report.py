"""mlsys-bench-report: the site from a small results folder, checked as files and in a real
headless browser (Debian's chromium; the browser test is skipped, with its reason, without it)."""
from __future__ import annotations

import html
import html.parser
import re
import pathlib
import shutil
import subprocess
import urllib.parse

import pytest

from bench.report import main
from bench.report.build import build_report
from impl.common.systems import systems

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[str] = []
        self.tables: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "a" and a.get("href"):
            self.refs.append(a["href"])
        if tag in ("img", "link", "script") and (a.get("src") or a.get("href")):
            self.refs.append(a.get("src") or a.get("href"))
        if tag == "table":
            self.tables.append(a.get("id") or a.get("class") or "")


def parse(text: str) -> Links:
    p = Links()
    p.feed(text)
    return p


def test_every_link_and_image_resolves_offline(site):
    pages = sorted(site.glob("*.html"))
    assert {p.name for p in pages} >= {"index.html", "adaptra.html", "malleus.html", "caraserve.html",
                                       "fisedit.html", "harness.html"}
    n_img = 0
    for page in pages:
        links = parse(page.read_text())
        for ref in links.refs:
            url = urllib.parse.urlparse(ref)
            assert not url.scheme and not url.netloc, f"{page.name}: {ref} leaves the site"
            if not url.path:  # a link within the page: its target id is there
                assert f'id="{url.fragment}"' in page.read_text(), f"{page.name}: {ref} has no target"
                continue
            target = (page.parent / urllib.parse.unquote(url.path)).resolve()
            assert target.is_file(), f"{page.name}: {ref} does not resolve"
            if target.suffix == ".png":
                n_img += 1
                assert target.read_bytes()[:8] == PNG_MAGIC
    assert n_img >= 2
    assert "<script" not in "".join(p.read_text() for p in pages)


def test_index_has_a_row_per_system_with_the_headline_and_names_skipped_input(site, report_results):
    text = html.unescape((site / "index.html").read_text())
    for name in ("adaptra", "caraserve", "fisedit", "malleus", "harness"):
        assert f'href="{name}.html"' in text
    # Every system has a row, with or without records (its impl/<system>/paper.yaml).
    rows = re.findall(r'<tr>\s*<td><a href="([a-z_]+)\.html"', text)
    for name in systems():
        assert name in rows, (name, rows)
    assert 'href="cross-paper.html"' in text
    assert "1.76x" in text and "mlsys-bench --multirun experiment=adaptra/microbench_7b" in text
    assert "not measured" in text  # the fidelity column until that work lands
    assert "3 input(s) skipped" in text
    assert re.search(r"records\.jsonl:7</code>: not valid JSON", text)
    assert "foreign/record.json" in text and "not an mlsys-bench record" in text
    assert "future-run/record.json" in text and "unknown schema version 'mlsys-bench.record/9'" in text


def test_system_page_puts_ours_beside_the_paper_and_never_compares_invalid_runs(site, report_results):
    text = (site / "adaptra.html").read_text()
    ok_adaptra = report_results["ok"]["adaptra"]
    ours = ok_adaptra["metrics"]["iteration_time_s"]["value"]
    # S3 7B first link 60 ms, answered by the default run's demo/sim record: paper 0.5 s.
    row = text[text.index("s3_7b_first_60ms_adaptra</code>"):]
    row = row[:row.index("</tr>")]
    assert "0.5 s" in row and f"{ours:.4g} s" in row and "simulated" in row
    assert ok_adaptra["run_id"] in row and report_results["invalid"]["run_id"] not in row
    # Both bad runs are in the records table, marked.
    assert 'class="status-invalid"' in text and "host contended: 60% foreign CPU" in text
    assert 'class="status-failed"' in text and "RuntimeError: boom" in text
    assert (site / "records" / f"{report_results['invalid']['run_id']}.json").is_file()


def test_cross_paper_page_has_a_table_and_a_figure_per_question_with_refusals(site):
    text = html.unescape((site / "cross-paper.html").read_text())
    assert 'id="cross-cross_stragglers"' in text and "fig/cross-cross_stragglers.png" in text
    assert (site / "fig" / "cross-cross_stragglers.png").read_bytes()[:8] == PNG_MAGIC
    assert "not applicable: <code>malleus</code> on <code>link_delay_60ms</code>" in text
    assert "does not support fault 'link_delay'" in text and "(simulated)" in text
    for q in ("stragglers", "gpu_loss", "varlen"):
        assert f"mlsys-bench --multirun experiment=cross/{q}" in text
    assert text.count("No run yet.") == 3  # stragglers_cpu, gpu_loss and varlen have no records in this folder
    # on Malleus's own page the refusal is "not applicable", not a failure of the system
    page = html.unescape((site / "malleus.html").read_text())
    assert '<span class="status-not-applicable">not-applicable</span>' in page


def test_malleus_page_draws_the_interleaved_trace_measured(site):
    text = (site / "malleus.html").read_text()
    assert "fig/malleus/malleus_cpu_static/iteration_trace.png" in text
    assert "real_a_over_uniform</code>" in text and "measured" in text
    assert "GPU compute: sleep-padded" in text  # the emulated piece, in the records table


def test_a_rebuilt_report_drops_old_pages(report_results, tmp_path):
    (tmp_path / "stale.html").write_text("old")
    build_report(report_results["dir"], tmp_path)
    assert not (tmp_path / "stale.html").exists() and (tmp_path / "index.html").is_file()


def test_missing_results_dir_is_one_line_exit_2(tmp_path, capsys):
    assert main(["--results", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium on PATH (CI installs Debian's `chromium`; apt-get install -y chromium)")


def run_browser(args: list[str]) -> subprocess.CompletedProcess:
    exe = chromium()
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{exe} did not finish within 60 s")
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"{exe} cannot start here (exit {proc.returncode}): {tail[0]}")
    return proc


def test_report_in_headless_chromium(site, tmp_path):
    index = site / "index.html"
    dom = run_browser(["--dump-dom", index.as_uri()]).stdout
    links = parse(dom)
    assert "systems" in links.tables
    assert dom.count('href="adaptra.html"') >= 2  # nav + its row
    page = run_browser(["--dump-dom", (site / "adaptra.html").as_uri()]).stdout
    parsed = parse(page)
    assert "paper-vs-ours" in parsed.tables and "records" in parsed.tables
    imgs = [r for r in parsed.refs if r.endswith(".png")]
    assert imgs and all((site / r).is_file() for r in imgs)
    rows = dom.count("<tr")
    for name in ("hydraulis", "ckpt_recovery"):
        assert f'href="{name}.html"' in dom
    assert rows >= 10  # header + nine systems (+ harness)
    cross = run_browser(["--dump-dom", (site / "cross-paper.html").as_uri()]).stdout
    parsed = parse(cross)
    assert "cross-cross_stragglers" in parsed.tables
    assert "not applicable" in cross and "(simulated)" in cross
    assert any(r.endswith("cross-cross_stragglers.png") for r in parsed.refs)
    # The page with a tornado chart (the synthetic HotSPa hinge records): its tables and chart.
    hinge = run_browser(["--dump-dom", (site / "hotspa.html").as_uri()]).stdout
    parsed = parse(hinge)
    assert "hinges-hotspa_hinges-matrix_max_band-table" in parsed.tables
    assert "What the claims hinge on" in hinge and "none within range" in hinge
    charts = [r for r in parsed.refs if r.endswith("hinges-hotspa_hinges-matrix_max_band.png")]
    assert charts and all((site / r).read_bytes()[:8] == PNG_MAGIC for r in charts)
    hinge_shot = tmp_path / "hinges.png"
    run_browser(["--window-size=1300,1400", f"--screenshot={hinge_shot}", (site / "hotspa.html").as_uri() + "#hinges"])
    assert hinge_shot.read_bytes()[:8] == PNG_MAGIC and hinge_shot.stat().st_size > 10_000
    print(f"screenshot: {hinge_shot}")
    shot = tmp_path / "index.png"
    run_browser(["--window-size=1300,900", f"--screenshot={shot}", index.as_uri()])
    assert shot.read_bytes()[:8] == PNG_MAGIC and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_logger_override_is_checked_and_disabled_wandb_logs_nothing(report_results, tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert main(["--results", str(report_results["dir"]), "--out", str(tmp_path), "logger=mlflow"]) == 2
    assert "logger=mlflow: not a logger" in capsys.readouterr().err
    assert main(["--results", str(report_results["dir"]), "--out", str(tmp_path), "logger=wandb",
                 "logger.mode=disabled"]) == 0
    assert "report artifact logged (disabled" in capsys.readouterr().out
    assert not (tmp_path / "wandb").exists()


def test_index_shows_the_paper_scale_family_with_cross_validated_errors(site):
    from impl.common.hardware import load_hardware

    text = html.unescape((site / "index.html").read_text())
    assert 'id="paper-scale-table"' in text and 'Fidelity family "paper scale (H100 Megatron)"' in text
    cv = load_hardware("h100-megatron").calibration["cross_validated"]
    row = re.search(r"<tr><td>h100-megatron</td><td>\(fitted\)</td>.*?</tr>", text, re.S).group(0)
    assert f"{100 * cv['pad_time']['median_abs']:.1f}%" in row and f"{100 * cv['verdict']['accuracy']:.1f}%" in row
    assert re.search(r"<tr><td>a800-80g-megatron</td><td>h100-megatron</td>", text)
