"""``mlsys-bench-comm``: the JSON object is the collectives module's result, the human line
names the bound, bad input is one error line and exit 2."""
from __future__ import annotations

import json

from bench.comm import main
from impl.common.collectives import collective
from impl.common.hardware import load_hardware


def test_json_is_the_module_result(capsys):
    assert main(["--hardware", "a100-80g", "--op", "all_reduce", "--bytes", str(2 ** 30), "--ranks", "16",
                 "--ranks-per-node", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = collective("all_reduce", 2 ** 30, load_hardware("a100-80g"), 16, 8)
    assert {"time_s", "algbw_bytes_per_s", "busbw_bytes_per_s", "bound"} <= set(out)
    assert out["time_s"] == c.time_s and out["busbw_bytes_per_s"] == c.busbw_bytes_per_s and out["bound"] == "nic"


def test_human_line(capsys):
    assert main(["--hardware", "h100-sxm", "--op", "send_recv", "--bytes", "1e6", "--ranks", "2",
                 "--ranks-per-node", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "bound by nic" in line and "busbw" in line


def test_bad_placement_is_one_line(capsys):
    assert main(["--hardware", "h100-sxm", "--op", "all_reduce", "--bytes", "1e6", "--ranks", "12",
                 "--ranks-per-node", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlsys-bench-comm: error:") and "ranks_per_node" in err and "\n" not in err
