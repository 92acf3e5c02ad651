"""The pipeline simulator's compile step and run loop, compiled with numba.

The same algorithm as ``pipeline._compile`` / ``pipeline._run`` (stack resumption, no delay
function), over a :class:`~impl.common.schedule.table.ScheduleTable` instead of ``Action``
lists, with the same float operations in the same order, so every time it produces is
bit-identical to the Python loop (``tests/common/test_sim_engines.py`` checks them against
each other). Why compiled: 1F1B at S=128, N=1024 is 782k actions, and a
Python loop spends ~0.5 us on each.

A schedule the compile step rejects (bad peer, a message sent or received twice, or sent
and never received) returns ``ok = False``; the caller then runs the Python compile, which
names the first bad action, so both engines fail with the same message.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from impl.common.schedule.table import B, RECV_B, RECV_F, SEND_F, W
from impl.common.schedule.table import F as OP_F

# program codes, as in pipeline.py (table op codes are imported above)
COMPUTE, P_SEND_F, P_SEND_B, RECV = 0, 1, 2, 3
# comm model kinds
LATENCY, IN_STREAM, DELEGATED, BLOCKING = 0, 1, 2, 3


@njit(cache=True)
def compile_program(off, op, mb, peer, tf, tb, tw, batch):
    """Table -> program arrays in execution order (batch_p2p: a comm run's receives after its
    sends) and per-stage stats. Returns ok == False on the first invalid action."""
    S = off.size - 1
    L = max(S - 1, 1)
    total = off[S]
    pcode = np.zeros(total, np.int8)
    pdur = np.zeros(total)
    pmsg = np.zeros(total, np.int64)
    porder = np.zeros(total, np.int64)
    busy = np.zeros(S)
    first = np.zeros(S, np.int64)
    last_weight = np.zeros(S, np.int64)
    n_comm = np.zeros(S, np.int64)
    n_send = np.zeros(2 * S, np.int64)  # per in_stream worker: 2s+1 forward, 2s backward
    max_mb = 0  # message ids come from comm ops only (compute ops' ids never index the flags)
    for i in range(total):
        if op[i] >= SEND_F and mb[i] > max_mb:
            max_mb = mb[i]
    size = (max_mb * L + L) * 2
    sent = np.zeros(size, np.int8)
    received = np.zeros(size, np.int8)
    held_k = np.zeros(total, np.int64)
    held_m = np.zeros(total, np.int64)
    n_keys = 2 * L * 64  # grown exactly as pipeline._compile grows it
    ok = True
    for s in range(S):
        t_f, t_b, t_w = tf[s], tb[s], tw[s]
        t_bw = t_b + t_w
        base = off[s]
        n = off[s + 1] - base
        pos = base
        nh = 0
        acc = 0.0
        fst, lw, lc, nc = -1, -1, -1, 0
        for k in range(n):
            i = base + k
            c = op[i]
            if c < SEND_F:
                for h in range(nh):
                    pcode[pos] = RECV
                    pmsg[pos] = held_m[h]
                    porder[pos] = held_k[h]
                    pos += 1
                nh = 0
                d = t_f if c == OP_F else (t_b if c == B else (t_w if c == W else t_bw))
                pcode[pos] = COMPUTE
                pdur[pos] = d
                porder[pos] = k
                pos += 1
                acc += d
                lc = k
                if fst < 0:
                    fst = k
                if c >= W:  # W or BW
                    lw = k
                continue
            if c == SEND_F:
                code, fwd, lk, want = P_SEND_F, 1, s, s + 1
            elif c == RECV_B:
                code, fwd, lk, want = RECV, 0, s, s + 1
            elif c == RECV_F:
                code, fwd, lk, want = RECV, 1, s - 1, s - 1
            else:  # SEND_B
                code, fwd, lk, want = P_SEND_B, 0, s - 1, s - 1
            if peer[i] != want or lk < 0 or lk >= S - 1:
                ok = False
                break
            nc += 1
            m = (mb[i] * L + lk) * 2 + fwd
            if m >= n_keys:
                n_keys += max(n_keys, m + 1 - n_keys)
            if code != RECV:
                if sent[m]:
                    ok = False
                    break
                sent[m] = 1
                n_send[2 * s + fwd] += 1
            else:
                if received[m]:
                    ok = False
                    break
                received[m] = 1
                if batch:
                    held_k[nh] = k
                    held_m[nh] = m
                    nh += 1
                    continue
            pcode[pos] = code
            pmsg[pos] = m
            porder[pos] = k
            pos += 1
        if not ok:
            break
        for h in range(nh):
            pcode[pos] = RECV
            pmsg[pos] = held_m[h]
            porder[pos] = held_k[h]
            pos += 1
        busy[s] = acc
        first[s] = fst if fst >= 0 else n
        last_weight[s] = lw if lw >= 0 else lc
        n_comm[s] = nc
    if ok:
        for j in range(size):
            if sent[j] != received[j]:
                ok = False
                break
    return ok, pcode, pdur, pmsg, porder, busy, first, last_weight, n_comm, n_keys, n_send


@njit(cache=True)
def run_program(off, pcode, pdur, pmsg, porder, n_send, n_keys, n_workers, kind, K, Q, copy_s, cost_f, cost_b):
    """The dataflow over the stages (pipeline._run without a delay function). Unsent messages
    have arrival NaN. Returns flat start/end times indexed like the table (off[s] + schedule
    index), per-stage clock / wait / hol / program position, and per-message tx start / arrival."""
    S = off.size - 1
    L = max(S - 1, 1)
    queued, delegated, blocking, latency = kind == IN_STREAM, kind == DELEGATED, kind == BLOCKING, kind == LATENCY
    total = off[S]
    starts = np.zeros(total)
    ends = np.zeros(total)
    arrival = np.full(n_keys, np.nan)
    tx_start = np.zeros(n_keys)
    waiter = np.full(n_keys, -1, np.int64)
    wfree = np.zeros(n_workers)
    # in_stream: each worker's delivery times, worker b's in done[done_off[b]:done_off[b] + n_done[b]]
    done_off = np.zeros(n_workers + 1, np.int64)
    if queued:
        for b in range(n_workers):
            done_off[b + 1] = done_off[b] + n_send[b]
    done = np.zeros(done_off[n_workers])
    n_done = np.zeros(n_workers, np.int64)
    pc = off[:S].copy()
    clock = np.zeros(S)
    wait_s = np.zeros(S)
    hol_s = np.zeros(S)
    stack = np.zeros(S + n_keys, np.int64)
    top = 0
    for s in range(S - 1, -1, -1):  # stage 0 on top
        stack[top] = s
        top += 1
    while top > 0:
        top -= 1
        s = stack[top]
        base = off[s]
        n = off[s + 1]
        t, wait, hol = clock[s], wait_s[s], hol_s[s]
        wf, wb, cf, cb = 2 * s + 1, 2 * s, cost_f[s], cost_b[s]
        k = n
        for i in range(pc[s], n):
            code = pcode[i]
            x = base + porder[i]
            starts[x] = t
            if code == COMPUTE:
                t += pdur[i]
            elif code == RECV:
                a = pmsg[i]
                arr = arrival[a]
                if np.isnan(arr):  # sleep until the producer sends it
                    waiter[a] = s
                    k = i
                    break
                if arr > t:
                    wait += arr - t
                    t = arr
                if delegated:
                    t += copy_s
            else:
                a = pmsg[i]
                if code == P_SEND_F:
                    b, c = wf, cf
                else:
                    b, c = wb, cb
                if delegated:
                    b = b * K + ((a >> 1) // L) % K
                if queued:
                    nd = n_done[b]
                    if nd >= Q:
                        d = done[done_off[b] + nd - Q]
                        if d > t:  # worker full: head-of-line block
                            hol += d - t
                            t = d
                    tx0 = t if t > wfree[b] else wfree[b]
                elif delegated:
                    t += copy_s
                    tx0 = t if t > wfree[b] else wfree[b]
                elif blocking:
                    tx0 = t if t > wfree[b] else wfree[b]
                else:
                    tx0 = t
                tx1 = tx0 + c
                if not latency:
                    wfree[b] = tx1
                    if queued:
                        done[done_off[b] + n_done[b]] = tx1
                        n_done[b] += 1
                if blocking:
                    hol += tx1 - t
                    t = tx1
                tx_start[a] = tx0
                arrival[a] = tx1
                w = waiter[a]
                if w >= 0:
                    waiter[a] = -1
                    stack[top] = w
                    top += 1
            ends[x] = t
        pc[s] = k
        clock[s] = t
        wait_s[s] = wait
        hol_s[s] = hol
    return starts, ends, clock, wait_s, hol_s, tx_start, arrival, pc - off[:S]
