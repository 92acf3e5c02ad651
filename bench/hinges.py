"""What each paper claim hinges on: one-at-a-time sweeps over declared inputs, and their reader.

A system's hinge experiment (``conf/experiment/<paper>/hinges.yaml``) is an ordinary Hydra multirun
over the claim's own settings (workloads, systems, faults) crossed with ``hinges.point``. It
declares the inputs the claim's figure depends on, each with the range that is physical or
documented and where that range comes from::

    hinges:
      paper: hotspa                     # impl/<paper>/paper.yaml
      claims: [matrix_max_band]         # the entries whose figures the sweep explains
      inputs:
      - name: inter-node bandwidth per NIC
        key: hardware.inter_node_bw_bytes_per_s
        values: [3.125e9, 12.5e9, 25e9, 50e9]   # low end first (or `factors`: x the composed value)
        display: {scale: 1.0e-9, unit: GB/s}
        source: "HDR/NDR InfiniBand, 25-50 GB/s per NIC; 3.1 GB/s = the old path's bus price"
        kind: profile                   # profile | reconstructed | baseline
        systems: []                     # apply to these systems only (empty: every system)
    hydra: {sweeper: {params: {hinges.point: "range(0,5)"}}}

Point 0 runs every setting as composed; point ``k >= 1`` sets one input to one value (inputs in
order, values in order). The point is applied to the job's config before it is typed, and added to
the job's overrides, so the record's labels (workload, hardware, fault) carry it like any sweep.

The reader (:func:`analyze`, ``mlsys-bench-hinges``) evaluates each claim as the README does
(:func:`bench.paper.find_ours`, the claim's match run on the hinge experiment's records of one
point) and reports, per input, the figure at each end of its range and, for a claim out of its
band, the value at which it would hold (linear between the two swept values around the crossing)
or "none within range". It reports; it never moves a constant.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from impl.common.api import ConfigError

PROG = "mlsys-bench-hinges"
KINDS = ("profile", "reconstructed", "baseline")
POINT_TOLERANCE = 0.10  # a one-number claim holds within +-10% (as the README table says)


@dataclass
class Display:
    scale: float = 1.0  # shown value = value * scale
    unit: str = ""


@dataclass
class HingeInput:
    name: str = "???"
    key: str = "???"  # dotted config key, e.g. hardware.inter_node_bw_bytes_per_s
    values: List[Any] = field(default_factory=list)  # absolute values, low end first
    factors: List[float] = field(default_factory=list)  # or multiples of the composed value
    display: Display = field(default_factory=Display)
    source: str = "???"  # where the range comes from (datasheet, spec section, README)
    kind: str = "profile"
    systems: List[str] = field(default_factory=list)  # only these systems take the value
    # The value as composed where the job's config does not hold it (a knob carried from a fitted
    # profile reads null in the config): the reader's reference for "holds at".
    composed: Optional[float] = None

    @property
    def count(self) -> int:
        return len(self.values) or len(self.factors)


@dataclass
class HingesConfig:
    paper: str = "???"
    claims: List[str] = field(default_factory=list)
    inputs: List[HingeInput] = field(default_factory=list)
    point: Optional[int] = None  # null: not a hinge job; 0: as composed; k: one input at one value


def points(h: HingesConfig) -> list[tuple[int, int]]:
    """Point k >= 1 is ``points(h)[k - 1]`` = (input index, value index)."""
    return [(i, j) for i, inp in enumerate(h.inputs) for j in range(inp.count)]


def typed(node: Any) -> Optional[HingesConfig]:
    if node is None:
        return None
    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    try:
        h = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HingesConfig), data))
    except Exception as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"hinges.{key}: {str(exc).splitlines()[0].rstrip('.')}") from None
    _check(h)
    return h


def _check(h: HingesConfig) -> None:
    if h.paper == "???":
        raise ConfigError("hinges.paper: a value is required (the paper file the claims are in)")
    if not h.claims:
        raise ConfigError("hinges.claims: name at least one entry of the paper file")
    for i, inp in enumerate(h.inputs):
        where = f"hinges.inputs[{i}]"
        for f in ("name", "key", "source"):
            if getattr(inp, f) == "???":
                raise ConfigError(f"{where}.{f}: a value is required")
        if bool(inp.values) == bool(inp.factors):
            raise ConfigError(f"{where} ({inp.name}): give exactly one of values or factors")
        if inp.kind not in KINDS:
            raise ConfigError(f"{where}.kind: {inp.kind!r} is not one of {', '.join(KINDS)}")
    n = len(points(h))
    if h.point is not None and not 0 <= h.point <= n:
        raise ConfigError(f"hinges.point: {h.point} is outside 0..{n} (0 = as composed, then {n} declared values)")


def _system_name(cfg: DictConfig) -> str:
    return str((cfg.get("system") or {}).get("name") or "")


def point_override(cfg: DictConfig) -> Optional[tuple[HingeInput, str, Any]]:
    """(input, key, value) that this job's point sets, or None (not a hinge job, point 0, or
    an input restricted to other systems)."""
    h = typed(cfg.get("hinges"))
    if h is None or not h.point:
        return None
    i, j = points(h)[h.point - 1]
    inp = h.inputs[i]
    if inp.systems and _system_name(cfg) not in inp.systems:
        return None
    if inp.values:
        value = inp.values[j]
    else:
        composed = OmegaConf.select(cfg, inp.key, default=None)
        if not isinstance(composed, (int, float)) or isinstance(composed, bool):
            raise ConfigError(f"hinges.inputs[{i}].factors ({inp.name}): {inp.key} is {composed!r}, "
                              "not a number to scale")
        # An integer key (a token budget, a count) stays an integer: the typed config refuses 1e5 as 100000.0.
        value = int(round(composed * inp.factors[j])) if isinstance(composed, int) else float(composed * inp.factors[j])
    return inp, inp.key, value


def apply_point(cfg: DictConfig, overrides: Optional[list[str]] = None) -> list[str]:
    """Set this job's hinge value in ``cfg`` (in place) and return the overrides with it added."""
    overrides = list(overrides or [])
    found = point_override(cfg)
    if found is None:
        return overrides
    inp, key, value = found
    parent, _, leaf = key.rpartition(".")
    if parent and OmegaConf.select(cfg, parent, default=None) is None and not key.startswith("hardware.megatron.knobs."):
        raise ConfigError(f"hinges ({inp.name}): {key}: no such key in this job's config")
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, force_add=True)
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return overrides + [f"{key}={text}"]


# ------------------------------------------------------------------ the reader

@dataclass
class Swing:
    """One claim's figure across one input's range."""

    input: HingeInput
    values: List[Any]  # the swept values in order (absolute, or the factors)
    figures: List[Optional[float]]
    holds_at: Optional[float] = None  # the value at which a missed claim would hold
    holds_side: str = ""  # "<=" / ">=": the claim holds on this side of holds_at
    holds_in_range: bool = False
    base: Optional[float] = None  # the claim's figure as composed (point 0)

    @property
    def ends(self) -> tuple[Optional[float], Optional[float]]:
        return self.figures[0], self.figures[-1]

    @property
    def span(self) -> float:
        """How far the input moves the figure, the as-composed figure included (a one-value input
        moves it from there)."""
        f = [x for x in [*self.figures, self.base] if x is not None]
        return (max(f) - min(f)) if f else 0.0


@dataclass
class ClaimHinges:
    paper: str
    claim: str
    experiment: str
    low: float
    high: float
    base: Optional[float]  # the figure at point 0 (as composed)
    state: str  # in band | below | above | no run
    swings: List[Swing] = field(default_factory=list)


def band(entry) -> tuple[float, float]:
    if entry.at_least:
        return float(entry.value), math.inf
    if entry.high is not None:
        return float(entry.value), float(entry.high)
    return float(entry.value) * (1 - POINT_TOLERANCE), float(entry.value) * (1 + POINT_TOLERANCE)


def _state(v: Optional[float], lo: float, hi: float) -> str:
    if v is None:
        return "no run"
    return "in band" if lo <= v <= hi else ("below" if v < lo else "above")


def _retarget(entry, experiment: str):
    e = copy.deepcopy(entry)
    for m in e.match:
        m.experiment = experiment
    return e


def _crossing(xs: list[float], fs: list[Optional[float]], lo: float, hi: float,
              base_x: Optional[float], base_f: Optional[float] = None) -> tuple[Optional[float], str, bool]:
    """The value nearest the as-composed one at which the figure enters [lo, hi], linear between
    neighbouring points (the as-composed point counts as one): a figure that passes through the
    band between two swept values holds there although neither value is in band."""
    pts = [(x, f) for x, f in zip(xs, fs)
           if f is not None and isinstance(x, (int, float)) and not isinstance(x, bool)]
    if base_x is not None and base_f is not None and all(x != base_x for x, _ in pts):
        pts = sorted(pts + [(base_x, base_f)])
    if not pts:
        return None, "", False
    ref = base_x if base_x is not None else pts[0][0]
    found = [x for x, f in pts if lo <= f <= hi]
    for (x1, f1), (x2, f2) in zip(pts, pts[1:]):
        for edge in (lo, hi):
            if f1 != f2 and min(f1, f2) <= edge <= max(f1, f2):
                found.append(x1 + (edge - f1) / (f2 - f1) * (x2 - x1))
    if not found:
        return None, "", False
    x_in = min(found, key=lambda x: abs(x - ref))
    side = ">=" if x_in >= ref else "<="
    return x_in, side, True


def analyze(records: list[dict], papers: Optional[dict] = None) -> list[ClaimHinges]:
    """Every hinge experiment's claims found in ``records`` (records of any experiment may be mixed in)."""
    from bench.paper import find_ours, load_papers

    papers = papers if papers is not None else load_papers()
    by_exp: dict[str, list[dict]] = {}
    for r in records:
        h = (r.get("config") or {}).get("hinges")
        if isinstance(h, dict) and h.get("point") is not None:
            by_exp.setdefault(str(r.get("experiment")), []).append(r)
    out: list[ClaimHinges] = []
    for exp, recs in sorted(by_exp.items()):
        decl = typed(max(recs, key=lambda r: str(r.get("created", "")))["config"]["hinges"])
        paper = papers.get(decl.paper)
        if paper is None:
            raise ConfigError(f"{exp}: hinges.paper: no impl/{decl.paper}/paper.yaml")
        by_point: dict[int, list[dict]] = {}
        for r in recs:
            by_point.setdefault(int(r["config"]["hinges"]["point"]), []).append(_point0_labels(r, decl))
        flat = points(decl)
        for claim in decl.claims:
            try:
                entry = _retarget(paper.entry(claim), exp)
            except KeyError:
                raise ConfigError(f"{exp}: hinges.claims: {claim!r} is not an entry of {paper.path}") from None
            lo, hi = band(entry)
            fig = lambda k: find_ours(entry, by_point.get(k, [])).value  # noqa: E731
            base = fig(0)
            ch = ClaimHinges(decl.paper, claim, exp, lo, hi, base, _state(base, lo, hi))
            for i, inp in enumerate(decl.inputs):
                ks = [k + 1 for k, (ii, _) in enumerate(flat) if ii == i]
                xs = list(inp.values or inp.factors)
                fs = [fig(k) for k in ks]
                sw = Swing(inp, xs, fs, base=base)
                if ch.state != "in band":
                    base_x = 1.0 if inp.factors else (inp.composed if inp.composed is not None
                                                      else _as_composed(recs, inp.key))
                    sw.holds_at, sw.holds_side, sw.holds_in_range = _crossing(xs, fs, lo, hi, base_x, base)
                ch.swings.append(sw)
            ch.swings.sort(key=lambda s: -s.span)
            out.append(ch)
    return out


LABELS = ("workload", "hardware", "fault")


def _point0_labels(rec: dict, decl: HingesConfig) -> dict:
    """``rec`` with its point's override taken out of its workload / hardware / fault label
    (``a100-40g[mfu=0.2]`` -> ``a100-40g``): the claim's match reads the labels as at point 0, so
    a ``where: {hardware: a100-40g}`` and the pairing with ``vs`` hold at every point."""
    k = int(rec["config"]["hinges"]["point"])
    if k < 1 or k > len(points(decl)):
        return rec
    key = decl.inputs[points(decl)[k - 1][0]].key
    group, _, sub = key.partition(".")
    label = rec.get(group)
    if group not in LABELS or not isinstance(label, str) or not label.endswith("]") or "[" not in label:
        return rec
    node: Any = rec.get("config") or {}
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    tweak = f"{sub}={json.dumps(node) if isinstance(node, (list, dict)) else node}"
    choice, inner = label[:-1].split("[", 1)
    tweaks = "," + inner + ","
    if "," + tweak + "," not in tweaks:
        return rec
    rest = tweaks.replace("," + tweak + ",", ",", 1).strip(",")
    return {**rec, group: f"{choice}[{rest}]" if rest else choice}


def _as_composed(recs: list[dict], key: str) -> Optional[float]:
    vals = set()
    for r in recs:
        if int(r["config"]["hinges"]["point"]) != 0:
            continue
        node: Any = r.get("config") or {}
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            vals.add(float(node))
    return vals.pop() if len(vals) == 1 else None


# ------------------------------------------------------------------ text

def value_text(inp: HingeInput, v: Any) -> str:
    if inp.factors:
        return f"x{v:g}"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v * inp.display.scale:.3g}{(' ' + inp.display.unit) if inp.display.unit else ''}"
    return str(v)


def fig_text(v: Optional[float], unit: str = "x") -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if unit == "%" else f"{v:.3g}{unit}"


def swing_text(sw: Swing, unit: str = "x") -> str:
    """``name lo..hi: f_lo..f_hi (holds at <= v | none within range)``."""
    inp = sw.input
    xs = sw.values
    if len(xs) == 1:  # one value: the figure there against the as-composed one
        text = f"{inp.name} {value_text(inp, xs[0])}: {fig_text(sw.base, unit)} -> {fig_text(sw.ends[0], unit)}"
    else:
        text = (f"{inp.name} {value_text(inp, xs[0])}..{value_text(inp, xs[-1])}: "
                f"{fig_text(sw.ends[0], unit)}..{fig_text(sw.ends[1], unit)}")
    if sw.holds_in_range:
        text += f" (holds at {sw.holds_side} {value_text(inp, sw.holds_at)})"
    return text


def claim_text(ch: ClaimHinges, unit: str = "x", top: int = 3) -> str:
    parts = [swing_text(s, unit) for s in ch.swings[:top]]
    if ch.state != "in band" and not any(s.holds_in_range for s in ch.swings):
        parts.append("holds for no single input within its range")
    return "; ".join(parts)


def _unit(papers: dict, ch: ClaimHinges) -> str:
    unit = papers[ch.paper].entry(ch.claim).unit
    return "%" if unit == "fraction" else unit  # paper files say "fraction", never "%"


def markdown(found: list[ClaimHinges], papers: dict) -> str:
    """One table per claim: input, kind, range, figure at each end, holds at, source."""
    out = []
    for ch in found:
        unit = _unit(papers, ch)
        band_text = f">= {fig_text(ch.low, unit)}" if math.isinf(ch.high) else f"{fig_text(ch.low, unit)}-{fig_text(ch.high, unit)}"
        out += [f"**{ch.claim}** (`experiment={ch.experiment}`): band {band_text}, "
                f"as composed {fig_text(ch.base, unit)} ({ch.state})", "",
                "| input | kind | range | figure at the low end | at the high end | holds at | source of the range |",
                "|---|---|---|---|---|---|---|"]
        for sw in ch.swings:
            if ch.state == "in band":
                holds = "(in band as composed)"
            elif sw.holds_in_range:
                holds = f"{sw.holds_side} {value_text(sw.input, sw.holds_at)}"
            else:
                holds = "none within range"
            rng = ", ".join(value_text(sw.input, v) for v in sw.values)
            cells = [sw.input.name, sw.input.kind, rng, fig_text(sw.ends[0], unit), fig_text(sw.ends[1], unit), holds,
                     sw.input.source]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from bench.paper import load_papers
    from bench.record import scan_records

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results/runs", help="a results folder with hinge records")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--markdown", action="store_true", help="print one markdown table per claim")
    args = p.parse_args(argv)
    if not pathlib.Path(args.results).is_dir():
        print(f"{PROG}: results dir {args.results} does not exist", file=sys.stderr)
        return 2
    try:
        papers = load_papers()
        found = analyze(list(scan_records(args.results).records), papers)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if not found:
        print(f"{PROG}: no hinge records in {args.results} (run mlsys-bench --multirun experiment=<paper>/hinges)",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in found], indent=1, default=str))
        return 0
    if args.markdown:
        print(markdown(found, papers))
        return 0
    for ch in found:
        unit = _unit(papers, ch)
        band_text = f">= {fig_text(ch.low, unit)}" if math.isinf(ch.high) else f"{fig_text(ch.low, unit)}..{fig_text(ch.high, unit)}"
        print(f"{ch.experiment}: {ch.claim}: band {band_text}, "
              f"as composed {fig_text(ch.base, unit)} ({ch.state})")
        for sw in ch.swings:
            print(f"  {swing_text(sw, unit)}   [{sw.input.kind}; {sw.input.source}]")
            if ch.state != "in band" and not sw.holds_in_range:
                print("    holds: none within range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
