"""Where a record came from: code version, packages, host, devices, container.

Nothing here reads arbitrary environment variables: a record must never carry a secret.
:func:`redact` scrubs secret-looking keys and any value equal to a secret held in the
environment from the resolved config before it is stored or logged.
"""
from __future__ import annotations

import functools
import os
import pathlib
import platform
import re
import socket
import subprocess
from importlib import metadata
from typing import Any

PACKAGES = ("mlsys-bench", "torch", "hydra-core", "omegaconf", "numpy", "scipy", "diffusers",
            "transformers", "peft", "wandb")
# Environment names that hold secrets (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...).
SECRET_ENV = re.compile(r"(KEY|TOKEN|SECRET|PASSW|CREDENTIAL)", re.I)
# Config keys whose string values are secrets; narrower so that e.g. `tokenizer` survives.
SECRET_KEY = re.compile(r"(api_?key|secret|passw|credential|(^|_)token$)", re.I)
REDACTED = "<redacted>"


@functools.lru_cache(maxsize=1)
def git_info() -> dict:
    root = pathlib.Path(__file__).resolve().parent.parent
    commit = dirty = None
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                    text=True, timeout=10, check=True).stdout.strip() or None
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10, check=True).stdout
            dirty = bool(status.strip())
        except (OSError, subprocess.SubprocessError):
            commit = dirty = None
    if commit is None:
        # Installed from a wheel (e.g. in the container): the build may stamp the commit.
        commit = os.environ.get("MLSYS_BENCH_GIT_COMMIT") or None
        flag = os.environ.get("MLSYS_BENCH_GIT_DIRTY")
        dirty = None if flag is None else flag.lower() in ("1", "true", "yes")
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def devices() -> list[dict]:
    import torch

    if torch.cuda.is_available():
        return [{"type": "cuda", "index": i, "name": torch.cuda.get_device_name(i)}
                for i in range(torch.cuda.device_count())]
    return [{"type": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}]


def host() -> dict:
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu_count": os.cpu_count()}


def scheduler() -> dict | None:
    """The batch job this run is part of: submitit's (``hydra/launcher=submitit_local`` or
    ``submitit_slurm``: its executor and job id, array jobs as ``<array>_<task>``), else a bare
    Slurm allocation's (``srun``/``sbatch`` without submitit), else None."""
    executor = os.environ.get("SUBMITIT_EXECUTOR")
    if executor:
        import submitit

        env = submitit.JobEnvironment()
        return {"kind": f"submitit_{executor}", "job_id": str(env.job_id), "hostname": env.hostname,
                "node": env.node, "global_rank": env.global_rank}
    if "SLURM_JOB_ID" in os.environ:
        return {"kind": "slurm", "job_id": os.environ["SLURM_JOB_ID"],
                "nodelist": os.environ.get("SLURM_JOB_NODELIST"), "node": int(os.environ.get("SLURM_NODEID", 0))}
    return None


def collect(emulated: list[str] | None = None, fidelity: dict | None = None) -> dict:
    """``fidelity``: for a sim record, its family's latest measured sim-vs-real error on this
    host (:func:`bench.fidelity.store.provenance_entry`; ``latest`` null when never measured)."""
    out = {"git": git_info(), "packages": package_versions(), "host": host(), "devices": devices(),
           "container_image": os.environ.get("MLSYS_BENCH_CONTAINER_IMAGE") or None,
           "emulated": list(emulated or [])}
    sched = scheduler()
    if sched is not None:
        out["scheduler"] = sched
    if fidelity is not None:
        out["fidelity"] = fidelity
    return out


def _env_secrets() -> set[str]:
    return {v for k, v in os.environ.items() if SECRET_ENV.search(k) and len(v) >= 6}


def redact(obj: Any, _secrets: set[str] | None = None) -> Any:
    secrets = _env_secrets() if _secrets is None else _secrets
    if isinstance(obj, dict):
        return {k: (REDACTED if isinstance(k, str) and SECRET_KEY.search(k) and isinstance(v, str) and v
                    else redact(v, secrets)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str):
        for s in secrets:
            if s in obj:
                obj = obj.replace(s, REDACTED)
        return obj
    return obj
