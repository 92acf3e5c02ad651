"""Text-to-image request traces with ControlNet/LoRA add-ons (SwiftDiffusion / Katz,
arXiv 2407.02031; trace fields as in `mental2008/T2I-Model-Serving-Request-Trace`).

:func:`generate_addon_trace` draws the reconstructed mix [R] of impl/swiftdiffusion/README.md
(ControlNet and LoRA counts per service, hot ControlNets, Zipf LoRA popularity, Poisson or Gamma
arrivals); :func:`load_addon_trace` replays a JSON list of records with the trace's fields
(``timestamp``, ``service``, ``base_model``, ``controlnets``, ``loras``) and rejects a malformed
record with one line naming row and field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from impl.common.api import ConfigError

from .requests import arrivals, zipf_popularity


@dataclass(frozen=True)
class AddonRequest:
    t: float
    service: str
    base_model: str
    controlnets: tuple
    loras: tuple


def _probs(p: Sequence[float], what: str) -> np.ndarray:
    a = np.asarray(p, dtype=float)
    if a.size == 0 or (a < 0).any() or not math.isclose(a.sum(), 1.0, abs_tol=1e-6):
        raise ConfigError(f"{what}: must be non-negative and sum to 1, got {list(p)}")
    return a


def hot_controlnet_probs(n: int, hot_share: float, hot_calls: float) -> np.ndarray:
    """The top ``hot_share`` of n ControlNets take ``hot_calls`` of the calls (uniform within each part)."""
    hot = max(1, round(n * hot_share))
    p = np.full(n, (1.0 - hot_calls) / max(1, n - hot))
    p[:hot] = hot_calls / hot
    return p / p.sum()


def generate_addon_trace(spec, seed: int) -> list[AddonRequest]:
    rng = np.random.default_rng(seed)
    n = spec.num_requests
    if n < 1:
        raise ConfigError(f"workload.trace.num_requests must be >= 1, got {n}")
    t = arrivals(spec.arrival, spec.rate_rps, spec.cv, n, rng)
    pc = _probs(spec.cn_count_probs, "workload.trace.cn_count_probs")
    pla = _probs(spec.lora_count_probs_a, "workload.trace.lora_count_probs_a")
    plb = _probs(spec.lora_count_probs_b, "workload.trace.lora_count_probs_b")
    pcn = hot_controlnet_probs(spec.controlnets_per_service, spec.hot_cn_share, spec.hot_cn_calls)
    plo = zipf_popularity(spec.num_loras, spec.lora_zipf_alpha)
    out = []
    for i in range(n):
        svc = "A" if rng.random() < spec.service_a_share else "B"
        k = int(rng.choice(len(pc), p=pc))
        m = int(rng.choice(len(pla), p=pla if svc == "A" else plb))
        cns = rng.choice(spec.controlnets_per_service, size=k, replace=False, p=pcn) if k else []
        los = rng.choice(spec.num_loras, size=m, replace=False, p=plo) if m else []
        out.append(AddonRequest(float(t[i]), svc, "sdxl-base-1.0", tuple(f"{svc}-cn{c}" for c in cns),
                                tuple(f"lora{x}" for x in los)))
    return out


FIELDS = ("timestamp", "service", "base_model", "controlnets", "loras")


def parse_records(records) -> list[AddonRequest]:
    if not isinstance(records, list):
        raise ConfigError("workload.trace.file: a JSON list of request records is expected")
    out, last = [], -math.inf
    for row, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ConfigError(f"workload.trace.file: row {row}: a record must be an object")
        for f in FIELDS:
            if f not in rec:
                raise ConfigError(f"workload.trace.file: row {row}: field {f!r} is missing")
        ts = rec["timestamp"]
        if not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < last:
            raise ConfigError(f"workload.trace.file: row {row}: field 'timestamp' must be a finite number, "
                              f"non-decreasing, got {ts!r}")
        last = ts
        for f in ("service", "base_model"):
            if not isinstance(rec[f], str) or not rec[f]:
                raise ConfigError(f"workload.trace.file: row {row}: field {f!r} must be a non-empty string")
        for f in ("controlnets", "loras"):
            v = rec[f]
            if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or len(set(v)) != len(v):
                raise ConfigError(f"workload.trace.file: row {row}: field {f!r} must be a list of distinct ids")
        out.append(AddonRequest(float(ts), rec["service"], rec["base_model"], tuple(rec["controlnets"]),
                                tuple(rec["loras"])))
    if not out:
        raise ConfigError("workload.trace.file: no records")
    t0 = out[0].t
    return [AddonRequest(r.t - t0, r.service, r.base_model, r.controlnets, r.loras) for r in out]


def load_addon_trace(path) -> list[AddonRequest]:
    with open(path) as f:
        return parse_records(json.load(f))


def save_addon_trace(reqs: Sequence[AddonRequest], path) -> None:
    with open(path, "w") as f:
        json.dump([dict(timestamp=r.t, service=r.service, base_model=r.base_model, controlnets=list(r.controlnets),
                        loras=list(r.loras)) for r in reqs], f)
