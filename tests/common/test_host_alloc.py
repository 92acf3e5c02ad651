"""The retained host allocator: it removes the page faults of re-allocated large tensors."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from impl.common.api import ConfigError
from impl.common.host_alloc import apply_host_malloc

# In a fresh process: what each policy reports, and that a later "default" job in the same
# process (a Hydra multirun) still reports the retained allocator it runs under.
PROBE = """
import json, sys
from impl.common.host_alloc import apply_host_malloc, retained
first = apply_host_malloc(sys.argv[1])
second = apply_host_malloc("default")
print(json.dumps({"first": first, "then_default": second, "retained": retained()}))
"""


def _probe(policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc mallopt")
def test_policy_in_force_is_what_the_record_names():
    # The page faults this removes (8-25k per fidelity UNet forward) are measured in
    # bench/fidelity/README.md; here: the record's host_malloc names what the process runs under.
    assert _probe("default") == {"first": False, "then_default": False, "retained": False}
    assert _probe("retain") == {"first": True, "then_default": True, "retained": True}


def test_unknown_policy_is_one_line_error():
    with pytest.raises(ConfigError) as err:
        apply_host_malloc("jemalloc")
    assert "workload.host_malloc: unknown value 'jemalloc' (one of: retain, default)" in str(err.value)
    assert "\n" not in str(err.value)


def test_workload_field_is_validated():
    from omegaconf import OmegaConf

    from bench.validate import typed_workload

    node = OmegaConf.merge(OmegaConf.load("conf/workload/fisedit_cpu_wide.yaml"), {"host_malloc": "tcmalloc"})
    with pytest.raises(ConfigError, match="workload.host_malloc: unknown value 'tcmalloc'"):
        typed_workload(node)
