"""ADAPTRA's host-delegated data plane (the paper's CPU-delegated data plane, as in
the artifact (wutianyuan1/PipeMorph, branch `AE`)). For each
channel (ordered neighbour pair src->dst) there are K sender delegate processes on the src
side and K receiver delegate processes on the dst side; sender k and receiver k form their
own 2-rank gloo process group (each delegate calls ``init_process_group`` with a
``PrefixStore`` of the job's TCPStore: they are not members of the trainers' world, so
``new_group`` cannot be used). Micro-batch j goes through slot j and delegate ``j mod K``.
Shared memory per channel side: N slots + N int32 flags (0 unready, 1 SEND, 2 RECV_CPU,
3 RECV_GPU, -1 bad checksum) + a control block. Send: the trainer copies into slot j, then
sets flag 1 (flag written after data); delegate k sees it, sleeps the delay, sends, clears
the flag to 0 (so "queue empty" = all flags 0). Receive: delegates post their receives as
soon as the iteration starts (eager), fill slot j, verify the checksum, set flag 2; the
trainer waits for flag 2, copies out (a real H2D copy on CUDA, a memcpy on CPU) and sets
flag 3. The trainer never waits on the network, only on data that has not arrived yet.

Doorbells: each flag write is followed by a ``multiprocessing.Semaphore`` release, and the
waiter re-checks the flag after each wake-up. Pure spinning by dozens of delegate processes
would starve the compute on a 2-core host; the flags stay the protocol.

Local jobs: the launcher's parent process creates the channels and the delegate processes (so
nothing is orphaned if a trainer dies). Under torchrun each trainer creates its own side of
its channels and starts its side's delegates (:class:`LocalDelegates`), so the data plane
spans hosts: sender k and receiver k of a channel meet through the launch's store.
:func:`delegate_main` is every delegate's entry point.
"""
from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from impl.common.runtime.comm import (HEADER_BYTES, Comm, CommError, MessageSpec, channel_name, checksum,
                                      direction_of, pack, payload_view, sleep_delay, unpack_header)
from impl.common.runtime.launch import Helper, StoreAddress, mp_context
from impl.common.execution import set_torch_threads

FLAG_UNREADY, FLAG_SEND, FLAG_RECV_CPU, FLAG_RECV_GPU, FLAG_BAD = 0, 1, 2, 3, -1
_CTRL_EPOCH, _CTRL_STOP, _CTRL_DELAY_NS = 0, 1, 2


@dataclass
class DelegateChannel:
    """Shared state of one channel src->dst (created by the parent, shared by 2 trainers and
    2K delegates). ``send_*`` is the src side, ``recv_*`` the dst side."""

    src: int
    dst: int
    num_delegates: int
    num_microbatches: int
    spec: MessageSpec
    send_slots: torch.Tensor  # (N, nbytes) uint8
    send_flags: torch.Tensor  # (N,) int32
    send_ctrl: torch.Tensor  # (3,) int64: epoch, stop, delay_ns
    recv_slots: torch.Tensor
    recv_flags: torch.Tensor
    recv_ns: torch.Tensor  # (N,) int64: perf_counter_ns when the delegate finished receiving
    recv_ctrl: torch.Tensor  # (3,) int64: epoch, stop, unused
    send_bells: list = field(default_factory=list)  # K semaphores: trainer -> sender delegate k
    recv_start_bells: list = field(default_factory=list)  # K: trainer -> receiver delegate k
    recv_ready_bell: Any = None  # receiver delegates -> trainer

    @classmethod
    def create(cls, ctx, src: int, dst: int, num_delegates: int, num_microbatches: int,
               spec: MessageSpec) -> "DelegateChannel":
        n = num_microbatches

        def shared(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype).share_memory_()

        u8, i32, i64 = torch.uint8, torch.int32, torch.int64
        return cls(src, dst, num_delegates, n, spec,
                   shared(n, spec.nbytes, dtype=u8), shared(n, dtype=i32), shared(3, dtype=i64),
                   shared(n, spec.nbytes, dtype=u8), shared(n, dtype=i32), shared(n, dtype=i64), shared(3, dtype=i64),
                   [ctx.Semaphore(0) for _ in range(num_delegates)],
                   [ctx.Semaphore(0) for _ in range(num_delegates)], ctx.Semaphore(0))

    @property
    def name(self) -> str:
        return channel_name(self.src, self.dst)

    def request_stop(self) -> None:
        """Tell all delegates of this channel to exit at their next wait (parent or trainer)."""
        self.send_ctrl[_CTRL_STOP] = 1
        self.recv_ctrl[_CTRL_STOP] = 1
        for b in list(self.send_bells) + list(self.recv_start_bells):
            b.release()


def make_delegate_channels(ctx, num_stages: int, num_delegates: int, num_microbatches: int,
                           spec: MessageSpec, rank: Optional[int] = None) -> dict[tuple[int, int], DelegateChannel]:
    """Every channel of the pipeline, or (``rank`` given) only the ones that rank is an end of."""
    if num_microbatches % num_delegates:
        from impl.common.api import ConfigError

        raise ConfigError(f"workload.num_microbatches {num_microbatches} is not divisible by delegate "
                          f"count {num_delegates} (num_delegates)")
    out = {}
    for i in range(num_stages - 1):
        for src, dst in ((i, i + 1), (i + 1, i)):
            if rank is None or rank in (src, dst):
                out[(src, dst)] = DelegateChannel.create(ctx, src, dst, num_delegates, num_microbatches, spec)
    return out


def _wait_until(cond: Callable[[], bool], bell, timeout_s: float, alive: Callable[[], bool],
                what: str, poll_s: float = 0.05) -> None:
    """Block on ``bell`` until ``cond()`` holds (re-checked after every wake-up)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        bell.acquire(timeout=poll_s)
        if not alive():
            raise CommError(f"{what}: parent process is gone")
        if time.monotonic() > deadline:
            raise CommError(f"{what}: waited {timeout_s:.0f} s")


class DelegatedComm(Comm):
    """Trainer side of the delegated path (see module docstring)."""

    name = "delegated"

    def __init__(self, *args, channels: Mapping[tuple[int, int], DelegateChannel],
                 health: Optional[Callable[[], None]] = None, **kw) -> None:
        super().__init__(*args, **kw)
        self._health = health  # raises if one of this rank's own delegates failed (torchrun)
        self.out = {dst: ch for (src, dst), ch in channels.items() if src == self.rank}
        self.inp = {src: ch for (src, dst), ch in channels.items() if dst == self.rank}
        self._np = {id(ch): (ch.send_flags.numpy(), ch.recv_flags.numpy(), ch.recv_ns.numpy())
                    for ch in list(self.out.values()) + list(self.inp.values())}
        self._ppid = os.getppid()
        if self.device.type == "cuda":
            self._pin([ch.recv_slots for ch in self.inp.values()] + [ch.send_slots for ch in self.out.values()])

    @staticmethod
    def _pin(tensors) -> None:
        # Page-lock the shared slots so H2D/D2H copies are DMA, as with the artifact's pinned
        # buffers. Best effort: pageable copies are still correct.
        for t in tensors:
            try:
                torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            except Exception:
                pass

    def _alive(self) -> bool:
        if self._health is not None:
            self._health()
        return os.getppid() == self._ppid

    def start_iteration(self, iteration, delays, origin_ns):
        super().start_iteration(iteration, delays, origin_ns)
        for dst, ch in self.out.items():
            ch.send_ctrl[_CTRL_DELAY_NS] = int(round(self._delay_s(self.rank, dst) * 1e9))
            ch.send_ctrl[_CTRL_EPOCH] += 1
            for b in ch.send_bells:
                b.release()
        for ch in self.inp.values():
            ch.recv_ctrl[_CTRL_EPOCH] += 1  # receivers post their receives now (eager)
            for b in ch.recv_start_bells:
                b.release()

    def send(self, tensor, peer, mb, direction):
        src, dst = self._check_peer(peer, direction, sending=True)
        t0 = time.perf_counter()
        ch = self.out[dst]
        flags = self._np[id(ch)][0]
        if flags[mb] != FLAG_UNREADY:
            raise CommError(f"rank {self.rank}: slot {mb} of {ch.name} is still busy (flag {flags[mb]})")
        # On CUDA this is a D2H copy the trainer waits for (tiny at these sizes); the artifact
        # issues it async and lets the GPU write the flag. Data first, flag after.
        pack(ch.send_slots[mb], tensor.detach(), self.spec, mb, self.iteration, self._now_rel_ns())
        flags[mb] = FLAG_SEND
        ch.send_bells[mb % ch.num_delegates].release()
        self.sent[(src, dst)] += 1
        self.send_wait_s += time.perf_counter() - t0

    def recv(self, peer, mb, direction):
        src, dst = self._check_peer(peer, direction, sending=False)
        ch = self.inp[src]
        _, flags, recv_ns = self._np[id(ch)]
        _wait_until(lambda: flags[mb] in (FLAG_RECV_CPU, FLAG_BAD), ch.recv_ready_bell, self.wait_timeout_s,
                    self._alive, f"rank {self.rank}: waiting for {'RF' if src < dst else 'RB'}{mb}<{src}",
                    poll_s=0.01)
        if flags[mb] == FLAG_BAD:
            raise CommError(f"rank {self.rank}: micro-batch {mb} on {ch.name}: payload checksum mismatch "
                            f"(detected by the receiving delegate)")
        slot = ch.recv_slots[mb]
        out = torch.empty(self.spec.shape, dtype=self.spec.dtype, device=self.device)
        out.copy_(payload_view(slot, self.spec))  # H2D on CUDA, memcpy on CPU
        header = unpack_header(slot)
        recv_rel = int(recv_ns[mb]) - self.origin_ns
        self._accept(header, src, mb, recv_rel, None)  # the delegate verified the checksum
        flags[mb] = FLAG_RECV_GPU
        return out

    def end_iteration(self):
        deadline = time.perf_counter() + self.wait_timeout_s
        for ch in self.out.values():  # queues empty: every slot handed to the network
            flags = self._np[id(ch)][0]
            while (flags != FLAG_UNREADY).any():
                if time.perf_counter() > deadline or not self._alive():
                    busy = [int(j) for j in (flags != FLAG_UNREADY).nonzero()[0]]
                    raise CommError(f"rank {self.rank}: {ch.name} slots {busy} never sent")
                time.sleep(0.0002)
        for ch in self.inp.values():
            flags = self._np[id(ch)][1]
            if (flags != FLAG_RECV_GPU).any():
                left = [int(j) for j in (flags != FLAG_RECV_GPU).nonzero()[0]]
                raise CommError(f"rank {self.rank}: {ch.name} slots {left} not consumed at iteration end")
            flags[:] = FLAG_UNREADY  # before the next epoch lets the delegates write again
        return super().end_iteration()

    def shutdown(self):
        for ch in list(self.out.values()) + list(self.inp.values()):
            ch.request_stop()


def delegate_name(role: str, ch: DelegateChannel, k: int) -> str:
    owner = ch.src if role == "send" else ch.dst
    return f"stage {owner} {role}-{direction_of(ch.src, ch.dst)}[{k}] ({ch.src}->{ch.dst})"


def delegate_main(role: str, ch: DelegateChannel, k: int, store: StoreAddress, pg_timeout_s: float,
                  result_q) -> None:
    """Entry point of one delegate process (``role`` 'send' on src, 'recv' on dst)."""
    name = delegate_name(role, ch, k)
    ppid = os.getppid()

    def alive() -> bool:  # exit if the parent (the executor) went away
        return os.getppid() == ppid

    try:
        set_torch_threads(1)
        # Own 2-rank gloo group per sender/receiver pair, rendezvous under its own prefix.
        pair_store = dist.PrefixStore(f"delegate/{ch.src}->{ch.dst}/{k}/", store.connect(pg_timeout_s))
        dist.init_process_group("gloo", store=pair_store, rank=0 if role == "send" else 1, world_size=2,
                                timeout=timedelta(seconds=pg_timeout_s))
        result_q.put(("ready", name))
        mine = range(k, ch.num_microbatches, ch.num_delegates)
        ctrl = ch.send_ctrl.numpy() if role == "send" else ch.recv_ctrl.numpy()
        bell = ch.send_bells[k] if role == "send" else ch.recv_start_bells[k]
        forever = 10 * 365 * 86400.0
        epoch = handled = 0
        while True:
            _wait_until(lambda: ctrl[_CTRL_EPOCH] > epoch or ctrl[_CTRL_STOP], bell, forever, alive, name, 0.5)
            if ctrl[_CTRL_EPOCH] <= epoch:
                break  # stop requested between iterations
            epoch += 1
            if role == "send":
                flags = ch.send_flags.numpy()
                for j in mine:
                    _wait_until(lambda: flags[j] == FLAG_SEND or ctrl[_CTRL_STOP], bell, forever, alive, name, 0.5)
                    if flags[j] != FLAG_SEND:
                        break
                    sleep_delay(int(ctrl[_CTRL_DELAY_NS]) / 1e9)  # latency c; K delegates: throughput K/c
                    dist.send(ch.send_slots[j], dst=1)
                    flags[j] = FLAG_UNREADY
                    handled += 1
            else:
                flags, recv_ns = ch.recv_flags.numpy(), ch.recv_ns.numpy()
                for j in mine:
                    slot = ch.recv_slots[j]
                    dist.recv(slot, src=0)
                    recv_ns[j] = time.perf_counter_ns()
                    head = unpack_header(slot)
                    ok = head[0] == j and checksum(slot[HEADER_BYTES:]) == head[3]
                    flags[j] = FLAG_RECV_CPU if ok else FLAG_BAD  # data first, flag after
                    ch.recv_ready_bell.release()
                    handled += 1
        result_q.put(("helper_done", name, handled))
    except BaseException as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        result_q.put(("error", name, type(e).__name__, msg))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def delegate_helpers(channels: Mapping[tuple[int, int], DelegateChannel], store: StoreAddress, pg_timeout_s: float,
                     rank: Optional[int] = None) -> list[Helper]:
    """The delegate processes of ``channels`` (only ``rank``'s side of each when given)."""
    out = []
    for ch in channels.values():
        for role in ("send", "recv"):
            if rank is not None and rank != (ch.src if role == "send" else ch.dst):
                continue
            for k in range(ch.num_delegates):
                out.append(Helper(delegate_name(role, ch, k), delegate_main, (role, ch, k, store, pg_timeout_s)))
    return out


class LocalDelegates:
    """One trainer's own delegates (torchrun: its side of each of its channels), started,
    watched and stopped by that trainer; a delegate that fails makes the trainer raise."""

    def __init__(self, rank: int, num_stages: int, num_delegates: int, num_microbatches: int, spec: MessageSpec,
                 store: StoreAddress, pg_timeout_s: float) -> None:
        ctx = mp_context("forkserver", ["impl.common.runtime.delegated"])
        self.channels = make_delegate_channels(ctx, num_stages, num_delegates, num_microbatches, spec, rank=rank)
        self.q = ctx.Queue()
        self.counts: dict[str, int] = {}
        self.ready: set[str] = set()
        self.procs = {}
        for h in delegate_helpers(self.channels, store, pg_timeout_s, rank=rank):
            p = ctx.Process(target=h.target, name=h.name, daemon=True, args=(*h.args, self.q))
            p.start()
            self.procs[h.name] = p
        deadline = time.monotonic() + pg_timeout_s
        while len(self.ready) < len(self.procs):
            self._next(0.2)
            self.check()
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - self.ready)
                raise CommError(f"rank {rank}: only {len(self.ready)}/{len(self.procs)} delegates started in "
                                f"{pg_timeout_s:.0f} s (waiting for: {', '.join(missing)})")

    def _next(self, block_s: float):
        try:
            msg = self.q.get(timeout=block_s) if block_s > 0 else self.q.get_nowait()
        except queue.Empty:
            return None
        if msg[0] == "error":
            raise CommError(f"delegate {msg[1]} failed: {msg[2]}: {msg[3]}")
        if msg[0] == "helper_done":
            self.counts[msg[1]] = msg[2]
        elif msg[0] == "ready":
            self.ready.add(msg[1])
        return msg

    def check(self) -> None:
        """Raise if a delegate reported an error or died."""
        while self._next(0) is not None:
            pass
        for name, p in self.procs.items():
            if p.exitcode not in (None, 0):
                raise CommError(f"delegate {name} exited with code {p.exitcode}")

    def stop(self) -> dict[str, int]:
        """Stop every delegate (they exit at their next wait); return messages handled by each."""
        for ch in self.channels.values():
            ch.request_stop()
        end = time.monotonic() + 10.0
        while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < end:
            try:
                self._next(0.05)
            except CommError:
                pass
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
            p.join(timeout=3.0)
        try:
            while self._next(0) is not None:
                pass
        except CommError:
            pass
        return dict(self.counts)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]
