"""The real trainer of one rank (scenario A, impl/ckpt_recovery/README.md): one pipeline of TP groups over gloo.

Each stage is a TP group (Megatron shards of :func:`impl.common.parallel.tensor_parallel.tensor_parallel`)
holding layers ``[lo, hi)`` of the varlen decoder (plus the embedding on the first stage and
the final norm and head on the last); stages exchange activations and their gradients with
point-to-point send/recv under a GPipe schedule (all forwards, then all backwards). Stages of
different TP degree talk rank-to-rank: receiver i of the next stage takes the (replicated)
activation from sender ``i mod g`` of this one, and the same for gradients going back.

Reproducibility: step s uses samples ``[sB, (s+1)B)`` whatever the layout (the
micro-batches only partition them), each sample's tokens come from its id, and dropout on the
embedding output draws from a generator seeded by (seed, step, sample): nothing depends on
the process, the rank or the RNG's history, so a resumed run replays the same numbers.

Checkpoints: ``backend`` ``elastor`` saves through :class:`~impl.common.checkpoint.async_save.AsyncCheckpointer`
every ``ckpt_every`` steps (skipped, never waited for, while one is in flight) and loads with
:func:`~impl.common.checkpoint.reshard.load_rank`; ``dcp_sync`` / ``dcp_async`` use torch DCP
on DTensors of the stage's TP sub-mesh (:mod:`impl.ckpt_recovery.dcp_baseline`).
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from impl.common.checkpoint.layout import StagePlan, pipeline_layout
from impl.common.checkpoint.model_state import flat_state, state_metas
from impl.common.models.varlen_gpt import SegmentLayout
from impl.common.models.varlen_gpt import VarlenGPT, rope, sequence_tokens
from impl.common.parallel.tensor_parallel import tensor_parallel
from impl.common.storage.emulator import Storage, StorageProfile
from impl.common.workloads.pipeline import ModelShape
from impl.common.execution import set_torch_threads

BACKENDS = ("elastor", "dcp_sync", "dcp_async", "dcp_async_process")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


@dataclass(frozen=True)
class KillAt:
    """The injected fault, seen from the victim: at the boundary where ``at_step`` steps are
    done (with ``mid_save``: the first boundary from there on where a save starts), the victim
    asks the supervisor for its SIGKILL and waits for it."""

    rank: int
    at_step: int
    mid_save: bool = False


@dataclass(frozen=True)
class PeerSpec:
    """The peer-memory tier of one launch (:mod:`impl.common.checkpoint.holder`)."""

    base: str  # shared-memory root of the holders and the savers' staging
    copies: int  # k peers per file
    num_nodes: int
    node_of: tuple  # rank -> emulated node, this launch
    live_nodes: tuple = ()  # nodes whose holder survived: what a resumed launch reads
    net: StorageProfile = field(default_factory=StorageProfile)  # a read from another node's memory


@dataclass(frozen=True)
class TrainSpec:
    shape: ModelShape
    seed: int
    stages: tuple  # StagePlan per pipeline stage (one pipeline; ranks 0..world-1)
    steps: int  # train until this many steps are done
    global_batch: int
    micro_batches: int
    root: str  # checkpoint root of this run
    backend: str = "elastor"
    lr: float = 1e-3
    dropout: float = 0.1
    ckpt_every: int = 2
    splits: int = 32
    keep: int = 2
    prof: StorageProfile = field(default_factory=StorageProfile)
    resume: bool = False
    resume_step: Optional[int] = None  # None: the latest committed
    kill: Optional[KillAt] = None
    threads: int = 1
    saver_start: str = "fork"  # how the saver process starts: fork | spawn
    peer: Optional[PeerSpec] = None  # elastor only: files also held in peer hosts' memory

    @property
    def seq_len(self) -> int:
        return self.shape.seq_len


def global_name(local: str, lo: int) -> str:
    """``blocks.j.*`` of a stage holding layers from ``lo`` -> ``blocks.(lo + j).*``."""
    return _BLOCK.sub(lambda m: f"blocks.{int(m.group(1)) + lo}.", local)


def full_metas(shape: ModelShape, seed: int) -> list:
    """Metas of the whole model + Adam state, in the order :func:`flat_state` gives."""
    model = VarlenGPT(shape, seed)
    meta = {}
    for k, p in model.named_parameters():
        meta[f"param/{k}"] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        meta[f"exp_avg/{k}"] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        meta[f"exp_avg_sq/{k}"] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        meta[f"step/{k}"] = torch.empty((), dtype=torch.float32, device="meta")
    return state_metas(meta)


def sample_mix(seed: int, step: int, sample: int) -> int:
    """The dropout generator's seed of one sample in one step (counter-based, no history)."""
    return ((seed * 1_000_003 + step) * 998_244_353 + sample) % (1 << 62)


def stage_of(stages, rank: int) -> tuple[int, int]:
    for si, st in enumerate(stages):
        if rank in st.ranks:
            return si, st.ranks.index(rank)
    raise ValueError(f"rank {rank} is in no stage of {stages}")


class StageModel:
    """This rank's part of the decoder: its layers' TP shards, Adam with eager state."""

    def __init__(self, spec: TrainSpec, rank: int, tp_groups: dict) -> None:
        self.spec = spec
        self.si, self.ti = stage_of(spec.stages, rank)
        st = spec.stages[self.si]
        self.lo, self.hi = st.layers
        self.first, self.last = self.si == 0, self.si == len(spec.stages) - 1
        m = VarlenGPT(spec.shape, spec.seed)
        m.blocks = nn.ModuleList(list(m.blocks)[self.lo:self.hi])
        if not self.first:
            m.tok_emb = None
        if not self.last:
            m.norm, m.head = None, None
        self.model = tensor_parallel(m, self.ti, len(st.ranks), tp_groups.get(self.si))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=spec.lr)
        # Adam's state made now (as its first step would), so the snapshot buffers and the
        # checkpoint's tensor list exist from step 0 and a load copies into them in place.
        for p in self.model.parameters():
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        self.local = {self._global(k): v for k, v in flat_state(self.model, self.opt).items()}

    def _global(self, key: str) -> str:
        kind, fqn = key.split("/", 1)
        return f"{kind}/{global_name(fqn, self.lo)}"

    def load_(self, tensors: dict) -> None:
        with torch.no_grad():
            for k, v in self.local.items():
                if v.dtype != tensors[k].dtype or v.shape != tensors[k].shape:
                    raise RuntimeError(f"load: {k} is {tensors[k].dtype}{list(tensors[k].shape)}, "
                                       f"rank holds {v.dtype}{list(v.shape)}")
                v.copy_(tensors[k])

    # -- one step ------------------------------------------------------------------------

    def _micro_batch(self, step: int, k: int):
        sp = self.spec
        b, T = sp.global_batch // sp.micro_batches, sp.seq_len
        ids = [step * sp.global_batch + k * b + i for i in range(b)]
        seqs = [sequence_tokens(i, T, sp.shape.vocab, sp.seed) for i in ids]
        tokens = torch.cat([s[:-1] for s in seqs])
        targets = torch.cat([s[1:] for s in seqs])
        cu = torch.arange(0, (b + 1) * T, T, dtype=torch.int32)
        return ids, tokens, targets, cu

    def _dropout(self, x: torch.Tensor, step: int, ids) -> torch.Tensor:
        p = self.spec.dropout
        if p <= 0:
            return x
        T, H = self.spec.seq_len, x.shape[-1]
        keep = torch.cat([torch.rand(T, H, generator=torch.Generator().manual_seed(sample_mix(self.spec.seed, step, i))) >= p
                          for i in ids])
        return x * keep / (1.0 - p)

    def forward(self, step: int, k: int, x_in: Optional[torch.Tensor]):
        ids, tokens, targets, cu = self._micro_batch(step, k)
        lay = SegmentLayout(tokens.numel(), cu, None, tokens.device)
        cos, sin = rope(lay.positions, self.spec.shape.hidden // self.spec.shape.heads)
        m = self.model
        x = self._dropout(m.tok_emb(tokens), step, ids) if self.first else x_in
        for blk in m.blocks:
            x = blk(x, cos, sin, lay)
        if not self.last:
            return x
        tokens_in_step = self.spec.global_batch * self.spec.seq_len
        return F.cross_entropy(m.head(m.norm(x)), targets, reduction="sum") / tokens_in_step


def _peers(spec: TrainSpec, si: int, ti: int):
    """(source of my input, receivers of my output, source of my output grad, receivers of my input grad)."""
    st = spec.stages
    prev = st[si - 1].ranks if si > 0 else ()
    nxt = st[si + 1].ranks if si + 1 < len(st) else ()
    g = len(st[si].ranks)
    src_in = prev[ti % len(prev)] if prev else None
    to_next = [r for i, r in enumerate(nxt) if i % g == ti]
    src_grad = nxt[ti % len(nxt)] if nxt else None
    to_prev = [r for i, r in enumerate(prev) if i % g == ti]
    return src_in, to_next, src_grad, to_prev


def train_step(sm: StageModel, step: int) -> Optional[float]:
    """One GPipe step; returns the step's loss on last-stage ranks (None elsewhere)."""
    sp = sm.spec
    src_in, to_next, src_grad, to_prev = _peers(sp, sm.si, sm.ti)
    rows = sp.global_batch // sp.micro_batches * sp.seq_len
    H = sp.shape.hidden
    saved = []
    loss = 0.0
    for k in range(sp.micro_batches):
        x_in = None
        if src_in is not None:
            x_in = torch.empty(rows, H)
            dist.recv(x_in, src=src_in)
            x_in.requires_grad_(True)
        out = sm.forward(step, k, x_in)
        if sm.last:
            loss += float(out.detach())
        else:
            for r in to_next:
                dist.send(out.detach().contiguous(), dst=r)
        saved.append((x_in, out))
    for k in reversed(range(sp.micro_batches)):
        x_in, out = saved[k]
        if sm.last:
            out.backward()
        else:
            grad = torch.empty(rows, H)
            dist.recv(grad, src=src_grad)
            out.backward(grad)
        if x_in is not None:
            for r in to_prev:
                dist.send(x_in.grad.contiguous(), dst=r)
    sm.opt.step()
    sm.opt.zero_grad(set_to_none=True)
    return loss if sm.last else None


# -- checkpoint backends --------------------------------------------------------------------


class ElastorCkpt:
    def __init__(self, spec: TrainSpec, rank: int, world: int, sm: StageModel, metas, layout) -> None:
        import multiprocessing as mp

        from impl.common.checkpoint.async_save import AsyncCheckpointer

        self.spec, self.rank = spec, rank
        # fork: the saver is up in milliseconds (spawn re-imports torch: seconds of restart
        # time); the child only serialises and writes, it touches no process group.
        stage = (spec.peer.base, spec.peer.node_of[rank]) if spec.peer is not None else None
        self.ck = AsyncCheckpointer(os.path.join(spec.root, "elastor"), rank, world, metas, layout, spec.splits,
                                    sm.local, prof=spec.prof, keep=spec.keep, mp_ctx=mp.get_context(spec.saver_start),
                                    stage=stage)
        self.started: dict[int, float] = {}
        self.commit_s: list = []
        self._seen_commit = 0.0

    @property
    def saver_pid(self):
        return self.ck.saver_pid

    def wait_ready(self) -> None:
        self.ck.wait_ready()

    def step(self, sm: StageModel, done: int) -> tuple[bool, float]:
        extra = {"consumed_samples": done * self.spec.global_batch, "scheduler": {"last_epoch": done}}
        if self.spec.peer is not None:  # which node owns each file: the holders place copies by it
            extra["node_of_rank"] = list(self.spec.peer.node_of)
        started = self.ck.step(done, sm.local, extra, due=(done % self.spec.ckpt_every == 0))
        stall = self.ck.log.stall_s[-1] if started else 0.0  # the snapshot copy
        if started:
            self.started[done] = time.time()
        t_c = self.ck.last_commit_time()
        if t_c and t_c != self._seen_commit:
            self._seen_commit = t_c
            s = int(self.ck.state[1])
            if s in self.started:
                self.commit_s.append((s, t_c - self.started[s]))
        return started, stall

    def finish(self) -> dict:
        out = self.ck.finish()
        return {**out, "commit_s": self.commit_s}


class DcpCkpt:
    def __init__(self, spec: TrainSpec, rank: int, sm: StageModel, metas, layout, mesh) -> None:
        self.spec, self.rank, self.sm, self.mesh = spec, rank, sm, mesh
        self.metas, self.own = metas, layout.ranks[rank]
        self.root = os.path.join(spec.root, spec.backend)
        self.storage = Storage(spec.prof)
        # a CPU group for the background saver's collectives, whatever the world's backend (torch
        # DCP's async_save docs: a gloo group keeps them off the training stream)
        self.group = dist.new_group(backend="gloo") if spec.backend != "dcp_sync" else None
        # dcp_async_process: DCP's checkpoint daemon process and its DefaultStager, made once
        # so the staging buffers (shared memory) are reused by every save
        from . import dcp_io

        self.stager = dcp_io.process_stager() if spec.backend == "dcp_async_process" else None
        self.fut = None
        self.fut_step: Optional[int] = None
        self.fut_t0 = 0.0
        self.commit_s: list = []
        self.saves = 0

    @property
    def saver_pid(self) -> Optional[int]:
        """dcp_async_process: DCP's checkpoint daemon, once the first save has started it (the
        supervisor SIGKILLs it with its rank, so a failed launch's save cannot commit later)."""
        from . import dcp_io

        return dcp_io.process_saver_pid() if self.stager is not None else None

    def wait_ready(self) -> None:
        pass

    def _poll(self) -> None:
        if self.fut is not None and self.fut.done():
            self.fut.result()
            self.commit_s.append((self.fut_step, time.time() - self.fut_t0))
            self.fut = None

    def step(self, sm: StageModel, done: int) -> tuple[bool, float]:
        from . import dcp_io

        self._poll()
        if done % self.spec.ckpt_every:
            return False, 0.0
        t0 = time.perf_counter()
        path = os.path.join(self.root, f"step{done:08d}")
        if self.spec.backend == "dcp_sync":
            dcp_io.save_sync(sm.local, self.metas, self.own, self.mesh, path, self.storage)
            self.commit_s.append((done, time.perf_counter() - t0))
        else:
            if self.fut is not None:  # one save in flight: waiting for it is stall
                self.fut.result()
                self.commit_s.append((self.fut_step, time.time() - self.fut_t0))
            self.fut_t0, self.fut_step = time.time(), done
            self.fut = dcp_io.save_async(sm.local, self.metas, self.own, self.mesh, path, self.storage, self.group,
                                         stager=self.stager)
        self.saves += 1
        return True, time.perf_counter() - t0

    def finish(self) -> dict:
        if self.fut is not None:
            self.fut.result()
            self.commit_s.append((self.fut_step, time.time() - self.fut_t0))
        dist.barrier()
        return {"saves": self.saves, "skipped_saves": 0, "commit_s": self.commit_s, "io": self.storage.stats.to_dict()}


# -- the rank's main ------------------------------------------------------------------------


def _load(spec: TrainSpec, rank: int, sm: StageModel, metas, layout, mesh) -> tuple[int, dict]:
    """Load the last committed checkpoint (or ``resume_step``) into this rank's layout."""
    storage = Storage(spec.prof)
    if spec.backend == "elastor":
        from impl.common.checkpoint.reshard import load_rank
        from impl.common.checkpoint.store import CheckpointStore

        store = CheckpointStore(os.path.join(spec.root, "elastor"), storage, keep=spec.keep)
        t0 = time.perf_counter()
        if spec.peer is not None:
            ck, tensors, st, extra = _load_peer(spec, rank, layout, metas, store, storage)
        else:
            ck = store.open(spec.resume_step)
            tensors, st = load_rank(ck, layout, rank, storage, metas=metas)
            extra = {}
        sm.load_(tensors)
        consumed = ck.manifest["extra"]["consumed_samples"]
        if consumed != ck.step * spec.global_batch:
            raise RuntimeError(f"{ck.dir}: consumed_samples {consumed} != step {ck.step} x batch {spec.global_batch}")
        return ck.step, {**st.to_dict(), **extra, "t_load_s": time.perf_counter() - t0}
    from . import dcp_io

    step = dcp_io.latest_step(os.path.join(spec.root, spec.backend)) if spec.resume_step is None else spec.resume_step
    t0 = time.perf_counter()
    info = dcp_io.load_into(sm.local, metas, layout.ranks[rank], mesh,
                            os.path.join(spec.root, spec.backend, f"step{step:08d}"), storage)
    return step, {**info, "t_load_s": time.perf_counter() - t0}


def _load_peer(spec: TrainSpec, rank: int, layout, metas, store, storage: Storage):
    """The storage path's commit (the pointed step, or ``resume_step``), each file read from
    the nearest live holder (this node's memory, then another node's over the emulated
    network) and from storage only where no live holder committed that step."""
    from impl.common.checkpoint.fileformat import CheckpointError
    from impl.common.checkpoint.peer import PeerView, open_from_holders
    from impl.common.checkpoint.reshard import load_rank

    p = spec.peer
    step = store.latest() if spec.resume_step is None else spec.resume_step
    me = p.node_of[rank]
    try:
        view = open_from_holders(p.base, p.live_nodes, me, store, min_step=step)
        if view.checkpoint.step != step:
            raise CheckpointError(f"holders have step {view.checkpoint.step}, not {step}")
    except CheckpointError:  # no live holder committed it: the storage path
        ck = store.open(step)
        view = PeerView(ck, {f: (os.path.join(ck.dir, f), "storage") for f in ck.manifest["files"]})
    local, net = Storage(), Storage(p.net)
    calls0, bytes0 = storage.stats.read_calls, storage.stats.read_bytes  # a fallback's manifest read is not a slice
    tensors, st = load_rank(view.checkpoint, layout, rank, storage, metas=metas,
                            locate=view.locator(net, storage, local, me))
    src = view.sources()
    by_source: dict = {}
    for f, n in st.slices_by_file.items():
        kind = "storage" if src[f] == "storage" else ("local" if src[f] == f"peer:{me}" else "peer")
        by_source[kind] = by_source.get(kind, 0) + n
    # The invariant the tier exists for: the emulated NAS is read only for files no live
    # holder has (read_file of a manifest is not a slice, so this counts the load itself).
    calls, nbytes = storage.stats.read_calls - calls0, storage.stats.read_bytes - bytes0
    if calls and not by_source.get("storage"):
        raise RuntimeError(f"rank {rank}: {calls} storage reads while every slice had a live copy")
    extra = {"slices_local": by_source.get("local", 0), "slices_peer": by_source.get("peer", 0),
             "slices_storage": by_source.get("storage", 0), "storage_read_calls": calls,
             "storage_read_bytes": nbytes, "peer_read_bytes": net.stats.read_bytes,
             "local_read_bytes": local.stats.read_bytes, "sources": src}
    return view.checkpoint, tensors, st, extra


def train_rank(ctx, spec: TrainSpec) -> dict:
    """Run on every rank by :func:`impl.common.runtime.launch.launch`."""
    set_torch_threads(spec.threads)
    rank, world = ctx.rank, ctx.world_size
    ctx.report(("pid", os.getpid(), time.time()))
    tp_groups = {}
    for si, st in enumerate(spec.stages):  # every rank creates every group, in the same order
        # the world's backend (the launcher's decision), not a hard-coded one
        grp = dist.new_group(list(st.ranks)) if len(st.ranks) > 1 else None
        if rank in st.ranks:
            tp_groups[si] = grp
    sm = StageModel(spec, rank, tp_groups)
    metas = full_metas(spec.shape, spec.seed)
    layout = pipeline_layout(metas, [list(spec.stages)], spec.shape.num_layers)
    mesh = None
    if spec.backend != "elastor":
        from . import dcp_io

        mesh = dcp_io.stage_mesh(spec.stages, rank)
    if rank == 0 and spec.backend == "elastor":
        from impl.common.checkpoint.store import CheckpointStore

        store = CheckpointStore(os.path.join(spec.root, "elastor"))
        store.clear_stale()
        if spec.resume_step is None:
            store.drop_unpointed()
    elif rank == 0:
        from . import dcp_io

        dcp_io.clear_uncommitted(os.path.join(spec.root, spec.backend))
    dist.barrier()
    out: dict = {"rank": rank, "t_up": time.time()}
    ctx.report(("up", rank, out["t_up"]))
    # The saver process starts before the load and comes up meanwhile; what is left of its
    # start-up after the load is restart time (t_saver_start_s).
    ck = (ElastorCkpt(spec, rank, world, sm, metas, layout) if spec.backend == "elastor"
          else DcpCkpt(spec, rank, sm, metas, layout, mesh))
    start = 0
    if spec.resume:
        start, out["load"] = _load(spec, rank, sm, metas, layout, mesh)
    out["start_step"] = start
    t0 = time.perf_counter()
    ck.wait_ready()
    dist.barrier()
    out["t_saver_start_s"] = time.perf_counter() - t0
    reported_saver = ck.saver_pid
    if reported_saver:
        ctx.report(("saver", rank, reported_saver))
    losses, step_s, stalls, saved_at = {}, {}, [], []
    n_commits = 0
    kill = spec.kill if spec.kill is not None and spec.kill.rank == rank else None
    for step in range(start, spec.steps):
        t0 = time.perf_counter()
        loss = train_step(sm, step)
        done = step + 1
        started, stall = ck.step(sm, done)
        step_s[done] = time.perf_counter() - t0
        if loss is not None:
            losses[step] = loss
            ctx.report(("loss", rank, step, loss))
        if started:
            stalls.append(stall)
            saved_at.append(done)
            ctx.report(("save", rank, done, stall))
        if ck.saver_pid != reported_saver:  # a saver that came up with a save (DCP's daemon)
            reported_saver = ck.saver_pid
            ctx.report(("saver", rank, reported_saver))
        while n_commits < len(ck.commit_s):
            ctx.report(("commit", rank, *ck.commit_s[n_commits]))
            n_commits += 1
        ctx.report(("hb", rank, done, time.time(), step_s[done]))
        if kill is not None and done >= kill.at_step and (started or not kill.mid_save):
            # The victim hands its pids to the supervisor, which SIGKILLs them; the survivors
            # have run ahead into the next step and block on it.
            ctx.report(("kill_me", rank, done, bool(started), os.getpid(), ck.saver_pid, time.time()))
            while True:
                time.sleep(1.0)
    out.update({"losses": losses, "step_s": step_s, "stall_s": stalls, "saves_started": saved_at,
                "ckpt": ck.finish(), "stage": sm.si, "tp": len(spec.stages[sm.si].ranks)})
    ctx.report(("done", rank))
    return out
