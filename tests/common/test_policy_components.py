"""Policies are registered components and configs check themselves: a bad knob fails where the
config is typed, in one line naming the field, and the shared serving substrate knows no
serving system's policy by name."""
from __future__ import annotations

import pathlib

import pytest

from bench.validate import typed_system
from impl.common.api import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target, knobs, message", [
    ("impl.malleus.system.HybridTraining", {"top_k": 0}, "system.top_k must be >= 1, got 0"),
    ("impl.malleus.system.HybridTraining", {"interleave": ["malleus", "x"]},
     "system.interleave: unknown policy 'x' (one of: malleus, uniform, data_only, layers_only, restart_replan)"),
    ("impl.lobra.system.LobRA", {"sim": {"homogeneous": [0, 1]}},
     "system.sim.homogeneous: must be [tp, pp] >= 1, got [0, 1]"),
    ("impl.lobra.system.LobRA", {"real": {"interleave": ["lobra", "x"]}},
     "system.real.interleave: unknown policy 'x' (one of: lobra, task_fused, task_sequential)"),
    ("impl.caraserve.system.ServingSystem", {"router": "x"},
     "system.router: unknown router 'x' (one of: rank_aware, mostidle, random, firstfit, punica)"),
    ("impl.caraserve.system.ServingSystem", {"cpu_workers": 2},
     "system.cpu_workers must be 0 (in-process CPU path) or 1 (a worker process), got 2"),
    ("impl.ckpt_recovery.system.CkptRecovery", {"policy": "x"}, "system.policy: unknown value 'x'"),
    ("impl.adaptra.system.PipelineTraining", {"dp_link_policy": "ladder"},
     "system.dp_link_policy: unknown value 'ladder' (one of: ignore, remap)"),
    ("impl.adaptra.falcon.Falcon", {"dp_link_policy": "remap"},
     "system.dp_link_policy: unknown value 'remap' (one of: ladder)"),
    ("impl.adaptra.falcon.Falcon", {"hazard": 1.0}, "system.hazard must be in (0, 1), got 1.0"),
    ("impl.fisedit.system.FISEditSystem", {"block": 0}, "system.block must be >= 1, got 0"),
    ("impl.swiftdiffusion.system.SwiftDiffusionSystem", {"slo_factor": 0.0}, "system.slo_factor must be > 0, got 0.0"),
])
def test_a_bad_knob_fails_when_the_config_is_typed(target, knobs, message):
    with pytest.raises(ConfigError) as e:
        typed_system({"_target_": target, "name": "x", **knobs})
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_lobra_real_steps_cover_every_policy():
    from impl.lobra.policies import POLICIES
    from impl.lobra.real import REAL_STEPS

    assert REAL_STEPS.names() == POLICIES.names()


@pytest.mark.parametrize("path", ["impl/common/llm/scheduler.py", "impl/common/llm/serving_engine.py",
                                  "impl/common/servesim/cluster.py"])
def test_serving_substrate_names_no_policy(path):
    from impl.caraserve.policies import POLICIES

    # lora_kernels picks a kernel family by its system's name (KERNEL_FAMILIES): a kernel knob, not a policy
    text = "\n".join(line for line in (REPO / path).read_text().splitlines() if not line.startswith("KERNEL_FAMILIES"))
    named = [p for p in POLICIES.names() if f'"{p}"' in text or f"'{p}'" in text]
    assert not named, f"{path} branches on policy names {named}: ask the ServingPolicy instead"


def test_serving_policies_keep_their_behaviour():
    # The behaviour each name stood for before it became a component (scheduler module table).
    from impl.caraserve.policies import serving

    assert [p for p in ("cached", "ondmd", "caraserve", "slora", "punica", "dlora", "hf_peft")
            if serving(p).sync_load] == ["ondmd", "slora", "punica", "dlora", "hf_peft"]
    assert serving("cached").preload_all and serving("caraserve").cpu_assisted_prefill
    assert serving("slora").kernels == ("mbgmv", "mbgmv") and serving("punica").kernels == ("sgmv", "bgmv_punica")
    assert serving("dlora").migrates and not serving("hf_peft").lora_compute
