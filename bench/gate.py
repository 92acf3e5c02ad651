"""CI performance gates: run candidate and baseline, compare ratios, fail loudly on a shortfall.

A suite is ``conf/gate/<suite>.yaml``::

    gates:
      - name: adaptra_beats_zb
        # Passed to `python -m bench` as they are: the yaml picks the experiment preset and
        # the override form (`experiment=...` or `+experiment=...`), workload, fault, ...
        overrides: ["+experiment=adaptra/microbench_7b"]
        candidate: adaptra
        baseline: zb
        metric: iteration_time_s
        min_ratio: 1.10      # x = times better than baseline (>1 better), as in compare
        mode: sim            # sim: one run each, exact; real: interleaved repeats, medians
        # repeats: 5         # real only: runs per side, interleaved c,b,c,b,...
        # tolerance: 0.05    # real only: pass if ratio >= min_ratio * (1 - tolerance)
        # max_value / min_value: bounds on the candidate's value, in the metric's unit

Every job runs as ``python -m bench <overrides> system=<x> mode=<mode> results_dir=<dir>``; the
record it writes is the one the gate reads. Exit codes: 0 all pass, 1 a gate fell short, 2 a
configuration error (one line naming the file and field).
"""
from __future__ import annotations

import argparse
import enum
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bench.compare import ratio as times_better
from bench.record import RecordError, load_records

PROG = "mlsys-bench-gate"
DEFAULT_REPEATS = 5


class GateMode(str, enum.Enum):
    sim = "sim"
    real = "real"


@dataclass
class Gate:
    name: str = MISSING
    candidate: str = MISSING
    metric: str = MISSING
    mode: GateMode = MISSING
    overrides: List[str] = field(default_factory=list)
    baseline: Optional[str] = None
    min_ratio: Optional[float] = None
    max_value: Optional[float] = None
    min_value: Optional[float] = None
    repeats: Optional[int] = None
    tolerance: Optional[float] = None


class GateConfigError(ValueError):
    """A gate yaml is wrong; the message is one line naming the file and field."""


# ------------------------------------------------------------------ loading

def default_gate_dir() -> pathlib.Path:
    from importlib import resources

    return pathlib.Path(str(resources.files("conf").joinpath("gate")))


def load_suite(path: pathlib.Path) -> list[Gate]:
    import yaml

    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise GateConfigError(f"{where}: invalid YAML ({getattr(exc, 'problem', None) or exc})") \
            from None
    if not OmegaConf.is_dict(raw) or "gates" not in raw:
        raise GateConfigError(f"{path}: gates: missing (a suite is a mapping with a `gates` list)")
    extra = [k for k in raw if k != "gates"]
    if extra:
        raise GateConfigError(f"{path}: {extra[0]}: unknown key (allowed: gates)")
    if not OmegaConf.is_list(raw.gates) or not raw.gates:
        raise GateConfigError(f"{path}: gates: must be a non-empty list of gates")
    gates = [_typed_gate(item, f"{path}: gates[{i}]") for i, item in enumerate(raw.gates)]
    names: set[str] = set()
    for i, gate in enumerate(gates):
        where = f"{path}: gates[{i}]"
        if gate.name in names:
            raise GateConfigError(f"{where}.name: duplicate gate name {gate.name!r}")
        names.add(gate.name)
        _check_gate(gate, where)
    return gates


def _typed_gate(item, where: str) -> Gate:
    """Merge one yaml gate into the dataclass, so a bad key or value fails by name."""
    if not OmegaConf.is_dict(item):
        raise GateConfigError(f"{where}: must be a mapping of gate fields")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Gate), item))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
        msg = str(getattr(exc, "msg", None) or exc).strip().splitlines()[0]
        if type(exc).__name__ == "ConfigKeyError":
            msg = f"unknown key (allowed: {', '.join(Gate.__dataclass_fields__)})"
        elif type(exc).__name__ == "MissingMandatoryValue":
            msg = "missing (required)"
        raise GateConfigError(f"{where}.{key}: {msg}") from None


def _check_gate(gate: Gate, where: str) -> None:
    if gate.min_ratio is None and gate.max_value is None and gate.min_value is None:
        raise GateConfigError(f"{where}: needs at least one of min_ratio, max_value, min_value")
    if gate.min_ratio is not None and not gate.baseline:
        raise GateConfigError(f"{where}.baseline: min_ratio needs a baseline system")
    if gate.min_ratio is not None and gate.min_ratio <= 0:
        raise GateConfigError(f"{where}.min_ratio: must be > 0, got {gate.min_ratio}")
    if gate.mode == GateMode.sim:
        # Sim is deterministic: repeats would measure nothing and a tolerance hides changes.
        for name in ("repeats", "tolerance"):
            if getattr(gate, name) is not None:
                raise GateConfigError(f"{where}.{name}: applies to real gates only "
                                      f"(sim gates are exact)")
    if gate.repeats is not None and gate.repeats < 1:
        raise GateConfigError(f"{where}.repeats: must be >= 1, got {gate.repeats}")
    if gate.tolerance is not None and not 0 <= gate.tolerance < 1:
        raise GateConfigError(f"{where}.tolerance: must be in [0, 1), got {gate.tolerance}")


def find_suites(gate_dir: pathlib.Path, names: Sequence[str]) -> list[pathlib.Path]:
    if not gate_dir.is_dir():
        raise GateConfigError(f"gate dir {gate_dir} does not exist")
    have = sorted(p.stem for p in gate_dir.glob("*.yaml"))
    if not names:
        if not have:
            raise GateConfigError(f"no gate suites (*.yaml) in {gate_dir}")
        names = have
    missing = [n for n in names if n not in have]
    if missing:
        raise GateConfigError(f"gate suite {missing[0]!r} not found in {gate_dir} "
                              f"(have: {', '.join(have) or 'none'})")
    return [gate_dir / f"{n}.yaml" for n in names]


# ------------------------------------------------------------------ running jobs

@dataclass
class JobOutcome:
    """What one ``python -m bench`` run left behind: its record, or why there is none."""

    returncode: int
    record: Optional[dict]
    error: Optional[str]  # one line


# runner(cmd, results_dir) -> (returncode, last line of stderr). Injectable so that tests can
# write synthetic records instead of running real jobs.
Runner = Callable[[List[str], pathlib.Path], "tuple[int, str]"]


def subprocess_runner(cmd: List[str], results_dir: pathlib.Path) -> tuple[int, str]:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
    return proc.returncode, (tail[-1].strip() if tail else "")


def job_command(gate: Gate, system: str, results_dir: pathlib.Path,
                prefix: Sequence[str]) -> list[str]:
    return [*prefix, *gate.overrides, f"system={system}", f"mode={gate.mode.value}",
            f"results_dir={results_dir}"]


def _run_ids(results_dir: pathlib.Path) -> set[str]:
    if not results_dir.exists():
        return set()
    return {r.get("run_id", "") for r in load_records(results_dir)}


def run_job(gate: Gate, system: str, results_dir: pathlib.Path, runner: Runner,
            prefix: Sequence[str]) -> JobOutcome:
    """Run one job and pick up the record it wrote (the one run_id that is new)."""
    try:
        before = _run_ids(results_dir)
        rc, last = runner(job_command(gate, system, results_dir, prefix), results_dir)
        new = [r for r in (load_records(results_dir) if results_dir.exists() else [])
               if r.get("run_id") not in before]
    except RecordError as exc:  # e.g. a torn records.jsonl line: file:line in the message
        return JobOutcome(-1, None, str(exc))
    if len(new) != 1:
        why = last or f"exit code {rc}"
        return JobOutcome(rc, None, f"{system}: job wrote {len(new)} records ({why})")
    return JobOutcome(rc, new[0], None)


# ------------------------------------------------------------------ judging

@dataclass
class GateResult:
    gate: Gate
    candidate_value: Optional[float] = None
    baseline_value: Optional[float] = None
    unit: str = ""
    ratio: Optional[float] = None
    passed: bool = False
    reasons: list[str] = field(default_factory=list)

    def required(self) -> str:
        g, parts = self.gate, []
        if g.min_ratio is not None:
            tol = g.tolerance or 0.0
            need = g.min_ratio * (1 - tol)
            parts.append(f">={need:.4g}x" + (f" ({g.min_ratio:g}x -{tol:.0%})" if tol else ""))
        if g.max_value is not None:
            parts.append(f"<={g.max_value:g} {self.unit}".rstrip())
        if g.min_value is not None:
            parts.append(f">={g.min_value:g} {self.unit}".rstrip())
        return ", ".join(parts)


def _metric_values(gate: Gate, outcomes: list[JobOutcome], side: str,
                   reasons: list[str]) -> tuple[list[float], str, str]:
    values, unit, better = [], "", "lower"
    for out in outcomes:
        rec = out.record
        if rec is None:
            reasons.append(f"{side}: {out.error}")
            continue
        if rec.get("status") != "ok":
            why = rec.get("error") or "; ".join(rec.get("invalid_reasons") or []) or "no reason"
            reasons.append(f"{side} {rec.get('system')}: status {rec.get('status')}: {why}")
            continue
        m = (rec.get("metrics") or {}).get(gate.metric)
        if m is None:
            have = ", ".join(sorted(rec.get("metrics") or {})) or "none"
            reasons.append(f"{side}: metric {gate.metric!r} not in record (has: {have})")
            continue
        values.append(float(m["value"]))
        unit, better = m.get("unit", ""), m.get("better", "lower")
    return values, unit, better


def judge(gate: Gate, cand: list[JobOutcome], base: list[JobOutcome]) -> GateResult:
    res = GateResult(gate)
    c_vals, unit, better = _metric_values(gate, cand, "candidate", res.reasons)
    b_vals, b_unit, b_better = _metric_values(gate, base, "baseline", res.reasons)
    res.unit = unit
    if res.reasons:  # a failed or invalid job is a FAIL, whatever the other runs say
        return res
    # Medians: one value per side for sim, the median of the interleaved repeats for real.
    res.candidate_value = statistics.median(c_vals)
    if gate.min_ratio is not None:
        res.baseline_value = statistics.median(b_vals)
        if (b_unit, b_better) != (unit, better):
            res.reasons.append(f"candidate reports {unit!r}/{better}, baseline "
                               f"{b_unit!r}/{b_better}")
            return res
        res.ratio = times_better(res.candidate_value, res.baseline_value, better)
        need = gate.min_ratio * (1 - (gate.tolerance or 0.0))
        if res.ratio is None or res.ratio < need:
            res.reasons.append(f"ratio {_fmt(res.ratio)}x < required {need:.4g}x")
    if gate.max_value is not None and res.candidate_value > gate.max_value:
        res.reasons.append(f"value {res.candidate_value:.4g} > max_value {gate.max_value:g}")
    if gate.min_value is not None and res.candidate_value < gate.min_value:
        res.reasons.append(f"value {res.candidate_value:.4g} < min_value {gate.min_value:g}")
    res.passed = not res.reasons
    return res


def run_gate(gate: Gate, results_dir: pathlib.Path, runner: Runner = subprocess_runner,
             prefix: Sequence[str] = (), progress: Optional[Callable[[str], None]] = None
             ) -> GateResult:
    progress = progress or (lambda line: print(line, flush=True))  # CI logs live, not at exit
    prefix = list(prefix) or [sys.executable, "-m", "bench"]
    repeats = (gate.repeats or DEFAULT_REPEATS) if gate.mode == GateMode.real else 1
    sides = [("candidate", gate.candidate)]
    if gate.min_ratio is not None:
        sides.append(("baseline", gate.baseline))
    # Interleaved c,b,c,b,...: drift on a shared machine hits both sides alike.
    plan = [side for _ in range(repeats) for side in sides]
    runs: dict[str, list[JobOutcome]] = {"candidate": [], "baseline": []}
    for i, (side, system) in enumerate(plan, 1):
        t0 = time.monotonic()
        out = run_job(gate, system, results_dir, runner, prefix)
        status = out.record.get("status") if out.record else "no record"
        progress(f"[{gate.name} {i}/{len(plan)}] {side} {system} ({gate.mode.value}): {status} "
                 f"in {time.monotonic() - t0:.1f}s")
        runs[side].append(out)
    return judge(gate, runs["candidate"], runs["baseline"])


# ------------------------------------------------------------------ report

def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def format_results(results: Sequence[GateResult]) -> str:
    head = ["gate", "candidate", "baseline", "metric", "candidate value", "baseline value",
            "ratio", "required", "result"]
    rows = []
    for r in results:
        g = r.gate
        unit = f" {r.unit}" if r.unit else ""
        rows.append([g.name, g.candidate, g.baseline or "-", f"{g.metric} ({g.mode.value})",
                     _fmt(r.candidate_value) + (unit if r.candidate_value is not None else ""),
                     _fmt(r.baseline_value) + (unit if r.baseline_value is not None else ""),
                     "-" if r.ratio is None else f"{r.ratio:.4g}x", r.required(),
                     "PASS" if r.passed else "FAIL"])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        lines += [f"{r.gate.name}: FAIL: {why}" for why in r.reasons]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Run CI performance gates "
                                "(conf/gate/<suite>.yaml); exit 1 if any falls short.")
    p.add_argument("suites", nargs="*", help="suite names (default: every conf/gate/*.yaml)")
    p.add_argument("--results", help="results dir for the gate's jobs (default: a temporary "
                                     "dir, kept only if a gate fails)")
    p.add_argument("--gate-dir", help="where the suite yamls are (default: conf/gate)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the suites and print the jobs, run nothing")
    return p


def main(argv: Optional[Sequence[str]] = None, *, runner: Runner = subprocess_runner,
         prefix: Sequence[str] = ()) -> int:
    args = _parser().parse_args(argv)
    gate_dir = pathlib.Path(args.gate_dir) if args.gate_dir else default_gate_dir()
    try:
        suites = {p.stem: load_suite(p) for p in find_suites(gate_dir, args.suites)}
    except GateConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    gates = [g for gs in suites.values() for g in gs]
    if args.dry_run:
        shown = prefix or [sys.executable, "-m", "bench"]
        where = pathlib.Path(args.results or "<tmpdir>")
        for g in gates:
            n = (g.repeats or DEFAULT_REPEATS) if g.mode == GateMode.real else 1
            for system in [g.candidate] + ([g.baseline] if g.min_ratio is not None else []):
                print(f"{g.name}: {n}x " + " ".join(job_command(g, system, where, shown)))
        return 0
    if args.results:
        results_dir, temporary = pathlib.Path(args.results), False
        try:  # an unreadable results dir is a setup error, not a failed gate
            _run_ids(results_dir)
        except RecordError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
    else:
        results_dir, temporary = pathlib.Path(tempfile.mkdtemp(prefix="mlsys-bench-gate-")), True
    print(f"{len(gates)} gate(s) from {', '.join(suites)}; records in {results_dir}", flush=True)
    results = [run_gate(g, results_dir, runner, prefix) for g in gates]
    print()
    print(format_results(results), end="")
    failed = sum(not r.passed for r in results)
    if temporary and not failed:
        shutil.rmtree(results_dir, ignore_errors=True)
    elif temporary:
        print(f"records kept in {results_dir}")
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
