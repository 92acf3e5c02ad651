"""CI performance gates: run candidate and baseline, compare ratios, fail loudly on a shortfall.

A suite is ``bench/data/gates/<suite>.yaml``::

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
        # min_diff: candidate minus baseline in the metric's unit, signed so that > 0 is
        #   better (e.g. SLO attainment points over a baseline router)
        # max_ratio: an upper bound on the ratio (a paper's band, e.g. 2.6-5.3x)
        # cases: [[overrides...], ...]: run the gate once per case (each case's overrides
        #   after `overrides`) and judge the aggregate of the per-case values, ratios and
        #   differences against the bounds, e.g. a mean speedup over several scenarios
        # aggregate: mean   # mean | min | max | each (every case must meet every bound)

Every job runs as ``python -m bench <overrides> system=<paper>/<x> mode=<mode> results_dir=<dir>``; the
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
from bench.system_choice import choice_of

PROG = "mlsys-bench-gate"
DEFAULT_REPEATS = 5


class GateMode(str, enum.Enum):
    sim = "sim"
    real = "real"


class Aggregate(str, enum.Enum):
    mean = "mean"
    min = "min"
    max = "max"
    each = "each"  # no aggregate: every case is judged against every bound on its own


AGGREGATORS: dict[Aggregate, Callable[[Sequence[float]], float]] = {
    Aggregate.mean: statistics.fmean, Aggregate.min: min, Aggregate.max: max}


@dataclass
class Gate:
    name: str = MISSING
    candidate: str = MISSING
    metric: str = MISSING
    mode: GateMode = MISSING
    overrides: List[str] = field(default_factory=list)
    baseline: Optional[str] = None
    min_ratio: Optional[float] = None
    max_ratio: Optional[float] = None
    max_value: Optional[float] = None
    min_value: Optional[float] = None
    min_diff: Optional[float] = None
    repeats: Optional[int] = None
    tolerance: Optional[float] = None
    cases: List[List[str]] = field(default_factory=list)
    aggregate: Aggregate = Aggregate.mean

    @property
    def needs_baseline(self) -> bool:
        return any(b is not None for b in (self.min_ratio, self.max_ratio, self.min_diff))

    def case_overrides(self) -> list[list[str]]:
        """The override list of each job side: ``overrides`` then the case's own."""
        return [[*self.overrides, *case] for case in (self.cases or [[]])]


class GateConfigError(ValueError):
    """A gate yaml is wrong; the message is one line naming the file and field."""


# ------------------------------------------------------------------ loading

def default_gate_dir() -> pathlib.Path:
    from importlib import resources

    return pathlib.Path(str(resources.files("bench").joinpath("data", "gates")))


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
    bounds = ("min_ratio", "max_ratio", "min_diff", "max_value", "min_value")
    if all(getattr(gate, b) is None for b in bounds):
        raise GateConfigError(f"{where}: needs at least one of {', '.join(bounds)}")
    for b in ("min_ratio", "max_ratio", "min_diff"):
        if getattr(gate, b) is not None and not gate.baseline:
            raise GateConfigError(f"{where}.baseline: {b} needs a baseline system")
    for i, case in enumerate(gate.cases):
        if not case:
            raise GateConfigError(f"{where}.cases[{i}]: empty case (give its overrides)")
    for b in ("min_ratio", "max_ratio"):
        if getattr(gate, b) is not None and getattr(gate, b) <= 0:
            raise GateConfigError(f"{where}.{b}: must be > 0, got {getattr(gate, b)}")
    if gate.aggregate != Aggregate.mean and not gate.cases:
        raise GateConfigError(f"{where}.aggregate: applies to gates with cases only")
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


def inprocess_runner(cmd: List[str], results_dir: pathlib.Path) -> tuple[int, str]:
    """A ``python -m bench`` job run in this process: Hydra's compose API, then the same
    :func:`bench.runner.execute` the CLI calls, so the record is the CLI's. Sim jobs are exact,
    and a suite of dozens of them no longer pays a Python and torch start-up per job; any other
    command (a container prefix, say) goes to :func:`subprocess_runner`."""
    default = [sys.executable, "-m", "bench"]
    if cmd[:len(default)] != default:
        return subprocess_runner(cmd, results_dir)
    from omegaconf import open_dict

    from bench.config import compose_config
    from bench.runner import execute
    from impl.common.errors import one_line

    overrides = cmd[len(default):]
    try:
        cfg = compose_config(overrides, return_hydra_config=True)
    except Exception as exc:  # a bad override: the CLI's preflight would refuse it (exit 2)
        return 2, one_line(exc)
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if v is not None}
    with open_dict(cfg):
        del cfg["hydra"]
    record = execute(cfg, overrides, choices=choices)
    return (1 if record["status"] == "failed" else 0), str(record.get("error") or "")


def job_command(gate: Gate, system: str, results_dir: pathlib.Path,
                prefix: Sequence[str], overrides: Optional[Sequence[str]] = None) -> list[str]:
    overrides = gate.overrides if overrides is None else overrides
    return [*prefix, *overrides, f"system={choice_of(system)}", f"mode={gate.mode.value}",
            f"results_dir={results_dir}"]


def _run_ids(results_dir: pathlib.Path) -> set[str]:
    if not results_dir.exists():
        return set()
    return {r.get("run_id", "") for r in load_records(results_dir)}


def run_job(gate: Gate, system: str, results_dir: pathlib.Path, runner: Runner,
            prefix: Sequence[str], overrides: Optional[Sequence[str]] = None) -> JobOutcome:
    """Run one job and pick up the record it wrote (the one run_id that is new)."""
    try:
        before = _run_ids(results_dir)
        rc, last = runner(job_command(gate, system, results_dir, prefix, overrides), results_dir)
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
class CaseValues:
    """One case's numbers (the median over repeats of each side)."""

    overrides: list[str]
    candidate: float
    baseline: Optional[float] = None
    ratio: Optional[float] = None
    diff: Optional[float] = None


@dataclass
class GateResult:
    gate: Gate
    candidate_value: Optional[float] = None
    baseline_value: Optional[float] = None
    unit: str = ""
    ratio: Optional[float] = None
    diff: Optional[float] = None
    passed: bool = False
    reasons: list[str] = field(default_factory=list)
    cases: list[CaseValues] = field(default_factory=list)

    def required(self) -> str:
        g, parts = self.gate, []
        if g.min_ratio is not None:
            tol = g.tolerance or 0.0
            need = g.min_ratio * (1 - tol)
            parts.append(f">={need:.4g}x" + (f" ({g.min_ratio:g}x -{tol:.0%})" if tol else ""))
        if g.max_ratio is not None:
            parts.append(f"<={g.max_ratio:g}x")
        if g.min_diff is not None:
            parts.append(f"diff >={g.min_diff:g} {self.unit}".rstrip())
        if g.max_value is not None:
            parts.append(f"<={g.max_value:g} {self.unit}".rstrip())
        if g.min_value is not None:
            parts.append(f">={g.min_value:g} {self.unit}".rstrip())
        text = ", ".join(parts)
        return f"{g.aggregate.value} of {len(g.cases)} cases: {text}" if g.cases else text


def _metric_values(gate: Gate, outcomes: list[JobOutcome], side: str,
                   reasons: list[str]) -> tuple[list[float], str, str]:
    values, unit, better = [], "", "lower"
    for out in outcomes:
        rec = out.record
        if rec is None:
            reasons.append(f"{side}: {out.error}")
            continue
        if rec.get("status") != "ok":  # failed, or invalid (e.g. a contended host): never judged
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
    """Judge a gate of one case (no ``cases``) from its candidate and baseline runs."""
    return judge_cases(gate, [(cand, base)])


def judge_cases(gate: Gate, runs: list[tuple[list[JobOutcome], list[JobOutcome]]]) -> GateResult:
    """Judge a gate from (candidate runs, baseline runs) per case: each case's medians, then
    the gate's aggregate over cases against its bounds."""
    res = GateResult(gate)
    kinds: set[tuple[str, str]] = set()
    overrides = gate.case_overrides()
    for i, (cand, base) in enumerate(runs):
        reasons: list[str] = []
        c_vals, unit, better = _metric_values(gate, cand, "candidate", reasons)
        b_vals, b_unit, b_better = _metric_values(gate, base, "baseline", reasons)
        tag = f"case {i} ({' '.join(gate.cases[i])}): " if gate.cases else ""
        if reasons:  # a failed or invalid job is a FAIL, whatever the other runs say
            res.reasons += [tag + r for r in reasons]
            continue
        kinds.add((unit, better))
        # Medians: one value per side for sim, the median of the interleaved repeats for real.
        case = CaseValues(overrides[i], statistics.median(c_vals))
        if gate.needs_baseline:
            kinds.add((b_unit, b_better))
            case.baseline = statistics.median(b_vals)
            case.ratio = times_better(case.candidate, case.baseline, better)
            case.diff = (case.candidate - case.baseline if better == "higher"
                         else case.baseline - case.candidate)
        res.cases.append(case)
    if res.reasons:
        return res
    if len(kinds) != 1:
        res.reasons.append("runs report different units or directions: "
                           + ", ".join(f"{u!r}/{b}" for u, b in sorted(kinds)))
        return res
    res.unit = next(iter(kinds))[0]
    if gate.aggregate == Aggregate.each:
        for i, case in enumerate(res.cases):
            res.reasons += [f"case {i} ({' '.join(gate.cases[i])}): {why}"
                            for why in _shortfalls(gate, case)]
    else:
        agg = AGGREGATORS[gate.aggregate]
        res.candidate_value = agg([c.candidate for c in res.cases])
        if gate.needs_baseline:
            res.baseline_value = agg([c.baseline for c in res.cases])
            ratios = [c.ratio for c in res.cases]
            res.ratio = None if None in ratios else agg(ratios)
            res.diff = agg([c.diff for c in res.cases])
        res.reasons += _shortfalls(gate, CaseValues([], res.candidate_value, res.baseline_value,
                                                    res.ratio, res.diff))
    res.passed = not res.reasons
    return res


def _shortfalls(gate: Gate, v: CaseValues) -> list[str]:
    """Every bound of ``gate`` that the numbers ``v`` miss, one line each."""
    out = []
    if gate.min_ratio is not None:
        need = gate.min_ratio * (1 - (gate.tolerance or 0.0))
        if v.ratio is None or v.ratio < need:
            out.append(f"ratio {_fmt(v.ratio)}x < required {need:.4g}x")
    if gate.max_ratio is not None and (v.ratio is None or v.ratio > gate.max_ratio):
        out.append(f"ratio {_fmt(v.ratio)}x > max_ratio {gate.max_ratio:g}x")
    if gate.min_diff is not None and v.diff < gate.min_diff:
        out.append(f"diff {v.diff:.4g} < min_diff {gate.min_diff:g}")
    if gate.max_value is not None and v.candidate > gate.max_value:
        out.append(f"value {v.candidate:.4g} > max_value {gate.max_value:g}")
    if gate.min_value is not None and v.candidate < gate.min_value:
        out.append(f"value {v.candidate:.4g} < min_value {gate.min_value:g}")
    return out


def default_runner(gate: Gate) -> Runner:
    """Sim gates run their jobs in this process (exact either way, and fast); real gates in a
    fresh process each, as a user's runs are."""
    return inprocess_runner if gate.mode == GateMode.sim else subprocess_runner


def run_gate(gate: Gate, results_dir: pathlib.Path, runner: Optional[Runner] = None,
             prefix: Sequence[str] = (), progress: Optional[Callable[[str], None]] = None
             ) -> GateResult:
    runner = runner or default_runner(gate)
    progress = progress or (lambda line: print(line, flush=True))  # CI logs live, not at exit
    prefix = list(prefix) or [sys.executable, "-m", "bench"]
    repeats = (gate.repeats or DEFAULT_REPEATS) if gate.mode == GateMode.real else 1
    sides = [("candidate", gate.candidate)]
    if gate.needs_baseline:
        sides.append(("baseline", gate.baseline))
    case_overrides = gate.case_overrides()
    # Interleaved c,b,c,b,... per case: drift on a shared machine hits both sides alike.
    plan = [(k, side, system) for k in range(len(case_overrides))
            for _ in range(repeats) for side, system in sides]
    runs = [{"candidate": [], "baseline": []} for _ in case_overrides]
    for i, (k, side, system) in enumerate(plan, 1):
        t0 = time.monotonic()
        out = run_job(gate, system, results_dir, runner, prefix, case_overrides[k])
        status = out.record.get("status") if out.record else "no record"
        case = f" case {k}" if gate.cases else ""
        progress(f"[{gate.name}{case} {i}/{len(plan)}] {side} {system} ({gate.mode.value}): "
                 f"{status} in {time.monotonic() - t0:.1f}s")
        runs[k][side].append(out)
    return judge_cases(gate, [(r["candidate"], r["baseline"]) for r in runs])


# ------------------------------------------------------------------ report

def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def format_results(results: Sequence[GateResult]) -> str:
    head = ["gate", "candidate", "baseline", "metric", "candidate value", "baseline value",
            "ratio", "diff", "required", "result"]
    rows = []
    for r in results:
        g = r.gate
        unit = f" {r.unit}" if r.unit else ""
        rows.append([g.name, g.candidate, g.baseline or "-", f"{g.metric} ({g.mode.value})",
                     _fmt(r.candidate_value) + (unit if r.candidate_value is not None else ""),
                     _fmt(r.baseline_value) + (unit if r.baseline_value is not None else ""),
                     "-" if r.ratio is None else f"{r.ratio:.4g}x",
                     "-" if r.diff is None else f"{r.diff:+.4g}", r.required(),
                     "PASS" if r.passed else "FAIL"])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        if r.gate.cases:
            for i, c in enumerate(r.cases):
                extra = "" if c.baseline is None else \
                    f", baseline {c.baseline:.4g}, ratio {_fmt(c.ratio)}x, diff {c.diff:+.4g}"
                lines.append(f"{r.gate.name} case {i} ({' '.join(r.gate.cases[i])}): "
                             f"candidate {c.candidate:.4g}{extra}")
        lines += [f"{r.gate.name}: FAIL: {why}" for why in r.reasons]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Run CI performance gates "
                                "(bench/data/gates/<suite>.yaml); exit 1 if any falls short.")
    p.add_argument("suites", nargs="*", help="suite names (default: every bench/data/gates/*.yaml)")
    p.add_argument("--results", help="results dir for the gate's jobs (default: a temporary "
                                     "dir, kept only if a gate fails)")
    p.add_argument("--gate-dir", help="where the suite yamls are (default: bench/data/gates)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the suites and print the jobs, run nothing")
    return p


def main(argv: Optional[Sequence[str]] = None, *, runner: Optional[Runner] = None,
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
            for ovs in g.case_overrides():
                for system in [g.candidate] + ([g.baseline] if g.needs_baseline else []):
                    print(f"{g.name}: {n}x " + " ".join(job_command(g, system, where, shown, ovs)))
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
