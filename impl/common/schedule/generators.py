"""Compute-only baseline schedules: ``(num_stages, num_microbatches) -> Schedule``.

They carry no SEND/RECV (add those with :func:`impl.common.schedule.comm.insert_comm`) and
no timing: the simulator or the runtime decides when each op actually runs, keeping only the
per-stage order.

* ``gpipe``: all forwards, then all fused backwards in micro-batch order.
* ``1f1b``: Megatron non-interleaved: stage i runs ``min(S−i−1, N)`` warm-up forwards, then
  alternates F and fused BW, then drains the remaining BWs.
* ``zb``: the delay-blind Zero Bubble baseline with split B/W. Our construction [R]: the same
  greedy list scheduler as ADAPTRA's Alg. 3/4 (:mod:`impl.common.schedule.list_scheduler`), run with unit op
  times and zero link delays, with warm-up quotas :func:`zb_warmup` = Alg. 1 at
  ``x_max = min(N, 2S−1)``, i.e. ``x_i = 2(S−i)−1``: slack 2 on every link and at most 2S−1
  stored activations, within the artifact's ZB memory limit of 2S. Slack 2 (not the 3 that
  ``x_max = 2S`` would give link 0) is what the ZB simulator reference of impl/adaptra/README.md shows: a delay
  of one op time is absorbed, two are not (750/760/880 ms at c = 0/10/20 ms, t = 10 ms). With
  uniform op times, c = 0 and N ≥ 2S−1 this is exactly ADAPTRA's schedule, as the equal
  no-delay times in the paper imply.
* ``zb_uncapped``: the ZB of the paper's own simulator [C] (PipeMorph
  ``pipeline_simulator/policy.py:ZeroBubblePolicy``): the same list scheduler with no warm-up
  quota and no activation cap, B > F > W among ready ops, built once at c = 0. Stage 0 runs
  forwards until its first B arrives, so its stored activations follow the op times, not 2S−1.
  With uniform op times and N ≥ 2S−1 it is exactly ``zb`` (the first B reaches stage i after
  ``2(S−i)−1`` forwards either way); with tB > tF it stores more and absorbs more delay. The
  artifact builds it with the profiled op times: :func:`zero_bubble_uncapped` takes them
  (the sim system passes the stage costs); the ``(S, N)`` generator uses unit times.
"""
from __future__ import annotations

from typing import Callable

from impl.common.api import ConfigError
from impl.common.schedule.ir import Action, Op, Schedule
from impl.common.schedule.list_scheduler import build_schedule
from impl.common.schedule.warmup import initial_warmup


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs F0..F(N−1) then BW0..BW(N−1)."""
    _check_sizes(num_stages, num_microbatches)
    n = num_microbatches
    row = [Action(Op.F, j) for j in range(n)] + [Action(Op.BW, j) for j in range(n)]
    return {s: list(row) for s in range(num_stages)}


def one_f_one_b_warmup(num_stages: int, num_microbatches: int) -> list[int]:
    """Megatron's warm-up forward counts ``min(S−i−1, N)`` (the first steady F makes it S−i in flight)."""
    return [min(num_stages - i - 1, num_microbatches) for i in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Megatron non-interleaved 1F1B with fused backward (BW)."""
    _check_sizes(num_stages, num_microbatches)
    n = num_microbatches
    out: Schedule = {}
    for s, w in enumerate(one_f_one_b_warmup(num_stages, n)):
        row = [Action(Op.F, j) for j in range(w)]
        for k in range(n - w):
            row += [Action(Op.F, w + k), Action(Op.BW, k)]
        row += [Action(Op.BW, j) for j in range(n - w, n)]
        out[s] = row
    return out


def zb_warmup(num_stages: int, num_microbatches: int) -> list[int]:
    """ZB baseline warm-up quotas: Alg. 1 at ``x_max = min(N, 2S−1)`` (see module docstring)."""
    _check_sizes(num_stages, num_microbatches)
    return initial_warmup(num_stages, min(num_microbatches, 2 * num_stages - 1))


def zero_bubble(num_stages: int, num_microbatches: int) -> Schedule:
    """Delay-blind ZB schedule (B/W split) from the list scheduler with unit op times, c = 0."""
    S = num_stages
    warmup = zb_warmup(S, num_microbatches)
    ones = [1.0] * S
    return build_schedule(ones, ones, ones, [0.0] * (S - 1), warmup,
                          num_microbatches=num_microbatches, steps_per_op=1)


def zero_bubble_uncapped(num_stages: int, num_microbatches: int, tF=None, tB=None, tW=None, *,
                         steps_per_op: int = 30) -> Schedule:
    """The paper simulator's delay-blind ZB: no activation cap, built with these op times
    (unit times when omitted), c = 0 (see module docstring)."""

    _check_sizes(num_stages, num_microbatches)
    S = num_stages
    ones = [1.0] * S
    return build_schedule(ones if tF is None else tF, ones if tB is None else tB, ones if tW is None else tW,
                          [0.0] * (S - 1), [1] * S, num_microbatches=num_microbatches,
                          steps_per_op=steps_per_op, wait_first_backward=False, limit_inflight=False)


GENERATORS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb": zero_bubble,
    "zb_uncapped": zero_bubble_uncapped,
}


def generate(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Look up a generator by name and run it; unknown names and bad sizes raise ConfigError."""
    if name not in GENERATORS:
        raise ConfigError(f"schedule {name!r} is unknown; choose one of {sorted(GENERATORS)}")
    return GENERATORS[name](num_stages, num_microbatches)
