"""The sender's kernels of the `ht` dispatch, and the receiver's wait for the rows.

The numbering, two kernels (per-block counts, then the prefix over earlier blocks): every (token,
destination rank) pair gets its row in the destination's receive region, and the second kernel stores,
ahead of the rows, each destination's token and pair counts, the caller's chunk count and the tokens'
destination-local ids and weights (signalled once, by its last program to finish). Then the rows' kernel
stores each row once per destination rank (fp8-quantized on the way), and signals per program. Dense mode:
slot = t at every rank, so the rows' kernel needs no numbering and runs first (`dispatch_send_dense`), the
numbering beside it. `wait_flags` blocks the receiver's stream until every rank's rows are here.

Shape letters: T tokens on this rank, D hidden size, K top-k, L local experts, R ranks, C capacity,
G = ceil(D / 128) fp8 scale groups, NT numbering blocks of NUMBER_BLOCK tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...config import FP8_BLOCK
from ..quant import divide_rn
from ..sync import DeviceWait, peer_ptr, signal_peers, spin_until
from .buffers import HtBuffers
from .launch import HtLaunch
from .layout import MAX_CHUNKS

# number_pairs: tokens per program, and blocks per step of the prefix over earlier blocks
NUMBER_BLOCK = 128
NUMBER_STEP = 1024


@triton.jit
def _number_block_kernel(ids_ptr, slot_ptr, table_ptr, seq_ptr, epoch_ptr, T, NT,
                         R: tl.constexpr, K: tl.constexpr, L: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_R: tl.constexpr, DENSE: tl.constexpr):
    """Program b, tokens [b * BLOCK_T, (b + 1) * BLOCK_T): slot[t, r] = earlier tokens of the block sent
    to rank r (DENSE: t itself) if token t has an expert on r, else -1 (ids outside [0, R*L) count as
    none); table[0, b, r] = tokens of the block sent to r, table[1, b, r] = their (token, slot) pairs on r.
    Program 0 writes this call's epoch, epoch[0] = seq + 1 (seq itself advances in `_number_fix_kernel`).
    Reads ids one slot at a time (a [BLOCK_T, K] tile reduced over K counted wrong on an H200 at K 8)."""
    b = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    hits = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.int32)
    for k in tl.static_range(K):
        e = tl.load(ids_ptr + t64 * K + k, mask=tmask, other=-1).to(tl.int32)
        dest = tl.where((e >= 0) & (e < R * L), e // L, -1)
        hits += (dest[:, None] == rr[None, :]).to(tl.int32)
    wants = (hits > 0).to(tl.int32)
    rmask = rr < R
    if DENSE:
        slot = tl.broadcast_to(t[:, None], [BLOCK_T, BLOCK_R])
    else:
        slot = tl.cumsum(wants, axis=0) - 1
    tl.store(slot_ptr + t64[:, None] * R + rr[None, :], tl.where(wants > 0, slot, -1),
             mask=tmask[:, None] & rmask[None, :])
    tl.store(table_ptr + b * R + rr, tl.sum(wants, axis=0), mask=rmask)
    tl.store(table_ptr + (NT + b) * R + rr, tl.sum(hits, axis=0), mask=rmask)
    if b == 0:
        tl.store(epoch_ptr, tl.load(seq_ptr) + 1)


@triton.jit(do_not_specialize=["chunks"])  # one build for every chunk count
def _number_fix_kernel(ids_ptr, w_ptr, slot_ptr, table_ptr, seq_ptr, epoch_ptr, done_ptr,
                       recv_count_peers, pairs_peers, chunks_peers, recv_ids_peers, recv_w_peers, flag_peers,
                       T, NT, rank, chunks, R: tl.constexpr, C, K: tl.constexpr, L: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_NT: tl.constexpr, DENSE: tl.constexpr):
    """Program b adds the tokens that earlier blocks sent to each rank to its block's slots, then stores
    its tokens' K destination-local ids (-1 for other ranks' experts) and weights into each
    destination's receive region at the token's slot. Program 0 also advances the epoch (seq =
    epoch[0]) and stores the tokens and the (token, slot) pairs sent to rank r, and `chunks` (the
    caller's chunk count), into r's recv_count, pairs and chunks at [parity, rank]. DENSE (slot = t): no
    slots to add; every rank gets T rows, and the ids (all -1) of the tokens not meant for it. The last
    program to finish (counter done[0], back to 0 after; its acq_rel chain orders every program's
    stores before it) signals flag[rank] on every rank: receivers then size their batch and lay it out
    (`layout_count` waits for it) before the rows arrive."""
    b = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < R
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = (t < T)[:, None] & rmask[None, :]
    at = slot_ptr + t.to(tl.int64)[:, None] * R + rr[None, :]
    slot = tl.load(at, mask=tmask, other=-1)
    if not DENSE:
        base = tl.zeros([BLOCK_R], dtype=tl.int32)
        for b0 in range(0, b, BLOCK_NT):
            bb = b0 + tl.arange(0, BLOCK_NT)
            earlier = (bb < b)[:, None] & rmask[None, :]
            base += tl.sum(tl.load(table_ptr + bb[:, None] * R + rr[None, :], mask=earlier, other=0), axis=0)
        slot = tl.where(slot >= 0, slot + base[None, :], -1)
        tl.store(at, slot, mask=tmask)
    epoch = tl.load(epoch_ptr)
    parity = (epoch % 2).to(tl.int32)
    if b == 0:
        rows = tl.zeros([BLOCK_R], dtype=tl.int32)  # tokens
        pairs = tl.zeros([BLOCK_R], dtype=tl.int32)
        for b0 in range(0, NT, BLOCK_NT):
            bb = b0 + tl.arange(0, BLOCK_NT)
            valid = (bb < NT)[:, None] & rmask[None, :]
            rows += tl.sum(tl.load(table_ptr + bb[:, None] * R + rr[None, :], mask=valid, other=0), axis=0)
            pairs += tl.sum(tl.load(table_ptr + (NT + bb[:, None]) * R + rr[None, :], mask=valid, other=0), axis=0)
        tl.store(seq_ptr, epoch)
        if DENSE:
            rows = tl.zeros([BLOCK_R], dtype=tl.int32) + T
        for r in tl.static_range(R):
            mine = parity * R + rank
            tl.store(peer_ptr(recv_count_peers, r, tl.int32) + mine, tl.sum(tl.where(rr == r, rows, 0), axis=0))
            tl.store(peer_ptr(pairs_peers, r, tl.int32) + mine, tl.sum(tl.where(rr == r, pairs, 0), axis=0))
            tl.store(peer_ptr(chunks_peers, r, tl.int32) + mine, chunks)
    kk = tl.arange(0, BLOCK_K)
    t64 = t.to(tl.int64)
    kmask = (t < T)[:, None] & (kk < K)[None, :]
    ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=kmask, other=-1).to(tl.int32)
    w = tl.load(w_ptr + t64[:, None] * K + kk[None, :], mask=kmask, other=0.0)
    for r in tl.static_range(R):
        lid = ids - r * L
        lid = tl.where((ids >= 0) & (lid >= 0) & (lid < L), lid, -1)
        if DENSE:
            row_at = ((parity * R + rank) * C + t).to(tl.int64)
            smask = kmask
        else:
            slot_r = tl.sum(tl.where(rr[None, :] == r, slot, 0), axis=1)
            row_at = ((parity * R + rank) * C + tl.maximum(slot_r, 0)).to(tl.int64)
            smask = kmask & (slot_r >= 0)[:, None]
        tl.store(peer_ptr(recv_ids_peers, r, tl.int32) + row_at[:, None] * K + kk[None, :], lid, mask=smask)
        tl.store(peer_ptr(recv_w_peers, r, tl.float32) + row_at[:, None] * K + kk[None, :], w, mask=smask)
    tl.debug_barrier()
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys") == NT - 1:  # the last program
        tl.store(done_ptr, 0)
        signal_peers(flag_peers, rank, R)


@triton.jit(do_not_specialize=["dense_parity"])
def _dispatch_send_kernel(x_ptr, slot_ptr, seq_ptr, recv_x_peers, recv_scale_peers, flag_peers, T, rank, dense_parity,
                          R: tl.constexpr, C, D: tl.constexpr, G: tl.constexpr, FP8: tl.constexpr,
                          BLOCK_G: tl.constexpr, ROWS: tl.constexpr, PROGRAMS: tl.constexpr, DENSE: tl.constexpr):
    """Each program takes ROWS tokens at a time (tokens pid*ROWS.., then + PROGRAMS*ROWS, ...), all
    loaded before any store; stores each row (fp8-quantized when FP8, with its scales) once into every
    destination rank's receive region at the token's slot there (DENSE: every row to every rank, at
    row t, in the region of parity dense_parity: no slots or epoch read); then one signal per peer."""
    pid = tl.program_id(0)
    if DENSE:
        parity = dense_parity
    else:
        parity = (tl.load(seq_ptr) % 2).to(tl.int32)
    BLOCK: tl.constexpr = 128
    # a step as [ROWS, BLOCK_G, 128]: group g of a row holds columns [128 g, 128 g + 128)
    cols = tl.arange(0, BLOCK_G)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    gg = tl.arange(0, BLOCK_G)
    for first in range(pid * ROWS, T, PROGRAMS * ROWS):
        t = first + tl.arange(0, ROWS)
        tmask = t < T
        t64 = t.to(tl.int64)
        xmask = tmask[:, None, None] & (cols < D)[None, :, :]
        row = tl.load(x_ptr + t64[:, None, None] * D + cols[None, :, :], mask=xmask, other=0.0)
        if FP8:
            amax = tl.max(tl.abs(row.to(tl.float32)), axis=2)
            # as epmoe.quant.quantize_act_ref, with correctly rounded divisions (a plain `/` may be approximate)
            scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
            q = tl.minimum(tl.maximum(divide_rn(row.to(tl.float32), scale[:, :, None]), -448.0), 448.0)
            row_out = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:
            row_out = row
        for r in tl.static_range(R):
            if DENSE:
                slot = t
            else:
                slot = tl.load(slot_ptr + t64 * R + r, mask=tmask, other=-1)
            sent = tmask & (slot >= 0)
            row_at = ((parity * R + rank) * C + tl.maximum(slot, 0)).to(tl.int64)
            dst = peer_ptr(recv_x_peers, r, row_out.dtype) + row_at[:, None, None] * D + cols[None, :, :]
            tl.store(tl.multiple_of(dst, [1, 16, 16]), row_out, mask=xmask & sent[:, None, None])
            if FP8:
                tl.store(peer_ptr(recv_scale_peers, r, tl.float32) + row_at[:, None] * G + gg[None, :], scale,
                         mask=sent[:, None] & (gg < G)[None, :])
    signal_peers(flag_peers, rank, R)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, T, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                      PROGRAMS: tl.constexpr):
    """dst[t] = src[t] for t < T (rows of D elements, contiguous), ROWS rows a program step."""
    cols = tl.arange(0, BLOCK_D)
    for first in range(tl.program_id(0) * ROWS, T, PROGRAMS * ROWS):
        t64 = (first + tl.arange(0, ROWS)).to(tl.int64)
        at = t64[:, None] * D + cols[None, :]
        m = (t64 < T)[:, None] & (cols < D)[None, :]
        tl.store(dst_ptr + at, tl.load(src_ptr + at, mask=m), mask=m)


@triton.jit
def _wait_kernel(flag_ptr, seq_ptr, err_ptr, timeout_ns, skip, R: tl.constexpr, PROGRAMS: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """One program: spin until every source rank's flag but flag[skip] reaches epoch * PROGRAMS
    (acquire, system scope)."""
    target = tl.load(seq_ptr).to(tl.int64) * PROGRAMS
    for r in tl.static_range(R):
        if r != skip:
            spin_until(flag_ptr + r, target, err_ptr, timeout_ns, INTERPRET)



def number_pairs(b: HtBuffers, ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_local_experts: int, *,
                 dense: bool = False, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Number the (token, destination rank) pairs, advance the epoch, and send every rank, ahead of the
    rows, what it needs to size and lay out its batch.

    Returns slot_TR int32 [T, R]: row of token t in rank r's receive region (tokens keep their order;
    dense: row t itself, every rank getting all T rows, those of tokens not meant for it with ids -1),
    -1 when none of its ids is on r; epoch_1 int64 [1]: this call's epoch (b.dispatch_seq after its
    increment on the device). Stores the tokens and the (token, slot) pairs sent to rank r, and `chunks`
    (the caller's chunk count, in [1, MAX_CHUNKS): `layout_count` passes the largest on to the host), into
    r's recv_count, pairs and chunks at [epoch % 2, rank], and each token's destination-local ids and
    weights into each destination's recv_ids / recv_w at the token's slot, then signals r's
    meta_flag[rank] once. ids_TK: int32/int64 [T, K] global ids, -1 none (outside [0, R*L): none);
    weights_TK: float32 [T, K]. Two kernels (T / NUMBER_BLOCK programs each), no host sync."""
    if not 1 <= chunks < MAX_CHUNKS.value:
        raise ValueError(f"chunks must be in [1, {MAX_CHUNKS.value}), got {chunks}")
    T, K = ids_TK.shape
    R, L, p = b.world_size, num_local_experts, b.peers
    dev = ids_TK.device
    slot_TR = torch.empty(T, R, dtype=torch.int32, device=dev)
    epoch_1 = torch.empty(1, dtype=torch.int64, device=dev)
    NT = max(1, triton.cdiv(T, NUMBER_BLOCK))
    table_2TR = torch.empty(2, NT, R, dtype=torch.int32, device=dev)
    BLOCK_R = triton.next_power_of_2(R)
    _number_block_kernel[(NT,)](ids_TK, slot_TR, table_2TR, b.dispatch_seq, epoch_1, T, NT, R=R, K=K, L=L,
                                BLOCK_T=NUMBER_BLOCK, BLOCK_R=BLOCK_R, DENSE=dense, num_warps=4)
    _number_fix_kernel[(NT,)](ids_TK, weights_TK, slot_TR, table_2TR, b.dispatch_seq, epoch_1, b.number_done,
                              p.recv_count, p.pairs, p.chunks, p.recv_ids, p.recv_w, p.meta_flag, T, NT, b.rank,
                              chunks, R=R, C=b.capacity, K=K, L=L, BLOCK_K=triton.next_power_of_2(K),
                              BLOCK_T=NUMBER_BLOCK, BLOCK_R=BLOCK_R, BLOCK_NT=NUMBER_STEP, DENSE=dense, num_warps=4)
    return slot_TR, epoch_1


def dispatch_send(b: HtBuffers, x_TD: torch.Tensor, slot_TR: torch.Tensor, launch: HtLaunch) -> None:
    """Store every token's row once into each destination rank's receive region (recv_x, and recv_scale
    with fp8 dispatch, of the parity of b.dispatch_seq: this call's epoch, already advanced by the
    numbering) and signal each rank's dispatch_flag[rank] once per program.

    x_TD: [T, D] cfg.dtype; slot_TR: int32 [T, R], the token's row at rank r (-1: not sent there)."""
    _send(b, x_TD, slot_TR, b.dispatch_seq, -1, launch)


def dispatch_send_dense(b: HtBuffers, x_TD: torch.Tensor, epoch: int, launch: HtLaunch) -> None:
    """dispatch_send with slot = t at every rank (number_pairs(dense=True)'s slots), needing neither the
    slots nor the device epoch: so it can run before the numbering (or beside it). epoch: this call's
    (the host's count, equal to the device's)."""
    _send(b, x_TD, None, None, epoch % 2, launch)


def _send(b: HtBuffers, x_TD: torch.Tensor, slot_TR: torch.Tensor | None, seq_1: torch.Tensor | None,
          dense_parity: int, launch: HtLaunch) -> None:
    """The rows' kernel: slots and epoch from slot_TR and seq_1, or (dense_parity >= 0, both None) row t in
    the region of that parity."""
    T, D = x_TD.shape
    G = -(-D // FP8_BLOCK)
    _dispatch_send_kernel[(launch.programs,)](
        x_TD, slot_TR, seq_1, b.peers.recv_x, b.peers.recv_scale, b.peers.dispatch_flag, T, b.rank, dense_parity,
        R=b.world_size, C=b.capacity, D=D, G=G, FP8=b.fp8, BLOCK_G=triton.next_power_of_2(G), ROWS=launch.rows(D),
        PROGRAMS=launch.programs, DENSE=dense_parity >= 0, num_warps=launch.num_warps)


def copy_rows(src_TD: torch.Tensor, dst_TD: torch.Tensor, launch: HtLaunch) -> None:
    """dst_TD[:T] = src_TD ([T, D], both contiguous) on the SMs: a local copy that leaves the copy engine
    to the rows going to peers (copy-engine mode)."""
    T, D = src_TD.shape
    _copy_rows_kernel[(launch.programs,)](src_TD, dst_TD, T, D=D, BLOCK_D=triton.next_power_of_2(D),
                                          ROWS=launch.rows(D), PROGRAMS=launch.programs, num_warps=launch.num_warps)


def wait_flags(flag_R: torch.Tensor, seq_1: torch.Tensor, programs: int, wait: DeviceWait, skip: int = -1) -> None:
    """Block the stream (one spinning program) until every rank's `programs` signalling programs
    signalled epoch seq_1 (int64 [1]) into flag_R (flag_R[skip] excepted), or `wait` gives up."""
    _wait_kernel[(1,)](flag_R, seq_1, wait.err_1, wait.timeout_ns, skip, R=flag_R.shape[0], PROGRAMS=programs,
                       INTERPRET=wait.interpret, num_warps=1)
