"""One-job console summary (the side-by-side table is bench.compare's)."""
from __future__ import annotations


def _fmt(value: float) -> str:
    a = abs(value)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def print_record(record: dict) -> None:
    head = (f"[{record['status']}] {record['system']} mode={record['mode']} ({'simulated' if record['mode'] == 'sim' else 'measured'})"
            f" experiment={record['experiment']} workload={record['workload']} hardware={record['hardware']}"
            f" fault={record['fault']}")
    print(head)
    ran = ((record.get("info") or {}).get("execution") or {}).get("label")
    if ran:
        print(f"  ran on: {ran}")
    if record.get("error"):
        print(f"  error: {record['error']}")
        for frame in (record.get("error_frames") or [])[-3:]:
            print(f"    at {frame}")
        if record.get("error_log"):
            print(f"  traceback: {record['error_log']}")
    for reason in record.get("invalid_reasons") or []:
        print(f"  invalid: {reason}")
    for name, m in sorted(record.get("metrics", {}).items()):
        spread = f" [p10 {_fmt(m['p10'])}, p90 {_fmt(m['p90'])}, n={m['n']}]" if m.get("n", 1) > 1 else ""
        print(f"  {name:<32} {_fmt(m['value']):>12} {m['unit']}{spread}")
    print(f"  record: {record['run_id']}")
