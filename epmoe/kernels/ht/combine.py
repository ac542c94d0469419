"""The `ht` combine: one kernel whose programs take items by ticket (`_combine_kernel`).

A remote item reduces rows received from a peer (their local results, fp32, top-k weights) into one row
per (token, rank), stores it into that peer's combine region and stamps the item's ready flag there with
the epoch. A local item, handed out about `combine_lag` waves of tickets later, waits for the ready flags
of its tokens' partial rows and writes out[t] = its own local results (reduced the same way) + the peers'
partial rows: the final sum overlaps the transfer, and this rank's own partial rows never go through
memory. Ranks emulated in one process, which run in turn, launch the remote half on every rank and then
the local half.

Shape letters: T tokens on this rank, D hidden size, K top-k, R ranks, C capacity, P = R*C receive rows,
N batch rows, NI items per source rank (`combine_items`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..sync import DeviceWait, peer_ptr, spin_until
from .buffers import HtBuffers
from .launch import HtLaunch


@triton.jit
def _pairs_of_rows(pos_ptr, w_ptr, p, smask, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """pos [ROWS, BLOCK_K] (batch row of each pair, -1 none) and weights of received rows p where smask."""
    kk = tl.arange(0, BLOCK_K)
    pair = smask[:, None] & (kk < K)[None, :]
    at = p.to(tl.int64)[:, None] * K + kk[None, :]
    return tl.load(pos_ptr + at, mask=pair, other=-1), tl.load(w_ptr + at, mask=pair, other=0.0)


@triton.jit
def _weighted_chunk(y_ptr, pos_RK, w_RK, c, cmask, D: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                    CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """[ROWS, CHUNK] fp32: sum_k w[i, k] * y[pos[i, k], c] (pos -1: none, k ascending); the K gathered
    loads are independent of each other (all in flight at once)."""
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    for k in tl.static_range(K):
        pick = (kk == k)[None, :]
        pos = tl.sum(tl.where(pick, pos_RK, 0), axis=1)
        w = tl.sum(tl.where(pick, w_RK, 0.0), axis=1)
        y = tl.load(y_ptr + tl.maximum(pos, 0).to(tl.int64)[:, None] * D + c[None, :],
                    mask=(pos >= 0)[:, None] & cmask[None, :], other=0.0)
        acc += w[:, None] * y.to(tl.float32)
    return acc


@triton.jit
def _combine_remote_item(y_ptr, pos_ptr, w_ptr, comb_peers, ready_peers, r, i, count, parity, epoch, rank,
                         R: tl.constexpr, C, NI, D: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                         CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """Item i of the rows received from rank r (slots [i * ROWS, (i + 1) * ROWS) below count): each
    row's weighted local results, rounded to y's dtype, stored into r's combine region at (this rank,
    slot); then ready[rank, i] = epoch on r (release, system scope)."""
    s = i * ROWS + tl.arange(0, ROWS)
    smask = s < count
    pos_RK, w_RK = _pairs_of_rows(pos_ptr, w_ptr, r * C + s, smask, K, BLOCK_K)
    dst = peer_ptr(comb_peers, r, y_ptr.dtype.element_ty) + ((parity * R + rank) * C + s).to(tl.int64)[:, None] * D
    cols = tl.arange(0, CHUNK)
    for c0 in tl.static_range(0, D, CHUNK):
        c = c0 + cols
        cmask = c < D
        acc = _weighted_chunk(y_ptr, pos_RK, w_RK, c, cmask, D, K, BLOCK_K, CHUNK, ROWS)
        tl.store(tl.multiple_of(dst + c[None, :], [1, 16]), acc.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=smask[:, None] & cmask[None, :])
    tl.debug_barrier()  # every thread's stores are issued before the one release below
    tl.atomic_xchg(peer_ptr(ready_peers, r, tl.int64) + rank * NI + i, epoch, sem="release", scope="sys")


@triton.jit
def _wait_partials(slot_ptr, ready_ptr, j, T, epoch, rank, err_ptr, timeout_ns, R: tl.constexpr, NI,
                   ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    """Spin until every peer r has stamped (ready[r, item] >= epoch) the items holding the partial rows
    of this rank's tokens [j * ROWS, (j + 1) * ROWS) below T. A token's slot at r rises with t, so these
    are the items from the first sent token's slot to the last's: one wait each. Scalar loads and
    runtime loops (reducing a vector of slots here cost ~80 registers a thread; loops unrolled over
    rows and peers took minutes to compile at R 8 and small D)."""
    first = j * ROWS
    end = tl.minimum(first + ROWS, T)
    for r in tl.static_range(R):
        if r != rank:
            a = first  # the item's first token sent to r (a = end - 1 if none)...
            lo = tl.load(slot_ptr + a.to(tl.int64) * R + r)
            while (lo < 0) & (a + 1 < end):
                a += 1
                lo = tl.load(slot_ptr + a.to(tl.int64) * R + r)
            b = end - 1  # ...and its last (b = a if none)
            hi = tl.load(slot_ptr + b.to(tl.int64) * R + r)
            while (hi < 0) & (b > a):
                b -= 1
                hi = tl.load(slot_ptr + b.to(tl.int64) * R + r)
            if lo >= 0:
                for item in range(lo // ROWS, hi // ROWS + 1):
                    spin_until(ready_ptr + r * NI + item, epoch, err_ptr, timeout_ns, INTERPRET)


@triton.jit
def _combine_local_item(y_ptr, pos_ptr, w_ptr, slot_ptr, comb_ptr, out_ptr, j, T, parity, rank,
                        R: tl.constexpr, C, D: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                        CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """Item j of this rank's tokens (t in [j * ROWS, (j + 1) * ROWS) below T), once the peers' partial
    rows are here (`_wait_partials`): out[t] = (its own weighted local results, rounded to y's dtype) +
    the peers' partial rows in rank order, fp32. Slots are read as per-rank vectors (reductions over a
    [ROWS, R] tile cost registers)."""
    t = j * ROWS + tl.arange(0, ROWS)
    tmask = t < T
    t64 = t.to(tl.int64)
    own = tl.load(slot_ptr + t64 * R + rank, mask=tmask, other=-1)
    pos_RK, w_RK = _pairs_of_rows(pos_ptr, w_ptr, rank * C + own, own >= 0, K, BLOCK_K)
    cols = tl.arange(0, CHUNK)
    for c0 in tl.static_range(0, D, CHUNK):
        c = c0 + cols
        cmask = c < D
        acc = _weighted_chunk(y_ptr, pos_RK, w_RK, c, cmask, D, K, BLOCK_K, CHUNK, ROWS)
        acc = acc.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
        for r in tl.static_range(R):
            s_r = tl.load(slot_ptr + t64 * R + r, mask=tmask & (tl.full([ROWS], r, tl.int32) != rank), other=-1)
            row_at = ((parity * R + r) * C + tl.maximum(s_r, 0)).to(tl.int64)
            part = tl.load(comb_ptr + row_at[:, None] * D + c[None, :], mask=(s_r >= 0)[:, None] & cmask[None, :],
                           other=0.0, cache_modifier=".cg")
            acc += part.to(tl.float32)
        tl.store(out_ptr + t64[:, None] * D + c[None, :], acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=tmask[:, None] & cmask[None, :])


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, count_ptr, slot_ptr, seq_ptr, comb_ptr, comb_peers, ready_ptr, ready_peers,
                    control_ptr, out_ptr, T, rank, lag, R: tl.constexpr, C, NI, D: tl.constexpr, K: tl.constexpr,
                    BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, REMOTE: tl.constexpr,
                    LOCAL: tl.constexpr, TIMEOUT_NS: tl.constexpr, INTERPRET: tl.constexpr):
    """Programs take tickets (control[0], counted up) in the order: iteration i = ticket // R holds the
    remote items i of the R - 1 peers (rank + 1, rank + 2, ... mod R; REMOTE) and then the local item
    i - lag (LOCAL); an item is ROWS rows. A local item waits only for peers' remote items of no
    larger index, which every rank hands out before it, to programs that never wait: any number of
    programs, resident or not, finishes. The last program to finish (counter control[1]) sets
    both counters back to 0 and, REMOTE, stores this call's epoch into seq (the only thing that
    advances it; no program reads seq after that: each reads it before its own control[1] add).
    control[2] is the error flag of the waits (TIMEOUT_NS; the flag and the
    timeout are not parameters of their own: two more parameters made ptxas take ~35 more registers)."""
    epoch = tl.load(seq_ptr) + REMOTE  # the remote half opens the call's epoch (stored back at the end)
    parity = (epoch % 2).to(tl.int32)
    items = 0
    if REMOTE:
        for src in tl.static_range(R):  # scalar loads: a reduced vector here cost ~70 registers a thread
            items = tl.maximum(items, tl.where(src != rank, tl.cdiv(tl.load(count_ptr + src), ROWS), 0))
    if LOCAL:
        items = tl.maximum(items, tl.cdiv(T, ROWS))
    total = (items + lag) * R
    # relaxed tickets: a ticket only hands out work (the rows' order is the ready flags' release / acquire;
    # control[1]'s acq_rel add orders every ticket before the reset); acq_rel ones cost a fence and an L1
    # invalidation each (measured: combine 214-215 against 209-212 µs at 4096 tokens, 389-392 against 382-383
    # at 8192, 2 H200s, bf16)
    ticket = tl.atomic_add(control_ptr, 1, sem="relaxed")
    while ticket < total:
        i = ticket // R
        q = ticket % R
        if q < R - 1:
            if REMOTE:
                r = (rank + 1 + q) % R
                count = tl.load(count_ptr + r)
                if i * ROWS < count:
                    _combine_remote_item(y_ptr, pos_ptr, w_ptr, comb_peers, ready_peers, r, i, count, parity, epoch,
                                         rank, R, C, NI, D, K, BLOCK_K, CHUNK, ROWS)
        elif LOCAL:
            j = i - lag
            if (j >= 0) & (j * ROWS < T):
                _wait_partials(slot_ptr, ready_ptr, j, T, epoch, rank, control_ptr + 2, TIMEOUT_NS, R, NI, ROWS,
                               INTERPRET)
                _combine_local_item(y_ptr, pos_ptr, w_ptr, slot_ptr, comb_ptr, out_ptr, j, T, parity, rank,
                                    R, C, D, K, BLOCK_K, CHUNK, ROWS)
        ticket = tl.atomic_add(control_ptr, 1, sem="relaxed")
    if tl.atomic_add(control_ptr + 1, 1) == tl.num_programs(0) - 1:  # every program has read seq by now
        tl.store(control_ptr, 0)
        tl.store(control_ptr + 1, 0)
        if REMOTE:
            tl.store(seq_ptr, epoch)



@dataclass(frozen=True)
class CombineArgs:
    """One call's combine: the expert outputs, the dispatch's routing state and the output.

    y_ND: [N, D] cfg.dtype; pos_PK: int32 [P, K], row of y for each received (row, slot) pair, -1 none;
    weights_PK: float32 [P, K]; counts_R: int32 [R], rows received from each rank; slot_TR: int32 [T, R],
    this rank's tokens' rows at each rank, -1 none; seq_1: int64 [1], the epoch (the remote half's: of
    the previous call, advanced by the kernel, so that no other kernel needs to; the local half alone:
    of this call); out_TD: [T, D] y's dtype, written by the local half."""

    y_ND: torch.Tensor
    pos_PK: torch.Tensor
    weights_PK: torch.Tensor
    counts_R: torch.Tensor
    slot_TR: torch.Tensor
    seq_1: torch.Tensor
    out_TD: torch.Tensor


def combine_items(capacity: int, hidden: int, launch: HtLaunch) -> int:
    """NI: items (of combine_tiles(hidden)[1] rows) of one source rank's receive region: the combine's
    ready flags per source rank."""
    return -(-capacity // launch.combine_tiles(hidden)[1])


def combine(b: HtBuffers, args: CombineArgs, launch: HtLaunch, wait: DeviceWait, *, remote: bool,
            local: bool) -> None:
    """The combine, or one half of it. remote: reduce each row received from a peer (its local
    results, weighted, fp32, rounded to y's dtype) into the peer's comb region and stamp the peer's
    comb_ready flag of its item with the epoch. local: out_TD[t] = this rank's own reduced row of
    token t + the peers' partial rows (rank order), once they are there (spins on b.comb_ready, or until
    `wait` gives up). Both at once (real ranks: one kernel, the local items trailing the remote ones by
    launch.combine_lag), or remote on every rank and then local (emulated ranks, which run in turn).
    The tickets and finished programs are b.control[:2] (zero, restored after) and the error flag
    b.control[2], which must be wait.err_1."""
    if wait.err_1.data_ptr() != b.control[2:].data_ptr():
        raise ValueError("the combine's error flag is control[2]: pass a DeviceWait on it")
    _, R, C, D = b.comb.shape
    T, K = args.slot_TR.shape[0], args.pos_PK.shape[1]
    chunk, rows = launch.combine_tiles(D)
    _combine_kernel[(launch.combine_programs,)](
        args.y_ND, args.pos_PK, args.weights_PK, args.counts_R, args.slot_TR, args.seq_1, b.comb, b.peers.comb,
        b.comb_ready, b.peers.comb_ready, b.control, args.out_TD, T, b.rank,
        launch.combine_lag_iterations(R) if remote and local else 0, R=R, C=C, NI=b.comb_ready.shape[1], D=D, K=K,
        BLOCK_K=triton.next_power_of_2(K), CHUNK=chunk, ROWS=rows, REMOTE=remote, LOCAL=local,
        TIMEOUT_NS=wait.timeout_ns, INTERPRET=wait.interpret, num_warps=launch.combine_warps,
        maxnreg=launch.combine_registers)
