"""The system page's "What the claims hinge on": per claim of a hinge experiment (bench/hinges.py),
a tornado chart and a table of the claim's figure at each end of every declared input's range.

The figures are :func:`bench.hinges.analyze`'s, unchanged; this module only lays them out. A bar
spans the figures at every swept value and at the as-composed one (point 0): every declared range
holds the composed value (a one-value input, e.g. "sequence parallelism off", is the pair composed
and that value), so a bar shows how far the input can move the figure. Rows are sorted by that
width, widest on top.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Optional

from bench.hinges import POINT_TOLERANCE, ClaimHinges, Swing, analyze, value_text
from bench.paper import PaperEntry, PaperFile
from bench.report.pieces import MODE_WORD, Figure, fmt, owner, slug
from bench.report.plots import tornado
from impl.common.api import ConfigError


@dataclass
class HingeRow:
    swing: Swing
    unit: str
    state: str  # the claim's state as composed (ClaimHinges.state)

    @property
    def name(self) -> str:
        return self.swing.input.name

    @property
    def kind(self) -> str:
        inp = self.swing.input
        return inp.kind + (f" ({', '.join(inp.systems)} only)" if inp.systems else "")

    @property
    def range_text(self) -> str:
        return ", ".join(value_text(self.swing.input, v) for v in self.swing.values)

    @property
    def low(self) -> Optional[float]:
        return self.swing.ends[0]

    @property
    def high(self) -> Optional[float]:
        return self.swing.ends[1]

    @property
    def low_text(self) -> str:
        return self._text(self.low)

    @property
    def high_text(self) -> str:
        return self._text(self.high)

    def _text(self, v: Optional[float]) -> str:
        # No figure: a system of the claim failed there (e.g. the setting does not fit); its record says why.
        return fmt(v, self.unit) if v is not None else "no ok run"

    @property
    def holds_text(self) -> str:
        if self.state == "in band":
            return "in band as composed"
        if self.state == "no run":
            return "-"
        sw = self.swing
        if sw.holds_in_range:
            return f"{sw.holds_side} {value_text(sw.input, sw.holds_at)}"
        return "none within range"

    @property
    def source(self) -> str:
        return self.swing.input.source

    def width(self, base: Optional[float]) -> float:
        figs = [f for f in self.swing.figures if f is not None]
        if not figs:
            return 0.0
        figs += [base] if base is not None else []
        return max(figs) - min(figs)


@dataclass
class HingeClaim:
    claim: ClaimHinges
    entry: PaperEntry
    modes: list[str]  # of the hinge experiment's ok records
    rows: list[HingeRow] = field(default_factory=list)
    figure: Optional[Figure] = None

    @property
    def anchor(self) -> str:
        return f"hinges-{slug(self.claim.experiment)}-{slug(self.claim.claim)}"

    @property
    def unit(self) -> str:
        return self.entry.unit

    @property
    def mode_word(self) -> str:
        return " + ".join(MODE_WORD.get(m, m) for m in self.modes) or "no ok run"

    @property
    def band_label(self) -> str:
        who = "paper" if self.entry.kind == "paper" else "our target [R]"
        if self.entry.high is None:
            return f"{who} {fmt(self.entry.value, self.unit)} +-{100 * POINT_TOLERANCE:g}%: {self.band_text}"
        return f"{who} band {self.band_text}"

    @property
    def band_text(self) -> str:
        return f"{fmt(self.claim.low, self.unit)} to {fmt(self.claim.high, self.unit)}"

    @property
    def base_text(self) -> str:
        return fmt(self.claim.base, self.unit)

    @property
    def holds_nowhere(self) -> bool:
        """Out of band as composed, and no single input brings it in within its range."""
        return self.claim.state in ("below", "above") and not any(r.swing.holds_in_range for r in self.rows)


def hinge_claims(records: list[dict], papers: dict[str, PaperFile],
                 out: pathlib.Path) -> tuple[dict[str, list[HingeClaim]], dict[str, list[str]]]:
    """Per page (the paper's system): its claims' hinge sections, with the tornado PNGs written
    under ``out/fig/<page>/``; and per page the hinge experiments that could not be read."""
    by_exp: dict[str, list[dict]] = {}
    for r in records:
        h = (r.get("config") or {}).get("hinges")
        if isinstance(h, dict) and h.get("point") is not None:
            by_exp.setdefault(str(r.get("experiment")), []).append(r)
    claims: dict[str, list[HingeClaim]] = {}
    errors: dict[str, list[str]] = {}
    for exp, recs in sorted(by_exp.items()):
        # One experiment at a time: a bad declaration costs its own section, never the report.
        try:
            found = analyze(recs, papers)
        except ConfigError as exc:
            msg = str(exc)
            errors.setdefault(owner(recs[0]), []).append(msg if msg.startswith(f"{exp}: ") else f"{exp}: {msg}")
            continue
        modes = sorted({r["mode"] for r in recs if r.get("status") == "ok"}, key=lambda m: (m != "real", m))
        for ch in found:
            hc = HingeClaim(ch, papers[ch.paper].entry(ch.claim), modes)
            rows = [HingeRow(sw, hc.unit, ch.state) for sw in ch.swings]
            hc.rows = sorted(rows, key=lambda r: -r.width(ch.base))
            try:
                hc.figure = _draw(hc, out)
            except Exception as exc:  # one broken chart never costs the report
                errors.setdefault(ch.paper, []).append(f"{exp}: {ch.claim}: tornado chart failed: "
                                                       f"{type(exc).__name__}: {exc}")
            claims.setdefault(ch.paper, []).append(hc)
    return claims, errors


def _draw(hc: HingeClaim, out: pathlib.Path) -> Figure:
    ch = hc.claim
    bars = [dict(label=f"{r.name}\n({r.swing.input.kind})", figures=r.swing.figures, low=r.low, high=r.high,
                 low_text=value_text(r.swing.input, r.swing.values[0]),
                 high_text=value_text(r.swing.input, r.swing.values[-1])) for r in hc.rows]
    simulated = "sim" in hc.modes
    word = f" ({hc.mode_word})" if hc.modes else ""
    path = tornado(bars, out / "fig" / slug(ch.paper) / f"{hc.anchor}.png",
                   f"{ch.paper} {ch.claim}{word}: the figure over each input's range, the others as composed",
                   base=ch.base, band=(ch.low, ch.high), band_label=hc.band_label, base_text=hc.base_text,
                   unit=hc.unit, simulated=simulated)
    return Figure(path.relative_to(out).as_posix(),
                  f"{ch.experiment}: {ch.claim}, as composed {hc.base_text} ({ch.state}); {hc.mode_word}")
