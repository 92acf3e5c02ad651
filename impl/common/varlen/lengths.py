"""Sequence-length distributions (typed workload fields) and a histogram file loader.

A :class:`LengthDist` is either
- ``kind: lognormal``: ``round(exp(N(ln median, sigma)))``; or
- ``kind: histogram``: lengths drawn with probability proportional to the counts of a CSV file.

Limits ``[min_len, max_len]`` (``max_len = 0``: no upper limit) are part of the distribution. With
``clip: true`` a draw outside them is clipped to the nearest limit (as in "lognormal(...) clipped to
[16, 2048]"). With ``resample: true`` a draw outside them is drawn again: the distribution
conditioned on the range, i.e. a dataset filtered to it (LobRA's authors' scripts, Hetu
`examples/lobra/`, keep lengths in [256, 16384]); it wins over ``clip``, and a range holding under
1e-4 of the mass is an error. With both false a draw or histogram row outside them is an error
naming the numbers: a sequence is never silently dropped or shortened.

Presets [R] (stand-ins, not the papers' data): CommonCrawl lognormal(ln 700, 1.25) and GitHub
lognormal(ln 1800, 1.3), clipped to the context (impl/hotspa/README.md,
impl/hydraulis/README.md); HotSPa's real CPU mode lognormal(ln 250, 1.0) clipped to [16, 2048] (impl/hotspa/README.md).

Histogram file format (chosen here): CSV, one ``length,count`` row per distinct length,
optional header line ``length,count``; blank lines and lines starting with ``#`` are skipped.
Lengths are integers >= 1 and distinct, counts integers >= 0 with a positive total. A bad row
raises a one-line :class:`ConfigError` naming the file, the line number and the field.
"""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

import numpy as np

from impl.common.api import ConfigError

KINDS = ("lognormal", "histogram")


@dataclass
class LengthDist:
    kind: str = "lognormal"
    median: float = 250.0  # lognormal: exp(mu), tokens
    sigma: float = 1.0  # lognormal: std of ln(length)
    path: str = ""  # histogram: CSV of ``length,count`` rows
    min_len: int = 1
    max_len: int = 0  # 0 = no upper limit
    clip: bool = True
    resample: bool = False  # draws outside [min_len, max_len] are drawn again (filtered data)
    field: str = "workload.lengths"  # config path named in error messages

    def validate(self) -> None:
        f = self.field
        if self.kind not in KINDS:
            raise ConfigError(f"{f}.kind: unknown kind {self.kind!r} (choose one of {', '.join(KINDS)})")
        if self.min_len < 1:
            raise ConfigError(f"{f}.min_len: must be >= 1, got {self.min_len}")
        if self.max_len < 0 or (self.max_len and self.max_len < self.min_len):
            raise ConfigError(f"{f}.max_len: {self.max_len} must be 0 (no limit) or >= min_len {self.min_len}")
        if self.kind == "lognormal":
            if not (self.median >= 1 and math.isfinite(self.median)):
                raise ConfigError(f"{f}.median: must be a finite number >= 1, got {self.median}")
            if not (self.sigma >= 0 and math.isfinite(self.sigma)):
                raise ConfigError(f"{f}.sigma: must be a finite number >= 0, got {self.sigma}")
        elif not self.path:
            raise ConfigError(f"{f}.path: a histogram distribution needs a CSV file path")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths (int64) drawn with ``rng``; limits applied as the class doc says."""
        self.validate()
        if n < 0:
            raise ConfigError(f"{self.field}: cannot draw {n} lengths")
        if self.resample:
            return self._resampled(n, rng)
        return self._limit(self._raw(n, rng))

    def _raw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "lognormal":
            raw = np.rint(rng.lognormal(math.log(self.median), self.sigma, size=n))
            # Far-tail draws can overflow int64; they are clipped or reported below anyway.
            raw = np.minimum(raw, float(2 ** 62)).astype(np.int64)
            return np.maximum(raw, 1)
        self.check_histogram_limits()
        lengths, counts = load_histogram(self.path)
        return rng.choice(lengths, size=n, p=counts / counts.sum())

    def _resampled(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Rejection sampling into [min_len, max_len], in draw order (seeded, deterministic)."""
        hi = self.max_len or np.iinfo(np.int64).max
        out = np.empty(0, dtype=np.int64)
        drawn = 0
        while len(out) < n:
            want = max(64, 2 * (n - len(out)))
            raw = self._raw(want, rng)
            drawn += want
            out = np.concatenate([out, raw[(raw >= self.min_len) & (raw <= hi)]])
            if drawn >= 10000 and len(out) < 1e-4 * drawn:
                raise ConfigError(f"{self.field}: [{self.min_len}, {self.max_len or 'inf'}] holds under 1e-4 of "
                                  f"the distribution's mass with resample true ({len(out)} of {drawn} draws)")
        return out[:n]

    def _limit(self, raw: np.ndarray) -> np.ndarray:
        hi = self.max_len or None
        if self.clip:
            return np.clip(raw, self.min_len, hi) if hi else np.maximum(raw, self.min_len)
        bad_hi = raw > hi if hi else np.zeros_like(raw, dtype=bool)
        if bad_hi.any():
            raise ConfigError(f"{self.field}: drew length {int(raw[bad_hi].max())} > max_len {hi} "
                              f"with clip false (set clip true to clip, or raise max_len)")
        if (raw < self.min_len).any():
            raise ConfigError(f"{self.field}: drew length {int(raw.min())} < min_len {self.min_len} "
                              f"with clip false (set clip true to clip, or lower min_len)")
        return raw

    def check_histogram_limits(self) -> None:
        """With ``clip`` and ``resample`` false, a histogram row outside the limits fails up
        front (file, line)."""
        if self.kind != "histogram" or self.clip or self.resample:
            return
        for length, line in _rows(self.path):
            if length < self.min_len or (self.max_len and length > self.max_len):
                raise ConfigError(f"{self.path}:{line}: length {length} is outside {self.field} limits "
                                  f"[{self.min_len}, {self.max_len or 'inf'}] with clip false")


def commoncrawl(context: int) -> LengthDist:
    """[R] CommonCrawl stand-in: lognormal(ln 700, 1.25), ~97% below 8K, clipped to the context."""
    return LengthDist(kind="lognormal", median=700.0, sigma=1.25, min_len=1, max_len=context, clip=True)


def github(context: int) -> LengthDist:
    """[R] GitHub stand-in: lognormal(ln 1800, 1.3), clipped to the context."""
    return LengthDist(kind="lognormal", median=1800.0, sigma=1.3, min_len=1, max_len=context, clip=True)


def hotspa_cpu() -> LengthDist:
    """HotSPa's real CPU mode [R]: lognormal(ln 250, 1.0) clipped to [16, 2048]."""
    return LengthDist(kind="lognormal", median=250.0, sigma=1.0, min_len=16, max_len=2048, clip=True)


PRESETS = {"commoncrawl": commoncrawl, "github": github, "hotspa_cpu": lambda context=2048: hotspa_cpu()}


def preset(name: str, context: int, field: str = "workload.lengths") -> LengthDist:
    if name not in PRESETS:
        raise ConfigError(f"{field}.preset: unknown preset {name!r} (choose one of {', '.join(PRESETS)})")
    return replace(PRESETS[name](context), field=field)


def _rows(path: str) -> list[tuple[int, int]]:
    """(length, line number) per data row, after full validation."""
    return [(int(length), line) for length, _, line in _parse(path)]


def load_histogram(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths int64, counts float64)`` of a validated ``length,count`` CSV (cached by path+mtime)."""
    p = pathlib.Path(path)
    try:
        mtime = p.stat().st_mtime_ns
    except OSError as e:
        raise ConfigError(f"{path}: cannot read histogram file ({e.strerror})") from None
    return _load_cached(str(p), mtime)


@lru_cache(maxsize=32)
def _load_cached(path: str, mtime_ns: int) -> tuple[np.ndarray, np.ndarray]:
    rows = _parse(path)
    lengths = np.array([r[0] for r in rows], dtype=np.int64)
    counts = np.array([r[1] for r in rows], dtype=np.float64)
    lengths.setflags(write=False)
    counts.setflags(write=False)
    return lengths, counts


def _parse_int(text: str, path: str, line: int, name: str) -> int:
    s = text.strip()
    try:
        return int(s)
    except ValueError:
        raise ConfigError(f"{path}:{line}: field {name} is not an integer: {s!r}") from None


def _parse(path: str) -> list[tuple[int, int, int]]:
    try:
        text = pathlib.Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read histogram file ({e.strerror})") from None
    rows: list[tuple[int, int, int]] = []
    seen: dict[int, int] = {}
    for line, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        parts = [x.strip() for x in s.split(",")]
        if not rows and parts == ["length", "count"]:
            continue
        if len(parts) != 2:
            raise ConfigError(f"{path}:{line}: expected 2 fields 'length,count', got {len(parts)}: {s!r}")
        length = _parse_int(parts[0], path, line, "length")
        count = _parse_int(parts[1], path, line, "count")
        if length < 1:
            raise ConfigError(f"{path}:{line}: field length must be >= 1, got {length}")
        if count < 0:
            raise ConfigError(f"{path}:{line}: field count must be >= 0, got {count}")
        if length in seen:
            raise ConfigError(f"{path}:{line}: field length {length} repeats line {seen[length]}")
        seen[length] = line
        rows.append((length, count, line))
    if not rows:
        raise ConfigError(f"{path}: histogram file has no 'length,count' rows")
    if sum(r[1] for r in rows) == 0:
        raise ConfigError(f"{path}: histogram counts sum to 0 over {len(rows)} rows")
    return rows


def write_histogram(path: str | pathlib.Path, lengths: np.ndarray, counts: Optional[np.ndarray] = None) -> None:
    """Write ``length,count`` rows; with ``counts`` None, ``lengths`` are raw samples to count."""
    if counts is None:
        lengths, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    body = "".join(f"{int(l)},{int(c)}\n" for l, c in zip(lengths, counts))
    pathlib.Path(path).write_text("length,count\n" + body)
