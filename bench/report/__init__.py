"""``mlsys-bench-report``: a static HTML site of every record beside each paper's numbers.

    mlsys-bench-report --results results/runs --out report/
    mlsys-bench-report --results results/runs --out report/ logger=wandb   # + a W&B artifact

The papers' numbers are ``impl/<system>/paper.yaml`` (format: :mod:`bench.paper`); the site is
built by :mod:`bench.report.build`. Bad input (torn or foreign JSON, an unknown schema version)
is skipped, named on the index page and on stderr; the exit status stays 0 for it.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Optional, Sequence

PROG = "mlsys-bench-report"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results/runs", help="results dir (default %(default)s)")
    p.add_argument("--out", default="report", help="where the site goes (default %(default)s)")
    p.add_argument("--papers", help="folder of <system>.yaml paper files (default: impl/<system>/paper.yaml)")
    p.add_argument("overrides", nargs="*", metavar="logger=wandb",
                   help="logger=wandb logs the site as a W&B artifact (offline unless logger.mode / WANDB_MODE "
                        "say otherwise); also logger.mode=, logger.project=, logger.dir=")
    return p


def _logger_settings(overrides: Sequence[str]) -> dict:
    allowed = {"logger", "logger.name", "logger.mode", "logger.project", "logger.entity", "logger.dir"}
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in allowed:
            raise ValueError(f"{item!r}: expected one of {', '.join(sorted(allowed))} as key=value")
        out["name" if key in ("logger", "logger.name") else key.split(".", 1)[1]] = value
    if out.get("name", "wandb" if len(out) else "none") not in ("none", "wandb"):
        raise ValueError(f"logger={out['name']}: not a logger (expected none or wandb)")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    results = pathlib.Path(args.results)
    if not results.is_dir():
        return _fail(f"results dir {results} does not exist (run `mlsys-bench` first)")
    try:
        logger = _logger_settings(args.overrides)
    except ValueError as exc:
        return _fail(str(exc))
    from bench.paper import load_papers
    from bench.report.build import build_report
    from impl.common.api import ConfigError

    try:
        papers = load_papers(args.papers)
    except ConfigError as exc:
        return _fail(str(exc))
    index = build_report(results, pathlib.Path(args.out), papers)
    from bench.record import scan_records

    skipped = scan_records(results).skipped
    for s in skipped:
        print(f"{PROG}: skipped {s.where}: {s.why}", file=sys.stderr)
    print(f"report: {index}" + (f" ({len(skipped)} input(s) skipped, listed on the index page)" if skipped else ""))
    if logger.get("name", "none") == "wandb":
        from bench.loggers.wandb_logger import log_report_artifact

        try:
            info = log_report_artifact(index.parent, mode=logger.get("mode"), project=logger.get("project"),
                                       entity=logger.get("entity"), directory=logger.get("dir"))
        except Exception as exc:  # the site is written; a W&B failure is reported, not fatal
            print(f"{PROG}: warning: logging the report to W&B failed: {exc}", file=sys.stderr)
            return 1
        print(f"wandb: report artifact logged ({info['mode']}, run {info['run_id']}, {info['dir']})")
    return 0


def _fail(msg: str) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return 2

