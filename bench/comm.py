"""Price one NCCL collective on a hardware profile: ``mlsys-bench-comm``.

The same numbers every pricer of the harness uses (:mod:`impl.common.collectives`): time,
nccl-tests' algbw and busbw, and the link that bounds it.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from impl.common.collectives import CollOp, collective
from impl.common.errors import ConfigError
from impl.common.hardware import load_hardware


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mlsys-bench-comm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", required=True, help="profile name (conf/hardware/<name>.yaml) or path")
    ap.add_argument("--op", required=True, choices=[o.value for o in CollOp])
    ap.add_argument("--bytes", required=True, type=float, help="buffer bytes (all-gather / reduce-scatter: the whole buffer)")
    ap.add_argument("--ranks", required=True, type=int)
    ap.add_argument("--ranks-per-node", type=int, default=None, help="default: as many as fit on a node")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    try:
        c = collective(a.op, a.bytes, load_hardware(a.hardware), a.ranks, a.ranks_per_node)
    except ConfigError as e:
        print(f"mlsys-bench-comm: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"op": c.op.value, "bytes": c.nbytes, "time_s": c.time_s, "bandwidth_s": c.bandwidth_s,
                          "latency_s": c.latency_s, "algbw_bytes_per_s": c.algbw_bytes_per_s,
                          "busbw_bytes_per_s": c.busbw_bytes_per_s, "bound": c.bound.value,
                          "algorithm": c.algorithm}))
    else:
        print(f"{c.op.value} {c.nbytes:.0f} B on {a.ranks} ranks ({a.hardware}): {c.time_s * 1e6:.1f} us, "
              f"algbw {c.algbw_bytes_per_s / 1e9:.1f} GB/s, busbw {c.busbw_bytes_per_s / 1e9:.1f} GB/s, "
              f"{c.algorithm}, bound by {c.bound.value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
