"""Checkpoint format and commit protocol (impl/ckpt_recovery/README.md, "Tests")."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from impl.common.api import ConfigError
from impl.common.checkpoint.fileformat import CheckpointError
from impl.common.checkpoint.layout import CheckpointLayout, TensorMeta, cut, cut_state, join, local_splits
from impl.common.checkpoint.reshard import load_rank
from impl.common.checkpoint.save import rng_from_json, rng_to_json, save_serial
from impl.common.checkpoint.store import CheckpointStore, kill_points, step_name

from .helpers import tp2, tp2pp2, trained_state

S = 8


class Killed(BaseException):
    pass


def _locals(state, metas, layout):
    return {r: cut_state(state, metas, own) for r, own in layout.ranks.items()}


def _extra(step):
    return {"consumed_samples": 16 * step, "rng": rng_to_json(torch.Generator().manual_seed(step).get_state()),
            "scheduler": {"last_epoch": step, "_last_lr": [1e-3]}}


def _load_all(store, layout, step=None):
    ck = store.open(step)
    out = {r: load_rank(ck, layout, r, store.storage)[0] for r in layout.ranks}
    return ck, out


def test_fused_cut_and_splits_are_inverse():
    m = TensorMeta("qkv", (24, 5), "float32", dim=0, fused=3)
    x = torch.arange(120.).reshape(24, 5)
    halves = [cut(x, m, t, 2) for t in range(2)]
    # each TP rank holds its q, k and v rows: piece p, rows [t*4, (t+1)*4)
    assert torch.equal(halves[1][:4], x[4:8]) and torch.equal(halves[1][4:8], x[12:16])
    assert torch.equal(join(halves, m), x)
    sp = local_splits(halves[0], m, (0, 2), 4)
    assert sorted(sp) == [0, 1] and torch.equal(join([sp[0], sp[1]], m), halves[0])
    row = TensorMeta("o", (4, 8), "float32", dim=1)
    y = torch.arange(32.).reshape(4, 8)
    assert torch.equal(cut(y, row, 1, 4), y[:, 2:4])  # row-parallel: its own (input) dim


def test_roundtrip_files_are_plain_safetensors_and_each_split_written_once(tmp_path):
    state, metas = trained_state()
    lay = tp2pp2(metas)
    store = CheckpointStore(tmp_path)
    save_serial(store, 1, metas, lay, S, _locals(state, metas, lay), _extra(1))
    ck = store.open()
    keys = [(n, j) for rec in ck.manifest["files"].values() for (n, j, _) in rec["keys"].values()]
    assert len(keys) == len(set(keys))  # each split once (lowest owning rank)
    want = {(m.name, j) for m in metas for j in (range(S) if m.dim is not None else [None])}
    assert set(keys) == want
    loaded = load_file(os.path.join(ck.dir, "rank00002.safetensors"))  # the stock reader agrees
    assert loaded and all(v.dtype == torch.float32 for v in loaded.values())
    _, out = _load_all(store, lay)
    for r, own in lay.ranks.items():
        for k, (t, g) in own.items():
            assert torch.equal(out[r][k], cut(state[k], next(m for m in metas if m.name == k), t, g))
    assert torch.equal(rng_from_json(ck.extra["rng"]), torch.Generator().manual_seed(1).get_state())


def test_duplicate_knob_writes_replicas(tmp_path):
    state, metas = trained_state()
    lay = tp2pp2(metas)
    store = CheckpointStore(tmp_path)
    save_serial(store, 1, metas, lay, S, _locals(state, metas, lay), _extra(1), duplicate=True)
    ck = store.open()
    n_keys = sum(len(r["keys"]) for r in ck.manifest["files"].values())
    once = sum(1 for m in metas for _ in (range(S) if m.dim is not None else [None]))
    assert n_keys > once  # replicated tensors written by both TP ranks
    _, out = _load_all(store, tp2(metas))
    assert torch.equal(out[0]["param/norm.weight"], state["param/norm.weight"])


@pytest.mark.parametrize("point", kill_points(4))
def test_crash_at_every_kill_point_loads_old_or_new_never_a_mix(tmp_path, point):
    old_state, metas = trained_state(seed=0)
    new_state, _ = trained_state(seed=0, steps=2)
    lay = tp2pp2(metas)
    store = CheckpointStore(tmp_path)
    save_serial(store, 1, metas, lay, S, _locals(old_state, metas, lay), _extra(1))
    save_serial(store, 2, metas, lay, S, _locals(new_state, metas, lay), _extra(2))

    def kill(p):
        if p == point:
            raise Killed(p)

    crashing = CheckpointStore(tmp_path, kill=kill)
    newer, _ = trained_state(seed=0, steps=3)
    with pytest.raises(Killed):
        save_serial(crashing, 3, metas, lay, S, _locals(newer, metas, lay), _extra(3))
    fresh = CheckpointStore(tmp_path)  # a restarted job
    ck, out = _load_all(fresh, lay)
    assert ck.step in (2, 3)
    expect = {2: new_state, 3: newer}[ck.step]
    committed = point in ("after_pointer", "mid_rotation", "after_rotation")
    assert ck.step == (3 if committed else 2), point
    by = {m.name: m for m in metas}
    for r, own in lay.ranks.items():
        for k, tg in own.items():
            assert torch.equal(out[r][k], cut(expect[k], by[k], *tg)), (point, k)
    assert ck.extra["consumed_samples"] == 16 * ck.step
    # the next save after the crash works and rotation keeps 2 copies
    save_serial(fresh, 4, metas, lay, S, _locals(newer, metas, lay), _extra(4))
    assert fresh.latest() == 4 and len(fresh.committed_steps()) == 2


def test_flipped_byte_is_a_checksum_error_naming_the_file(tmp_path):
    state, metas = trained_state()
    lay = tp2pp2(metas)
    store = CheckpointStore(tmp_path)
    save_serial(store, 1, metas, lay, S, _locals(state, metas, lay), _extra(1))
    p = os.path.join(store.open().dir, "rank00001.safetensors")
    raw = bytearray(open(p, "rb").read())
    raw[-100] ^= 0x01
    open(p, "wb").write(raw)
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors: checksum mismatch in key"):
        _load_all(store, lay)
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors: checksum mismatch"):
        store.verify_files(store.open())


def _two_checkpoints(tmp_path):
    state, metas = trained_state()
    lay = tp2pp2(metas)
    store = CheckpointStore(tmp_path)
    for s in (1, 2):
        save_serial(store, s, metas, lay, S, _locals(state, metas, lay), _extra(s))
    return store, state, metas, lay


def _still_loadable(store, lay, state, metas):
    ck, skipped = store.open_latest_valid()
    assert ck.step == 1 and len(skipped) == 1
    _, out = _load_all(store, lay, step=1)
    assert torch.equal(out[0]["param/tok_emb.weight"], state["param/tok_emb.weight"])


def test_manifest_naming_a_missing_file(tmp_path):
    store, state, metas, lay = _two_checkpoints(tmp_path)
    os.unlink(os.path.join(tmp_path, step_name(2), "rank00003.safetensors"))
    with pytest.raises(CheckpointError, match=r"step00000002/rank00003\.safetensors: missing \(named by the manifest\)"):
        store.open()
    _still_loadable(store, lay, state, metas)


def test_truncated_safetensors(tmp_path):
    store, state, metas, lay = _two_checkpoints(tmp_path)
    p = os.path.join(tmp_path, step_name(2), "rank00000.safetensors")
    os.truncate(p, os.path.getsize(p) - 10)
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors: truncated or rewritten \(\d+ bytes, manifest says \d+\)"):
        store.open()
    _still_loadable(store, lay, state, metas)


def test_checkpoint_of_another_model_shape(tmp_path):
    store, state, metas, lay = _two_checkpoints(tmp_path)
    other = [TensorMeta(m.name, (m.shape[0] * 2, *m.shape[1:]), m.dtype, m.dim) if m.name == "param/head.weight" else m
             for m in metas]
    with pytest.raises(CheckpointError, match=r"tensor param/head\.weight is float32\[256, 64\] in the checkpoint, "
                                              r"the model expects float32\[512, 64\]"):
        load_rank(store.open(), lay, 0, metas=other)


def test_splits_not_divisible_by_a_tp_degree(tmp_path):
    store, state, metas, lay = _two_checkpoints(tmp_path)
    three = CheckpointLayout({0: {m.name: ((0, 3) if m.dim is not None else (0, 1)) for m in metas}})
    with pytest.raises(ConfigError, match=r"checkpoint\.splits: S=8 is not divisible by TP degree 3 \(rank 0"):
        load_rank(store.open(), three, 0)
    with pytest.raises(ConfigError, match=r"S=6 is not divisible by TP degree 4"):
        four = CheckpointLayout({r: {m.name: ((r, 4) if m.dim is not None else (0, 1)) for m in metas} for r in range(4)})
        save_serial(CheckpointStore(tmp_path / "b"), 1, metas, four, 6, {}, {})
    _, out = _load_all(store, lay)  # the good checkpoint is untouched
    assert out


def test_no_pickle_anywhere(tmp_path):
    """A checkpoint directory holds only JSON and safetensors; the loader never imports pickle's loads."""
    store, *_ = _two_checkpoints(tmp_path)
    for d in store.committed_steps():
        for f in os.listdir(os.path.join(tmp_path, step_name(d))):
            assert f.endswith((".safetensors", ".json")), f
        json.load(open(os.path.join(tmp_path, step_name(d), "manifest.json")))
    import impl.common.checkpoint as pkg

    d = os.path.dirname(pkg.__file__)
    src = "".join(open(os.path.join(d, f)).read() for f in os.listdir(d) if f.endswith(".py"))
    assert "import pickle" not in src and "torch.load(" not in src and "pickle.load" not in src
