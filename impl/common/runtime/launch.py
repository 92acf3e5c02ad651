"""One process launcher for every multi-process job: local ranks by default, torchrun's ranks
when the job was started by ``torchrun`` / ``python -m torch.distributed.run``.

:func:`launch` runs ``fn(ctx, *args)`` on ``world_size`` ranks, each inside a process group
this module sets up (gloo; NCCL with one GPU per local rank when asked), and returns every
rank's return value, in rank order, as :class:`Launched`.

* **Local** (the default): the caller's process hosts a ``TCPStore`` on 127.0.0.1 and starts
  one process per rank (``forkserver``: torch is imported once, and the caller's
  ``__main__`` is never re-imported). Results come back through a queue as bytes; a rank
  that raises reports ``(who, exception, traceback)`` and the launcher stops every other
  process and raises one line naming the rank; a rank that dies silently, or a run past
  ``timeout_s``, also ends in one line, never a hang. Optional *helper* processes (the
  pipeline's delegates) start first and must report ready before the ranks start.
* **torchrun**: the elastic agent's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``) names this process's rank; the
  rendezvous is ``env://`` (the agent's store), each launch under its own key prefix, and
  ``fn`` runs in this process. ``all_gather_object`` hands every rank the same result list,
  so a system that launches several runs per job and branches on their results takes the
  same branches on every rank; only :func:`is_primary` (global rank 0) writes records. A rank
  that raises writes its one-line error into the store and re-raises, so the agent tears the
  job down (no hang) and rank 0 names the root cause when it can see it. Past ``timeout_s`` a
  watchdog thread writes a ``TimeoutError`` line the same way and exits the rank (124).
"""
from __future__ import annotations

import contextlib
import io
import itertools
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from impl.common.api import ConfigError
from impl.common.errors import first_line
from impl.common.execution import Placement, current as current_execution, note as note_placement

LOCAL_HOST = "127.0.0.1"
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
# torch._dynamo: torch.optim imports it lazily on first use, seconds of CPU per process.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "impl.common.runtime.launch"]
# A peer's reaction to a failure elsewhere, never the root cause.
_SECONDARY = ("Connection closed by peer", "Connection reset", "Timed out", "timed out", "parent process is gone",
              "Broken pipe", "SIGTERM")
_launch_seq = itertools.count()  # every rank makes the same launches in the same order


def under_torchrun() -> bool:
    """True when torch's elastic agent started this process (its environment is present)."""
    return all(k in os.environ for k in _TORCHRUN_ENV)


def is_primary() -> bool:
    """Global rank 0 under torchrun; always true for a local job (its ranks are children)."""
    return not under_torchrun() or int(os.environ["RANK"]) == 0


@dataclass(frozen=True)
class StoreAddress:
    """Where a rank (or a helper process) finds this launch's key-value store."""

    host: str
    port: int
    prefix: str

    def connect(self, timeout_s: float) -> dist.Store:
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return dist.PrefixStore(self.prefix, store)


@dataclass
class RankContext:
    """What ``fn`` gets: its rank, the launch's store (also for helpers), and a report channel."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    store: Any
    store_address: StoreAddress
    torchrun: bool
    pg_timeout_s: float
    _report: Optional[Callable[[int, Any], None]] = field(default=None, repr=False)

    def report(self, item: Any) -> None:
        """Send ``item`` to the caller's ``on_report`` (progress bars); dropped if none."""
        if self._report is not None:
            self._report(self.rank, item)


@dataclass
class Launched:
    results: list  # fn's return value per rank
    helpers: dict = field(default_factory=dict)  # helper name -> what it reported when done
    pids: list = field(default_factory=list)  # every local process started (all gone now)


@dataclass
class Helper:
    """A side process started before the ranks (local mode). ``target(*args, q)`` must put
    ``("ready", name)`` once set up and may put ``("helper_done", name, value)`` at the end,
    or ``("error", name, type, text)``."""

    name: str
    target: Callable
    args: tuple


def choose_backend(backend: Optional[str], local_ranks: int) -> str:
    """gloo, or nccl when asked (or by default) and every local rank can have its own GPU on
    the device the job's execution decided (``impl.common.execution``)."""
    return rank_placement(backend, local_ranks).backend


def rank_placement(backend: Optional[str], local_ranks: int) -> Placement:
    """Where ``local_ranks`` ranks run: ``backend`` None = the job's choice (nccl when every
    rank gets a GPU), ``gloo`` = the system's ranks run on the CPU, ``nccl`` = GPUs required."""
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend: unknown value {backend!r} (one of: gloo, nccl)")
    ex = current_execution()
    if backend == "gloo":
        return ex.placement(local_ranks, backend="auto", ranks_use_gpu=False)
    try:
        return ex.placement(local_ranks, backend=backend)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("execution.backend", "backend")) from None


def local_world(world_size: int) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else the whole (local) world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size


def mp_context(start_method: str = "forkserver", preload: Sequence[str] = ()):
    import torch.multiprocessing as mp

    if start_method not in ("forkserver", "spawn"):
        raise ConfigError(f"start_method: {start_method!r} is not supported (forkserver or spawn)")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The fork server imports torch once; each process then starts in milliseconds instead
        # of re-importing torch, with the same clean-process guarantees as spawn.
        ctx.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *preload])))
    return ctx


@contextlib.contextmanager
def stdlib_start_method():
    """A process-wide start method that new processes can restore, for the duration. Every
    spawned or forkserver child re-applies its parent's (``spawn.prepare``); inside a joblib
    (loky) worker that is loky's, which the child cannot set up, so every rank of a real job
    started from ``hydra/launcher=joblib`` died at start-up. The worker gets its own back after."""
    import multiprocessing as mp

    old = mp.get_start_method(allow_none=True)
    if old in (None, "fork", "spawn", "forkserver"):
        yield
        return
    mp.set_start_method(None, force=True)
    try:
        yield
    finally:
        mp.set_start_method(old, force=True)


def _init_group(rank: int, world: int, local_rank: int, backend: str, store, timeout_s: float) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, store=dist.PrefixStore("pg/", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return device


def _destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def pick_error(errors: list[tuple]) -> tuple:
    """Prefer a root cause over a peer's reaction to it (closed connections, timeouts)."""
    for e in errors:
        if not any(s in e[3] for s in _SECONDARY):
            return e
    return errors[0]


def _raise(label: str, who: str, etype: str, text: str) -> None:
    line = f"{label} {who} failed: {etype}: {text}"
    if etype in ("ConfigError", "ScheduleError"):
        raise ConfigError(line)
    raise RuntimeError(line)


# ---------------------------------------------------------------------------------------
# local ranks
# ---------------------------------------------------------------------------------------


def _local_rank_main(rank: int, world: int, backend: str, addr: StoreAddress, pg_timeout_s: float,
                     fn: Callable, args: tuple, q) -> None:
    try:
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            # Local ranks only: bind gloo to loopback rather than whatever the hostname resolves to.
            os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
        store = addr.connect(pg_timeout_s)
        device = _init_group(rank, world, rank, backend, store, pg_timeout_s)
        ctx = RankContext(rank, world, rank, backend, device, store, addr, False, pg_timeout_s,
                          lambda r, item: q.put(("report", r, item)))
        out = fn(ctx, *args)
        # Tensors through an mp.Queue travel as shared-memory handles that die with this
        # process; plain bytes do not.
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put(("result", rank, buf.getvalue()))
    except BaseException as e:  # report and exit; the parent tears the rest down
        q.put(("error", f"rank {rank}", type(e).__name__, first_line(e), traceback.format_exc()))
        raise SystemExit(1)
    finally:
        _destroy_group()


def _launch_local(fn, world, args, *, label, backend, pg_timeout_s, timeout_s, start_method, preload,
                  on_report, helpers, stop_helpers, describe_death, victim) -> Launched:
    ctx = mp_context(start_method, preload)
    master = dist.TCPStore(LOCAL_HOST, 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=pg_timeout_s))
    addr = StoreAddress(LOCAL_HOST, master.port, f"launch/{next(_launch_seq)}/")
    q = ctx.Queue()
    procs: dict[str, Any] = {}
    results: dict[int, Any] = {}
    helper_out: dict[str, Any] = {}
    errors: list[tuple] = []
    ready: set = set()
    deadline = time.monotonic() + timeout_s

    def handle(msg) -> None:
        kind = msg[0]
        if kind == "result":
            try:  # plain data only: a rank's result never runs pickled code in the caller
                results[msg[1]] = torch.load(io.BytesIO(msg[2]), weights_only=True)
            except Exception as exc:
                errors.append(("error", f"rank {msg[1]}", "ResultError",
                               f"returned a result that is not plain data (dict, list, tensor, number, "
                               f"str): {first_line(exc)}", ""))
        elif kind == "error":
            errors.append(msg)
        elif kind == "report":
            if on_report is not None:
                on_report(msg[1], msg[2])
        elif kind == "ready":
            ready.add(msg[1])
        elif kind == "helper_done":
            helper_out[msg[1]] = msg[2]

    def drain(block_s: float) -> None:
        try:
            handle(q.get(timeout=block_s))
            while True:
                handle(q.get_nowait())
        except queue.Empty:
            pass

    def dead_unreported() -> Optional[tuple]:
        reported = {e[1] for e in errors}
        # The injected victim first: its silence is the cause of everything else.
        order = sorted(procs.items(), key=lambda kv: kv[0] != victim)
        for name, p in order:
            if p.exitcode in (None, 0) or name in reported:
                continue
            rank = int(name.split()[1]) if name.startswith("rank ") else None
            if rank is not None and rank in results:
                continue
            why = describe_death(name, p.exitcode) if describe_death else None
            if why is not None:
                return ("error", name, *why)
            return ("error", name, "ProcessDied", f"exited with code {p.exitcode} without reporting an error "
                    "(at start-up? the caller's __main__ must be import-safe: if __name__ == '__main__')")
        return None

    def watch(done: Callable[[], bool], what: str) -> None:
        while not errors and not done():
            drain(0.2)
            if errors:
                return
            died = dead_unreported()
            if died:
                drain(1.0)  # its own report may still be in the pipe
                if not errors:
                    errors.append(died)
            if time.monotonic() > deadline:
                errors.append(("error", label if what == "ranks" else what, "TimeoutError",
                               f"run exceeded timeout_s={timeout_s:.0f} (ranks done: {sorted(results)})"))

    hs = list(helpers(addr) if helpers else [])
    try:
        for h in hs:  # all connected before the ranks start
            p = ctx.Process(target=h.target, name=h.name, daemon=True, args=(*h.args, q))
            with stdlib_start_method():
                p.start()
            procs[h.name] = p
        if hs:
            watch(lambda: len(ready) >= len(hs), "helpers")
        if not errors:
            for rank in range(world):
                p = ctx.Process(target=_local_rank_main, name=f"rank {rank}",
                                args=(rank, world, backend, addr, pg_timeout_s, fn, args, q))
                with stdlib_start_method():
                    p.start()
                procs[f"rank {rank}"] = p
            watch(lambda: len(results) >= world, "ranks")
        if errors:
            drain(1.0)  # give the root cause a moment to arrive
            time.sleep(0.2)
            died = dead_unreported()
            if died and victim is not None and died[1] == victim:
                errors.insert(0, died)
    finally:
        if stop_helpers is not None:
            stop_helpers()
        # After a failure the survivors are typically blocked on a dead peer: don't wait long.
        _shutdown(procs, drain, grace_s=1.0 if errors else 10.0)
        del master
    if errors:
        _raise(label, *pick_error(errors)[1:4])
    return Launched([results[r] for r in range(world)], helper_out, [p.pid for p in procs.values()])


def _shutdown(procs: dict, drain, grace_s: float) -> None:
    """Join everything (reading the queue meanwhile), then terminate, then kill."""
    end = time.monotonic() + grace_s
    while any(p.is_alive() for p in procs.values()) and time.monotonic() < end:
        drain(0.05)
    for sig in ("terminate", "kill"):
        alive = [p for p in procs.values() if p.is_alive()]
        for p in alive:
            getattr(p, sig)()
        for p in alive:
            p.join(timeout=3.0)
    for p in procs.values():
        p.join(timeout=0.1)
    drain(0.05)  # what the last ones said on their way out


# ---------------------------------------------------------------------------------------
# torchrun ranks
# ---------------------------------------------------------------------------------------

_agent_store: list = []


def _torchrun_store(timeout_s: float):
    """The rendezvous store of ``env://`` (the elastic agent's), opened once per process."""
    if not _agent_store:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        _agent_store.append(store)
    return _agent_store[0]


class _Watchdog:
    """Ends this torchrun rank past ``timeout_s``: one line on stderr, the error into the store
    (rank 0 names it), this rank's own child processes killed, exit 124; the elastic agent then
    stops the other ranks. A rank blocked in a collective cannot raise, so the timer exits the
    process instead. ``finish`` (under the same lock) keeps a rank that completed from exiting."""

    def __init__(self, timeout_s: float, label: str, rank: int, store) -> None:
        self.timeout_s, self.label, self.rank, self.store = timeout_s, label, rank, store
        self._lock, self._finished = threading.Lock(), False
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def finish(self) -> None:
        with self._lock:
            self._finished = True
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            if self._finished:
                return
            text = f"run exceeded timeout_s={self.timeout_s:.0f}"
            print(f"{self.label} rank {self.rank} failed: TimeoutError: {text}", file=sys.stderr, flush=True)
            # the store may be gone with the agent: a bounded try, never a second hang
            w = threading.Thread(target=self._tell, args=(text,), daemon=True)
            w.start()
            w.join(2.0)
            import psutil

            for child in psutil.Process().children(recursive=True):  # os._exit skips atexit
                try:
                    child.kill()
                except psutil.Error:
                    pass
            os._exit(124)

    def _tell(self, text: str) -> None:
        try:
            self.store.set(f"error/{self.rank}", "\x1f".join((f"rank {self.rank}", "TimeoutError", text)))
        except Exception:
            pass


def _launch_torchrun(fn, world, args, *, label, backend, pg_timeout_s, timeout_s, on_report) -> Launched:
    rank, env_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if env_world != world:
        raise ConfigError(f"world size: the job needs {world} ranks, torchrun started {env_world} "
                          f"(--nnodes x --nproc-per-node must equal {world})")
    prefix = f"mlsys/{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/" \
             f"launch/{next(_launch_seq)}/"
    store = dist.PrefixStore(prefix, _torchrun_store(pg_timeout_s))
    addr = StoreAddress(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), prefix)
    report = (lambda r, item: on_report(r, item)) if on_report is not None else None
    watchdog = _Watchdog(timeout_s, label, rank, store)
    try:
        device = _init_group(rank, world, local_rank, backend, store, pg_timeout_s)
        ctx = RankContext(rank, world, local_rank, backend, device, store, addr, True, pg_timeout_s, report)
        out = fn(ctx, *args)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, out)
    except BaseException as e:
        watchdog.finish()
        mine = (f"rank {rank}", type(e).__name__, first_line(e))
        errors = [("error", *mine)]
        try:
            store.set(f"error/{rank}", "\x1f".join(mine))
            time.sleep(0.5)  # a root cause elsewhere may be on its way
            for r in range(world):
                if r != rank and store.check([f"error/{r}"]):
                    errors.append(("error", *store.get(f"error/{r}").decode().split("\x1f", 2)))
        except Exception:
            pass
        _destroy_group()
        who, etype, text = pick_error(errors)[1:4]
        try:
            _raise(label, who, etype, text)
        except (RuntimeError, ConfigError) as line:
            raise line from e
    watchdog.finish()
    _destroy_group()
    return Launched(gathered)


def launch(fn: Callable, world_size: int, args: tuple = (), *, label: str = "launch",
           backend: Optional[str] = "gloo", pg_timeout_s: float = 120.0, timeout_s: float = 900.0,
           start_method: str = "forkserver", preload: Sequence[str] = (),
           on_report: Optional[Callable[[int, Any], None]] = None,
           helpers: Optional[Callable[[StoreAddress], list[Helper]]] = None,
           stop_helpers: Optional[Callable[[], None]] = None,
           describe_death: Optional[Callable[[str, int], Optional[tuple[str, str]]]] = None,
           victim: Optional[str] = None) -> Launched:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks (see the module docstring).

    ``fn`` and ``args`` must be picklable (local mode). ``backend`` None picks nccl when
    every local rank has a GPU. Failures raise one line ``"{label} {who} failed: {type}: {text}"``
    (ConfigError for config/schedule errors, else RuntimeError). ``helpers`` (local mode only)
    are side processes started first; ``stop_helpers`` is called once the ranks are done or
    failed. ``describe_death(name, exitcode)`` may explain a silent death as ``(type, text)``;
    ``victim`` names the process whose silent death is the root cause if it happens.
    """
    if world_size < 1:
        raise ConfigError(f"world size: must be >= 1, got {world_size}")
    placement = note_placement(rank_placement(backend, local_world(world_size)))
    backend = placement.backend
    if under_torchrun():
        if helpers is not None:
            raise ConfigError("helpers: local-mode side processes cannot start under torchrun; "
                              "start them from the ranks")
        return _launch_torchrun(fn, world_size, args, label=label, backend=backend, pg_timeout_s=pg_timeout_s,
                                timeout_s=timeout_s, on_report=on_report)
    return _launch_local(fn, world_size, args, label=label, backend=backend, pg_timeout_s=pg_timeout_s,
                         timeout_s=timeout_s, start_method=start_method, preload=preload, on_report=on_report,
                         helpers=helpers, stop_helpers=stop_helpers, describe_death=describe_death, victim=victim)
