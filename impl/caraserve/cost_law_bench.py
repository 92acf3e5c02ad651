"""``system=caraserve/caraserve_cost_law`` (the cost-law job of impl/caraserve/README.md, real mode only):
does a real decode step follow the rank-aware cost law of :mod:`impl.caraserve.cost`?

Times decode steps (one new token per request, ``context_len`` tokens of KV cache each) of the
workload's tiny Llama for rank mixes at several batch sizes B, once with the pad kernel (BGMV:
every row padded to the batch's max rank) and once with the segment kernel (SGMV: each request
at its own rank; or MBGMV), then fits both forms of :mod:`impl.caraserve.cost` to every kernel with the cost model's
non-negative least squares:

- ``max_r``: T = a0 + a1 B + a2 B max r   (the pad law)
- ``sum_r``: T = a0 + a1 B + a2 sum r     (the segment law)

and reports R^2 of each, so the law that fits better is visible next to the one that should.
The mixes include ``B-1`` low ranks plus one high rank (and the reverse), where the two laws
disagree most; uniform mixes alone could not tell them apart (there B max r = sum r).

Caveats. The reference kernels compute in rank chunks of 32 (``kernels.RANK_CHUNK``), so ranks
8, 16 and 32 cost the same arithmetic and only 64 costs more: every law is fitted twice, with
the nominal r of the cost law and with r rounded up to the chunk (metrics ``*_chunked``). On a CPU
the per-call overhead of B small GEMMs is large next to the rank term, so the segment kernel's
rank signal is weak (the law is only qualitative on a CPU). There is one adapter per rank, so MBGMV
(rows grouped by adapter) computes each distinct rank once and follows those, not sum r.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import List, Sequence

import numpy as np
import torch

from impl.caraserve.cost import features_dec, nnls_fit
from impl.common.api import ConfigError, JobContext, Metric, RunResult, System
from impl.common.llm.kernels import RANK_CHUNK
from impl.common.execution import set_torch_threads

LAWS = {"max_r": "bgmv", "sum_r": "mbgmv"}  # law -> cost_model's decode-feature variant
EXPECTED = {"bgmv": "max_r", "sgmv": "sum_r", "mbgmv": "sum_r"}
# Metric suffix -> rank granularity of the features: the nominal r of the cost law, and r rounded up
# to the reference kernels' rank chunk (what they compute with: 8, 16 and 32 cost the same).
FEATURES = {"": 1, "_chunked": RANK_CHUNK}
PLOT_NAME = "cost_law.png"


def rank_mixes(batch_sizes: Sequence[int], ranks: Sequence[int], random_mixes: int,
               rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Per B: every uniform mix, B-1 lowest + 1 highest, B-1 highest + 1 lowest, and
    ``random_mixes`` seeded draws; each sorted, duplicates dropped (order of first appearance)."""
    lo, hi = min(ranks), max(ranks)
    out, seen = [], set()
    for B in batch_sizes:
        mixes = [(r,) * B for r in ranks]
        if B > 1:
            mixes += [(lo,) * (B - 1) + (hi,), (hi,) * (B - 1) + (lo,)]
            mixes += [tuple(int(r) for r in rng.choice(ranks, size=B)) for _ in range(random_mixes)]
        for m in map(tuple, map(sorted, mixes)):  # a mix is a multiset: (8, 64) == (64, 8)
            if m not in seen:
                seen.add(m)
                out.append(m)
    return out


def effective_rank(r: int, chunk: int) -> int:
    return -(-r // chunk) * chunk


def _features(mixes, law: str, chunk: int) -> np.ndarray:
    return np.array([features_dec([0] * len(m), [effective_rank(r, chunk) for r in m], LAWS[law])[:3]
                     for m in mixes], dtype=float)


def fit_law(mixes: Sequence[Sequence[int]], times_s: Sequence[float], law: str,
            chunk: int = 1) -> tuple[list[float], float]:
    """(a0, a1, a2) and R^2 of ``law`` fitted to the measured step times; ``chunk`` > 1 replaces
    each r by r rounded up to a multiple of it (the rank the kernels actually compute with)."""
    coef, r2 = nnls_fit(_features(mixes, law, chunk), np.asarray(times_s, dtype=float))
    return [float(c) for c in coef], float(r2)


def predict(coef: Sequence[float], mixes: Sequence[Sequence[int]], law: str, chunk: int = 1) -> np.ndarray:
    return _features(mixes, law, chunk) @ np.asarray(coef)


def _pad_stacks(ad) -> None:
    """Zero-pad an adapter's stacks to the kernels' rank chunk once, at load, as LoRAX pads
    ranks for SGMV: ``lora_delta`` would otherwise allocate a padded copy on every call for
    r < 32, and r = 8 would time slower than r = 32 (measured). Results are unchanged (exact
    zeros), and ``ad.rank`` stays the nominal rank."""
    rp = effective_rank(ad.rank, RANK_CHUNK)
    for s in list(ad.A):
        A, B = ad.A[s], ad.B[s]
        if A.shape[1] < rp:
            ad.A[s] = torch.cat([A, A.new_zeros(A.shape[0], rp - A.shape[1], A.shape[2])], 1)
            ad.B[s] = torch.cat([B, B.new_zeros(B.shape[0], B.shape[1], rp - B.shape[2])], 2)


class DecodeBench:
    """The workload's Llama and one PEFT adapter per rank; :meth:`step_s` times one decode step."""

    def __init__(self, shape, ranks: Sequence[int], context_len: int, seed: int):
        from impl.common.llm.forward import RequestSlice, KVCache, ragged_forward
        from impl.common.llm.lora import AdapterSpec, adapters_from_peft, make_peft_model
        from impl.common.llm.model import build_llama, synthetic_prompt

        self._item, self._cache, self._forward = RequestSlice, KVCache, ragged_forward
        self.model = build_llama(shape, seed)
        specs = [AdapterSpec(f"r{r}", r) for r in ranks]
        self.adapters = adapters_from_peft(make_peft_model(copy.deepcopy(self.model), specs, seed=seed + 1))
        for ad in self.adapters.values():
            _pad_stacks(ad)
        # One prefix cache shared by every row: KVCache.append concatenates into new tensors, so
        # a step never writes into it and every step sees the same context.
        cache = KVCache()
        ragged_forward(self.model, [RequestSlice(synthetic_prompt(context_len, np.random.default_rng(seed)), cache)])
        self.prefix = cache.layers

    def step_s(self, kernel: str, mix: Sequence[int]) -> float:
        from impl.common.llm.lora import LoRABatch

        used = sorted(set(mix))
        slot = {r: i for i, r in enumerate(used)}
        batch = LoRABatch(adapters=[self.adapters[f"r{r}"] for r in used],
                          row_adapter=torch.tensor([slot[r] for r in mix], dtype=torch.long),
                          segments=[(slot[r], 1) for r in mix], kernel=kernel)
        items = [self._item([7], self._cache(list(self.prefix))) for _ in mix]
        t0 = time.perf_counter()
        self._forward(self.model, items, batch)
        return time.perf_counter() - t0


def plot(mixes, times: dict, fits: dict, repeats: int, path) -> None:
    """Measured vs fitted step time: a column per kernel, a row per rank feature, both laws."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * len(times), 9.0), dpi=100)
    FigureCanvasAgg(fig)
    for row, (sfx, chunk) in enumerate(FEATURES.items()):
        for i, (k, ts) in enumerate(times.items()):
            ax = fig.add_subplot(len(FEATURES), len(times), row * len(times) + i + 1)
            y = np.asarray(ts) * 1e3
            for law, marker in (("max_r", "o"), ("sum_r", "x")):
                coef, r2 = fits[k][law + sfx]
                tag = " (expected)" if law == EXPECTED[k] else ""
                ax.scatter(y, predict(coef, mixes, law, chunk) * 1e3, marker=marker, alpha=0.7,
                           label=f"{law} law{tag}: R^2 {r2:.3f}")
            lim = [0.0, float(y.max()) * 1.1]
            ax.plot(lim, lim, color="grey", lw=0.8)
            ax.set_xlabel(f"measured decode step (ms, min of {repeats})")
            ax.set_ylabel("fitted (ms)")
            what = "nominal r" if chunk == 1 else f"r rounded up to {chunk}"
            ax.set_title(f"{k}, {what} ({len(mixes)} rank mixes)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path))


class CostLaw(System):
    @dataclass
    class Config:
        kernels: List[str] = field(default_factory=lambda: ["bgmv", "sgmv"])
        batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
        ranks: List[int] = field(default_factory=lambda: [8, 16, 32, 64])
        random_mixes: int = 2  # per batch size, besides the uniform and one-high/one-low mixes
        context_len: int = 16
        warmup: int = 2  # untimed steps per kernel at the largest batch
        repeats: int = 7  # timed steps per mix and kernel (minimum), one per pass over the mixes
        plots: bool = True
        # The Toppings (ATC'25) kernel-latency law on our kernels alone: BGMV and
        # MBGMV timed on the batch 4/8/16/32 x rank 8/16/32/64 grid (impl/caraserve/kernel_law.py)
        # at one projection of kernel_hidden x kernel_hidden (the tiny model's 256 would time call
        # overhead, not the rank term; at the paper model's 4096 our reference BGMV's per-row weight
        # gathers allocate ~33 MB a call), each row on its own adapter, min of kernel_repeats.
        kernel_law: bool = True
        kernel_hidden: int = 1024
        kernel_repeats: int = 7

    modes = ("real",)

    def __init__(self, cfg, name):
        super().__init__(cfg, name)
        bad = [k for k in cfg.kernels if k not in EXPECTED]
        if not cfg.kernels or bad:
            raise ConfigError(f"system.kernels: need one or more of {', '.join(EXPECTED)}, got {list(cfg.kernels)}")
        if len(set(cfg.batch_sizes)) < 2 or min(cfg.batch_sizes) < 1:
            raise ConfigError(f"system.batch_sizes: need >= 2 distinct sizes >= 1 (the B term), got {list(cfg.batch_sizes)}")
        if not cfg.ranks or min(cfg.ranks) < 1:
            raise ConfigError(f"system.ranks: need ranks >= 1, got {list(cfg.ranks)}")
        if cfg.kernel_hidden < 1 or cfg.kernel_repeats < 1:
            raise ConfigError(f"system.kernel_hidden and system.kernel_repeats must be >= 1 (got {cfg.kernel_hidden}, "
                              f"{cfg.kernel_repeats})")
        if cfg.repeats < 1 or cfg.warmup < 0 or cfg.random_mixes < 0 or cfg.context_len < 1:
            raise ConfigError("system.repeats and system.context_len must be >= 1, system.warmup and "
                              f"system.random_mixes >= 0 (got {cfg.repeats}, {cfg.context_len}, {cfg.warmup}, "
                              f"{cfg.random_mixes})")

    def check(self, mode, workload, hardware, fault) -> None:
        if mode != "real":
            raise ConfigError(f"mode: {self.name} times real decode steps; it has no {mode!r} mode (use mode=real)")
        kind = getattr(workload, "kind", None)
        if kind != "serving":
            raise ConfigError(f"workload.kind: {self.name} times the model of a 'serving' workload, got {kind!r}")

    def run(self, job: JobContext) -> RunResult:
        from tqdm import tqdm

        c = self.cfg
        self.check(job.mode, job.workload, job.hardware, job.fault)
        wl = job.workload
        rng = np.random.default_rng(job.seed)
        mixes = rank_mixes(c.batch_sizes, c.ranks, c.random_mixes, rng)
        samples: dict = {k: [[] for _ in mixes] for k in c.kernels}
        old_threads = torch.get_num_threads()
        set_torch_threads(wl.torch_threads)
        try:
            bench = DecodeBench(wl.model, sorted(set(c.ranks)), c.context_len, job.seed)
            total = len(c.kernels) * (c.warmup + len(mixes) * c.repeats)
            with tqdm(total=total, desc=f"{self.name} decode steps", disable=not job.show_progress,
                      leave=False) as bar:
                widest = max(mixes, key=len)
                for k in c.kernels:
                    for _ in range(c.warmup):
                        bench.step_s(k, widest)
                        bar.update(1)
                # A mix's repeats are spread over the run (one per pass, each pass in a fresh
                # order), so a burst of load from other processes cannot inflate all of them.
                for rep in range(c.repeats):
                    ks = c.kernels if rep % 2 == 0 else c.kernels[::-1]
                    for i in rng.permutation(len(mixes)):
                        for k in ks:
                            samples[k][i].append(bench.step_s(k, mixes[i]))
                            bar.update(1)
        finally:
            set_torch_threads(old_threads)

        # Minimum over repeats: on a shared host contention only ever adds time.
        times = {k: [min(s) for s in samples[k]] for k in c.kernels}
        fits = {k: {law + sfx: fit_law(mixes, times[k], law, chunk) for law in LAWS for sfx, chunk in FEATURES.items()}
                for k in c.kernels}
        metrics, per_kernel = {}, {}
        for k in c.kernels:
            for name, (_, r2) in fits[k].items():
                metrics[f"{k}_r2_{name}"] = Metric.scalar(r2, "R^2", "higher")
            better = {sfx: max(LAWS, key=lambda law: fits[k][law + sfx][1]) for sfx in FEATURES}
            for sfx in FEATURES:
                metrics[f"{k}_follows_{EXPECTED[k]}{sfx}"] = Metric.scalar(float(better[sfx] == EXPECTED[k]), "bool",
                                                                           "higher")
            per_kernel[k] = {"expected_law": EXPECTED[k], "better_fit": {sfx or "nominal": better[sfx] for sfx in FEATURES},
                             "fits": {name: {"coef_s": coef, "r2": r2} for name, (coef, r2) in fits[k].items()}}
        info = {"laws": {"max_r": "T = a0 + a1 B + a2 B max r", "sum_r": "T = a0 + a1 B + a2 sum r",
                         "_chunked": f"r rounded up to a multiple of {RANK_CHUNK} in the features"},
                "coef_order": ["a0", "a1", "a2"], "kernels": per_kernel,
                "model": {"hidden": wl.model.hidden, "num_layers": wl.model.num_layers},
                "torch_threads": wl.torch_threads, "context_len": c.context_len, "repeats": c.repeats,
                "samples": [{"B": len(m), "rank_counts": {str(r): m.count(r) for r in sorted(set(m))},
                             **{f"{k}_s": times[k][i] for k in c.kernels}} for i, m in enumerate(mixes)]}
        if c.kernel_law:
            laws = kernel_law_fits(c.kernel_hidden, c.kernel_repeats, job.seed)
            info["kernel_law"] = laws
            for k, fits_k in laws["fits"].items():
                for form, f in fits_k.items():
                    metrics[f"kernel_law_{k}_r2_{form}"] = Metric.scalar(f["r2"], "R^2", "higher")
        artifacts = []
        if c.plots:
            job.out_dir.mkdir(parents=True, exist_ok=True)
            plot(mixes, times, fits, c.repeats, job.out_dir / PLOT_NAME)
            artifacts.append(PLOT_NAME)
        return RunResult(metrics=metrics, artifacts=artifacts, info=info)


def kernel_law_fits(hidden: int, repeats: int, seed: int) -> dict:
    """The Toppings law on our reference kernels (real, CPU, one thread as the caller set it):
    each of BGMV (pad) and MBGMV (no pad) timed on the law grid at one ``hidden`` x ``hidden``
    projection, minimum of ``repeats`` interleaved passes, and both forms fitted to each (its own
    form should fit better; R^2 as the paper reports it). The ``_chunked`` fits use r rounded up
    to the kernels' 32-rank chunk, the rank they compute with."""
    from impl.caraserve.kernel_law import fit_kernel_law, law_grid, time_kernel

    rng = torch.Generator().manual_seed(seed)
    mixes = law_grid(seed)
    ranks = sorted({r for m in mixes for r in m})
    # one adapter per rank, zero-padded once to the kernels' rank chunk as at load (_pad_stacks:
    # otherwise lora_delta pads on every call); every row of a batch reads it as its own adapter
    adapters = {}
    for r in ranks:
        rp = effective_rank(r, RANK_CHUNK)
        A, B = torch.zeros(rp, hidden), torch.zeros(hidden, rp)
        A[:r] = torch.randn(r, hidden, generator=rng) * 0.01
        B[:, :r] = torch.randn(hidden, r, generator=rng) * 0.01
        adapters[r] = (A, B)
    xs = {B: torch.randn(B, hidden, generator=rng) for B in {len(m) for m in mixes}}
    times = {k: [float("inf")] * len(mixes) for k in ("bgmv", "mbgmv")}
    for k in times:  # warm-up
        time_kernel(k, max(mixes, key=len), adapters, xs[len(max(mixes, key=len))])
    order = np.random.default_rng(seed)
    for rep in range(repeats):
        for i in order.permutation(len(mixes)):
            for k in (("bgmv", "mbgmv") if rep % 2 == 0 else ("mbgmv", "bgmv")):
                times[k][i] = min(times[k][i], time_kernel(k, mixes[i], adapters, xs[len(mixes[i])]))
    fits = {}
    for k in times:
        fits[k] = {}
        for form in ("bgmv", "mbgmv"):
            for sfx, chunk in (("", 1), ("_chunked", RANK_CHUNK)):
                ms = [[effective_rank(r, chunk) for r in m] for m in mixes]
                law = fit_kernel_law(ms, times[k], form, fitted_to=f"our {k} kernel on the CPU, hidden {hidden}")
                fits[k][("own" if form == k else "other") + sfx] = law.to_dict()
    return {"grid": "batch 4/8/16/32 x rank 8/16/32/64, uniform and mixed", "hidden": hidden, "repeats": repeats,
            "fits": fits, "samples": [{"B": len(m), "ranks": list(m), **{f"{k}_s": times[k][i] for k in times}}
                                      for i, m in enumerate(mixes)]}
