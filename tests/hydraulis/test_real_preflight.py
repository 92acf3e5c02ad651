"""Bad real-mode input fails at preflight with one line naming the field and the numbers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from impl.common.api import ConfigError
from impl.common.varlen.lengths import LengthDist
from impl.common.workloads.varlen import VarlenModelShape, VarlenWorkload
from impl.hydraulis.real.run import job_runs
from impl.hydraulis.real.config import HydraulisRealKnobs, RealRun, ReplicaKind
from impl.hydraulis.system import Hydraulis

NO_FAULT = SimpleNamespace(kind="none")
SPEC5_RUNS = [RealRun("H", "two_stage", [["A", "B"]]), RealRun("B0", "greedy", [["A", "A"]]),
              RealRun("B1", "two_stage", [["A", "A"]])]


def _system(policy="hydraulis_h", **real):
    return Hydraulis(Hydraulis.Config(policy=policy, real=HydraulisRealKnobs(**real)), policy)


def _wl(**kw):
    model = VarlenModelShape(name="t", num_layers=4, hidden=256, heads=4, ffn_hidden=704, vocab=2048)
    return VarlenWorkload(**{"model": model, "num_gpus": 2, "gpus_per_node": 2, "context": 2048, "global_batch_seqs": 0,
                             "token_budget": 16384,
                             "lengths": LengthDist(median=300, sigma=1.0, min_len=16, max_len=2048), **kw})


def _check(system, wl) -> str:
    with pytest.raises(ConfigError) as e:
        system.check("real", wl, None, NO_FAULT)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("policy", ["hydraulis_h", "hydraulis_b0", "hydraulis_b1"])
def test_the_spec5_systems_pass_preflight_and_default_to_their_own_run(policy):
    s = _system(policy)
    s.check("real", _wl(), None, NO_FAULT)
    (run,) = job_runs(s)
    assert run.name == policy and run.candidates == ([["A", "B"]] if policy == "hydraulis_h" else [["A", "A"]])
    _system(policy, runs=SPEC5_RUNS).check("real", _wl(), None, NO_FAULT)


def test_a_pool_that_cannot_hold_the_longest_sequence():
    msg = _check(_system(runs=[RealRun("H", "two_stage", [["B", "B"]])]), _wl())
    assert msg == ("system.real.runs[H].candidates: no candidate holds a sequence of workload.context 2048 tokens "
                   "(largest cap 1024)")
    msg = _check(_system(runs=[RealRun("B0", "greedy", [["A", "B"]])]), _wl())
    assert "largest smallest-replica cap 1024" in msg


def test_g_smaller_than_one_sequence_and_a_budget_by_count():
    assert _check(_system(), _wl(token_budget=1000)) == (
        "workload.token_budget: G = 1000 is smaller than one sequence of up to 2048 tokens "
        "(workload.lengths.max_len / context)")
    assert "fixed token budget G > 0" in _check(_system(), _wl(token_budget=0, global_batch_seqs=64))


def test_replicas_must_span_the_ranks_and_name_known_kinds():
    assert _check(_system(runs=[RealRun("H", "two_stage", [["A"]])]), _wl()) == (
        "system.real.runs[H].candidates[0]: replicas ['A'] span 1 ranks, workload.num_gpus is 2 "
        "(sum of tp must equal it)")
    assert "unknown replica kind 'C'" in _check(_system(runs=[RealRun("H", "two_stage", [["A", "C"]])]), _wl())
    kinds = [ReplicaKind("A", True, 2048, 3)]
    assert _check(_system(kinds=kinds), _wl()) == (
        "system.real.kinds[A].tp: real mode runs tp 1 or tp = workload.num_gpus 2, got 3")


def test_a_sim_policy_and_too_few_fit_lengths_are_refused():
    assert "has no real mode" in _check(_system("hydraulis"), _wl())
    assert _check(_system(fit_lengths=[64, 128, 4096]), _wl()) == (
        "system.real.fit_lengths: kind 'A' (cap 2048) gets 2 distinct lengths <= its cap, the fit needs >= 3")
