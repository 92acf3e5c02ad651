"""``mlsys-bench-runs``: price every launch of a Megatron runs file with the step model and put
the measured values beside the prediction; ``mlsys-bench-calibrate-megatron``: fit a profile's
Megatron knobs to a runs file and write the profile with the fit's provenance.

    mlsys-bench-runs --runs impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz --folds 5 --out results/runs/megatron_runs
    mlsys-bench-calibrate-megatron --runs impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz \\
        --hardware h100-sxm --output conf/hardware/h100-megatron.yaml

    mlsys-bench-runs --runs impl/common/megatron/data/megatron_h100_holdout.jsonl.gz --holdout --out results/runs/megatron_holdout

``--holdout``: price a file no fit saw with the profile's shipped knobs, error table per
architecture (GPT, LLaMA). ``--folds K``: K-fold cross-validation, each launch predicted by knobs fitted on the other K-1
folds (the errors quoted in ``bench/fidelity/README.md``). Without it, the profile's own knobs
price every launch (in-sample when the profile was fitted on that file).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import pathlib
import sys
from importlib import resources
from typing import Optional, Sequence

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile, load_hardware
from impl.common.megatron import fit as megafit
from impl.common.megatron.runs import DocLengths, file_sha256, load_runs
from impl.common.plots.save import save_png

DEFAULT_HARDWARE = "h100-megatron"
DEFAULT_RUNS = "impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz"
DEFAULT_KERNELS = "impl/common/megatron/data/h200_kernels_2026-12-04.jsonl"
DEFAULT_KERNELS_GPU = "h200"
BAND = 0.10


def _default_runs() -> str:
    return _data_path(DEFAULT_RUNS)


def _data_path(rel: str) -> str:
    p = pathlib.Path(rel)
    return str(p if p.is_file() else pathlib.Path(str(resources.files("impl.common.megatron").joinpath("data", p.name))))


def _progress(total: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, leave=False, disable=not sys.stderr.isatty())
    return bar


def format_table(table: dict, title: str) -> str:
    lines = [title, f"{'metric':<22} {'n':>5} {'median |err|':>13} {'p90 |err|':>10}"]
    for key, label in (("pad_time", "pad iteration time"), ("pack_time", "pack iteration time"),
                       ("memory", "peak allocated memory")):
        r = table[key]
        lines.append(f"{label:<22} {r['n']:>5} {_pct(r['median_abs']):>13} {_pct(r['p90_abs']):>10}")
    v = table["verdict"]
    lines.append(f"{'fit / OOM verdict':<22} {v['n']:>5} {_pct(v['accuracy'], 'right'):>13}")
    lines.append(f"  measured fits: predicted fits {v['fits_predicted_fits']}, predicted OOM {v['fits_predicted_oom']}; "
                 f"measured OOM: predicted fits {v['oom_predicted_fits']}, predicted OOM {v['oom_predicted_oom']}")
    return "\n".join(lines)


def _pct(x: float, suffix: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%{(' ' + suffix) if suffix else ''}"


def plot(preds: Sequence[dict], table: dict, path: pathlib.Path, title: str) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    ax = axes[0]
    for mode, color in (("pad", "tab:blue"), ("pack", "tab:orange")):
        pts = [(r["measured_iteration_ms"] / 1e3, r["predicted_iteration_ms_if_run"] / 1e3) for r in preds
               if r["mode"] == mode and r.get("measured_iteration_ms") and r.get("predicted_iteration_ms_if_run")]
        if pts:
            x, y = zip(*pts)
            t = table[f"{mode}_time"]
            ax.scatter(x, y, s=12, alpha=0.7, color=color,
                       label=f"{mode} (n={t['n']}, median |err| {_pct(t['median_abs'])})")
    _diag(ax, "measured iteration time (s)", "predicted (s)")
    ax.set_title("iteration time")
    ax = axes[1]
    pts = [(r["measured_peak_allocated_mb"] / 1024, r["predicted_peak_allocated_mb_printed_ranks"] / 1024, r["mode"])
           for r in preds if r.get("measured_peak_allocated_mb") and r.get("predicted_peak_allocated_mb_printed_ranks")]
    for mode, color in (("pad", "tab:blue"), ("pack", "tab:orange")):
        sel = [(a, b) for a, b, m in pts if m == mode]
        if sel:
            x, y = zip(*sel)
            ax.scatter(x, y, s=12, alpha=0.7, color=color, label=mode)
    _diag(ax, "measured peak allocated (GiB)", "predicted (GiB)")
    ax.set_title(f"peak memory (median |err| {_pct(table['memory']['median_abs'])})")
    ax = axes[2]
    v = table["verdict"]
    grid = [[v["fits_predicted_fits"], v["fits_predicted_oom"]], [v["oom_predicted_fits"], v["oom_predicted_oom"]]]
    ax.imshow([[1, 0], [0, 1]], cmap="Greens", alpha=0.25, vmin=0, vmax=1)
    for i in range(2):
        for j in range(2):
            ax.text(j, i, str(grid[i][j]), ha="center", va="center", fontsize=16)
    ax.set_xticks([0, 1], ["predicted fits", "predicted OOM"])
    ax.set_yticks([0, 1], ["ran", "OOM"])
    ax.set_title(f"fit / OOM verdict: {_pct(v['accuracy'])} right of {v['n']}")
    fig.suptitle(title)
    return save_png(fig, path)


def _diag(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    lo, hi = ax.get_xlim()
    lo, hi = min(lo, ax.get_ylim()[0]), max(hi, ax.get_ylim()[1])
    xs = [lo, hi]
    ax.plot(xs, xs, color="black", lw=1)
    ax.fill_between(xs, [x * (1 - BAND) for x in xs], [x * (1 + BAND) for x in xs], color="grey", alpha=0.2,
                    label=f"±{int(BAND * 100)}%")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="upper left")


ARCHS = ("gpt", "llama")


def tables_by_arch(preds: Sequence[dict]) -> dict:
    """The error table of every launch and of each architecture's launches."""
    out = {"all": megafit.error_table(preds)}
    for arch in ARCHS:
        rows = [r for r in preds if r.get("arch") == arch]
        if rows:
            out[arch] = megafit.error_table(rows)
    return out


def format_arch_tables(tables: dict, title: str) -> str:
    parts = [title]
    for key, t in tables.items():
        parts.append(format_table(t, f"-- {key} launches"))
        parts.append(f"  median signed error (predicted / measured - 1): pad time {_pct(t['pad_time']['median_signed'])}, "
                     f"pack time {_pct(t['pack_time']['median_signed'])}, memory {_pct(t['memory']['median_signed'])}")
    return "\n".join(parts)


def check_not_fitted_on(runs: str, hw: HardwareProfile) -> str:
    """The runs file's sha256, refused when the profile's knobs were fitted on it (a held-out
    check prices launches no fit saw)."""
    if not pathlib.Path(runs).is_file():
        raise ConfigError(f"--runs: no such file {runs}")
    sha = file_sha256(runs)
    fitted = (hw.calibration or {}).get("runs_sha256")
    if fitted and fitted == sha:
        raise ConfigError(f"--holdout: {runs} is the file {hw.name}'s knobs were fitted on (calibration.runs_sha256 "
                          f"{sha[:16]}): not held out")
    return sha


def run_pricing(runs: str, hardware: str, out: pathlib.Path, folds: Optional[int], seed: int = 0,
                own_histograms: bool = False, holdout: bool = False) -> dict:
    hw = load_hardware(hardware)
    if holdout:
        if folds:
            raise ConfigError("--holdout: prices with the profile's shipped knobs; --folds would re-fit them")
        if hw.megatron.knobs is None:
            raise ConfigError(f"--holdout: hardware {hw.name} has no fitted Megatron knobs to check")
        check_not_fitted_on(runs, hw)
    launches = load_runs(runs)
    priced = megafit.featurize(launches, hw, DocLengths(launches, own=own_histograms))
    if folds:
        bar = _progress(folds, f"{folds}-fold fit")
        preds, per_fold = megafit.cross_validate(priced, hw, folds, seed, progress=lambda f: bar.update(1))
        bar.close()
        how = f"{folds}-fold cross-validated (each launch predicted by knobs fitted on the other folds)"
    else:
        if hw.megatron.knobs is None:
            print(f"mlsys-bench-runs: note: hardware {hw.name} has no fitted Megatron knobs; priced from its datasheet "
                  f"figures", file=sys.stderr)
        preds, per_fold = [megafit.predict(p, hw) for p in priced], []
        how = f"priced with hardware {hw.name}'s knobs"
    table = megafit.error_table(preds)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as fh:
        for r in preds:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
    skipped = [p for p in priced if p.feats is None]
    summary = {"runs": str(runs), "runs_sha256": file_sha256(runs), "hardware": hw.name, "how": how,
               "launches": len(launches), "priced": len(preds), "layout_cannot_run": len(skipped),
               "no_layout": len(launches) - len(priced),
               "skipped_no_layout": sum(la.no_layout for la in launches), "table": table, "folds": per_fold,
               "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True), encoding="utf-8")
    title = f"{pathlib.Path(runs).name}: {how}"
    plot(preds, table, out / "pred_vs_measured.png", title if len(title) < 110 else title[:107] + "...")
    head = f"{len(preds)} launches of {pathlib.Path(runs).name} on {hw.name}, {how}"
    if holdout:
        summary["held_out"] = True
        summary["tables_by_arch"] = tables_by_arch(preds)
        summary["text"] = format_arch_tables(summary["tables_by_arch"], head + " (held out: no fit saw these launches)")
        (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True), encoding="utf-8")
    else:
        summary["text"] = format_table(table, head)
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mlsys-bench-runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=None, help=f"runs file (.jsonl or .jsonl.gz; default {DEFAULT_RUNS})")
    ap.add_argument("--hardware", default=DEFAULT_HARDWARE, help="profile name or path (default: the calibrated H100)")
    ap.add_argument("--out", default="results/runs/megatron_runs", help="folder for predictions.jsonl, summary.json, the PNG")
    ap.add_argument("--folds", type=int, default=None, help="K-fold cross-validation (fit on K-1 folds)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fold assignment")
    ap.add_argument("--own-histograms", action="store_true",
                    help="pack launches draw documents from their own histogram instead of the file's pooled one")
    ap.add_argument("--holdout", action="store_true",
                    help="held-out check: price with --hardware's shipped knobs (no re-fit; refused on the file they "
                         "were fitted on) and report the error table per architecture")
    a = ap.parse_args(argv)
    try:
        if a.folds is not None and a.folds < 2:
            raise ConfigError(f"--folds: needs >= 2, got {a.folds}")
        s = run_pricing(a.runs or _default_runs(), a.hardware, pathlib.Path(a.out), a.folds, a.seed, a.own_histograms,
                        holdout=a.holdout)
    except ConfigError as e:
        print(f"mlsys-bench-runs: error: {e}", file=sys.stderr)
        return 2
    print(s["text"])
    if s["skipped_no_layout"]:
        print(f"{s['skipped_no_layout']} launches printed no layout (effective.mode null, status error): skipped")
    if s["layout_cannot_run"]:
        print(f"{s['layout_cannot_run']} launches have a layout Megatron cannot run (predicted_fits false, "
              f"reason in predicted_error)")
    print(f"wrote {pathlib.Path(a.out) / 'predictions.jsonl'}, summary.json, pred_vs_measured.png")
    return 0


# ---- calibration ------------------------------------------------------------------------------

HEADER = """# {name}: {base} with Megatron-LM step-model knobs fitted to measured launches.
# Written by `mlsys-bench-calibrate-megatron --runs {runs_name} --hardware {base}`; do not edit by
# hand: re-fit. `kernels` holds the GEMM and attention tables ({kernels_name}, measured on one
# {kernels_gpu}, carried to {base} by impl/common/megatron/kernels.carried: compute-bound times kept at the
# same bf16 peak, memory-bound ones at {base}'s HBM bandwidth); `megatron` the fitted knobs
# (impl/common/hardware.MegatronKnobs documents each, impl/common/megatron/fit.knob_ranges their
# physical ranges) and `calibration` the fit's input (files, sha256), residuals, knobs at a bound
# and cross-validated errors.
# Sources: the datasheet fields are {base}'s (conf/hardware/{base}.yaml cites them); the measured
#   launches are the training logs of https://github.com/Sakura-gh/Megatron-LM (branch sync_files,
#   commit 838d7c8), copied to impl/common/megatron/data/ (impl/common/megatron/data/README.md); the kernel file is the workplace's
#   shared/data/{kernels_name} (impl/common/megatron/data/README.md).
"""

DERIVED_HEADER = """# {name}: {target} with Megatron-LM step-model knobs derived from {base} by datasheet ratios.
# Written by `mlsys-bench-calibrate-megatron --derive {target} --from {base}`; do not edit by hand.
# Sources: the datasheet fields are {target}'s (conf/hardware/{target}.yaml cites them); the knobs
#   are {base}'s (fitted to the measured H100 launches of https://github.com/Sakura-gh/Megatron-LM,
#   impl/common/megatron/data/README.md), scaled as impl/common/megatron/derive.py documents: the kernel tables
#   scale by the bf16 peak ratio (compute-bound) and the HBM bandwidth (memory-bound), the time
#   factors over the tables are kept, bus bandwidths scale with the datasheet link ratio, host
#   overheads and the software's bytes are kept, the allocatable memory keeps the same headroom
#   below the GPU's memory. Not measured on {target}.
"""


def with_kernel_tables(hw: HardwareProfile, kernels: str, kernels_gpu: str) -> HardwareProfile:
    """``hw`` with the kernel tables of ``kernels`` (a probe file measured on ``kernels_gpu``),
    carried to ``hw`` (:func:`impl.common.megatron.kernels.carried`)."""
    from impl.common.megatron.kernels import carried, tables_from_jsonl

    src = load_hardware(kernels_gpu)
    tabs = tables_from_jsonl(kernels, source=f"{pathlib.Path(kernels).name} (sha256 {file_sha256(kernels)[:16]}, "
                                             f"measured on {src.name})")
    if src.name != hw.name:
        tabs = carried(tabs, src.peak_flops["bf16"], src.memory_bw_bytes_per_s, hw)
    return hw.with_megatron(kernels=tabs)


def calibrate(runs: str, base: str, output: pathlib.Path, name: Optional[str] = None, folds: int = 5,
              kernels: Optional[str] = None, kernels_gpu: str = DEFAULT_KERNELS_GPU) -> HardwareProfile:
    from bench.calibrate.system import write_profile_atomic

    launches = load_runs(runs)
    hw = load_hardware(base)
    kernels = kernels or _data_path(DEFAULT_KERNELS)
    hw_base = with_kernel_tables(_without_knobs(hw), kernels, kernels_gpu)
    priced = megafit.featurize(launches, hw_base)
    knobs, info = megafit.fit(priced, hw_base)
    cv_table = megafit.error_table(megafit.cross_validate(priced, hw_base, folds)[0]) if folds else {}
    name = name or output.stem
    calibration = {"runs_file": pathlib.Path(runs).name, "runs_sha256": file_sha256(runs), "base_profile": hw.name,
                   "kernels_file": pathlib.Path(kernels).name, "kernels_sha256": file_sha256(kernels),
                   "kernels_measured_on": kernels_gpu,
                   "knob_ranges": {k: [lo, hi] for k, (lo, hi, _) in megafit.knob_ranges(hw_base).items()},
                   "launches": len(launches), "fit": info, "cross_validated": {"folds": folds, **cv_table},
                   "fitted": _dt.date.today().isoformat(), "tool": "mlsys-bench-calibrate-megatron"}
    import dataclasses

    prof = dataclasses.replace(hw_base.with_megatron(knobs=knobs), name=name, calibration=calibration,
                               source=f"{hw.source}; Megatron knobs fitted to {pathlib.Path(runs).name} (measured H100 runs)")
    write_profile_atomic(prof, output, HEADER.format(name=name, base=hw.name, runs_name=pathlib.Path(runs).name,
                                                     kernels_name=pathlib.Path(kernels).name, kernels_gpu=kernels_gpu))
    return prof


def derive(target: str, base: str, output: pathlib.Path) -> HardwareProfile:
    from bench.calibrate.system import write_profile_atomic
    from impl.common.megatron.derive import derived_profile

    prof = derived_profile(load_hardware(base), load_hardware(target), name=output.stem)
    write_profile_atomic(prof, output, DERIVED_HEADER.format(name=output.stem, target=target, base=base))
    return prof


def _without_knobs(hw: HardwareProfile) -> HardwareProfile:
    import dataclasses

    return dataclasses.replace(hw.with_megatron(knobs=None, kernels=None), calibration={})


def calibrate_main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mlsys-bench-calibrate-megatron",
                                 description="Fit a hardware profile's Megatron knobs to measured launches, on "
                                             "kernel tables from a probe file.")
    ap.add_argument("--runs", default=None, help=f"runs file (default {DEFAULT_RUNS})")
    ap.add_argument("--hardware", default="h100-sxm", help="datasheet profile the launches ran on")
    ap.add_argument("--output", default="conf/hardware/h100-megatron.yaml")
    ap.add_argument("--folds", type=int, default=5, help="cross-validation folds recorded in the provenance (0: none)")
    ap.add_argument("--kernels", default=None, help=f"kernel probe file (default {DEFAULT_KERNELS})")
    ap.add_argument("--kernels-gpu", default=DEFAULT_KERNELS_GPU,
                    help="datasheet profile of the GPU the kernel file was measured on (its tables are carried to --hardware)")
    ap.add_argument("--derive", metavar="TARGET", default=None,
                    help="instead of fitting: derive TARGET's knobs (a datasheet profile) from --from by datasheet ratios")
    ap.add_argument("--from", dest="base", default=DEFAULT_HARDWARE, help="calibrated profile --derive starts from")
    a = ap.parse_args(argv)
    try:
        if a.derive:
            out = pathlib.Path(a.output if a.output != "conf/hardware/h100-megatron.yaml"
                               else f"conf/hardware/{a.derive}-megatron.yaml")
            prof = derive(a.derive, a.base, out)
            print(json.dumps({"profile": str(out), "knobs": {k: float(f"{v:.4g}") for k, v in vars(prof.megatron.knobs).items()},
                              "derived_from": a.base}, indent=1))
            return 0
        prof = calibrate(a.runs or _default_runs(), a.hardware, pathlib.Path(a.output), folds=a.folds,
                         kernels=a.kernels, kernels_gpu=a.kernels_gpu)
    except ConfigError as e:
        print(f"mlsys-bench-calibrate-megatron: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"profile": a.output, "knobs": {k: float(f"{v:.4g}") for k, v in vars(prof.megatron.knobs).items()},
                      "fit": prof.calibration["fit"], "at_bound": prof.calibration["fit"].get("at_bound", []),
                      "cross_validated": prof.calibration.get("cross_validated", {})}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
