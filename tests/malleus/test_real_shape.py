"""The real scenarios run the model shape the README states (tiny GPT: 8 layers, d=64, 4
heads, GPT MLP of 4d, vocab 256, seq 64). ``tiny_shape`` once built ``ModelShape``
positionally and skipped ``ffn_hidden``, so vocab and seq_len shifted one field over (vocab
64, seq 32), and the single-process reference used the same wrong shape."""
from __future__ import annotations

from bench.config import compose_config
from bench.validate import typed_workload
from impl.common.models.tiny_gpt import TinyGPT
from impl.common.workloads.pipeline import ModelShape
from impl.malleus.real import tiny_shape

README_SHAPE = dict(name="gpt-tiny", num_layers=8, hidden=64, heads=4, ffn_mult=4, ffn_hidden=0, vocab=256, seq_len=64)


def _workload(name: str):
    cfg = compose_config([f"workload={name}", "system=malleus/malleus", "mode=real"])
    return typed_workload(cfg.workload)


def test_real_workload_runs_the_readme_shape():
    shape = tiny_shape(_workload("malleus_cpu_dp2pp2").model)
    assert shape == ModelShape(**README_SHAPE)
    model = TinyGPT(shape, seed=0)
    assert tuple(model.tok_emb.weight.shape) == (256, 64)
    assert tuple(model.pos_emb.weight.shape) == (64, 64)
    assert len(model.blocks) == 8


def test_tiny_shape_keeps_every_field():
    """Fields that differ from ModelShape's defaults survive (a positional build would shift them)."""
    src = ModelShape(name="x", num_layers=3, hidden=48, heads=6, ffn_mult=2, ffn_hidden=0, vocab=97, seq_len=40)
    assert tiny_shape(src) == src
