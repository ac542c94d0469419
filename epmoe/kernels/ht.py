"""Triton kernels of the `ht` dispatcher: peer stores into symmetric buffers, device-side signals.

Every peer buffer is reached through an int64 table of its address on each rank (epmoe/symm.py); a
kernel casts `table[r]` to a pointer. Buffers that change per call exist twice (parity = epoch % 2,
the epoch being a device counter in the workspace), flags are monotonic counters: a sender adds 1 per
program and call, a receiver waits until a flag reaches epoch * programs.

Shape letters: T tokens on this rank, D hidden size, K top-k, L local experts, R ranks,
C capacity (max tokens per rank), P = R*C receive rows, G = ceil(D / 128) fp8 scale groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import FP8_BLOCK

@dataclass(frozen=True)
class HtLaunch:
    """Launch config of the ht kernels: `programs` persistent programs for the send kernels (the same
    on every rank: flags count one signal per program), `num_warps` per program."""

    programs: int
    num_warps: int


def ht_launch(row_bytes: int, device: torch.device) -> HtLaunch:
    """Pure function of the row size and the device: half the SMs on a GPU (the other half stay free
    for the receiver's work), a few programs under the CPU interpreter."""
    if device.type != "cuda":
        return HtLaunch(programs=2, num_warps=1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return HtLaunch(programs=max(1, sms // 2), num_warps=8 if row_bytes >= 4096 else 4)


@triton.jit
def _peer(table_ptr, r, dtype: tl.constexpr):
    return tl.load(table_ptr + r).to(tl.pointer_type(dtype))


@triton.jit
def _signal(flag_peers, rank, R: tl.constexpr):
    # All stores of this program are issued before one release-add per peer (flag[rank] on rank r).
    tl.debug_barrier()
    for r in tl.static_range(R):
        flag = tl.load(flag_peers + r).to(tl.pointer_type(tl.int64))
        tl.atomic_add(flag + rank, 1, sem="release", scope="sys")


@triton.jit
def _dispatch_send_kernel(x_ptr, ids_ptr, w_ptr, slot_ptr, count_ptr, seq_ptr,
                          recv_x_peers, recv_scale_peers, recv_ids_peers, recv_w_peers, recv_count_peers,
                          flag_peers, T, rank,
                          R: tl.constexpr, C: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                          L: tl.constexpr, G: tl.constexpr, FP8: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr):
    """Each program takes tokens pid, pid + PROGRAMS, ...; stores the row (fp8-quantized when FP8)
    once into every destination rank's receive region at the token's slot there, with its K
    destination-local ids (-1 for other ranks' experts) and weights; then the counts and one signal."""
    pid = tl.program_id(0)
    parity = tl.load(seq_ptr) % 2
    BLOCK: tl.constexpr = 128
    # a row as [BLOCK_G, 128]: group g holds columns [128 g, 128 g + 128)
    cols = tl.arange(0, BLOCK_G)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    cmask = cols < D
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    gg = tl.arange(0, BLOCK_G)
    for t in range(pid, T, PROGRAMS):
        row = tl.load(x_ptr + tl.cast(t, tl.int64) * D + cols, mask=cmask, other=0.0)
        if FP8:
            amax = tl.max(tl.abs(row.to(tl.float32)), axis=1)
            # as epmoe.quant.quantize_act_ref, with IEEE divisions (a plain `/` may be approximate)
            scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
            q = tl.div_rn(row.to(tl.float32), scale[:, None] + tl.zeros(row.shape, tl.float32))
            q = tl.minimum(tl.maximum(q, -448.0), 448.0)
            row_out = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:
            row_out = row
        ids = tl.load(ids_ptr + t * K + kk, mask=kmask, other=-1).to(tl.int32)
        w = tl.load(w_ptr + t * K + kk, mask=kmask, other=0.0)
        for r in tl.static_range(R):
            slot = tl.load(slot_ptr + t * R + r)
            if slot >= 0:
                row_at = ((parity * R + rank) * C + slot).to(tl.int64)
                dst = _peer(recv_x_peers, r, row_out.dtype) + row_at * D + cols
                tl.store(tl.multiple_of(dst, [16, 16]), row_out, mask=cmask)
                if FP8:
                    tl.store(_peer(recv_scale_peers, r, tl.float32) + row_at * G + gg, scale, mask=gg < G)
                lid = ids - r * L
                lid = tl.where((ids >= 0) & (lid >= 0) & (lid < L), lid, -1)
                tl.store(_peer(recv_ids_peers, r, tl.int32) + row_at * K + kk, lid, mask=kmask)
                tl.store(_peer(recv_w_peers, r, tl.float32) + row_at * K + kk, w, mask=kmask)
    for r in tl.static_range(R):
        tl.store(_peer(recv_count_peers, r, tl.int32) + parity * R + rank, tl.load(count_ptr + r))
    _signal(flag_peers, rank, R)


@triton.jit
def _wait_kernel(flag_ptr, seq_ptr, R: tl.constexpr, PROGRAMS: tl.constexpr):
    """One program: spin until every source rank's flag reaches epoch * PROGRAMS (acquire, system scope)."""
    target = tl.load(seq_ptr).to(tl.int64) * PROGRAMS
    for r in tl.static_range(R):
        seen = tl.atomic_add(flag_ptr + r, 0, sem="acquire", scope="sys")
        while seen < target:
            seen = tl.atomic_add(flag_ptr + r, 0, sem="acquire", scope="sys")


@triton.jit
def _combine_send_kernel(y_ptr, pos_ptr, w_ptr, count_ptr, seq_ptr, comb_peers, flag_peers, rank,
                         R: tl.constexpr, C: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                         BLOCK_D: tl.constexpr, PROGRAMS: tl.constexpr):
    """For each received row (source r, slot s): sum_k w[k] * y[pos[k]] in fp32 over its local pairs
    (pos -1: none), stored as one row into rank r's combine region at (this rank, s); then a signal."""
    pid = tl.program_id(0)
    parity = tl.load(seq_ptr) % 2
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    zero_D = tl.zeros([BLOCK_D], dtype=tl.int32)  # broadcasts a scalar condition into a mask
    for r in tl.static_range(R):
        count = tl.load(count_ptr + r)
        for s in range(pid, count, PROGRAMS):
            p = r * C + s
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for k in range(K):
                pos = tl.load(pos_ptr + p * K + k)
                w = tl.load(w_ptr + p * K + k)
                y = tl.load(y_ptr + tl.maximum(pos, 0).to(tl.int64) * D + cols, mask=cmask & (pos + zero_D >= 0),
                            other=0.0)
                acc += w * y.to(tl.float32)
            row_at = ((parity * R + rank) * C + s).to(tl.int64)
            dst = _peer(comb_peers, r, y_ptr.dtype.element_ty) + row_at * D + cols
            tl.store(tl.multiple_of(dst, 16), acc.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=cmask)
    _signal(flag_peers, rank, R)


@triton.jit
def _combine_reduce_kernel(out_ptr, slot_ptr, seq_ptr, comb_ptr, T,
                           R: tl.constexpr, C: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           PROGRAMS: tl.constexpr):
    """out[t] = sum over ranks r with slot[t, r] >= 0 of comb[parity, r, slot], fp32, in rank order."""
    pid = tl.program_id(0)
    parity = tl.load(seq_ptr) % 2
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    zero_D = tl.zeros([BLOCK_D], dtype=tl.int32)  # broadcasts a scalar condition into a mask
    for t in range(pid, T, PROGRAMS):
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for r in tl.static_range(R):
            slot = tl.load(slot_ptr + t * R + r)
            row_at = ((parity * R + r) * C + tl.maximum(slot, 0)).to(tl.int64)
            acc += tl.load(comb_ptr + row_at * D + cols, mask=cmask & (slot + zero_D >= 0),
                           other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.cast(t, tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=cmask)


def dispatch_send(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, slot_TR: torch.Tensor,
                  counts_R: torch.Tensor, seq_1: torch.Tensor, peers: dict[str, torch.Tensor], rank: int,
                  capacity: int, num_local_experts: int, fp8: bool, launch: HtLaunch) -> None:
    """Store every token's row once into each destination rank's receive region and signal.

    x_TD: [T, D] cfg.dtype; ids_TK int32/int64 [T, K] global ids (-1 none); weights_TK float32 [T, K];
    slot_TR: int32 [T, R], the token's row at rank r (-1: not sent there); counts_R: int32 [R] rows
    per destination; seq_1: int32 [1] this call's epoch (already incremented); peers: address tables
    (int64 [R]) of "recv_x", "recv_scale" (fp8), "recv_ids", "recv_w", "recv_count", "dispatch_flag".
    """
    T, D = x_TD.shape
    K = ids_TK.shape[1]
    R = slot_TR.shape[1]
    G = -(-D // FP8_BLOCK)
    _dispatch_send_kernel[(launch.programs,)](
        x_TD, ids_TK, weights_TK, slot_TR, counts_R, seq_1,
        peers["recv_x"], peers["recv_scale"] if fp8 else peers["recv_x"], peers["recv_ids"], peers["recv_w"],
        peers["recv_count"], peers["dispatch_flag"], T, rank,
        R=R, C=capacity, D=D, K=K, L=num_local_experts, G=G, FP8=fp8,
        BLOCK_G=triton.next_power_of_2(G), BLOCK_K=triton.next_power_of_2(K), PROGRAMS=launch.programs,
        num_warps=launch.num_warps)


def wait_flags(flag_R: torch.Tensor, seq_1: torch.Tensor, launch: HtLaunch) -> None:
    """Block the stream (one spinning program) until every rank signalled epoch seq_1 into flag_R."""
    _wait_kernel[(1,)](flag_R, seq_1, R=flag_R.shape[0], PROGRAMS=launch.programs, num_warps=1)


def combine_send(y_ND: torch.Tensor, pos_PK: torch.Tensor, weights_PK: torch.Tensor, counts_R: torch.Tensor,
                 seq_1: torch.Tensor, comb_peers_R: torch.Tensor, flag_peers_R: torch.Tensor, rank: int,
                 capacity: int, launch: HtLaunch) -> None:
    """Reduce each received row's local results and store it into its source rank's combine region.

    y_ND: expert outputs, cfg.dtype; pos_PK: int32 [P, K] row of y for each received (row, slot) pair,
    -1 none; weights_PK: float32 [P, K]; counts_R: int32 [R] rows received from each rank.
    """
    N, D = y_ND.shape
    R = counts_R.shape[0]
    _combine_send_kernel[(launch.programs,)](
        y_ND, pos_PK, weights_PK, counts_R, seq_1, comb_peers_R, flag_peers_R, rank,
        R=R, C=capacity, D=D, K=pos_PK.shape[1], BLOCK_D=triton.next_power_of_2(D), PROGRAMS=launch.programs,
        num_warps=launch.num_warps)


def combine_reduce(comb_2RCD: torch.Tensor, slot_TR: torch.Tensor, seq_1: torch.Tensor, launch: HtLaunch) -> torch.Tensor:
    """out_TD[t] = sum of the partial rows the ranks returned for token t (fp32), in comb's dtype."""
    _, R, C, D = comb_2RCD.shape
    T = slot_TR.shape[0]
    out_TD = torch.empty(T, D, dtype=comb_2RCD.dtype, device=comb_2RCD.device)
    if T:
        programs = max(1, min(T, 4 * launch.programs))
        _combine_reduce_kernel[(programs,)](
            out_TD, slot_TR, seq_1, comb_2RCD, T, R=R, C=C, D=D, BLOCK_D=triton.next_power_of_2(D),
            PROGRAMS=programs, num_warps=launch.num_warps)
    return out_TD
