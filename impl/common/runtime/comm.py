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
* :class:`FifoComm` -- GPU-path fidelity (the HOL model [R] of impl/adaptra/README.md): one FIFO worker
  thread per peer for sends, holding at most Q messages, queued plus in flight (default 1,
  the simulator's ``CommModel.queue_depth``). ``send`` blocks while the worker is full, so a
  slow link stalls the compute thread behind it (head-of-line blocking); the worker sleeps
  the delay before each send, so the link's throughput is 1/c. Receives are blocking on the
  compute thread (the consumer needs the data anyway).
* :class:`~impl.common.runtime.delegated.DelegatedComm` -- ADAPTRA's host-delegated data plane
  (its own module).
"""
from __future__ import annotations

import abc
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from impl.common.runtime.link_delay import Link, TransitMonitor, link_of

FWD, BWD = "fwd", "bwd"
HEADER_BYTES = 32  # 4 x int64; keeps the payload 32-byte aligned


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


def sleep_delay(seconds: float) -> None:
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
        sleep_delay(self._delay_s(src, dst))
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
                    sleep_delay(delay_s)
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
