"""``mlsys-bench-fidelity-passes``: the CPU fidelity families quoted as a spread over several fresh
calibrate-then-run passes, not one.

    mlsys-bench-fidelity-passes --passes 3 --out results/runs/fidelity_passes

Each pass runs in its own empty working directory, so the fidelity presets find no
``./conf/hardware/local*.yaml`` there and calibrate the profiles themselves, as on a new user's
machine (a profile left in the package's own ``conf/hardware/`` would be reused instead: refused).
Per pass and family: ``mlsys-bench --multirun experiment=fidelity/<family>`` with that pass's
results directory; a family whose real runs come back ``invalid`` (host contended) is run again up
to ``--retries`` times. What moves between passes is shown on both sides: the real value and the
sim value of every headline per pass, and the calibrated profile fields of each pass with their
spread, so a sim that moves while the real run stays put points at the calibration.

Writes ``OUT/spread.md`` (the tables), ``OUT/summary.json`` (every row of every pass, the
per-pass verdict, the profile spread) and ``OUT/pass<i>/`` (the records and the profiles).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

import yaml

from bench.fidelity.view import fidelity_rows
from bench.record import load_records
from impl.common.hardware import hardware_dir

FAMILIES = ("pipeline", "hybrid", "serving", "diffusion")
BAND_PCT = 10.0
PROFILES = ("local", "local-t1")


def _run_family(family: str, pass_dir: pathlib.Path, extra: Sequence[str]) -> int:
    cmd = [sys.executable, "-m", "bench", "--multirun", f"experiment=fidelity/{family}",
           f"results_dir={pass_dir / 'results'}", *extra]
    with open(pass_dir / f"{family}.log", "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        return subprocess.run(cmd, cwd=pass_dir, stdout=out, stderr=subprocess.STDOUT).returncode


def _calibrate_median(pass_dir: pathlib.Path, rounds: int) -> None:
    """``rounds`` fresh ``system=harness/calibrate`` processes per profile, then their per-field median
    as the pass's ``conf/hardware/<name>.yaml`` (the presets then find it and calibrate nothing)."""
    from bench.calibrate.system import median_profile

    for name in PROFILES:
        threads = name.rsplit("-t", 1)[1] if "-t" in name else None
        paths = []
        for j in range(rounds):
            path = pass_dir / "calibrations" / f"{name}-{j + 1}.yaml"
            cmd = [sys.executable, "-m", "bench", "system=harness/calibrate", "mode=real", f"system.output={path}",
                   f"results_dir={pass_dir / 'calibrations' / 'results'}"] + ([f"system.threads={threads}"] if threads else [])
            with open(pass_dir / "calibrate.log", "a") as out:
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                rc = subprocess.run(cmd, cwd=pass_dir, stdout=out, stderr=subprocess.STDOUT).returncode
            if rc != 0 or not path.exists():
                raise SystemExit(f"mlsys-bench-fidelity-passes: calibration {j + 1} of {name} failed "
                                 f"(rc {rc}, see {pass_dir / 'calibrate.log'})")
            paths.append(path)
        median_profile(paths, pass_dir / "conf" / "hardware" / f"{name}.yaml")


def _family_records(pass_dir: pathlib.Path, family: str, since: str) -> list[dict]:
    res = pass_dir / "results"
    if not (res / "records.jsonl").exists():
        return []
    return [r for r in load_records(res) if ((r.get("info") or {}).get("fidelity") or {}).get("family") == family
            and r.get("created", "") >= since]


def stale_profiles(records: list[dict], pass_dir: pathlib.Path) -> list[str]:
    """Profiles a pass's fidelity records priced with that do not lie in the pass's own directory."""
    root = str(pass_dir.resolve())
    srcs = {((r.get("info") or {}).get("fidelity") or {}).get("sim_hardware_path") or "" for r in records}
    return sorted(s for s in srcs if s and not str(pathlib.Path(s).resolve()).startswith(root))


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())


def _numeric_fields(profile: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (profile or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out[key] = float(v)
        elif isinstance(v, dict):
            out.update(_numeric_fields(v, key + "."))
    return out


def profile_spread(profiles: list[dict[str, dict]]) -> list[dict[str, Any]]:
    """Per calibrated field present in every pass: the values and (max - min) / median."""
    rows = []
    for name in PROFILES:
        per_pass = [_numeric_fields(p.get(name) or {}) for p in profiles]
        if not per_pass or not all(per_pass):
            continue
        for field in sorted(set.intersection(*(set(p) for p in per_pass))):
            vals = [p[field] for p in per_pass]
            med = statistics.median(vals)
            if med == 0:
                continue
            rows.append({"profile": name, "field": field, "values": vals,
                         "spread_pct": 100.0 * (max(vals) - min(vals)) / abs(med)})
    return sorted(rows, key=lambda r: -r["spread_pct"])


def row_spread(passes: list[list[dict]]) -> list[dict[str, Any]]:
    """Per (family, situation, workload, fault, metric): real, sim and error % of each pass."""
    keyed: dict[tuple, list[Optional[dict]]] = {}
    for i, rows in enumerate(passes):
        for r in rows:
            key = (r["family"], r["situation"], str(r.get("workload")), str(r.get("fault")), r["metric"])
            keyed.setdefault(key, [None] * len(passes))[i] = r
    out = []
    for key, per in sorted(keyed.items()):
        ok = [r for r in per if r is not None and r["status"] == "ok"]
        errs = [r["error_pct"] for r in ok]

        def rel(vals):
            return 100.0 * (max(vals) - min(vals)) / statistics.median(vals) if vals else None
        out.append({"family": key[0], "situation": key[1], "workload": key[2], "fault": key[3], "metric": key[4],
                    "error_pct": [None if r is None else r["error_pct"] for r in per],
                    "status": [None if r is None else r["status"] for r in per],
                    "real": [None if r is None else r["real"] for r in per],
                    "sim": [None if r is None else r["sim"] for r in per],
                    "error_min": min(errs) if errs else None, "error_max": max(errs) if errs else None,
                    "real_spread_pct": rel([r["real"] for r in ok]), "sim_spread_pct": rel([r["sim"] for r in ok])})
    return out


def pass_verdicts(passes: list[list[dict]], families: Sequence[str]) -> list[dict[str, Any]]:
    """Per pass: each family's max |error %| over its valid rows, and whether it is within the band."""
    out = []
    for rows in passes:
        fam = {}
        for f in families:
            ok = [abs(r["error_pct"]) for r in rows if r["family"] == f and r["status"] == "ok"]
            invalid = sum(1 for r in rows if r["family"] == f and r["status"] != "ok")
            fam[f] = {"max_abs_error_pct": max(ok) if ok else None, "valid_rows": len(ok), "invalid_rows": invalid,
                      "within_band": bool(ok) and invalid == 0 and max(ok) <= BAND_PCT}
        out.append({"families": fam, "families_within_band": sum(v["within_band"] for v in fam.values())})
    return out


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_markdown(spread: list[dict], verdicts: list[dict], prof: list[dict], n: int, top: int = 12) -> str:
    lines = ["| family | situation | fault | metric | " + " | ".join(f"pass {i + 1} error %" for i in range(n))
             + " | real spread % | sim spread % |", "|" + "---|" * (n + 6)]
    for r in spread:
        cells = [("-" if e is None else f"{e:+.1f}") + ("" if s in (None, "ok") else f" ({s})")
                 for e, s in zip(r["error_pct"], r["status"])]
        sit = r["situation"] + ("" if r["workload"] in ("None", "") else f" ({r['workload']})")
        lines.append(f"| {r['family']} | {sit} | {r['fault']} | {r['metric']} | " + " | ".join(cells)
                     + f" | {_fmt(r['real_spread_pct'], '.1f')} | {_fmt(r['sim_spread_pct'], '.1f')} |")
    lines += ["", "| pass | " + " | ".join(verdicts[0]["families"]) + " | families within ±10% |",
              "|" + "---|" * (len(verdicts[0]["families"]) + 2)] if verdicts else []
    for i, v in enumerate(verdicts):
        cells = [_fmt(f["max_abs_error_pct"], ".1f") + ("" if f["within_band"] else " (out)")
                 for f in v["families"].values()]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + f" | {v['families_within_band']} |")
    if prof:
        lines += ["", f"Calibrated fields that moved most between passes (top {top}):", "",
                  "| profile | field | " + " | ".join(f"pass {i + 1}" for i in range(n)) + " | spread % |",
                  "|" + "---|" * (n + 3)]
        for p in prof[:top]:
            lines.append(f"| {p['profile']} | {p['field']} | " + " | ".join(f"{v:.4g}" for v in p["values"])
                         + f" | {p['spread_pct']:.1f} |")
    return "\n".join(lines) + "\n"


def _refuse_package_profiles() -> None:
    own = [hardware_dir() / f"{n}.yaml" for n in PROFILES]
    left = [str(p) for p in own if p.exists()]
    if left:
        raise SystemExit(f"mlsys-bench-fidelity-passes: {', '.join(left)} exists and would be reused by every pass "
                         f"instead of a fresh calibration; move it away first")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mlsys-bench-fidelity-passes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--out", default="results/runs/fidelity_passes")
    ap.add_argument("--retries", type=int, default=1, help="re-runs of a family whose real runs were invalid")
    ap.add_argument("--calibrations", type=int, default=1,
                    help="fresh calibrations per profile and pass; > 1: the pass prices with their per-field median "
                         "(1: the presets calibrate once themselves)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job")
    args = ap.parse_args(argv)
    if args.passes < 1:
        raise SystemExit("mlsys-bench-fidelity-passes: --passes must be >= 1")
    if args.calibrations < 1:
        raise SystemExit("mlsys-bench-fidelity-passes: --calibrations must be >= 1")
    _refuse_package_profiles()
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    all_rows, profiles = [], []
    for i in range(args.passes):
        pdir = out / f"pass{i + 1}"
        if pdir.exists() and any(pdir.iterdir()):
            raise SystemExit(f"mlsys-bench-fidelity-passes: {pdir} is not empty (a pass must start fresh)")
        pdir.mkdir(parents=True, exist_ok=True)
        if args.calibrations > 1:
            _calibrate_median(pdir, args.calibrations)
            print(f"[{time.monotonic() - t0:7.0f} s] pass {i + 1}/{args.passes}: median of {args.calibrations} "
                  f"calibrations per profile", flush=True)
        for fam in args.families:
            for attempt in range(args.retries + 1):
                since = _stamp()
                rc = _run_family(fam, pdir, args.overrides)
                recs = _family_records(pdir, fam, since)
                bad = [r for r in recs if r.get("status") != "ok"]
                print(f"[{time.monotonic() - t0:7.0f} s] pass {i + 1}/{args.passes} {fam}: rc {rc}, "
                      f"{len(recs)} records, {len(bad)} not ok" + (" (retry)" if bad and attempt < args.retries else ""),
                      flush=True)
                if not bad and rc == 0:
                    break
        all_rows.append(fidelity_rows(load_records(pdir / "results"), include_invalid=True)
                        if (pdir / "results" / "records.jsonl").exists() else [])
        profiles.append({n: yaml.safe_load((pdir / "conf" / "hardware" / f"{n}.yaml").read_text())
                         for n in PROFILES if (pdir / "conf" / "hardware" / f"{n}.yaml").exists()})
        stale = stale_profiles(load_records(pdir / "results") if (pdir / "results" / "records.jsonl").exists() else [], pdir)
        if stale:
            raise SystemExit(f"mlsys-bench-fidelity-passes: pass {i + 1} priced with a profile outside its own "
                             f"directory ({stale[0]}); a pass must calibrate fresh")
        if i + 1 < args.passes:
            _write(out, all_rows, profiles, args)
    print(_write(out, all_rows, profiles, args))
    print(f"wrote {out / 'spread.md'} and {out / 'summary.json'}")
    return 0


def _write(out: pathlib.Path, all_rows: list, profiles: list, args) -> str:
    """The tables over the passes done so far (rewritten after every pass: a cut run keeps them)."""
    spread = row_spread(all_rows)
    verdicts = pass_verdicts(all_rows, args.families)
    prof = profile_spread(profiles)
    md = format_markdown(spread, verdicts, prof, len(all_rows))
    how = (f"Profiles: per pass, the per-field median of {args.calibrations} fresh calibrations."
           if args.calibrations > 1 else "Profiles: one fresh calibration per pass (by the presets).")
    md = how + "\n\n" + md
    (out / "spread.md").write_text(md)
    (out / "summary.json").write_text(json.dumps({"passes": len(all_rows), "families": args.families,
                                                  "calibrations": args.calibrations,
                                                  "rows": spread, "verdicts": verdicts, "profile_spread": prof,
                                                  "per_pass_rows": all_rows}, indent=1, default=str))
    return md


if __name__ == "__main__":
    sys.exit(main())
