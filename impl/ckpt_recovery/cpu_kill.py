"""The cpu_kill preset without the harness (until the system's config lands in the tree):
``python -m impl.ckpt_recovery.cpu_kill [seeds] [policies] [nas|local]`` runs :func:`run_real`
on the preset's workload and fault for every seed and policy, and prints per-policy medians
as JSON. The harness command is ``mlsys-bench --multirun experiment=ckpt_recovery/cpu_kill``."""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
import tempfile
from types import SimpleNamespace

from omegaconf import OmegaConf

from impl.common.api import JobContext
from impl.common.conf_files import load_group_file, system_identity
from impl.common.workloads.hybrid import HybridWorkload

from impl.ckpt_recovery.real import REAL_POLICIES, check_real, run_real
from impl.ckpt_recovery.real_config import CkptRealKnobs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def workload() -> HybridWorkload:
    node = OmegaConf.load(ROOT / "conf/workload/ckpt_cpu_tp2pp2.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HybridWorkload), node))


def job(seed: int, wl, fault, out: str) -> JobContext:
    return JobContext("real", seed, "ckpt_recovery/cpu_kill", wl, "ckpt_cpu_tp2pp2", None, "cpu", fault, "gpu_loss",
                      pathlib.Path(out), show_progress=False)


SYSTEMS = tuple(REAL_POLICIES) + ("ckpt_recovery_peer",)  # the preset's sweep


def system_config(name: str, storage: str) -> SimpleNamespace:
    """``conf/system/ckpt_recovery/<name>.yaml``'s policy and real knobs (the preset's storage and
    save interval)."""
    group = ROOT / "conf" / "system"
    node = system_identity(load_group_file(group / "ckpt_recovery" / f"{name}.yaml", root=group), name)
    real = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CkptRealKnobs), node.get("real") or {},
                                               {"storage": storage, "ckpt_every": 3}))
    return SimpleNamespace(policy=str(node.policy), real=real)


def main(seeds=(0, 1, 2, 3, 4), policies=SYSTEMS, storage: str = "nas") -> dict:
    wl = workload()
    fault = SimpleNamespace(kind="gpu_loss", ranks=[], at_step=-1, mid_save=False, seed=0)
    out: dict = {}
    for pol in policies:
        system = SimpleNamespace(cfg=system_config(pol, storage))
        check_real(system, wl, None, fault)
        runs = []
        for s in seeds:
            r = run_real(system, job(s, wl, fault, tempfile.mkdtemp(prefix="cpu-kill-")))
            runs.append(r)
            print(pol, s, json.dumps({k: round(v.value, 4) for k, v in r.metrics.items()}), file=sys.stderr)
        keys = runs[0].metrics.keys()
        out[pol] = {k: statistics.median(r.metrics[k].value for r in runs) for k in keys}
        out[pol]["layout_after"] = sorted({r.info.get("layout_after") for r in runs})
        out[pol]["read_calls_per_rank"] = [r.info.get("read_calls_per_rank") for r in runs]
        out[pol]["emulated"] = runs[0].emulated
    return out


if __name__ == "__main__":
    a = sys.argv[1:]
    seeds = tuple(range(int(a[0]))) if a else (0, 1, 2, 3, 4)
    pols = tuple(a[1].split(",")) if len(a) > 1 else SYSTEMS
    print(json.dumps(main(seeds, pols, a[2] if len(a) > 2 else "nas"), indent=1, default=str))
