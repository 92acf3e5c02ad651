"""One real job across the nodes of a Slurm allocation: ``srun`` starts one torchrun agent per
node, and each agent's rendezvous comes from Slurm's environment (:func:`rendezvous`), so the
batch script names no host and no port::

    srun --ntasks-per-node=1 python -m impl.common.runtime.slurm -- system=adaptra/adaptra mode=real

runs ``python -m torch.distributed.run --nnodes N --nproc-per-node P --rdzv-backend c10d
--rdzv-endpoint FIRST_HOST:PORT --rdzv-id SLURM_JOB_ID --max-restarts 0 -m bench <overrides>``
on every node; :mod:`impl.common.runtime.launch` then takes rank and world size from
torchrun's environment (``--print`` shows the command instead of running it).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from impl.common.api import ConfigError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    node_rank: int
    nproc_per_node: int
    endpoint: str  # host:port of the c10d store (the first node of the allocation)
    run_id: str

    def torchrun_args(self) -> list[str]:
        return ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
                "--max-restarts", "0"]


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist (``gpu[007-009,012],cpu1`` -> ``gpu007``), what
    ``scontrol show hostnames | head -1`` prints, without needing scontrol on the node."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m or not m.group(1).strip():
        raise ConfigError(f"SLURM_JOB_NODELIST: cannot read a host from {nodelist!r}")
    prefix, ranges = m.group(1).strip(), m.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value:
            # SLURM_GPUS_ON_NODE is a count; SLURM_GPUS_PER_NODE may read "gpu:a100:4"
            m = re.search(r"(\d+)\s*(?:\(|$)", value)
            if not m:
                raise ConfigError(f"{name}: not a count: {value!r}")
            return int(m.group(1))
    return None


def rendezvous(env: Mapping[str, str] = os.environ, nproc_per_node: Optional[int] = None,
               port: Optional[int] = None) -> Rendezvous:
    """torchrun's rendezvous for this node of a Slurm job step (one task per node).

    Processes per node: ``nproc_per_node``, else the GPUs Slurm gave the node
    (``SLURM_GPUS_ON_NODE``, ``SLURM_GPUS_PER_NODE``), else 1. Port: ``port``, else
    ``MLSYS_RDZV_PORT``, else 29500."""
    if "SLURM_JOB_ID" not in env:
        raise ConfigError("SLURM_JOB_ID: not set (run this under srun inside a Slurm allocation)")
    nnodes = _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    ntasks = _int(env, "SLURM_NTASKS") or nnodes
    if ntasks != nnodes:
        raise ConfigError(f"SLURM_NTASKS: {ntasks} tasks on {nnodes} nodes; start one torchrun agent per node "
                          "(srun --ntasks-per-node=1)")
    nproc = nproc_per_node or _int(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE") or 1
    port = port or int(env.get("MLSYS_RDZV_PORT") or DEFAULT_PORT)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("SLURM_JOB_NODELIST: not set")
    return Rendezvous(nnodes=nnodes, node_rank=_int(env, "SLURM_NODEID") or 0, nproc_per_node=nproc,
                      endpoint=f"{first_host(nodelist)}:{port}", run_id=f"slurm-{env['SLURM_JOB_ID']}")


def torchrun_command(overrides: Sequence[str], env: Mapping[str, str] = os.environ,
                     nproc_per_node: Optional[int] = None) -> list[str]:
    rdzv = rendezvous(env, nproc_per_node)
    return [sys.executable, "-m", "torch.distributed.run", *rdzv.torchrun_args(), "-m", "bench", *overrides]


def main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m impl.common.runtime.slurm",
                                description="start this node's torchrun agent for a real mlsys-bench job")
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks on this node (default: its GPUs)")
    p.add_argument("--print", action="store_true", help="print the command instead of running it")
    p.add_argument("overrides", nargs="*", help="the job's Hydra overrides (after --)")
    args = p.parse_args(argv)
    try:
        cmd = torchrun_command(args.overrides, nproc_per_node=args.nproc_per_node)
    except ConfigError as exc:
        print(f"mlsys-bench slurm: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.print:
        print(" ".join(cmd))
        return
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
