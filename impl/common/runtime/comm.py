"""Pipeline P2P paths of the real runtime; all three share one interface.

Every path moves *messages*: one contiguous uint8 buffer = a 32-byte header (int64 micro-batch
id, iteration, send time in ns since the sender's aligned iteration origin, checksum of the
payload) + the payload (the activation or its gradient). The receiver checks the micro-batch
id and iteration (per-link order), the checksum, and records the transit time for measured
delay detection. An injected link delay is slept before each send on that link (both
directions of the link).

* :class:`InlineComm` -- blocking ``torch.distributed`` send/recv on the compute thread, the
  1F1B baseline's "P2P issued in order on the compute stream". The delay is slept on the
  compute thread too, like the artifact's sleep kernel in the compute stream.
* :class:`FifoComm` -- GPU-path fidelity (spec section 3, "HOL fidelity"): one FIFO worker
  thread per peer for sends, holding at most Q messages, queued plus in flight (default 1,
  the simulator's ``CommModel.queue_depth``). ``send`` blocks while the worker is full, so a
  slow link stalls the compute thread behind it (head-of-line blocking); the worker sleeps
  the delay before each send, so the link's throughput is 1/c. Receives are blocking on the
  compute thread (the consumer needs the data anyway).
* :class:`DelegatedComm` -- ADAPTRA's host-delegated data plane (spec section 2.5). For each
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
  would starve the compute on a 2-core host (spec section 8); the flags stay the protocol.

Delegate processes are created by the executor's parent process (so nothing is orphaned if a
trainer dies); :func:`delegate_main` is their entry point.
"""
from __future__ import annotations

import abc
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from impl.common.runtime.link_delay import Link, TransitMonitor, link_of

FWD, BWD = "fwd", "bwd"
HEADER_BYTES = 32  # 4 x int64; keeps the payload 32-byte aligned
FLAG_UNREADY, FLAG_SEND, FLAG_RECV_CPU, FLAG_RECV_GPU, FLAG_BAD = 0, 1, 2, 3, -1
_CTRL_EPOCH, _CTRL_STOP, _CTRL_DELAY_NS = 0, 1, 2


class CommError(RuntimeError):
    """A broken message protocol (wrong order, bad checksum, count mismatch, timeout)."""


@dataclass(frozen=True)
class MessageSpec:
    """Shape and dtype of every payload crossing a stage boundary (activation == gradient)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


def checksum(payload_u8: torch.Tensor) -> int:
    """Exact integer sum of the payload's 32-bit words (bytes if not a multiple of 4)."""
    words = payload_u8.view(torch.int32) if payload_u8.numel() % 4 == 0 else payload_u8
    return int(words.sum(dtype=torch.int64))


def pack(buf: torch.Tensor, tensor: torch.Tensor, spec: MessageSpec, mb: int, iteration: int,
         send_rel_ns: int) -> None:
    """Write payload, then header (with its checksum) into the uint8 message buffer ``buf``."""
    payload = buf[HEADER_BYTES:]
    payload.view(spec.dtype).view(spec.shape).copy_(tensor)
    header = torch.tensor([mb, iteration, send_rel_ns, checksum(payload)], dtype=torch.int64)
    buf[:HEADER_BYTES].view(torch.int64).copy_(header)


def unpack_header(buf: torch.Tensor) -> list[int]:
    return buf[:HEADER_BYTES].view(torch.int64).tolist()


def payload_view(buf: torch.Tensor, spec: MessageSpec) -> torch.Tensor:
    return buf[HEADER_BYTES:].view(spec.dtype).view(spec.shape)


def direction_of(src: int, dst: int) -> str:
    return FWD if dst == src + 1 else BWD


def channel_name(src: int, dst: int) -> str:
    return f"{src}->{dst} {direction_of(src, dst)}"


class Comm(abc.ABC):
    """Common bookkeeping: direction checks, counts, transit times, header checks."""

    name = "base"

    def __init__(self, rank: int, num_stages: int, num_microbatches: int, spec: MessageSpec,
                 device: torch.device, *, verify_checksums: bool = True, wait_timeout_s: float = 120.0) -> None:
        self.rank = rank
        self.num_stages = num_stages
        self.n = num_microbatches
        self.spec = spec
        self.device = device
        self.verify = verify_checksums
        self.wait_timeout_s = wait_timeout_s
        self.iteration = -1
        self.origin_ns = 0
        self.delays: dict[Link, float] = {}
        self.sent: Counter = Counter()
        self.received: Counter = Counter()
        self.monitor = TransitMonitor()
        self.send_wait_s = 0.0  # compute-thread time spent inside send() (HOL indicator)

    # -- interface --------------------------------------------------------------------
    def start_iteration(self, iteration: int, delays: Mapping[Link, float], origin_ns: int) -> None:
        self.iteration = iteration
        self.delays = dict(delays)
        self.origin_ns = origin_ns
        self.sent.clear()
        self.received.clear()
        self.monitor.reset()

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, peer: int, mb: int, direction: str) -> None:
        """Hand ``tensor`` (micro-batch ``mb``) to ``peer``; each path decides when it blocks."""

    @abc.abstractmethod
    def recv(self, peer: int, mb: int, direction: str) -> torch.Tensor:
        """Block until ``peer``'s message for ``mb`` has arrived and return it."""

    def end_iteration(self) -> dict[str, int]:
        """Check exactly N messages per direction on each of this rank's links; return counts."""
        counts: dict[str, int] = {}
        for peer in (self.rank - 1, self.rank + 1):
            if not 0 <= peer < self.num_stages:
                continue
            for src, dst, table in ((self.rank, peer, self.sent), (peer, self.rank, self.received)):
                got = table[(src, dst)]
                if got != self.n:
                    verb = "sent" if src == self.rank else "received"
                    raise CommError(f"rank {self.rank}: {verb} {got} messages on {channel_name(src, dst)} "
                                    f"in iteration {self.iteration}, expected {self.n} (one per micro-batch)")
                counts[channel_name(src, dst)] = got
        return counts

    def shutdown(self) -> None:
        pass

    # -- helpers ----------------------------------------------------------------------
    def _check_peer(self, peer: int, direction: str, sending: bool) -> tuple[int, int]:
        src, dst = (self.rank, peer) if sending else (peer, self.rank)
        if abs(src - dst) != 1 or not 0 <= peer < self.num_stages:
            raise CommError(f"rank {self.rank}: peer {peer} is not a pipeline neighbour")
        if direction_of(src, dst) != direction:
            raise CommError(f"rank {self.rank}: {direction} message cannot go {src}->{dst}")
        return src, dst

    def _now_rel_ns(self) -> int:
        return time.perf_counter_ns() - self.origin_ns

    def _delay_s(self, src: int, dst: int) -> float:
        return self.delays.get(link_of(src, dst), 0.0)

    def _accept(self, header: list[int], src: int, mb: int, recv_rel_ns: int,
                payload_u8: Optional[torch.Tensor]) -> None:
        got_mb, got_it, send_rel_ns, cs = header
        what = f"{'RF' if src < self.rank else 'RB'}{mb}<{src}"
        if got_mb != mb or got_it != self.iteration:
            raise CommError(f"rank {self.rank}: {what} in iteration {self.iteration} received micro-batch "
                            f"{got_mb} of iteration {got_it} (send order != receive order on the link)")
        if payload_u8 is not None and self.verify and checksum(payload_u8) != cs:
            raise CommError(f"rank {self.rank}: {what}: payload checksum mismatch")
        self.monitor.record(link_of(src, self.rank), max(0, recv_rel_ns - send_rel_ns) / 1e9)
        self.received[(src, self.rank)] += 1


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class InlineComm(Comm):
    """Blocking send/recv on the compute thread (one process group per channel)."""

    name = "inline"

    def __init__(self, *args, groups: Mapping[tuple[int, int], Any], **kw) -> None:
        super().__init__(*args, **kw)
        self.groups = dict(groups)

    def _message(self, tensor: torch.Tensor, mb: int) -> torch.Tensor:
        buf = torch.empty(self.spec.nbytes, dtype=torch.uint8, device=self.device)
        pack(buf, tensor, self.spec, mb, self.iteration, self._now_rel_ns())
        return buf

    def send(self, tensor, peer, mb, direction):
        src, dst = self._check_peer(peer, direction, sending=True)
        t0 = time.perf_counter()
        buf = self._message(tensor, mb)
        _sleep(self._delay_s(src, dst))
        dist.send(buf, dst=dst, group=self.groups[(src, dst)])
        self.sent[(src, dst)] += 1
        self.send_wait_s += time.perf_counter() - t0

    def recv(self, peer, mb, direction):
        src, dst = self._check_peer(peer, direction, sending=False)
        buf = torch.empty(self.spec.nbytes, dtype=torch.uint8, device=self.device)
        dist.recv(buf, src=src, group=self.groups[(src, dst)])
        self._accept(unpack_header(buf), src, mb, self._now_rel_ns(), buf[HEADER_BYTES:])
        return payload_view(buf, self.spec)


class _FifoWorker(threading.Thread):
    """Sends one peer's messages in order; sleeps the link delay before each (throughput 1/c).

    ``credits`` counts the messages it may hold, queued plus the one being sent (the
    simulator's ``CommModel.queue_depth``); a credit comes back when a send completes, i.e.
    once the receiver has taken the message (gloo, like NCCL, sends by rendezvous)."""

    def __init__(self, group, dst: int, depth: int) -> None:
        super().__init__(daemon=True, name=f"fifo-send-to-{dst}")
        self.group = group
        self.dst = dst
        self.q: queue.Queue = queue.Queue()
        self.credits = threading.Semaphore(depth)
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                buf, delay_s = item
                if self.error is None:  # after a failure, drain without sending
                    _sleep(delay_s)
                    dist.send(buf, dst=self.dst, group=self.group)
            except BaseException as e:  # surfaced on the compute thread at its next call
                self.error = e
            finally:
                if item is not None:
                    self.credits.release()
                self.q.task_done()


class FifoComm(InlineComm):
    """Sends through a FIFO worker per peer holding <= Q messages; ``send`` blocks when full."""

    name = "fifo"

    def __init__(self, *args, depth: int = 1, **kw) -> None:
        super().__init__(*args, **kw)
        if depth < 1:
            raise ValueError(f"fifo depth must be >= 1, got {depth}")
        self.workers: dict[int, _FifoWorker] = {}
        for (src, dst), group in self.groups.items():
            if src == self.rank:
                w = _FifoWorker(group, dst, depth)
                w.start()
                self.workers[dst] = w

    def _raise_worker_error(self) -> None:
        for w in self.workers.values():
            if w.error is not None:
                raise CommError(f"rank {self.rank}: send to {w.dst} failed: "
                                f"{type(w.error).__name__}: {str(w.error).splitlines()[0] if str(w.error) else ''}")

    def send(self, tensor, peer, mb, direction):
        src, dst = self._check_peer(peer, direction, sending=True)
        self._raise_worker_error()
        t0 = time.perf_counter()
        buf = self._message(tensor, mb)
        worker = self.workers[dst]
        deadline = t0 + self.wait_timeout_s
        while not worker.credits.acquire(timeout=0.5):  # full: head-of-line blocking
            self._raise_worker_error()
            if time.perf_counter() > deadline:
                raise CommError(f"rank {self.rank}: send queue to {dst} stayed full for "
                                f"{self.wait_timeout_s:.0f} s")
        worker.q.put((buf, self._delay_s(src, dst)))
        self.sent[(src, dst)] += 1
        self.send_wait_s += time.perf_counter() - t0

    def end_iteration(self):
        deadline = time.perf_counter() + self.wait_timeout_s
        for w in self.workers.values():  # queues empty and the last send done
            while w.q.unfinished_tasks:
                self._raise_worker_error()
                if time.perf_counter() > deadline:
                    raise CommError(f"rank {self.rank}: send queue to {w.dst} did not drain in "
                                    f"{self.wait_timeout_s:.0f} s")
                time.sleep(0.0002)
        self._raise_worker_error()
        return super().end_iteration()

    def shutdown(self):
        for w in self.workers.values():
            w.q.put(None)
        for w in self.workers.values():
            w.join(timeout=2.0)


# ---------------------------------------------------------------------------------------
# Delegated data plane
# ---------------------------------------------------------------------------------------


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
                           spec: MessageSpec) -> dict[tuple[int, int], DelegateChannel]:
    if num_microbatches % num_delegates:
        from impl.common.api import ConfigError

        raise ConfigError(f"workload.num_microbatches {num_microbatches} is not divisible by delegate "
                          f"count {num_delegates} (num_delegates)")
    out = {}
    for i in range(num_stages - 1):
        for src, dst in ((i, i + 1), (i + 1, i)):
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

    def __init__(self, *args, channels: Mapping[tuple[int, int], DelegateChannel], **kw) -> None:
        super().__init__(*args, **kw)
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


def delegate_main(role: str, ch: DelegateChannel, k: int, store_host: str, store_port: int,
                  pg_timeout_s: float, result_q) -> None:
    """Entry point of one delegate process (``role`` 'send' on src, 'recv' on dst)."""
    name = delegate_name(role, ch, k)
    ppid = os.getppid()

    def alive() -> bool:  # exit if the parent (the executor) went away
        return os.getppid() == ppid

    try:
        torch.set_num_threads(1)
        store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=pg_timeout_s))
        # Own 2-rank gloo group per sender/receiver pair, rendezvous under its own prefix.
        pair_store = dist.PrefixStore(f"delegate/{ch.src}->{ch.dst}/{k}/", store)
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
                    _sleep(int(ctrl[_CTRL_DELAY_NS]) / 1e9)  # latency c; K delegates: throughput K/c
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
        result_q.put(("delegate_done", name, handled))
    except BaseException as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        result_q.put(("error", name, type(e).__name__, msg))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
