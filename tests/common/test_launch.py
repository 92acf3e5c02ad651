"""The one process launcher: rank results come back as plain data, failures as one line."""
from __future__ import annotations

import dataclasses

import pytest

from impl.common.runtime.launch import launch

pytestmark = pytest.mark.real


@dataclasses.dataclass
class NotPlain:
    x: int


def _plain(ctx):
    return {"rank": ctx.rank, "world": ctx.world_size}


def _not_plain(ctx):
    return NotPlain(ctx.rank)


def _fails_on_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    return ctx.rank


def test_results_in_rank_order():
    assert launch(_plain, 2, label="t").results == [{"rank": 0, "world": 2}, {"rank": 1, "world": 2}]


def test_a_result_that_is_not_plain_data_is_one_line_naming_the_rank():
    with pytest.raises(RuntimeError) as e:
        launch(_not_plain, 2, label="t", timeout_s=60)
    msg = str(e.value)
    assert "not plain data" in msg and "rank" in msg and "\n" not in msg


def test_a_failing_rank_is_named():
    with pytest.raises(RuntimeError) as e:
        launch(_fails_on_1, 2, label="t", timeout_s=60)
    assert "rank 1" in str(e.value) and "rank one is broken" in str(e.value)


def _hangs(ctx):
    import time

    if ctx.rank == 1:
        time.sleep(120)  # rank 0 waits in the gather behind it: a hang without the watchdog
    return ctx.rank


if __name__ == "__main__":  # a torchrun rank of the test below
    launch(_hangs, 2, label="t", timeout_s=3)


@pytest.mark.timeout(120)
def test_a_torchrun_rank_past_timeout_s_ends_in_one_line_not_a_hang():
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    # its own session, so a failure here kills the agent and both ranks, not just the agent
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--max-restarts", "0", __file__], cwd=repo, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # 100 s < the 120 s sleep: only the watchdog ends the run in time
        _, stderr = p.communicate(timeout=100)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode != 0
    # either rank's timer may fire first (rank 0 waits in the gather as long as rank 1 sleeps)
    assert re.search(r"t rank [01] failed: TimeoutError: run exceeded timeout_s=3\n", stderr), stderr[-2000:]
