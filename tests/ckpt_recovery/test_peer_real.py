"""Peer memory, real mode: the peer tier's holder processes (impl/common/checkpoint/holder.py) in
the 4-rank kill-and-recover loop, and its staging / copy / fallback path in one process."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from types import SimpleNamespace

import psutil
import pytest

from impl.ckpt_recovery.real import check_real
from impl.ckpt_recovery.recovery import replan as R
from impl.ckpt_recovery.recovery.supervisor import run
from impl.ckpt_recovery.recovery.trainer import KillAt, PeerSpec, TrainSpec, full_metas
from impl.common.api import ConfigError
from impl.common.checkpoint.holder import HolderSpec, copy_step, drop_node, stage_file
from impl.common.checkpoint.layout import cut_state
from impl.common.checkpoint.peer import holder_root, open_from_holders
from impl.common.checkpoint.reshard import load_rank
from impl.common.checkpoint.save import save_serial
from impl.common.checkpoint.store import CheckpointStore
from impl.common.storage.emulator import Storage, profile

from .helpers import SHAPE, tp2_tp1, tp2pp2, trained_state
from .test_recovery import _system, _wl

SHAPE32 = dataclasses.replace(SHAPE, seq_len=32)
CLUSTER = R.Cluster(num_gpus=4, gpus_per_node=2, tp=2, pp=2, num_layers=4, micro_batches=4, alpha=(1.0, 2.0))
NODE_OF = (0, 0, 1, 1)  # two emulated nodes of two ranks


@pytest.fixture
def shm(tmp_path):
    d = tempfile.mkdtemp(prefix="peer-real-", dir="/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _commit_staged(nas_root, base, state, metas, lay, step=3):
    """A storage commit of ``state`` whose files the savers also staged on their nodes."""
    store = CheckpointStore(nas_root, keep=4)
    save_serial(store, step, metas, lay, 8, {r: cut_state(state, metas, own) for r, own in lay.ranks.items()},
                {"consumed_samples": 8 * step, "node_of_rank": list(NODE_OF)})
    ck = store.open(step)
    for f, rec in ck.manifest["files"].items():
        stage_file(base, NODE_OF[rec["rank"]], step, f, open(os.path.join(ck.dir, f), "rb").read())
    return store, ck


def _spec(base, nas_root, node):
    return HolderSpec(base, node, nas_root, copies=1, num_nodes=2, net=profile("net"))


def test_holders_copy_a_commit_and_a_lost_node_leaves_every_file_on_the_other(tmp_path, shm):
    state, metas = trained_state()
    store, ck = _commit_staged(tmp_path / "nas", shm, state, metas, tp2pp2(metas))
    for n in (0, 1):
        assert copy_step(_spec(shm, store.root, n), ck.step, Storage(profile("net")), Storage())
    drop_node(shm, 1)  # node 1 lost with its GPU: its holder and its staging are gone
    assert not os.path.exists(holder_root(shm, 1))
    view = open_from_holders(shm, [0], reader_node=0, storage_store=store)
    assert view.checkpoint.step == ck.step and set(view.sources().values()) == {"peer:0"}
    survivors = tp2_tp1(metas)
    nas, net, local = Storage(), Storage(), Storage()
    for r in survivors.ranks:
        tensors, _ = load_rank(view.checkpoint, survivors, r, nas, locate=view.locator(net, nas, local, 0))
        assert all((tensors[k] == v).all() for k, v in cut_state(state, metas, survivors.ranks[r]).items())
    assert nas.stats.read_calls == 0 and local.stats.read_calls > 0


def test_a_copy_whose_source_node_died_first_falls_back_to_storage_for_those_files(tmp_path, shm):
    state, metas = trained_state()
    store, ck = _commit_staged(tmp_path / "nas", shm, state, metas, tp2pp2(metas))
    drop_node(shm, 1)  # the window: node 1 died before node 0's holder copied its files
    assert not copy_step(_spec(shm, store.root, 0), ck.step, Storage(), Storage())
    with pytest.raises(Exception, match="no step readable from live holders"):
        open_from_holders(shm, [0])
    # node 0's holder has nothing of this step: the load is the storage path, every read counted
    assert CheckpointStore(holder_root(shm, 0)).committed_steps() == []


@pytest.mark.real
def test_peer_recovery_reads_no_storage_and_equals_the_fault_free_run(tmp_path, shm):
    metas = full_metas(SHAPE32, 5)
    peer = PeerSpec(shm, 1, 2, NODE_OF, (0, 1), profile("net"))
    # saves at steps 4 and 8; step 8 commits at step 9's boundary (10's on a slow host) and its
    # copies land in ms, so the kill at step 11 finds them in node 0's holder (a kill inside
    # that window would load node 1's files from storage: the fallback test above)
    base = dict(shape=SHAPE32, seed=5, stages=R.uniform_stages(2, 2, 4), steps=12, global_batch=8, micro_batches=4,
                ckpt_every=4, splits=8, keep=8)
    o = run(TrainSpec(root=str(tmp_path / "peer"), kill=KillAt(rank=3, at_step=11), peer=peer, **base),
            lambda lost: R.replan(CLUSTER, lost, metas))
    start = o.results[0]["start_step"]
    assert start == max(o.committed_on_disk) == 8
    assert o.peer["lost_nodes"] == [1] and o.peer["live_nodes"] == [0]
    loads = [r["load"] for r in o.results]
    # the survivor on node 1 (its holder died with rank 3) reads node 0's copies over the network
    assert sum(x["slices_peer"] for x in loads) > 0 and sum(x["slices_local"] for x in loads) > 0
    for x in loads:  # every file had a live copy: not one read of the storage tier
        assert set(x["sources"].values()) == {"peer:0"}
        assert x["storage_read_calls"] == 0 and x["slices_storage"] == 0
    # the loss curve after recovery is the fault-free run's from the same commit, float for float
    free = run(TrainSpec(root=str(tmp_path / "peer"), resume=True, resume_step=start,
                         **{**base, "stages": o.relayout.stages, "ckpt_every": 10_000}))
    assert {s: v for s, v in o.losses().items() if s >= start} == free.losses()
    # every holder (node 0's, node 1's, node 1's replacement) is gone once the job ends
    assert len(o.peer["holder_pids"]) == 3
    for pid in o.peer["holder_pids"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_peer_knobs_one_line_each():
    fault = SimpleNamespace(kind="gpu_loss", ranks=[3], at_step=7, mid_save=False, seed=0)
    check_real(_system(peer_copies=1), _wl(), None, fault)
    cases = [(_system("dcp_async", peer_copies=1), _wl(), r"^real\.peer_copies: peer copies hold our split files"),
             (_system(peer_copies=2), _wl(), r"^real\.peer_copies: 2 copies off the owner's node need >= 3 emulated nodes"),
             (_system(peer_copies=1, host_mem_bytes=1e6), _wl(),
              r"^real\.host_mem_bytes: peer copies do not fit: snapshots .* MB > 1 MB of shared memory$"),
             (_system(peer_copies=1, peer_net="ib"), _wl(), r"^real\.peer_net: unknown 'ib'")]
    for system, wl, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            check_real(system, wl, None, fault)
        assert "\n" not in str(e.value)
