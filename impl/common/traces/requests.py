"""Serving request traces (CaraServe's sim workload, impl/caraserve/README.md): Poisson or Gamma
arrivals, Zipf adapter popularity, rank mixes, lognormal prompt/output lengths; a loader for real
CSV/JSONL traces.

A trace is plain data: a list of :class:`TraceRequest` plus the adapter table
``{adapter_id: rank}``. Every generator takes a ``numpy.random.Generator`` so a seed fixes the
trace bit for bit. Malformed input fails with one line naming the row and the field.
"""
from __future__ import annotations

import csv
import enum
import json
import math
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

from impl.common.api import ConfigError

FIELDS = ("arrival_s", "adapter", "prompt_len", "output_len")


@dataclass(frozen=True)
class TraceRequest:
    rid: int
    arrival_s: float
    adapter: str
    prompt_len: int
    output_len: int


@dataclass
class Trace:
    requests: list
    adapters: dict  # adapter id -> rank

    def __len__(self) -> int:
        return len(self.requests)

    def validate(self, supported_ranks: Optional[Sequence[int]] = None, kernel: str = "") -> "Trace":
        last = -math.inf
        for r in self.requests:
            if r.adapter not in self.adapters:
                raise ConfigError(f"trace request {r.rid}: unknown adapter id {r.adapter!r} "
                                  f"({len(self.adapters)} adapters known)")
            if r.arrival_s < last:
                raise ConfigError(f"trace request {r.rid}: arrival_s {r.arrival_s} is earlier than the previous request")
            last = r.arrival_s
        if supported_ranks is not None:
            for a, rank in sorted(self.adapters.items()):
                if rank not in supported_ranks:
                    raise ConfigError(f"adapter {a!r}: rank {rank} is not supported by the {kernel} kernel "
                                      f"(supported: {', '.join(map(str, supported_ranks))})")
        return self


class Arrival(enum.StrEnum):
    """How request arrival times are drawn: a Poisson process, or gamma inter-arrivals (bursty, ``cv``)."""

    poisson = "poisson"
    gamma = "gamma"


@dataclass
class TraceSpec:
    """Synthetic trace parameters (defaults: CaraServe's sim workload, impl/caraserve/README.md; [R] where marked)."""

    num_requests: int = 1000
    arrival: Arrival = Arrival.poisson
    rate_rps: float = 5.0
    cv: float = 3.0  # gamma only
    num_adapters: int = 100
    zipf_alpha: float = 1.0
    ranks: list = field(default_factory=lambda: [8, 16, 32, 64])
    rank_weights: list = field(default_factory=lambda: [0.25, 0.25, 0.25, 0.25])
    prompt_median: float = 60.0  # [R] lognormal medians, sigma, clip
    output_median: float = 120.0
    sigma: float = 0.8
    len_min: int = 4
    len_max: int = 2048
    # Output-length clip; 0 = the same as len_min / len_max.
    output_min: int = 0
    output_max: int = 0
    # One distinct adapter per request (the paper's synthetic setting, v1): num_adapters and
    # zipf_alpha are ignored.
    per_request: bool = False
    # Adapter popularity: "zipf" (zipf_alpha) or "lognormal", the MAF stand-in of
    # impl/caraserve/README.md (per-adapter weights lognormal with sigma lognormal_sigma, adapters grouped
    # at random into popularity_groups groups, each group an equal share of the requests).
    popularity: str = "zipf"
    lognormal_sigma: float = 3.54
    popularity_groups: int = 1


POPULARITIES = ("zipf", "lognormal")


def check_popularity(popularity: str, zipf_alpha: float, sigma: float, groups: int, num_adapters: int,
                     where: str = "workload.adapters") -> None:
    """One-line errors for the popularity options (preflight and generator alike)."""
    if popularity not in POPULARITIES:
        raise ConfigError(f"{where}.popularity: unknown {popularity!r} (one of: {', '.join(POPULARITIES)})")
    if popularity == "zipf" and not (math.isfinite(zipf_alpha) and zipf_alpha >= 0):
        raise ConfigError(f"{where}.zipf_alpha must be a finite number >= 0, got {zipf_alpha}")
    if popularity == "lognormal":
        if not (math.isfinite(sigma) and sigma > 0):
            raise ConfigError(f"{where}.lognormal_sigma must be a finite number > 0, got {sigma}")
        if not 1 <= groups <= num_adapters:
            raise ConfigError(f"{where}.popularity_groups: {groups} groups for {num_adapters} adapters "
                              f"(need 1 <= groups <= num_adapters; 0 = one group per server)")


def lognormal_weights(num_adapters: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Per-adapter invocation weights of the MAF stand-in (impl/caraserve/README.md): lognormal with
    ``sigma`` (3.54: the top 18.6% of adapters carry 99.6% of the weight, as the top 18.6% of
    Azure functions carry 99.6% of invocations), normalised to sum 1."""
    w = rng.lognormal(0.0, sigma, size=num_adapters)
    return w / w.sum()


def maf_popularity(num_adapters: int, sigma: float, groups: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(P(adapter), group of each adapter): lognormal weights, adapters grouped at random into
    ``groups`` groups of (near) equal size, one group per server as the papers map MAF functions;
    each group takes 1/groups of the requests, and within a group an adapter's probability is
    proportional to its weight."""
    w = lognormal_weights(num_adapters, sigma, rng)
    group = np.empty(num_adapters, dtype=int)
    group[rng.permutation(num_adapters)] = np.arange(num_adapters) % groups
    tot = np.bincount(group, weights=w, minlength=groups)
    p = w / tot[group] / groups
    return p / p.sum(), group


def top_share(p: np.ndarray, top_fraction: float) -> float:
    """Share of the mass on the ``top_fraction`` most popular entries."""
    k = max(1, int(round(top_fraction * len(p))))
    return float(np.sort(np.asarray(p))[::-1][:k].sum() / np.sum(p))


def poisson_arrivals(rate_rps: float, n: int, rng: np.random.Generator) -> np.ndarray:
    if rate_rps <= 0:
        raise ConfigError(f"workload.trace.rate_rps must be > 0, got {rate_rps}")
    return np.cumsum(rng.exponential(1.0 / rate_rps, size=n))


def gamma_arrivals(rate_rps: float, cv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Gamma inter-arrivals with mean 1/rate and coefficient of variation ``cv`` (bursts)."""
    if rate_rps <= 0 or cv <= 0:
        raise ConfigError(f"workload.trace: gamma arrivals need rate_rps > 0 and cv > 0, got {rate_rps}, {cv}")
    shape = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate_rps * shape), size=n))


def arrivals(arrival: str, rate_rps: float, cv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times of a ``poisson`` or ``gamma`` (bursty, coefficient of variation ``cv``) process."""
    if arrival == "poisson":
        return poisson_arrivals(rate_rps, n, rng)
    if arrival == "gamma":
        return gamma_arrivals(rate_rps, cv, n, rng)
    raise ConfigError(f"workload.trace.arrival: unknown {arrival!r} (one of: poisson, gamma)")


def zipf_popularity(num_adapters: int, alpha: float) -> np.ndarray:
    """P(adapter k) proportional to 1 / (k+1)^alpha (alpha = 0: uniform)."""
    w = 1.0 / np.arange(1, num_adapters + 1) ** alpha
    return w / w.sum()


def rank_mix(num_adapters: int, ranks: Sequence[int], weights: Sequence[float], rng: np.random.Generator) -> list[int]:
    if len(ranks) != len(weights) or not ranks:
        raise ConfigError(f"workload.adapters.rank_weights: {len(weights)} weights for {len(ranks)} ranks")
    w = np.asarray(weights, dtype=float)
    if (w < 0).any() or w.sum() <= 0:
        raise ConfigError("workload.adapters.rank_weights must be >= 0 and not all zero")
    return [int(r) for r in rng.choice(np.asarray(ranks), size=num_adapters, p=w / w.sum())]


def lognormal_lengths(median: float, sigma: float, n: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, size=n)), lo, hi).astype(int)


def generate_trace(spec: TraceSpec, seed: int) -> Trace:
    if spec.num_requests < 1:
        raise ConfigError(f"workload.trace.num_requests must be >= 1, got {spec.num_requests}")
    if spec.num_adapters < 1:
        raise ConfigError(f"workload.adapters.num_adapters must be >= 1, got {spec.num_adapters}")
    rng = np.random.default_rng(seed)
    n = spec.num_requests
    num_adapters = n if spec.per_request else spec.num_adapters
    ranks = rank_mix(num_adapters, spec.ranks, spec.rank_weights, rng)
    t = arrivals(spec.arrival, spec.rate_rps, spec.cv, n, rng)
    # Popularity rank is shuffled against adapter ids so that rank and popularity are independent.
    if spec.per_request:
        pick = np.arange(n)
    elif spec.popularity == "lognormal":
        check_popularity(spec.popularity, spec.zipf_alpha, spec.lognormal_sigma, spec.popularity_groups, num_adapters)
        # the weights and grouping from their own stream of the seed
        p, _ = maf_popularity(num_adapters, spec.lognormal_sigma, spec.popularity_groups,
                              np.random.default_rng([seed, 10]))
        pick = rng.choice(num_adapters, size=n, p=p)
    else:
        check_popularity(spec.popularity, spec.zipf_alpha, spec.lognormal_sigma, spec.popularity_groups, num_adapters)
        p = zipf_popularity(num_adapters, spec.zipf_alpha)
        perm = rng.permutation(num_adapters)
        pick = perm[rng.choice(num_adapters, size=n, p=p)]
    pl = lognormal_lengths(spec.prompt_median, spec.sigma, n, spec.len_min, spec.len_max, rng)
    ol = lognormal_lengths(spec.output_median, spec.sigma, n, spec.output_min or spec.len_min,
                           spec.output_max or spec.len_max, rng)
    names = [f"lora-{i:05d}" for i in range(num_adapters)]
    reqs = [TraceRequest(i, float(t[i]), names[int(pick[i])], int(pl[i]), int(ol[i])) for i in range(n)]
    return Trace(reqs, dict(zip(names, ranks)))


# ---- files ---------------------------------------------------------------------------------
def save_trace(trace: Trace, path: pathlib.Path) -> pathlib.Path:
    """JSONL: one header line {"adapters": {...}} then one request per line; or CSV (requests
    only, with a ``rank`` column)."""
    path = pathlib.Path(path)
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(FIELDS + ("rank",))
            for r in trace.requests:
                w.writerow([repr(r.arrival_s), r.adapter, r.prompt_len, r.output_len, trace.adapters[r.adapter]])
    else:
        with path.open("w") as f:
            f.write(json.dumps({"adapters": trace.adapters}) + "\n")
            for r in trace.requests:
                f.write(json.dumps({k: getattr(r, k) for k in FIELDS}) + "\n")
    return path


def _field(row: dict, name: str, kind, where: str):
    if name not in row or row[name] in (None, ""):
        raise ConfigError(f"{where}: field {name!r} is missing")
    raw = row[name]
    try:
        if kind is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            v = int(raw) if not isinstance(raw, str) else int(raw.strip())
            if v < 1:
                raise ValueError
        elif kind is float:
            v = float(raw)
            if not math.isfinite(v) or v < 0:
                raise ValueError
        else:
            v = str(raw).strip()
            if not v:
                raise ValueError
    except (TypeError, ValueError):
        expect = {int: "a positive integer", float: "a finite number >= 0", str: "a non-empty string"}[kind]
        raise ConfigError(f"{where}: field {name!r}: expected {expect}, got {raw!r}") from None
    return v


def load_trace(path, adapters: Optional[dict] = None) -> Trace:
    """Load a CSV (header: arrival_s,adapter,prompt_len,output_len[,rank]) or JSONL trace.

    ``adapters`` (id -> rank) is required when the file carries no ranks. Rows are numbered
    from 1 as a text editor shows them (the CSV header is line 1)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise ConfigError(f"workload.trace.file: {path} does not exist")
    table = dict(adapters or {})
    reqs = []
    rows: list[tuple[int, dict]] = []
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in FIELDS if c not in (reader.fieldnames or [])]
            if missing:
                raise ConfigError(f"{path.name} line 1: header lacks column {missing[0]!r} (need {', '.join(FIELDS)})")
            for i, row in enumerate(reader, start=2):
                rows.append((i, row))
    else:
        with path.open() as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path.name} line {i}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{path.name} line {i}: expected a JSON object")
                if "adapters" in row and len(row) == 1:
                    for a, r in row["adapters"].items():
                        table[str(a)] = _field({"rank": r}, "rank", int, f"{path.name} line {i} adapter {a!r}")
                    continue
                rows.append((i, row))
    for i, row in rows:
        where = f"{path.name} line {i}"
        arrival = _field(row, "arrival_s", float, where)
        adapter = _field(row, "adapter", str, where)
        pl = _field(row, "prompt_len", int, where)
        ol = _field(row, "output_len", int, where)
        if row.get("rank") not in (None, ""):
            rank = _field(row, "rank", int, where)
            if table.get(adapter, rank) != rank:
                raise ConfigError(f"{where}: field 'rank': adapter {adapter!r} has rank {table[adapter]} elsewhere, got {rank}")
            table[adapter] = rank
        elif adapter not in table:
            raise ConfigError(f"{where}: field 'adapter': unknown adapter id {adapter!r}")
        if reqs and arrival < reqs[-1].arrival_s:
            raise ConfigError(f"{where}: field 'arrival_s': {arrival} is earlier than the previous row ({reqs[-1].arrival_s})")
        reqs.append(TraceRequest(len(reqs), arrival, adapter, pl, ol))
    if not reqs:
        raise ConfigError(f"{path.name}: no requests")
    return Trace(reqs, table)
