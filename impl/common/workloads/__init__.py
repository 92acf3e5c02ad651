"""Typed workload specs. A workload yaml names its ``kind``; the kind picks the dataclass.

Register a new kind by adding it to ``KINDS`` (lazy "module:Class" so that importing the
harness does not import every family's dependencies).
"""
from __future__ import annotations

import importlib

KINDS: dict[str, str] = {
    "demo": "impl.common.workloads.demo:DemoWorkload",
    "pipeline": "impl.common.workloads.pipeline:PipelineWorkload",
    "serving": "impl.common.workloads.serving:ServingWorkload",
    "diffusion_edit": "impl.common.workloads.diffusion:DiffusionEditWorkload",
    "diffusion_serving": "impl.common.workloads.diffusion_serving:DiffusionServingWorkload",
    "hybrid": "impl.common.workloads.hybrid:HybridWorkload",
    "varlen": "impl.common.workloads.varlen:VarlenWorkload",
    "multitask_lora": "impl.common.workloads.multitask_lora:MultitaskLoraWorkload",
}


def workload_class(kind: str):
    if kind not in KINDS:
        raise KeyError(kind)
    module, cls = KINDS[kind].split(":")
    return getattr(importlib.import_module(module), cls)
