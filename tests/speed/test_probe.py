"""``mlsys-bench-probe`` on a machine without CUDA: one line and exit 2; the probe file it writes
reads back as kernel tables (the shared file's format)."""
from __future__ import annotations

import pytest
import torch

from bench.probe import main
from impl.common.megatron.kernels import gemm_s, tables_from_jsonl


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_probe_without_cuda_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--quick", "--output", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mlsys-bench-probe: error: no CUDA device")
    assert not (tmp_path / "p.yaml").exists()


def test_probe_rows_read_back_as_tables(tmp_path):
    import json

    rows = [{"kind": "env", "gpu": "x"}]
    for m in (128, 256, 512):
        for tag, (mm, nn, kk) in (("fwd", (m, 1024, 512)), ("dgrad", (m, 512, 1024)), ("wgrad", (1024, 512, m))):
            rows.append({"kind": "gemm", "shape": f"t_{tag}", "m": mm, "n": nn, "k": kk, "s": 1e-6 * (mm * nn * kk) ** 0.5})
    rows.append({"kind": "attn", "s": 1024, "heads": 32, "head_dim": 128, "fwd_s": 1e-4, "fwdbwd_s": 4e-4})
    rows.append({"kind": "attn", "s": 2048, "heads": 32, "head_dim": 128, "fwd_s": 3e-4, "fwdbwd_s": 1.1e-3})
    f = tmp_path / "probe.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = tables_from_jsonl(f)
    assert float(gemm_s(t, 256, 1024, 512)) == pytest.approx(1e-6 * (256 * 1024 * 512) ** 0.5)
    assert float(gemm_s(t, 1024, 512, 256)) == pytest.approx(1e-6 * (1024 * 512 * 256) ** 0.5)  # a wgrad shape
    assert t.attn[0].bwd_s == pytest.approx([3e-4, 8e-4])
