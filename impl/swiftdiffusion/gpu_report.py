"""The gpu/swiftdiffusion_sd15 preset's figure hook: ours beside the paper's figures
(``impl/swiftdiffusion/paper.yaml``, entries named ``gpu_sd15_*``), printed and kept as markdown."""
from __future__ import annotations

import pathlib

from impl.common.papers import paper_entries

# (paper entry, scenario of the record, our metric)
ROWS = (("gpu_sd15_bal_vs_diffusers", "bal", "speedup_vs_diffusers"),
        ("gpu_sd15_diffusers_load_fuse", "bal", "diffusers_load_fuse_s"),
        ("gpu_sd15_direct_merge", "lora_api", "direct_merge_s"))
# more of ours, no paper number beside them
OURS = (("bal", "latency_s"), ("bal", "latency_diffusers_s"), ("bal", "latency_sync_merge_s"),
        ("bal", "speedup_vs_diffusers_model"), ("bal", "diffusers_unfuse_unload_s"),
        ("bal", "max_rel_diff_diffusers_pipeline_vs_sync"), ("lora_api", "diffusers_load_fuse_s"),
        ("lora_api", "direct_vs_load_fuse_x"))


def _paper(e: dict) -> str:
    x = "x" if e["unit"] == "x" else f" {e['unit']}"
    return f"{e['value']:g}-{e['high']:g}{x}" if e.get("high") is not None else f"{e['value']:g}{x}"


def figure(records: list, out_dir) -> list:
    by = {}
    for r in records:
        if r.get("status") in ("ok", "invalid"):
            by[(r.get("config") or {}).get("workload", {}).get("scenario")] = r

    def ours(scenario: str, metric: str) -> str:
        m = by.get(scenario, {}).get("metrics", {}).get(metric)
        return "—" if m is None else f"{m['value']:.4g} {m.get('unit', '')}".strip()

    paper = paper_entries("swiftdiffusion")
    lines = ["| figure | paper | ours |", "|---|---|---|"]
    for name, scenario, metric in ROWS:
        e = paper.get(name)
        if e is not None:
            lines.append(f"| {metric}: {e['setting']} | {_paper(e)} ({e['source']}) | {ours(scenario, metric)} |")
    for scenario, metric in OURS:
        lines.append(f"| {scenario} {metric} | | {ours(scenario, metric)} |")
    where = {s: f"{r.get('info', {}).get('device')} {r.get('info', {}).get('gpu_name') or ''} "
                f"{r.get('info', {}).get('dtype', '')} ({r.get('status')})" for s, r in by.items()}
    lines.append(f"| device | | {'; '.join(f'{s}: {w}' for s, w in where.items())} |")
    text = "\n".join(lines)
    print(text)
    path = pathlib.Path(out_dir) / "gpu_swiftdiffusion_sd15.md"
    path.write_text(text + "\n")
    return [path]
