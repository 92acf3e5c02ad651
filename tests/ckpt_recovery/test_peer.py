"""Peer memory: partition-agnostic files held in peer hosts' memory (impl/common/checkpoint/peer.py)
and ``ckpt_recovery_peer`` in the sim (impl/ckpt_recovery/sim/peer.py)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import pytest
import torch

from impl.common.fault_model.spec import GpuLoss, NodeLoss
from impl.ckpt_recovery.sim import peer as sim_peer
from impl.ckpt_recovery.sim.scenario import Scenario, check_sim, fault_metrics
from impl.ckpt_recovery.sim.config import CkptSimKnobs
from impl.ckpt_recovery.system import CkptRecovery
from impl.common.api import ConfigError
from impl.common.checkpoint.fileformat import CheckpointError
from impl.common.checkpoint.layout import cut, cut_state
from impl.common.checkpoint.peer import copy_commit, copy_kill_points, holders, open_from_holders, placement
from impl.common.checkpoint.reshard import load_rank
from impl.common.checkpoint.save import save_serial
from impl.common.checkpoint.store import CheckpointStore
from impl.common.storage.emulator import Storage, paper_profile

from .helpers import tp2_tp1, tp2pp2, trained_state
from .test_sim_local import _hw, _wl

S = 8
NODES = 4  # one emulated node per rank of tp2pp2


class Killed(BaseException):
    pass


@pytest.mark.parametrize("k,nodes", [(1, 2), (1, 5), (2, 4), (3, 4), (2, 9)])
def test_placement_never_on_the_owner_node_and_balanced(k, nodes):
    file_nodes = {f"rank{r:05d}": (r * 7) % nodes for r in range(3 * nodes)}
    pl = placement(file_nodes, k, nodes)
    held = [0] * nodes
    for f, hs in pl.items():
        assert len(hs) == len(set(hs)) == k and file_nodes[f] not in hs, (f, hs)
        held[file_nodes[f]] += 1  # its owner keeps it too (holders())
        for h in hs:
            held[h] += 1
    assert max(held) - min(held) <= 1  # equal-size files: within one file of even


def test_placement_refuses_more_copies_than_other_nodes():
    with pytest.raises(ConfigError, match=r"^peer\.copies: 3 copies off the owner's node need >= 4 nodes, got 3$"):
        placement({"a": 0}, 3, 3)


def _committed(tmp_path, states, lay, metas):
    """Storage commits of ``states`` (step i+1) and, for each, its bytes (the saver's memory)."""
    store = CheckpointStore(tmp_path / "nas", keep=len(states))
    out = []
    for i, st in enumerate(states):
        save_serial(store, i + 1, metas, lay, S, {r: cut_state(st, metas, own) for r, own in lay.ranks.items()},
                    {"consumed_samples": 16 * (i + 1)})
        ck = store.open(i + 1)
        out.append((ck, {f: open(os.path.join(ck.dir, f), "rb").read() for f in ck.manifest["files"]}))
    return store, out


def _holders(ck, k=1):
    return holders({f: rec["rank"] for f, rec in ck.manifest["files"].items()}, k, NODES)


def _load_from(view, layout, peer, nas):
    return {r: load_rank(view.checkpoint, layout, r, locate=view.locator(peer, nas))[0] for r in layout.ranks}


def _assert_state(out, state, metas, layout):
    by = {m.name: m for m in metas}
    for r, own in layout.ranks.items():
        for key, tg in own.items():
            assert torch.equal(out[r][key], cut(state[key], by[key], *tg)), key


def _shm(tmp_path):
    """Holders live in shared memory where there is one (what a holder process maps)."""
    if os.path.isdir("/dev/shm"):
        d = tempfile.mkdtemp(prefix="peer-", dir="/dev/shm")
        _SHM.append(d)
        return d
    return str(tmp_path / "shm")


_SHM: list = []


@pytest.fixture(autouse=True)
def _clean_shm():
    yield
    while _SHM:
        shutil.rmtree(_SHM.pop(), ignore_errors=True)


def _kill_points():
    files = [f"rank{r:05d}.safetensors" for r in range(4)]
    return copy_kill_points(files, holders({f: r for r, f in enumerate(files)}, 1, NODES))


@pytest.fixture(scope="module")
def three_commits(tmp_path_factory):
    states = [trained_state(seed=0, steps=n)[0] for n in (1, 2, 3)]
    _, metas = trained_state()
    lay = tp2pp2(metas)
    _, commits = _committed(tmp_path_factory.mktemp("nas"), states, lay, metas)
    return states, metas, lay, commits


@pytest.mark.parametrize("point", _kill_points())
def test_copy_killed_at_every_point_leaves_old_or_new_readable(tmp_path, three_commits, point):
    states, metas, lay, commits = three_commits
    base = _shm(tmp_path)
    hs = _holders(commits[0][0])
    for ck, data in commits[:2]:  # two copies committed: the next one rotates the oldest away
        copy_commit(base, ck, data, hs)

    def kill(p):
        if p == point:
            raise Killed(p)

    with pytest.raises(Killed):
        copy_commit(base, *commits[2], hs, kill=kill)
    # the new step is readable once each file has a holder past its pointer write
    pts = _kill_points()
    done = {h for h in range(NODES) if pts.index(f"h{h}:after_pointer") <= pts.index(point)}
    committed = all(set(v) & done for v in hs.values())
    view = open_from_holders(base, range(NODES))
    assert view.checkpoint.step == (3 if committed else 2), point
    assert all(s.startswith("peer:") for s in view.sources().values())
    peer, nas = Storage(), Storage()
    _assert_state(_load_from(view, lay, peer, nas), states[2] if committed else states[1], metas, lay)
    assert nas.stats.read_calls == 0 and peer.stats.read_calls > 0
    copy_commit(base, *commits[2], hs)  # the copy is retried and completes
    assert open_from_holders(base, range(NODES)).checkpoint.step == 3


def test_node_loss_reads_survivors_and_storage_only_for_slices_without_a_live_copy(tmp_path):
    state, metas = trained_state()
    lay = tp2pp2(metas)
    store, [(ck, data)] = _committed(tmp_path, [state], lay, metas)
    base = str(tmp_path / "shm")
    hs = _holders(ck, k=1)
    copy_commit(base, ck, data, hs)
    survivors = tp2_tp1(metas)
    # node 3 dead (rank 3 and its holder): every file keeps a live copy (its owner's or a peer's)
    view = open_from_holders(base, [0, 1, 2], reader_node=0, storage_store=store)
    peer, nas = Storage(), Storage()
    _assert_state(_load_from(view, survivors, peer, nas), state, metas, survivors)
    assert nas.stats.read_calls == 0 and all(s.startswith("peer:") for s in view.sources().values())
    # nodes 2 and 3 dead: a file held only there (owner 2, peer 3) comes from storage
    view = open_from_holders(base, [0, 1], storage_store=store)
    orphans = {f for f, h in hs.items() if set(h) <= {2, 3}}
    assert orphans and {f for f, s in view.sources().items() if s == "storage"} == orphans
    peer, nas = Storage(), Storage()
    _assert_state(_load_from(view, survivors, peer, nas), state, metas, survivors)
    assert nas.stats.read_calls > 0 and peer.stats.read_calls > 0
    with pytest.raises(CheckpointError, match="no step readable from live holders"):
        open_from_holders(base, [0, 1])  # without storage nothing covers those files


# ---- sim -------------------------------------------------------------------------------------

def _sc(wl="ckpt_s3_34b", **kw):
    knobs = dataclasses.replace(CkptSimKnobs(), peer_copies=1, storage_profiles=["nas5"], **kw)
    return Scenario("ckpt_recovery", _wl(wl), _hw(), knobs)


def test_host_memory_overflow_is_one_line():
    wl = _wl("ckpt_s4_70b")
    knobs = dataclasses.replace(CkptSimKnobs(), peer_copies=2, host_mem_bytes_per_node=2.5e12)
    with pytest.raises(ConfigError) as e:
        Scenario("ckpt_recovery", wl, _hw(), knobs)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("system.sim.host_mem_bytes_per_node: peer copies do not fit on node")
    assert msg.endswith("> 2500 GB")
    # what it sums: training + snapshot + 2 x held, held = own files + k peers' (S4: DP 1, 4 nodes)
    sc = Scenario("ckpt_recovery", wl, _hw(), dataclasses.replace(knobs, peer_copies=1))
    mem = sim_peer.host_memory(sc.io, sc.base, 1, sc.num_nodes, sc.rank_state, sc.k)
    assert sum(h.held_bytes for h in mem) == pytest.approx(2 * sum(sc.io.save_ours(sc.base).rank_bytes.values()))
    assert all(h.snapshot_bytes == pytest.approx(8 * sc.rank_state) and h.train_bytes == 8 * 100e9 for h in mem)
    sim_peer.check(sc.io, sc.base, 1, sc.num_nodes, sc.rank_state, dataclasses.replace(sc.k, host_mem_bytes_per_node=2.5e12))


def test_bad_peer_knobs():
    wl = _wl("ckpt_s1_7b")
    for policy, kw in (("dcp_async", {"peer_copies": 1}), ("ckpt_recovery", {"peer_copies": 4}),
                       ("ckpt_recovery", {"peer_copies": 1, "local_copies": 1}),
                       ("ckpt_recovery", {"peer_copies": 1, "peer_correlated_frac": 1.5})):
        sysm = CkptRecovery(CkptRecovery.Config(policy=policy, sim=dataclasses.replace(CkptSimKnobs(), **kw)), policy)
        with pytest.raises(ConfigError, match=r"^system\.sim\.(peer_copies|peer_correlated_frac):"):
            check_sim(sysm, wl, _hw(), GpuLoss(ranks=[5]))


def test_sim_node_loss_loads_from_peers_and_a_correlated_loss_counts_storage_slices():
    sc = _sc(peer_correlated_frac=0.25)
    prof = paper_profile("nas5")
    f = fault_metrics(sc, NodeLoss(node=1), prof)
    assert f["storage_slices"] == 0 and f["peer_slices"] > 0 and f["lost_copy_files"] == 0
    # the window: rework counts from the newest *copied* commit (interval / 2 + lag of the peer tier)
    ps = sc.peer_save()
    assert f["t_rework_s"] == pytest.approx(ps.interval_s / 2 + ps.lag_s)
    # correlated: every copy of the files node 1 held gone: all slices from the storage tier's commit
    g = sc.failure(prof, tuple(range(8, 16)), False, 4 * 3600.0, down_nodes=frozenset([1]), copies_lost=True)
    assert g["lost_copy_files"] > 0 and g["peer_slices"] == 0 and g["storage_slices"] == f["peer_slices"]
    assert f["storage_slices_correlated"] == g["storage_slices"]
    assert g["t_rework_s"] == pytest.approx(sc.save(prof).rework_s()) and g["t_rework_s"] > f["t_rework_s"]
    plain = fault_metrics(Scenario("ckpt_recovery", _wl("ckpt_s3_34b"), _hw(),
                                   dataclasses.replace(sc.k, peer_copies=0, peer_correlated_frac=0.0)), NodeLoss(node=1), prof)
    assert g["t_load_s"] == pytest.approx(plain["t_load_s"])
    assert f["t_lost_s"] < plain["t_lost_s"] / 2


def test_sim_copy_gets_the_idle_nic_share_and_training_waits_a_packet_per_transfer():
    sc = _sc("ckpt_s1_7b")
    ps = sc.peer_save()
    wire, f = sc._memo["peer_save"][1:]
    busy, transfers = sim_peer.nic_traffic(sc.base, sc.cm)
    assert 0 < f == busy < 1 and wire > 0 and transfers > 0
    staging = sc.rank_state / sc.k.d2h_bytes_per_s
    copy = wire / (1 - f)
    assert ps.lag_s == pytest.approx(staging + copy)
    steps = -(-copy // sc.base_step_s)
    packet = sim_peer.IB_MTU_BYTES / sc.cm.inter_bw_bytes_per_s
    assert ps.stall_s == pytest.approx(max(0.0, staging - sc.base_step_s) + steps * transfers * packet)
    assert ps.interval_s >= max(ps.lag_s, sc.base_step_s)
