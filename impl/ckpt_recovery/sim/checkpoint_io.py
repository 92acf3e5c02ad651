"""Paper-scale checkpoint I/O without bytes ([R]: impl/ckpt_recovery/README.md, "Sim"): what each
rank writes and reads, counted by the checkpoint layer's own plan code on metadata only.

- State tensors: per parameter ``param/`` (bf16) plus ``master/``, ``exp_avg/``,
  ``exp_avg_sq/`` (fp32): 14 B per parameter. Shard dims as the real model's (column-parallel
  q/k/v/gate/up and the vocab-parallel embedding / head on dim 0, row-parallel o/down on dim 1,
  norms replicated). Adam's step scalars are left out (bytes and keys negligible).
- Layouts: a :class:`~impl.common.parallel.plan.Plan` becomes a checkpoint
  :class:`~impl.common.checkpoint.layout.CheckpointLayout` through ``pipeline_layout`` (the real path).
- Ours: each split written once by its lowest owner (pipeline 0), keys laid out by
  ``fileformat.file_order``; a new rank's reads are ``plan.read_plan`` blocks plus one header
  read per file it touches.
- DCP: one chunk per distinct saved shard; a reader issues one request per overlapping saved
  chunk and reads the whole chunk (narrowed afterwards), plus ``.metadata``.
- Legacy per-rank files (restart_all): a reader reads every saved file that overlaps its part.
- UCP: a reader reads the whole fp32 tensors (master, moments) of every tensor it holds part of.

Ranks with the same ownership read the same blocks, so each distinct ownership is priced once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from impl.common.checkpoint.fileformat import Entry, file_order
from impl.common.checkpoint.layout import DTYPES, CheckpointLayout, StagePlan, TensorMeta, pipeline_layout, split_range
from impl.common.checkpoint.plan import key_index, owners, read_plan
from impl.common.cost.transformer import ffn_size, is_swiglu, kv_size
from impl.common.parallel.plan import Plan

KINDS = (("param", "bfloat16"), ("master", "float32"), ("exp_avg", "float32"), ("exp_avg_sq", "float32"))
HEADER_BYTES = 64 * 1024  # one safetensors header read [R]: JSON of a few thousand keys


def state_metas(model) -> list[TensorMeta]:
    """Paper-scale state tensors in model order (embedding, blocks, final norm, head)."""
    h, f, kv, V = model.hidden, ffn_size(model), kv_size(model), model.vocab
    params: list[tuple[str, tuple[int, ...], Optional[int]]] = [("emb.weight", (V, h), 0)]
    for layer in range(model.num_layers):
        b = f"blocks.{layer}."
        params += [(b + "norm1.weight", (h,), None), (b + "attn.q.weight", (h, h), 0), (b + "attn.k.weight", (kv, h), 0),
                   (b + "attn.v.weight", (kv, h), 0), (b + "attn.o.weight", (h, h), 1), (b + "norm2.weight", (h,), None)]
        if is_swiglu(model):
            params += [(b + "mlp.gate.weight", (f, h), 0)]
        params += [(b + "mlp.up.weight", (f, h), 0), (b + "mlp.down.weight", (h, f), 1)]
    params += [("norm_f.weight", (h,), None), ("head.weight", (V, h), 0)]
    return [TensorMeta(f"{kind}/{name}", shape, dt, dim) for name, shape, dim in params for kind, dt in KINDS]


def total_bytes(metas: Sequence[TensorMeta]) -> int:
    return sum(m.nbytes for m in metas)


def checkpoint_layout(plan: Plan, metas: Sequence[TensorMeta], pipelines: Optional[Sequence[int]] = None) -> CheckpointLayout:
    """The plan's ranks (``rank_map`` order) and what each holds; ``pipelines`` keeps only those."""
    stages: dict[tuple[int, int], list[int]] = {}
    ranges: dict[tuple[int, int], tuple[int, int]] = {}
    for e in plan.rank_map():
        if pipelines is not None and e["pipeline"] not in pipelines:
            continue
        stages.setdefault((e["pipeline"], e["stage"]), []).append(e["rank"])
        ranges[(e["pipeline"], e["stage"])] = tuple(e["layers"])
    pipes: dict[int, list[StagePlan]] = {}
    for (i, j) in sorted(stages):
        pipes.setdefault(i, []).append(StagePlan(tuple(stages[(i, j)]), ranges[(i, j)]))
    return pipeline_layout(metas, [pipes[i] for i in sorted(pipes)], plan.num_layers)


@dataclass(frozen=True)
class RankIO:
    """One rank's requests and bytes (the slowest-rank figures are what a load waits for)."""

    calls: int
    nbytes: float
    needed_bytes: float


@dataclass(frozen=True)
class LoadIO:
    """Per distinct reader: its I/O and how many ranks read like it."""

    readers: tuple[tuple[RankIO, int], ...]

    def max_calls(self) -> int:
        return max(r.calls for r, _ in self.readers)

    def total_bytes(self) -> float:
        return sum(r.nbytes * n for r, n in self.readers)

    def read_ratio(self) -> float:
        return sum(r.nbytes * n for r, n in self.readers) / max(sum(r.needed_bytes * n for r, n in self.readers), 1.0)


@dataclass(frozen=True)
class SaveIO:
    """Bytes and requests per writing rank, and which ranks write."""

    rank_bytes: dict  # rank -> bytes it writes
    rank_calls: dict  # rank -> requests


def _roles(layout: CheckpointLayout) -> list[tuple[int, int]]:
    """(a representative rank, how many ranks hold exactly what it holds)."""
    seen: dict[tuple, list[int]] = {}
    for r in sorted(layout.ranks):
        seen.setdefault(tuple(sorted(layout.ranks[r].items())), []).append(r)
    return [(rs[0], len(rs)) for rs in seen.values()]


def _need_bytes(metas, own, S) -> float:
    by = {m.name: m for m in metas}
    return float(sum(by[k].nbytes // (1 if by[k].dim is None else tg[1]) for k, tg in own.items()))


class CheckpointIO:
    """I/O of one model's checkpoints at S splits, for any saved and loaded plan."""

    def __init__(self, model, S: int = 32) -> None:
        self.metas = state_metas(model)
        self.S = S
        self.order = {m.name: i for i, m in enumerate(self.metas)}
        self._by = {m.name: m for m in self.metas}
        self._cache: dict = {}

    @property
    def state_bytes(self) -> int:
        return total_bytes(self.metas)

    def layout(self, plan: Plan, writers_only: bool = False) -> CheckpointLayout:
        key = ("layout", plan.signature(), writers_only)
        if key not in self._cache:
            self._cache[key] = checkpoint_layout(plan, self.metas, [0] if writers_only else None)
        return self._cache[key]

    # ---- ours: partition-agnostic splits ----------------------------------------------------
    def _files(self, saved: Plan) -> tuple[dict, dict]:
        """(file -> key -> Entry, manifest-like file -> {rank, keys}) of the lowest-owner save."""
        key = ("files", saved.signature())
        if key in self._cache:
            return self._cache[key]
        lay = self.layout(saved, writers_only=True)
        own = owners(self.metas, lay, self.S)
        per_rank: dict[int, list] = {}
        for (name, j), holders in own.items():
            per_rank.setdefault(holders[0], []).append((name, j))
        files, manifest = {}, {}
        for r, keys in sorted(per_rank.items()):
            keys.sort(key=lambda nj: file_order(DTYPES[self._by[nj[0]].dtype], nj[1], self.order[nj[0]]))
            fname, off, entries, mk = f"rank{r:05d}", HEADER_BYTES, {}, {}
            for seq, (name, j) in enumerate(keys):
                m = self._by[name]
                n = m.nbytes if j is None else m.nbytes // self.S
                k = f"{seq:08d}"
                entries[k] = Entry(k, m.dtype, (), off, n)
                mk[k] = (name, j, "")
                off += n
            files[fname], manifest[fname] = entries, {"rank": r, "keys": mk}
        self._cache[key] = (files, manifest)
        return files, manifest

    def save_ours(self, saved: Plan) -> SaveIO:
        key = ("save_ours", saved.signature())
        if key not in self._cache:
            files, manifest = self._files(saved)
            rb = {m["rank"]: float(HEADER_BYTES + sum(e.length for e in files[f].values())) for f, m in manifest.items()}
            self._cache[key] = SaveIO(rb, {r: 1 for r in rb})
        return self._cache[key]

    def _ours_reads(self, saved: Plan, new: Plan) -> tuple:
        """Per distinct reader of the new layout: (rank, how many ranks read like it, file ->
        [requests, bytes, slices] it reads there: the file's header plus one request per merged
        block, and the splits those blocks hold)."""
        key = ("ours_reads", saved.signature(), new.signature())
        if key not in self._cache:
            files, manifest = self._files(saved)
            idx = key_index(files, manifest)
            lay = self.layout(new)
            out = []
            for r, n in _roles(lay):
                per: dict[str, list] = {}
                for b in read_plan(self.metas, lay, r, self.S, idx):
                    c = per.setdefault(b.file, [1, float(HEADER_BYTES), 0])
                    c[0] += 1
                    c[1] += b.length
                    c[2] += len(b.needs)
                out.append((r, n, per))
            self._cache[key] = tuple(out)
        return self._cache[key]

    def load_ours(self, saved: Plan, new: Plan) -> LoadIO:
        key = ("load_ours", saved.signature(), new.signature())
        if key not in self._cache:
            lay = self.layout(new)
            # the manifest, then per touched file its header and one request per merged block
            self._cache[key] = LoadIO(tuple(
                (RankIO(1 + sum(c[0] for c in per.values()), float(sum(c[1] for c in per.values())),
                        _need_bytes(self.metas, lay.ranks[r], self.S)), n)
                for r, n, per in self._ours_reads(saved, new)))
        return self._cache[key]

    def load_ours_by_file(self, saved: Plan, new: Plan) -> tuple[tuple[dict, int], ...]:
        """Per distinct reader of ``load_ours``: (file -> (requests, bytes) it reads there, how
        many ranks read like it); the manifest request is not in it."""
        return tuple(({f: (c[0], c[1]) for f, c in per.items()}, n) for _, n, per in self._ours_reads(saved, new))

    def slices_by_file(self, saved: Plan, new: Plan) -> tuple[tuple[dict, int], ...]:
        """Per distinct reader: (file -> splits it reads there, how many ranks read like it)."""
        return tuple(({f: c[2] for f, c in per.items()}, n) for _, n, per in self._ours_reads(saved, new))

    def file_ranks(self, saved: Plan) -> dict[str, int]:
        """file -> the rank that writes it (lowest-owner save)."""
        return {f: m["rank"] for f, m in self._files(saved)[1].items()}

    # ---- DCP: one chunk per saved shard --------------------------------------------------------
    def _chunks(self, saved: Plan) -> dict[str, set]:
        """tensor -> distinct saved fractions (t, g) (DP replicas deduplicated, as DCP's planner)."""
        key = ("chunks", saved.signature())
        if key not in self._cache:
            out: dict[str, set] = {}
            for own in self.layout(saved, writers_only=True).ranks.values():
                for k, tg in own.items():
                    out.setdefault(k, set()).add(tg)
            self._cache[key] = out
        return self._cache[key]

    def save_dcp(self, saved: Plan) -> SaveIO:
        """DCP balances deduplicated chunks over every rank: bytes ~ total / ranks each."""
        n = len(saved.active_gpus)
        per = self.state_bytes / n
        return SaveIO({r: per for r in range(n)}, {r: 2 for r in range(n)})  # data file + its metadata piece

    def load_dcp(self, saved: Plan, new: Plan) -> LoadIO:
        return self._load_overlap(saved, new, "dcp")

    # ---- legacy per-rank files (restart_all) ------------------------------------------------
    def save_legacy(self, saved: Plan) -> SaveIO:
        key = ("save_legacy", saved.signature())
        if key not in self._cache:
            lay = self.layout(saved, writers_only=True)
            rb = {r: _need_bytes(self.metas, own, self.S) for r, own in lay.ranks.items()}
            self._cache[key] = SaveIO(rb, {r: 1 for r in rb})
        return self._cache[key]

    def load_legacy(self, saved: Plan, new: Plan) -> LoadIO:
        return self._load_overlap(saved, new, "legacy")

    # ---- UCP: whole fp32 tensors per parameter ------------------------------------------
    def load_ucp(self, new: Plan) -> LoadIO:
        key = ("load_ucp", new.signature())
        if key in self._cache:
            return self._cache[key]
        lay = self.layout(new)
        out = []
        for r, n in _roles(lay):
            own = lay.ranks[r]
            fp32 = [k for k in own if self._by[k].dtype == "float32"]
            out.append((RankIO(len(fp32), float(sum(self._by[k].nbytes for k in fp32)),
                               _need_bytes(self.metas, {k: own[k] for k in fp32}, self.S)), n))
        self._cache[key] = LoadIO(tuple(out))
        return self._cache[key]

    def ucp_universal_files(self) -> int:
        return sum(1 for m in self.metas if m.dtype == "float32")

    def _load_overlap(self, saved: Plan, new: Plan, how: str) -> LoadIO:
        key = ("load_" + how, saved.signature(), new.signature())
        if key in self._cache:
            return self._cache[key]
        chunks = self._chunks(saved)
        lay_new = self.layout(new)
        if how == "legacy":
            saved_lay = self.layout(saved, writers_only=True)
            files = {r: (own, _need_bytes(self.metas, own, self.S)) for r, own in saved_lay.ranks.items()}
        out = []
        for r, n in _roles(lay_new):
            own = lay_new.ranks[r]
            if how == "dcp":
                calls, nbytes = 1, 0.0  # .metadata
                for k, tg in own.items():
                    m = self._by[k]
                    for c in chunks[k]:
                        if _overlap(tg, c, m):
                            calls += 1
                            nbytes += m.nbytes / (1 if m.dim is None else c[1])
                out.append((RankIO(calls, nbytes, _need_bytes(self.metas, own, self.S)), n))
            else:
                hit: set = set()
                replicated = []
                for k, tg in own.items():
                    holders = [fr for fr, (fo, _) in sorted(files.items()) if k in fo]
                    if self._by[k].dim is None:
                        replicated.append(holders)
                    else:
                        hit.update(fr for fr in holders if _overlap(tg, files[fr][0][k], self._by[k]))
                for holders in replicated:  # from a file read anyway, else the first holding it
                    if not hit.intersection(holders):
                        hit.add(holders[0])
                out.append((RankIO(len(hit), float(sum(files[fr][1] for fr in hit)), _need_bytes(self.metas, own, self.S)), n))
        self._cache[key] = LoadIO(tuple(out))
        return self._cache[key]


def _overlap(a: tuple[int, int], b: tuple[int, int], m: TensorMeta) -> bool:
    if m.dim is None:
        return True
    (ta, ga), (tb, gb) = a, b
    return ta * gb < (tb + 1) * ga and tb * ga < (ta + 1) * gb
