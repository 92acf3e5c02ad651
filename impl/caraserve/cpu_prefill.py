"""CPU LoRA worker (the paper's CPU LoRA processes, arXiv 2401.11240): a spawned, single-threaded process that holds
the host adapters and computes ``lora_delta`` for (adapter, layer, LoRA input) jobs.

Data moves through ``multiprocessing.shared_memory`` with sequence-number flags: no pickling and
no PyTorch IPC on the request path. Two counting semaphores are only doorbells (a sleeping
side wakes without spinning: on 2 shared cores a spinning poller steals the core the other
side needs); the flags in shared memory are the truth, so a spurious wake-up is harmless. A ring of ``slots`` job slots lets
the engine submit several cold requests' jobs before waiting. The worker calls the same
:func:`impl.common.llm.kernels.lora_delta` as the device segment kernel, with the same adapter
tensors (loaded from the same safetensors file), so a CPU delta is bit-identical to the device
one at the same thread count.

The ring itself (:class:`ShmWorker`) knows nothing of LoRA: the job the worker runs is a
parameter, so the IPC benchmark (impl/caraserve/README.md, "IPC and cost-law measurements"; :func:`negate_job` vs :class:`QueueWorker`)
times this very transport.

Control block (int64): [0] submitted seq, [1] completed seq, [2] stop, [3] ready;
per slot: [4 + 6*s + 0..5] = three job ints (LoRA: adapter index, layer, input group 0=qkv,
1=o), rows, seq, -.
"""
from __future__ import annotations

import multiprocessing as mp
import pathlib
import time
from multiprocessing import shared_memory
from typing import Optional, Sequence

import numpy as np
import torch

from impl.common.llm.model import SITES
from impl.common.execution import set_torch_threads

GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",))
HDR = 4
PER = 6


def save_host_adapters(adapters: dict, path: pathlib.Path) -> pathlib.Path:
    """Host stacks as one safetensors file, read by the worker (and by nobody else)."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, ad in adapters.items():
        for s in SITES:
            tensors[f"{name}|{s}|A"] = ad.A[s].contiguous()
            tensors[f"{name}|{s}|B"] = ad.B[s].contiguous()
        meta[name] = repr(float(ad.scale))
    save_file(tensors, str(path), metadata=meta)
    return path


def _lora_job(path, adapter_names):
    """Job of a CPU LoRA worker: the deltas of one LoRA input group, one output plane per site."""
    from safetensors import safe_open

    from impl.common.llm.kernels import lora_delta

    W: dict = {}
    scales = []
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        for i, name in enumerate(adapter_names):
            scales.append(float(meta[name]))
            for s in SITES:  # fp32 on the host whatever the device's dtype (no-op for fp32 stacks)
                W[(i, s)] = (f.get_tensor(f"{name}|{s}|A").float(), f.get_tensor(f"{name}|{s}|B").float())

    def run(job, x, y):
        a, layer, grp = job
        for j, site in enumerate(GROUPS[grp]):
            A, B = W[(a, site)]
            d = lora_delta(x, A[layer], B[layer], scales[a])
            y[j, :x.shape[0], :d.shape[1]] = d

    return run


def negate_job():
    """Job of the IPC benchmark: y = -x. Exact in fp32, and unlike an echo it
    proves the worker wrote the returned bytes (a stale or aliased slot fails the check)."""

    def run(job, x, y):
        torch.neg(x, out=y[0, :x.shape[0], :x.shape[1]])

    return run


def _worker_main(names_shm, shapes, threads, slots, req_sem, done_sem, make_job, job_args):
    set_torch_threads(threads)
    ctrl_shm = shared_memory.SharedMemory(name=names_shm[0])
    x_shm = shared_memory.SharedMemory(name=names_shm[1])
    y_shm = shared_memory.SharedMemory(name=names_shm[2])
    max_rows, d_in, d_out, outs = shapes
    ctrl = np.ndarray((HDR + PER * slots,), dtype=np.int64, buffer=ctrl_shm.buf)
    xb = torch.from_numpy(np.ndarray((slots, max_rows, d_in), dtype=np.float32, buffer=x_shm.buf))
    yb = torch.from_numpy(np.ndarray((slots, outs, max_rows, d_out), dtype=np.float32, buffer=y_shm.buf))
    job = make_job(*job_args)
    ctrl[3] = 1
    done = int(ctrl[1])
    while not ctrl[2]:
        if ctrl[0] == done:
            req_sem.acquire(timeout=0.05)
            continue
        seq = done + 1
        slot = seq % slots
        base = HDR + PER * slot
        a, layer, grp, n = (int(v) for v in ctrl[base:base + 4])
        job((a, layer, grp), xb[slot, :n], yb[slot])
        done = seq
        ctrl[1] = done
        done_sem.release()
    for shm in (ctrl_shm, x_shm, y_shm):
        shm.close()


class _Handle:
    __slots__ = ("worker", "seq", "slot", "n", "dims", "result")

    def __init__(self, worker, seq, slot, n, dims):
        self.worker, self.seq, self.slot, self.n, self.dims = worker, seq, slot, n, dims
        self.result = None

    def wait(self) -> list[torch.Tensor]:
        if self.result is None:
            w = self.worker
            ctrl = w.ctrl
            seq = self.seq
            t0 = time.perf_counter()
            spins = 0
            while ctrl[1] < seq:
                spins += 1
                if spins > 50:
                    w.done_sem.acquire(timeout=0.01)
            w.wait_s += time.perf_counter() - t0
            self.result = [w.yb[self.slot, j, :self.n, :d].clone() for j, d in enumerate(self.dims)]
            w.outstanding.remove(self)
        return self.result


class ShmWorker:
    """A spawned, single-threaded process serving jobs from a shared-memory ring of ``slots``
    slots, each ``max_rows x d_in`` fp32 in and ``outs x max_rows x d_out`` fp32 out.
    ``make_job(*job_args)`` runs in the worker (a module-level function: spawn pickles it by
    name) and returns ``run(job, x, y_slot)``; ``job`` is three ints the job reads as it likes."""

    def __init__(self, make_job, job_args, max_rows: int, d_in: int, d_out: int, outs: int = 1, threads: int = 1,
                 slots: int = 8, start_timeout_s: float = 120.0):
        self.max_rows, self.slots = max_rows, slots
        sizes = (8 * (HDR + PER * slots), 4 * slots * max_rows * d_in, 4 * slots * outs * max_rows * d_out)
        _check_shm_room(sum(sizes))
        self._shm = [shared_memory.SharedMemory(create=True, size=8 * (HDR + PER * slots)),
                     shared_memory.SharedMemory(create=True, size=4 * slots * max_rows * d_in),
                     shared_memory.SharedMemory(create=True, size=4 * slots * outs * max_rows * d_out)]
        self.ctrl = np.ndarray((HDR + PER * slots,), dtype=np.int64, buffer=self._shm[0].buf)
        self.ctrl[:] = 0
        self.xb = torch.from_numpy(np.ndarray((slots, max_rows, d_in), dtype=np.float32, buffer=self._shm[1].buf))
        self.yb = torch.from_numpy(np.ndarray((slots, outs, max_rows, d_out), dtype=np.float32,
                                              buffer=self._shm[2].buf))
        self.seq = 0
        self.outstanding: list[_Handle] = []
        self.wait_s = 0.0
        self.jobs = 0
        ctx = mp.get_context("spawn")  # CUDA + multiprocessing needs spawn
        self.req_sem, self.done_sem = ctx.Semaphore(0), ctx.Semaphore(0)
        self.proc = ctx.Process(target=_worker_main, daemon=True,
                                args=([s.name for s in self._shm], (max_rows, d_in, d_out, outs), threads, slots,
                                      self.req_sem, self.done_sem, make_job, tuple(job_args)))
        try:
            self.proc.start()
            t0 = time.perf_counter()
            while not self.ctrl[3]:
                if not self.proc.is_alive():
                    raise RuntimeError(f"CPU worker exited during start-up (exit code {self.proc.exitcode})")
                if time.perf_counter() - t0 > start_timeout_s:
                    raise RuntimeError(f"CPU worker not ready after {start_timeout_s:.0f} s")
                time.sleep(0.01)
        except BaseException:
            self.close()
            raise

    def post(self, x: torch.Tensor, job: tuple = (0, 0, 0), dims: Optional[Sequence[int]] = None) -> _Handle:
        """Copy ``x`` into the next slot and ring the worker; ``handle.wait()`` returns the first
        ``dims[j]`` columns of output plane j (default: one plane as wide as x)."""
        n = x.shape[0]
        if n > self.max_rows:
            raise ValueError(f"CPU worker job of {n} rows exceeds the shared buffer ({self.max_rows} rows)")
        if len(self.outstanding) >= self.slots:
            self.outstanding[0].wait()
        self.seq += 1
        slot = self.seq % self.slots
        self.xb[slot, :n].copy_(x.detach().to("cpu", torch.float32))
        base = HDR + PER * slot
        self.ctrl[base:base + 4] = (*job, n)
        self.ctrl[0] = self.seq  # publish last (x86 stores are ordered)
        self.req_sem.release()
        h = _Handle(self, self.seq, slot, n, list(dims) if dims is not None else [x.shape[1]])
        self.outstanding.append(h)
        self.jobs += 1
        return h

    def close(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        self.ctrl[2] = 1
        self.req_sem.release()
        if self.proc.pid is not None:
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        self.proc = None
        self.ctrl = None
        self.xb = self.yb = None
        for shm in self._shm:
            shm.close()
            shm.unlink()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_shm_room(nbytes: int) -> None:
    """Refuse in one line when /dev/shm cannot hold the ring (a container's default is 64 MiB):
    the segments are created sparse, so an overfull one fails later with SIGBUS mid-run."""
    import os

    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise RuntimeError(f"CPU worker: its shared-memory ring needs {nbytes / 2**20:.0f} MiB, /dev/shm has "
                           f"{free / 2**20:.0f} MiB free (a container needs a larger --shm-size)")


class CPULoRAWorker(ShmWorker):
    """One spawned CPU LoRA process (2 cores allow 1). It computes in fp32 from its own
    copy of the host adapters, whatever the device's dtype; the safetensors file it loads them
    from is removed once it is ready."""

    def __init__(self, adapters: dict, workdir: pathlib.Path, max_rows: int, threads: int = 1, slots: int = 8,
                 start_timeout_s: float = 120.0):
        self.names = list(adapters)
        self.index = {n: i for i, n in enumerate(self.names)}
        first = next(iter(adapters.values()))
        d_in = max(first.A[s].shape[2] for s in SITES)
        self.dims = {s: first.B[s].shape[1] for s in SITES}
        path = save_host_adapters(adapters, pathlib.Path(workdir) / "cpu_worker_adapters.safetensors")
        try:
            super().__init__(_lora_job, (str(path), self.names), max_rows, d_in, max(self.dims.values()),
                             outs=max(len(g) for g in GROUPS), threads=threads, slots=slots,
                             start_timeout_s=start_timeout_s)
        finally:
            path.unlink(missing_ok=True)  # the worker holds its copy (a 7B job's file is GBs)

    def submit(self, adapter: str, layer: int, sites: Sequence[str], x: torch.Tensor) -> _Handle:
        grp = 0 if tuple(sites) == GROUPS[0] else 1
        return self.post(x, (self.index[adapter], layer, grp), [self.dims[s] for s in GROUPS[grp]])


def _queue_main(inq, outq):
    while (x := inq.get()) is not None:
        outq.put(np.negative(x))


class QueueWorker:
    """The IPC benchmark's baseline: :func:`negate_job` behind ``multiprocessing.Queue``, so the array is
    pickled through a pipe both ways (numpy, not torch: torch tensors would travel by PyTorch
    IPC, which the paper rules out, not what the IPC benchmark compares against)."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.inq, self.outq = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_queue_main, args=(self.inq, self.outq), daemon=True)
        self.proc.start()

    def roundtrip(self, x: np.ndarray, timeout_s: float = 120.0) -> np.ndarray:
        self.inq.put(x)
        return self.outq.get(timeout=timeout_s)

    def close(self) -> None:
        if self.proc is None:
            return
        self.inq.put(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        self.proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
