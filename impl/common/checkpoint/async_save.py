"""Asynchronous save (the save path of Elastor's reference code, PKU-DAIR/Hetu PR #9): a snapshot
into preallocated shared memory at a step boundary, a long-lived saver process per rank that splits,
serialises and writes, and a per-step agreement that SKIPS a save (never waits) while the last one
is still in flight or ``min_interval_s`` has not passed.

Per training step every rank calls :meth:`AsyncCheckpointer.step`, which runs one 3-int
all-reduce (MIN) of [ready, written, interval_ok]: ``ready`` = this rank's saver is idle (rank 0:
also no commit in flight), ``written`` = the pending save's file is fsynced, ``interval_ok`` =
rank 0's clock says ``min_interval_s`` passed (others send 1). When every rank has written,
rank 0's saver commits (manifest, rename, pointer, rotation) in the background. A save is due
when interval_ok; it happens when everyone is also ready, else it is counted as skipped.
Training blocks only for the snapshot copy (``stall_s``).
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from impl.common.api import ConfigError
from impl.common.storage.emulator import Storage, StorageProfile

from .layout import CheckpointLayout, TensorMeta
from .plan import model_order, save_items
from .store import CheckpointStore
from impl.common.execution import set_torch_threads

_IDLE, _WRITING, _WRITTEN, _COMMITTING = 0, 1, 2, 3


def check_shm(nbytes: int, path: str = "/dev/shm") -> None:
    """The snapshot must fit in shared memory (a full /dev/shm kills the saver with SIGBUS)."""
    if not os.path.isdir(path):
        return
    free = shutil.disk_usage(path).free
    if nbytes > free:
        raise ConfigError(f"checkpoint.async: snapshot needs {nbytes / 1e6:.1f} MB of shared memory, "
                          f"{path} has {free / 1e6:.1f} MB free")


def _saver_main(root: str, prof: StorageProfile, keep: int, rank: int, world: int, metas: list, layout_d: dict,
                S: int, duplicate: bool, buffers: dict, state, conn, stage: Optional[tuple] = None) -> None:
    """The saver process: wait for a command, act on it, flag the result in ``state``.
    ``stage`` = (base, node): each file is also staged in the node's shared memory for the
    peer tier's holders (:mod:`.holder`)."""
    set_torch_threads(1)
    layout = CheckpointLayout.from_dict(layout_d)
    store = CheckpointStore(root, Storage(prof), keep=keep)
    order = model_order(metas)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            conn.send(("stats", store.storage.stats.to_dict()))
            return
        try:
            if msg[0] == "write":
                step = msg[1]
                items = save_items(metas, layout, S, rank, buffers, duplicate)
                mirror = None
                if stage is not None:
                    from .holder import stage_file

                    mirror = (lambda name, data, step=step: stage_file(stage[0], stage[1], step, name, data))
                store.write_rank(step, rank, items, order, mirror=mirror)
                state[1] = step
                state[0] = _WRITTEN
            elif msg[0] == "commit":
                step, extra = msg[1], msg[2]
                store.commit(step, store.read_sidecars(step, world), metas, layout, S, extra)
                state[2] = time.time()
                state[1] = step
                state[0] = _IDLE
        except BaseException as e:  # noqa: BLE001 - reported to the training rank
            state[0] = -1
            conn.send(("error", f"{type(e).__name__}: {e}"))


@dataclass
class SaveLog:
    saves: int = 0
    skipped: int = 0
    committed: list = field(default_factory=list)
    stall_s: list = field(default_factory=list)
    last_commit_time: float = 0.0

    def to_dict(self, now: Optional[float] = None) -> dict:
        now = time.time() if now is None else now
        return {"saves": self.saves, "skipped_saves": self.skipped, "committed_steps": list(self.committed),
                "last_commit_age_s": (now - self.last_commit_time) if self.last_commit_time else None}


class AsyncCheckpointer:
    def __init__(self, root: str, rank: int, world: int, metas: Sequence[TensorMeta], layout: CheckpointLayout, S: int,
                 local: Mapping[str, torch.Tensor], *, prof: Optional[StorageProfile] = None, keep: int = 2,
                 min_interval_s: float = 20.0, duplicate: bool = False, group=None, mp_ctx=None,
                 stage: Optional[tuple] = None) -> None:
        import torch.multiprocessing as mp

        self.rank, self.world, self.min_interval_s, self.group = rank, world, min_interval_s, group
        self.metas, self.layout, self.S = list(metas), layout, S
        check_shm(sum(t.numel() * t.element_size() for t in local.values()))
        # preallocated once, in host shared memory wherever the state lives (a GPU-resident
        # state's snapshot is its device-to-host copy): a snapshot is a copy_, never an allocation
        self.buffers = {k: torch.empty(v.shape, dtype=v.dtype).share_memory_() for k, v in local.items()}
        ctx = mp_ctx or mp.get_context("spawn")
        self.state = ctx.Array("d", [_IDLE, -1, 0.0], lock=False)  # phase, step, last commit (wall clock)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_saver_main, daemon=True,
                                args=(root, prof or StorageProfile(), keep, rank, world, self.metas, layout.to_dict(),
                                      S, duplicate, self.buffers, self.state, child, stage))
        self.proc.start()
        self._up = False
        self.log = SaveLog()
        self._pending: Optional[int] = None
        self._pending_extra: dict = {}
        self._last_save_t = time.monotonic() - min_interval_s

    def _recv(self, timeout_s: Optional[float] = None):
        """The saver's next message other than its start-up "ready" (None on timeout)."""
        while timeout_s is None or self.conn.poll(timeout_s):
            msg = self.conn.recv()
            if msg[0] == "ready":
                self._up = True
                continue
            return msg
        return None

    def _check(self) -> None:
        if self.state[0] == -1 or not self.proc.is_alive():
            msg = self._recv(0.0)
            why = msg[1] if msg else f"saver exited with code {self.proc.exitcode}"
            raise RuntimeError(f"checkpoint saver of rank {self.rank}: {why}")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the saver process is up (a restart that must be able to save at once;
        otherwise the first save waits in the saver's queue meanwhile)."""
        end = time.monotonic() + timeout_s
        while not self._up:
            self._check()
            if time.monotonic() > end:
                raise RuntimeError(f"checkpoint saver of rank {self.rank}: not up within {timeout_s:.0f} s")
            if self.conn.poll(0.01):
                msg = self._recv(0.0)
                if msg is not None:
                    raise RuntimeError(f"checkpoint saver of rank {self.rank}: {msg[-1]}")

    @property
    def saver_pid(self) -> Optional[int]:
        return self.proc.pid

    def step(self, step: int, local: Mapping[str, torch.Tensor], extra: dict, due: Optional[bool] = None) -> bool:
        """Call at a step boundary (after the optimizer update). Returns True if a save started.
        ``due`` (the same on every rank, e.g. "every k steps") replaces the ``min_interval_s``
        clock; a due save is still skipped while the last one is in flight."""
        self._check()
        phase = int(self.state[0])
        ready = 1 if phase == _IDLE and self._pending is None else 0
        written = 1 if self._pending is None or phase == _WRITTEN else 0
        if due is not None:
            interval_ok = int(due)
        else:
            interval_ok = 1 if self.rank != 0 else int(time.monotonic() - self._last_save_t >= self.min_interval_s)
        flags = torch.tensor([ready, written, interval_ok], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        all_ready, all_written, due = (int(x) for x in flags)
        if self._pending is not None and all_written:
            self._commit_pending()
        if not due:
            return False
        if not all_ready:
            self.log.skipped += 1
            return False
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, v in local.items():
                self.buffers[k].copy_(v)  # from a GPU into pageable host memory: returns when copied
        self.log.stall_s.append(time.perf_counter() - t0)
        self.state[0] = _WRITING
        self._pending, self._pending_extra = step, dict(extra)
        self._last_save_t = time.monotonic()
        self.conn.send(("write", step))
        self.log.saves += 1
        return True

    def _commit_pending(self) -> None:
        """Every rank's shard of the pending step is written: rank 0's saver commits it."""
        if self.rank == 0:
            self.state[0] = _COMMITTING
            self.conn.send(("commit", self._pending, self._pending_extra))
        else:
            self.state[0] = _IDLE
        self.log.committed.append(self._pending)
        self._pending = None

    def finish(self, timeout_s: float = 120.0) -> dict:
        """Drain: let the pending save commit (collective: every rank calls it), stop the saver."""
        end = time.monotonic() + timeout_s
        while True:
            self._check()
            phase = int(self.state[0])
            busy = 0 if (phase == _IDLE and self._pending is None) else 1
            written = 1 if self._pending is None or phase == _WRITTEN else 0
            # One MAX all-reduce: any rank busy; written negated so MAX gives "all written".
            flags = torch.tensor([busy, -written], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            any_busy, all_written = int(flags[0]), -int(flags[1]) == 1
            if self._pending is not None and all_written:
                self._commit_pending()
            elif not any_busy:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"checkpoint saver of rank {self.rank}: pending save did not finish in {timeout_s:.0f} s")
            time.sleep(0.01)
        self.log.last_commit_time = float(self.state[2]) if self.rank == 0 else 0.0
        self.conn.send(("stop",))
        stats = self._recv(30.0)[1]
        self.proc.join(timeout=10)
        return {**self.log.to_dict(), "io": stats}

    def last_commit_time(self) -> float:
        return float(self.state[2])
