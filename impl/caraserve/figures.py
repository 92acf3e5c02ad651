"""CaraServe sweep figures, drawn from a multirun's records (``figure:`` in an experiment).

Both read the swept values from each record's resolved config, so a figure never depends on how
the runs were labelled."""
from __future__ import annotations

import collections
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from impl.common.plots.records import plottable  # noqa: E402
from impl.common.plots.save import save_png  # noqa: E402

PAPER_BAND = (1.3, 1.7)  # our S1 target [R] (README "Reconstructed choices"): 1.3-1.7x below S-LoRA at lambda >= 7


def _trace(r) -> dict:
    return r["config"]["workload"]["trace"]


def latency_ratios(records, base: str = "slora", mine: str = "caraserve") -> dict:
    """``{(rate, output median, load overhead): (base / mine mean latency, flagged)}`` for every
    point where both policies have a record; ``flagged`` when either run was marked invalid."""
    lat, flagged = {}, set()
    for r in plottable(records, "latency_mean_s", with_invalid=True):
        key = (_trace(r)["rate_rps"], _trace(r)["output_median"], r["config"]["system"]["cost"]["load_overhead_s"])
        lat[(key, r["config"]["system"]["policy"])] = r["metrics"]["latency_mean_s"]["value"]
        if r["status"] != "ok":
            flagged.add(key)
    out = {}
    for key in sorted({k for k, _ in lat}):
        a, b = lat.get((key, base)), lat.get((key, mine))
        if a is not None and b:
            out[key] = (a / b, key in flagged)
    return out


def latency_ratio_map(records, out_dir, base: str = "slora", mine: str = "caraserve") -> list[pathlib.Path]:
    """S1 sensitivity: mean-latency ratio ``base / mine`` per (output median, per-load overhead),
    one panel per arrival rate; cells inside the paper's band in bold with a '*'. Runs the
    harness flagged invalid (e.g. CaraServe's TTFT below CACHED's: README "TTFT-order check") are drawn with a '!'
    because the ratio itself is still the simulated one; cells without both systems stay blank."""
    ratios = latency_ratios(records, base, mine)
    keys = sorted(ratios)
    if not keys:
        return []
    rates = sorted({k[0] for k in keys})
    outs = sorted({k[1] for k in keys})
    overheads = sorted({k[2] for k in keys})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates) + 0.8, 3.6), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        grid = np.full((len(outs), len(overheads)), np.nan)
        for i, o in enumerate(outs):
            for j, h in enumerate(overheads):
                if (rate, o, h) in ratios:
                    grid[i, j] = ratios[(rate, o, h)][0]
        finite = grid[np.isfinite(grid)]
        im = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto", vmin=min(1.0, float(finite.min())),
                       vmax=max(2.0, float(finite.max())))
        for i in range(len(outs)):
            for j in range(len(overheads)):
                if np.isfinite(grid[i, j]):
                    inside = PAPER_BAND[0] <= grid[i, j] <= PAPER_BAND[1]
                    mark = ("*" if inside else "") + ("!" if ratios[(rate, outs[i], overheads[j])][1] else "")
                    ax.text(j, i, f"{grid[i, j]:.2f}{mark}", ha="center", va="center", fontsize=8,
                            color="white", fontweight="bold" if inside else "normal")
        ax.set_xticks(range(len(overheads)))
        ax.set_xticklabels([f"{h * 1e3:g}" for h in overheads])
        ax.set_yticks(range(len(outs)))
        ax.set_yticklabels([f"{o:g}" for o in outs])
        ax.set_xlabel("added cost per adapter load (ms)")
        ax.set_ylabel("output length median (tokens)")
        ax.set_title(f"{rate:g} RPS", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"simulated mean latency {base} / {mine}   (*: inside the paper's {PAPER_BAND[0]}-"
                 f"{PAPER_BAND[1]}x;  !: a run flagged invalid)", fontsize=9)
    path = save_png(fig, pathlib.Path(out_dir) / "latency_ratio_map.png")
    return [path]


def slo_vs_rate(records, out_dir) -> list[pathlib.Path]:
    """S3 capacity: SLO attainment against the offered rate, one line per router."""
    pts = collections.defaultdict(dict)
    for r in plottable(records, "slo_attainment"):
        pts[r["system"]][_trace(r)["rate_rps"]] = r["metrics"]["slo_attainment"]["value"]
    if not pts:
        return []
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in sorted(pts):
        xs = sorted(pts[name])
        ax.plot(xs, [100 * pts[name][x] for x in xs], marker="o", label=name)
    ax.axhline(99, color="k", ls="--", lw=0.8)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title("simulated SLO attainment vs load (dashed: 99%)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = save_png(fig, pathlib.Path(out_dir) / "slo_vs_rate.png")
    return [path]


# ---- the paper's own figures beside ours (v1 and Toppings; values in this package's paper.yaml)
PAPER_FILE = pathlib.Path(__file__).with_name("paper.yaml")


def paper_values(path: pathlib.Path = PAPER_FILE) -> dict:
    """``{name: value}`` of the paper's numbers (the ``entries`` of the paper file, format in
    ``bench/paper.py``; the harness's report reads the same file)."""
    import yaml

    doc = yaml.safe_load(pathlib.Path(path).read_text())
    return {e["name"]: float(e["value"]) for e in doc["entries"]}


def _setting(r) -> str:
    """Paper-table key of a record's workload: ``9rps_r64`` (synthetic) or ``maf512``."""
    wl = r["config"]["workload"]
    if wl["adapters"].get("per_request"):
        return f"{wl['trace']['rate_rps']:g}rps_r{max(wl['adapters']['ranks'])}"
    return f"maf{wl['adapters']['num_adapters']}"


def _mean_latency(records) -> dict:
    out, flagged = {}, set()
    for r in plottable(records, "latency_mean_s", with_invalid=True):
        key = (_setting(r), r["config"]["system"]["policy"])
        out[key] = r["metrics"]["latency_mean_s"]["value"]
        if r["status"] != "ok":
            flagged.add(key)
    return out, flagged


def s1_table(records) -> dict:
    """``{setting: {"over_cached": {policy: ours}, "ratio": S-LoRA / CaraServe, "flagged": [...]}}``."""
    lat, flagged = _mean_latency(records)
    out = {}
    for s in sorted({k[0] for k in lat}):
        base = lat.get((s, "cached"))
        row = {"over_cached": {}, "ratio": None, "flagged": sorted(p for (t, p) in flagged if t == s)}
        for p in ("ondmd", "slora", "caraserve"):
            if base and (s, p) in lat:
                row["over_cached"][p] = lat[(s, p)] / base - 1
        if lat.get((s, "caraserve")) and (s, "slora") in lat:
            row["ratio"] = lat[(s, "slora")] / lat[(s, "caraserve")]
        out[s] = row
    return out


def s1_vs_paper(records, out_dir, paper: dict | None = None) -> list[pathlib.Path]:
    """S1-synthetic / S1-MAF: mean latency over CACHED per system and the S-LoRA / CaraServe
    ratio, ours (solid) beside the paper's (hatched, where the paper gives the setting)."""
    paper = paper_values() if paper is None else paper
    table = s1_table(records)
    if not table:
        return []
    settings = list(table)
    pols = ("ondmd", "slora", "caraserve")
    colors = dict(zip(pols, ("tab:red", "tab:orange", "tab:green")))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    w = 0.13
    for i, s in enumerate(settings):
        for j, p in enumerate(pols):
            x = i + (j - 1) * 2.2 * w
            ours = table[s]["over_cached"].get(p)
            if ours is not None:
                ax.bar(x - w / 2, 100 * ours, w, color=colors[p], label=p if i == 0 else None)
            theirs = paper.get(f"latency_over_cached_{p}_{s}")
            if theirs is not None:
                ax.bar(x + w / 2, 100 * theirs, w, color="white", edgecolor=colors[p], hatch="///",
                       label=f"{p} (paper)" if i == 0 else None)
        ours, theirs = table[s]["ratio"], paper.get(f"slora_over_caraserve_{s}")
        if ours is not None:
            bx.bar(i - 0.18, ours, 0.36, color="tab:blue", label="ours (sim)" if i == 0 else None)
            bx.text(i - 0.18, ours, f"{ours:.2f}" + ("!" if table[s]["flagged"] else ""), ha="center", va="bottom", fontsize=7)
        if theirs is not None:
            bx.bar(i + 0.18, theirs, 0.36, color="white", edgecolor="tab:blue", hatch="///",
                   label="paper" if i == 0 else None)
            bx.text(i + 0.18, theirs, f"{theirs:.2f}", ha="center", va="bottom", fontsize=7)
    for a in (ax, bx):
        a.set_xticks(range(len(settings)))
        a.set_xticklabels(settings, fontsize=7, rotation=20)
        a.grid(alpha=0.3, axis="y")
        a.legend(fontsize=6, ncol=2)
    ax.set_ylabel("mean latency over CACHED (%)")
    bx.set_ylabel("S-LoRA / CaraServe mean latency (x)")
    bx.axhline(1.0, color="k", lw=0.6)
    fig.suptitle("simulated (solid) vs paper (hatched; arXiv 2401.11240 v1, impl/caraserve/paper.yaml)"
                 "   !: a run flagged invalid (TTFT order CACHED <= CaraServe <= ONDMD)", fontsize=8)
    name = "s1_maf_vs_paper.png" if all(s.startswith("maf") for s in settings) else "s1_synthetic_vs_paper.png"
    return [save_png(fig, pathlib.Path(out_dir) / name)]


def stall_share_vs_paper(records, out_dir, paper: dict | None = None) -> list[pathlib.Path]:
    """Cold-start share of on-demand loading by rate: one line per system variant (record name)
    beside the paper's 10 / 16 / 20 % (v1 Fig. 3-left)."""
    paper = paper_values() if paper is None else paper
    pts = collections.defaultdict(dict)
    for r in plottable(records, "stall_share", with_invalid=True):
        pts[r["system"]][_trace(r)["rate_rps"]] = r["metrics"]["stall_share"]["value"]
    if not pts:
        return []
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in sorted(pts):
        xs = sorted(pts[name])
        ax.plot(xs, [100 * pts[name][x] for x in xs], marker="o", label=f"{name} (sim)")
    px = [x for x in (3, 6, 9) if f"cold_start_share_{x}rps" in paper]
    ax.plot(px, [100 * paper[f"cold_start_share_{x}rps"] for x in px], "k--s", label="paper (v1 Fig. 3-left)")
    ax.fill_between(px, [100 * paper[f"cold_start_share_{x}rps"] - 5 for x in px],
                    [100 * paper[f"cold_start_share_{x}rps"] + 5 for x in px], color="k", alpha=0.08)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("stalled share of serving time (%)")
    ax.set_title("on-demand cold-start share, 512 rank-64 adapters (band: paper +-5 points)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return [save_png(fig, pathlib.Path(out_dir) / "stall_share_vs_paper.png")]


S3_PAPER_NAMES = {"caraserve": "rank_aware", "mostidle": "mostidle", "route_random": "random", "firstfit": "firstfit"}


def _kernel_family(r) -> str:
    """``slora`` when the record's servers decoded with MBGMV (info.lora_kernels), else ``punica``."""
    kernels = (r.get("info") or {}).get("lora_kernels") or []
    return "slora" if "mbgmv" in kernels else "punica"


def _routers_vs_paper(records, out_dir, paper_key, kernels, title: str, fname: str) -> list[pathlib.Path]:
    """SLO attainment per router (mean over seeds, each seed a dot) beside the paper's, one pair
    of bars per kernel in ``kernels`` (ours solid, the paper's hatched). ``paper_key(router,
    kernel)`` names the paper entry."""
    paper = paper_values()
    pts = collections.defaultdict(list)
    for r in plottable(records, "slo_attainment"):
        pts[(r["system"], _kernel_family(r))].append(r["metrics"]["slo_attainment"]["value"])
    names = [n for n in S3_PAPER_NAMES if any((n, k) in pts for k in kernels)]
    if not names:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.8))
    w = 0.8 / (2 * len(kernels))
    colors = {"punica": "tab:blue", "slora": "tab:orange"}
    for i, n in enumerate(names):
        for k, kern in enumerate(kernels):
            x = i - 0.4 + w * (2 * k + 0.5)
            v = pts.get((n, kern))
            if v:
                ax.bar(x, 100 * float(np.mean(v)), w, color=colors[kern], label=f"ours (sim), {kern} kernel" if i == 0 else None)
                ax.plot([x] * len(v), [100 * y for y in v], "k.", ms=4)
                ax.text(x, 100 * float(np.mean(v)), f"{100 * float(np.mean(v)):.0f}", ha="center", va="bottom", fontsize=6)
            pv = paper.get(paper_key(S3_PAPER_NAMES[n], kern))
            if pv is not None:
                ax.bar(x + w, 100 * pv, w, color="white", edgecolor=colors[kern], hatch="///",
                       label=f"paper, {kern} kernel" if i == 0 else None)
                ax.text(x + w, 100 * pv, f"{100 * pv:.0f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 110)
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=6, ncol=2)
    return [save_png(fig, pathlib.Path(out_dir) / fname)]


def s3_vs_paper(records, out_dir) -> list[pathlib.Path]:
    """S3 routing: ours per kernel the records ran (info.lora_kernels) beside the paper's
    Punica-kernel and S-LoRA-kernel figures of v1."""
    kernels = sorted({_kernel_family(r) for r in plottable(records, "slo_attainment")}) or ["punica"]
    return _routers_vs_paper(records, out_dir, lambda n, k: f"s3_slo_{n}_{k}_kernel", kernels,
                             "S3 (60 servers, 340 RPS): SLO = 1.5x the reference's per-token latency (info.slo_reference; "
                             "Toppings: the base model under the same load)",
                             "s3_vs_paper.png")


def s4_vs_paper(records, out_dir) -> list[pathlib.Path]:
    """S4 testbed-like (8 servers, CACHED backends): ours beside v1's 80 / 42 / 43 / 22%."""
    return _routers_vs_paper(records, out_dir, lambda n, k: f"s4_slo_{n}", ["punica"],
                             "S4 (8 servers, CACHED backends, 60 RPS): SLO = 1.5x the reference's per-token latency "
                             "(info.slo_reference)",
                             "s4_vs_paper.png")


def slo_vs_scale(records, out_dir) -> list[pathlib.Path]:
    """S3 sensitivity: SLO attainment per router against the SLO, slo_scale x HF-PEFT's per-token
    latency from each record's own HF-PEFT run (info.slo_reference), one panel per offered rate;
    the top axis reads the same SLO as the HF-PEFT per-token latency it would be 1.5x of (how
    much slower a real HF-PEFT would have to be than ours for that point to be the paper's SLO).
    The paper's figures are drawn at 1.5x."""
    paper = paper_values()
    pts = collections.defaultdict(dict)
    ref = {}
    for r in plottable(records, "slo_attainment"):
        rate = _trace(r)["rate_rps"]
        sr = (r.get("info") or {}).get("slo_reference") or {}
        if "slo_tpot_s" not in sr:
            continue
        pts[(rate, r["system"])][sr["slo_tpot_s"]] = r["metrics"]["slo_attainment"]["value"]
        ref[rate] = sr["tpot_mean_s"]
    rates = sorted(ref)
    if not rates:
        return []
    fig, axes = plt.subplots(1, len(rates), figsize=(5.2 * len(rates), 3.8), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for n in S3_PAPER_NAMES:
            d = pts.get((rate, n))
            if not d:
                continue
            xs = sorted(d)
            line, = ax.plot([1e3 * x for x in xs], [100 * d[x] for x in xs], marker="o", label=n)
            pv = paper.get(f"s3_slo_{S3_PAPER_NAMES[n]}_slora_kernel")
            if pv is not None:
                ax.plot([1.5e3 * ref[rate]], [100 * pv], marker="*", ms=11, color=line.get_color(), ls="none")
        ax.axvline(1.5e3 * ref[rate], color="k", ls=":", lw=0.8)
        ax.set_xlabel(f"SLO per-token latency (ms); HF-PEFT (ours) = {1e3 * ref[rate]:.1f} ms")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_title(f"{rate:g} RPS  (stars: paper at 1.5x HF-PEFT; dotted: 1.5x ours)", fontsize=8)
        top = ax.secondary_xaxis("top", functions=(lambda x: x / 1.5, lambda x: x * 1.5))
        top.set_xlabel("HF-PEFT per-token latency this SLO is 1.5x of (ms)", fontsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return [save_png(fig, pathlib.Path(out_dir) / "slo_vs_scale.png")]


def s2_vs_paper(records, out_dir) -> list[pathlib.Path]:
    """S2 multi-GPU: mean latency over CACHED per system, and CaraServe's end-to-end gain over
    on-demand (1 - CaraServe / on-demand) beside v1's 20.2% (13B, 2x A10) / 18.5% (70B, 4x A100)."""
    paper = paper_values()
    lat = {}
    for r in plottable(records, "latency_mean_s", with_invalid=True):
        m = r["config"]["workload"]["paper_model"]["name"]
        lat[(m, r["config"]["system"]["policy"])] = r["metrics"]["latency_mean_s"]["value"]
    models = sorted({m for m, _ in lat})
    if not models:
        return []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6))
    pols = ("ondmd", "slora", "caraserve")
    colors = dict(zip(pols, ("tab:red", "tab:orange", "tab:green")))
    for i, m in enumerate(models):
        base = lat.get((m, "cached"))
        for j, p in enumerate(pols):
            if base and (m, p) in lat:
                ax.bar(i + (j - 1) * 0.25, 100 * (lat[(m, p)] / base - 1), 0.25, color=colors[p], label=p if i == 0 else None)
        ours = 1 - lat[(m, "caraserve")] / lat[(m, "ondmd")] if (m, "caraserve") in lat and (m, "ondmd") in lat else None
        theirs = paper.get(f"s2_caraserve_gain_over_ondmd_{m.split('-')[-1]}")
        if ours is not None:
            bx.bar(i - 0.18, 100 * ours, 0.36, color="tab:green", label="ours (sim)" if i == 0 else None)
            bx.text(i - 0.18, 100 * ours, f"{100 * ours:.1f}", ha="center", va="bottom", fontsize=7)
        if theirs is not None:
            bx.bar(i + 0.18, 100 * theirs, 0.36, color="white", edgecolor="tab:green", hatch="///",
                   label="paper" if i == 0 else None)
            bx.text(i + 0.18, 100 * theirs, f"{100 * theirs:.1f}", ha="center", va="bottom", fontsize=7)
    for a in (ax, bx):
        a.set_xticks(range(len(models)))
        a.set_xticklabels(models, fontsize=8)
        a.grid(alpha=0.3, axis="y")
        a.legend(fontsize=7)
    ax.set_ylabel("mean latency over CACHED (%)")
    bx.set_ylabel("CaraServe faster than on-demand (%)")
    fig.suptitle("S2 multi-GPU, 6 RPS, rank 64: simulated (solid) vs paper (hatched; arXiv 2401.11240 v1)", fontsize=8)
    return [save_png(fig, pathlib.Path(out_dir) / "s2_vs_paper.png")]


def s3_testbed_vs_paper(records, out_dir) -> list[pathlib.Path]:
    """The Toppings testbed (8 instances, 30 / 40 / 50 RPS): SLO attainment and mean per-token
    latency against the load, one line per router. The sources give the paper's result in words
    only (rank-aware highest at every load), so it is written on the figure
    rather than drawn."""
    pts = collections.defaultdict(dict)
    for r in plottable(records, "slo_attainment"):
        m = r["metrics"]
        pts[r["system"]][_trace(r)["rate_rps"]] = (m["slo_attainment"]["value"], m["tpot_mean_s"]["value"])
    if not pts:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for name in [n for n in S3_PAPER_NAMES if n in pts] + sorted(set(pts) - set(S3_PAPER_NAMES)):
        xs = sorted(pts[name])
        axes[0].plot(xs, [100 * pts[name][x][0] for x in xs], marker="o", label=name)
        axes[1].plot(xs, [1e3 * pts[name][x][1] for x in xs], marker="o", label=name)
    axes[0].set_ylabel("SLO attainment (%)")
    axes[1].set_ylabel("mean per-token latency (ms)")
    for ax in axes:
        ax.set_xlabel("offered load (requests/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Toppings testbed, 8 instances (sim); SLO = 1.5x base-model per-token latency. "
                 "Paper: rank-aware highest at every load (no numbers in the sources)", fontsize=8)
    return [save_png(fig, pathlib.Path(out_dir) / "s3_testbed_vs_paper.png")]
