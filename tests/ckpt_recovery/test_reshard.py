"""Resharded load: bit-exact, each split read exactly once (impl/ckpt_recovery/README.md, "Tests")."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from impl.common.checkpoint.layout import cut_state, gather_state, split_range
from impl.common.checkpoint.plan import format_read_plan, key_index, read_plan
from impl.common.checkpoint.reshard import load_rank
from impl.common.checkpoint.save import rng_from_json, rng_to_json, save_serial
from impl.common.checkpoint.store import CheckpointStore
from impl.common.storage.emulator import Storage

from .helpers import tp1, tp2, tp2_tp1, tp2pp2, trained_state

S = 8
CHANGES = {"tp2pp2->[tp2|tp1]": (tp2pp2, tp2_tp1), "tp2pp2->[tp2|tp1] split 1": (tp2pp2, lambda m: tp2_tp1(m, 1)),
           "tp2->tp1": (tp2, tp1), "tp2pp2->tp2": (tp2pp2, tp2), "[tp2|tp1]->tp2pp2": (tp2_tp1, tp2pp2)}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_bit_exact_reshard_each_split_once(tmp_path, change):
    old_fn, new_fn = CHANGES[change]
    state, metas = trained_state(steps=2)
    old, new = old_fn(metas), new_fn(metas)
    rng = torch.Generator().manual_seed(7).get_state()
    sched = {"last_epoch": 2, "base_lrs": [1e-3], "_last_lr": [9.5e-4]}
    store = CheckpointStore(tmp_path)
    save_serial(store, 2, metas, old, S, {r: cut_state(state, metas, o) for r, o in old.ranks.items()},
                {"consumed_samples": 32, "rng": rng_to_json(rng), "scheduler": sched})
    ck = store.open()
    locs, covered = {}, Counter()
    for r in new.ranks:
        storage = Storage()
        locs[r], st = load_rank(ck, new, r, storage, metas=metas)
        covered.update((r, *c) for c in st.covered)
        assert st.bytes_read - st.bytes_needed == sum(_hdr(ck, f) for f in _files(ck, new, r))  # headers only
        # one request per file header plus one per block; blocks <= split indices needed per file
        assert st.blocks <= st.read_calls <= st.files + st.blocks
        assert st.blocks <= st.files * (S + 1)  # S split indices + the replicated run, not tensors x overlaps
    for r, own in new.ranks.items():  # each needed split read exactly once by its rank
        for k, tg in own.items():
            m = next(x for x in metas if x.name == k)
            for j in split_range(tg, S, m):
                assert covered[(r, k, j)] == 1
    back = gather_state(locs, metas, new)
    assert back.keys() == state.keys()
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k
    assert torch.equal(rng_from_json(ck.extra["rng"]), rng) and ck.extra["scheduler"] == sched
    assert ck.extra["consumed_samples"] == 32


def _files(ck, layout, r):
    from impl.common.checkpoint.plan import files_needed

    return files_needed(ck.metas, layout, r, ck.splits, ck.manifest["files"])


def _hdr(ck, f):
    import os

    with open(os.path.join(ck.dir, f), "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def test_needed_splits_of_a_split_index_are_one_block(tmp_path):
    """TP2xPP2 -> TP1 over all layers: the single new rank needs every split of every file; the
    ordering (split index, then model order) makes each file one block (S reads would be the
    worst case)."""
    state, metas = trained_state()
    old = tp2pp2(metas)
    store = CheckpointStore(tmp_path)
    save_serial(store, 1, metas, old, S, {r: cut_state(state, metas, o) for r, o in old.ranks.items()}, {})
    ck = store.open()
    _, st = load_rank(ck, tp1(metas), 0)
    assert st.blocks == st.files == 4 and st.read_calls == 4  # header + rest of the file: one stream each
    # new stage [TP2 | TP1] rank 2 (layers 3-4 + head) from stage 1's files (layers 2-4):
    # one block per split index per file, not one per tensor
    new = tp2_tp1(metas)
    from impl.common.checkpoint.fileformat import parse_header
    import os

    hdrs = {}
    for f in ck.manifest["files"]:
        raw = open(os.path.join(ck.dir, f), "rb").read()
        hdrs[f] = parse_header(raw, f, len(raw))[1]
    blocks = read_plan(ck.metas, new, 2, S, key_index(hdrs, ck.manifest["files"]))
    per_file = Counter(b.file for b in blocks)
    assert per_file["rank00002.safetensors"] <= S and per_file["rank00003.safetensors"] <= S
    assert len(blocks) < sum(len(b.needs) for b in blocks) / 4, format_read_plan(blocks)
