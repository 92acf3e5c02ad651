"""What moves when a plan changes (Malleus's live migration, the authors' code: Hetu
`hetu/graph/switch_exec_graph.*`), as data: a list of transfers.

State units: ``-1`` = embeddings (first stage), ``0..L-1`` = layers, ``L`` = final norm + LM
head (last stage). A GPU of a TP group of size g at TP rank t holds the fraction
[t/g, (t+1)/g) of every unit its stage holds (its TP shard). For each (unit, destination GPU)
the needed fraction is cut at every old holder's shard boundary; each piece is
- reused in place when the destination already holds it,
- else sent by the same-node holder with the fewest bytes assigned so far,
- else by the inter-node holder with the fewest inter-node bytes assigned so far.
Ties go to the lower GPU id, so the result is deterministic.

That is the default ``policy="bandwidth_greedy"`` (HotSPa's hot-switch planner too, the
same Hetu code: separate
intra/inter counters because the two links run concurrently). HotSPa's ablation policies pick
the sender of each (needer, slice) differently; reuse in place is the same for all:
- ``greedy_msgs``: as bandwidth_greedy, but the counters count slices sent (messages), not
  bytes (same-node owners still preferred);
- ``node_aware_rr``: round-robin over the slice's same-node owners, over all owners when no
  owner shares the needer's node;
- ``round_robin``: round-robin over all the slice's owners, nodes ignored;
- ``fcfs``: the first owner (lowest GPU id).
The round-robin cursor is kept per slice (unit, lo, hi), advancing at each needer served.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional

from impl.common.registry import Registry

from .plan import Plan


@dataclass(frozen=True)
class Transfer:
    unit: int
    lo: Fraction  # fraction of the unit's state, [lo, hi)
    hi: Fraction
    src: int
    dst: int
    nbytes: float
    inter_node: bool


def held_units(plan: Plan) -> dict[int, dict[int, tuple[Fraction, Fraction]]]:
    """GPU -> unit -> its shard [lo, hi)."""
    out: dict[int, dict[int, tuple[Fraction, Fraction]]] = {}
    L = plan.num_layers
    for p in plan.pipelines:
        S = p.num_stages
        for j, (g, (a, b)) in enumerate(zip(p.groups, p.layer_ranges())):
            units = list(range(a, b)) + ([-1] if j == 0 else []) + ([L] if j == S - 1 else [])
            grp = plan.groups[g]
            for t, dev in enumerate(grp.gpus):
                sh = (Fraction(t, grp.size), Fraction(t + 1, grp.size))
                out.setdefault(dev, {}).update({u: sh for u in units})
    return out


# A sender picker serves one plan change: ``pick(u, lo, hi, cost_bytes, same, cover)`` names
# the GPU that sends slice [lo, hi) of unit u, given the slice's holders on the needer's node
# (``same``) and all of them (``cover``); it keeps its own counters or cursors across the change.
Picker = Callable[[int, Fraction, Fraction, float, list, list], int]


def _greedy(by_bytes: bool) -> Callable[[], Picker]:
    def make() -> Picker:
        sent: dict[int, float] = {}
        sent_inter: dict[int, float] = {}

        def pick(u, lo, hi, nbytes, same, cover) -> int:
            cost = nbytes if by_bytes else 1.0
            if same:
                src = min(same, key=lambda d: (sent.get(d, 0.0), d))
            else:
                src = min(cover, key=lambda d: (sent_inter.get(d, 0.0), d))
                sent_inter[src] = sent_inter.get(src, 0.0) + cost
            sent[src] = sent.get(src, 0.0) + cost
            return src
        return pick
    return make


def _round_robin(node_aware: bool) -> Callable[[], Picker]:
    def make() -> Picker:
        rr: dict[tuple, int] = {}  # cursor per slice

        def pick(u, lo, hi, nbytes, same, cover) -> int:
            pool = same if (same and node_aware) else cover
            k = rr.get((u, lo, hi), 0)
            rr[(u, lo, hi)] = k + 1
            return pool[k % len(pool)]
        return pick
    return make


def _fcfs() -> Picker:
    return lambda u, lo, hi, nbytes, same, cover: cover[0]


SENDERS: Registry[Callable[[], Picker]] = Registry("policy", "switch policy")
SENDERS.add("bandwidth_greedy", _greedy(by_bytes=True))
SENDERS.add("greedy_msgs", _greedy(by_bytes=False))
SENDERS.add("node_aware_rr", _round_robin(node_aware=True))
SENDERS.add("round_robin", _round_robin(node_aware=False))
SENDERS.add("fcfs", _fcfs)
POLICIES = SENDERS.names()


def plan_migration(old: Plan, new: Plan, unit_bytes: Callable[[int], float],
                   policy: str = "bandwidth_greedy") -> tuple[list[Transfer], dict]:
    """Transfers taking ``old``'s state to where ``new`` needs it, plus a summary. ``policy``
    picks the sender of each piece (module doc); the default is the bandwidth-aware greedy."""
    if policy not in SENDERS:
        raise ValueError(f"switch policy: unknown {policy!r} (one of: {', '.join(POLICIES)})")
    pick = SENDERS.get(policy)()
    have = held_units(old)
    need = held_units(new)
    gpn = new.gpus_per_node
    holders: dict[int, list[tuple[int, Fraction, Fraction]]] = {}
    for dev, units in have.items():
        for u, (lo, hi) in units.items():
            holders.setdefault(u, []).append((dev, lo, hi))
    transfers: list[Transfer] = []
    reused = 0.0
    for dst in sorted(need):
        for u in sorted(need[dst]):
            lo, hi = need[dst][u]
            hs = sorted(holders.get(u, []))
            if not hs:
                raise ValueError(f"unit {u} is held by no GPU of the old plan")
            cuts = sorted({lo, hi} | {c for _, a, b in hs for c in (a, b) if lo < c < hi})
            for a, b in zip(cuts, cuts[1:]):
                cover = [d for d, x, y in hs if x <= a and b <= y]
                nbytes = float(b - a) * unit_bytes(u)
                if dst in cover:
                    reused += nbytes
                    continue
                same = [d for d in cover if d // gpn == dst // gpn]
                src = pick(u, a, b, nbytes, same, cover)
                inter = src // gpn != dst // gpn
                transfers.append(Transfer(u, a, b, src, dst, nbytes, inter))
    recv: dict[int, float] = {}
    send_bytes: dict[int, float] = {}
    for t in transfers:
        recv[t.dst] = recv.get(t.dst, 0.0) + t.nbytes
        send_bytes[t.src] = send_bytes.get(t.src, 0.0) + t.nbytes
    summary = {"transfers": len(transfers), "bytes_moved": sum(t.nbytes for t in transfers),
               "bytes_inter_node": sum(t.nbytes for t in transfers if t.inter_node), "bytes_reused": reused,
               "max_send_bytes": max(send_bytes.values(), default=0.0), "max_recv_bytes": max(recv.values(), default=0.0)}
    return transfers, summary


def migration_time_s(transfers: list[Transfer], intra_bw: float, inter_bw: float, latency_s: float = 0.0) -> float:
    """Each GPU sends and receives in parallel; the busiest endpoint gates (bytes / link bw)."""
    busy: dict[tuple[str, int], float] = {}
    for t in transfers:
        dt = t.nbytes / (inter_bw if t.inter_node else intra_bw)
        for key in (("s", t.src), ("r", t.dst)):
            busy[key] = busy.get(key, 0.0) + dt
    return (max(busy.values()) + latency_s) if busy else 0.0


def buckets(transfers: list[Transfer], bucket_bytes: float) -> list[list[Transfer]]:
    """Rounds of transfers: per (src, dst) pair at most ``bucket_bytes`` per round (bounds the
    extra peak memory of a migration), in a deterministic order every rank computes alike."""
    per_pair: dict[tuple[int, int], list[list[Transfer]]] = {}
    for t in sorted(transfers, key=lambda t: (t.src, t.dst, t.unit, t.lo)):
        lst = per_pair.setdefault((t.src, t.dst), [[]])
        if lst[-1] and sum(x.nbytes for x in lst[-1]) + t.nbytes > bucket_bytes:
            lst.append([])
        lst[-1].append(t)
    rounds: list[list[Transfer]] = []
    for pair in sorted(per_pair):
        for r, b in enumerate(per_pair[pair]):
            while len(rounds) <= r:
                rounds.append([])
            rounds[r].extend(b)
    return rounds
