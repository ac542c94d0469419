"""The receiver's layout kernels of the `ht` dispatch: the layout engine (epmoe/kernels/layout.py: count,
scan, place) over the receive buffers, behind ht's prologue.

The layout (expert-sorted batch) costs work proportional to the (row, slot) pairs received, not to the
capacity, and moves no rows: a count kernel and a place kernel visit blocks of received rows (blocks past
a source's count do nothing) and write each batch row's index into the receive buffer, which the experts
read through; the counts are read on the device. The count kernel's prologue waits for every sender's
numbering (`meta_flag`) and writes the batch size word, which goes through to pinned host memory where
the host polls it (`batch_size` decodes it).

Shape letters: R ranks, C capacity, K top-k, L local experts, P = R*C receive rows, B = R * ceil(C /
BLOCK_S) blocks of received rows, N batch rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import (SCAN_BLOCKS, SCAN_EXPERTS, SCAN_SUM_STEP, LayoutBlocks, block_pairs, count_block, place_block,
                      scan_experts)
from ..sync import DeviceWait, spin_until
from .buffers import HtBuffers

# layout_count's size word: bits 56-62 the epoch mod SIZE_EPOCHS, 32-55 the largest chunk count of any
# rank (below MAX_CHUNKS), 0-31 the batch's valid rows, or SIZE_FAILED when a wait gave up. The host
# word of a parity holds epoch - 2's until the layout of epoch writes it: 7 bits tell them apart.
SIZE_FAILED = tl.constexpr(0xFFFFFFFF)
SIZE_EPOCHS = tl.constexpr(128)
MAX_CHUNKS = tl.constexpr(1 << 24)


@triton.jit
def _block_pairs(count_ptr, seq_ptr, R: tl.constexpr, K: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The (row, slot) pairs of layout program (r, b): block b of the rows received from rank r
    (`layout.block_pairs`, rows below rank r's count of this epoch's parity). Returns (r, parity, j, s,
    k, pair)."""
    r = tl.program_id(0)
    parity = (tl.load(seq_ptr) % 2).to(tl.int32)
    count = tl.load(count_ptr + parity * R + r)
    j, s, k, pair = block_pairs(count, tl.program_id(1), K, BLOCK_S, BLOCK_K)
    return r, parity, j, s, k, pair


@triton.jit
def _layout_count_kernel(ids_ptr, count_ptr, seq_ptr, table_ptr, flag_ptr, pairs_ptr, chunks_ptr, size_ptr, err_ptr,
                         timeout_ns,
                         R: tl.constexpr, C, K: tl.constexpr, L: tl.constexpr,
                         NB, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (r, b), once rank r's numbering of epoch seq[0] has signalled flag[r] (acquire, system
    scope: its counts, ids and weights are here): table[r * NB + b, l] = valid pairs of local expert l
    among rows [b * BLOCK_S, (b + 1) * BLOCK_S) received from rank r (rows past the count hold none).
    Program (0, 0) waits for every rank and writes size[0]: the epoch mod SIZE_EPOCHS, the largest
    chunk count the ranks sent (chunks [2, R], per parity) and the (row, slot) pairs received in all
    (SIZE_FAILED instead if some wait of this rank gave up), in one 8-byte store that goes through to
    host memory (the host polls it there; `batch_size` reads it)."""
    epoch = tl.load(seq_ptr)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        for src in tl.static_range(R):
            spin_until(flag_ptr + src, epoch, err_ptr, timeout_ns, INTERPRET)
        rr = tl.arange(0, BLOCK_R)
        n = tl.sum(tl.load(pairs_ptr + (epoch % 2) * R + rr, mask=rr < R, other=0).to(tl.int64), axis=0)
        low = tl.where(tl.load(err_ptr, volatile=True) != 0, SIZE_FAILED, n)
        chunks = tl.max(tl.load(chunks_ptr + (epoch % 2) * R + rr, mask=rr < R, other=0), axis=0).to(tl.int64)
        high = (epoch % SIZE_EPOCHS).to(tl.int64) * MAX_CHUNKS + chunks  # < 2**31: no overflow below
        tl.store(size_ptr, (high << 32) + low, cache_modifier=".wt")
    else:
        spin_until(flag_ptr + tl.program_id(0), epoch, err_ptr, timeout_ns, INTERPRET)
    r, parity, j, s, k, pair = _block_pairs(count_ptr, seq_ptr, R, K, BLOCK_S, BLOCK_K)
    p = (parity * R + r) * C + s
    lid = tl.load(ids_ptr + p.to(tl.int64) * K + k, mask=pair, other=-1)
    count_block(lid, table_ptr + (r * NB + tl.program_id(1)) * L, L, BLOCK_L)


@triton.jit
def _layout_scan_kernel(table_ptr, count_ptr, seq_ptr, counts_ptr, offsets_ptr, start_ptr, recv_counts_ptr,
                        B, R: tl.constexpr, L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    """`layout.scan_experts` over the [B, L] table (~11 µs for 512 blocks x 128 experts on an H200);
    program 0 also writes recv_counts[r] = recv_count[parity, r]."""
    scan_experts(table_ptr, counts_ptr, offsets_ptr, start_ptr, B, L, BLOCK_T, BLOCK_B, BLOCK_E, BLOCK_L)
    if tl.program_id(0) == 0:
        parity = (tl.load(seq_ptr) % 2).to(tl.int32)
        rr = tl.arange(0, BLOCK_R)
        tl.store(recv_counts_ptr + rr, tl.load(count_ptr + parity * R + rr, mask=rr < R), mask=rr < R)


@triton.jit
def _layout_place_kernel(ids_ptr, w_ptr, count_ptr, seq_ptr, start_ptr, pos_ptr, w_out_ptr, rows_ptr, N,
                         R: tl.constexpr, C, K: tl.constexpr, L: tl.constexpr,
                         NB, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (r, b): batch row of each valid pair (row p = r * C + s, slot k) of its block =
    start[r * NB + b, expert] + earlier pairs of the block with that expert, so rows within an
    expert keep the order (source rank, slot, k). Writes pos[p, k] (-1: no local expert), the
    pair's weight w_out[p, k], and rows[pos] (pos < N) = the received row's index in recv_x viewed as
    [2 * R * C, D] (parity * R * C + p)."""
    r, parity, j, s, k, pair = _block_pairs(count_ptr, seq_ptr, R, K, BLOCK_S, BLOCK_K)
    p = r * C + s
    at = (parity * R * C + p).to(tl.int64) * K + k
    lid = tl.load(ids_ptr + at, mask=pair, other=-1)
    w = tl.load(w_ptr + at, mask=pair, other=0.0)
    pos = place_block(lid, j, start_ptr + (r * NB + tl.program_id(1)) * L)
    valid = lid >= 0
    tl.store(pos_ptr + p * K + k, pos, mask=pair)
    tl.store(w_out_ptr + p * K + k, w, mask=pair)
    # pos < N always, unless a wait gave up and the ids changed after the count (then no stray store)
    tl.store(rows_ptr + pos, parity * R * C + p, mask=pair & valid & (pos < N))


def layout_count(b: HtBuffers, epoch_1: torch.Tensor, blocks: LayoutBlocks, num_local_experts: int,
                 size_1: torch.Tensor, wait: DeviceWait) -> torch.Tensor:
    """Per block of received rows, pairs of each local expert, once the rows' senders' numbering of
    epoch epoch_1 (int64 [1]) has signalled b.meta_flag (spins on the device, or until `wait` gives up;
    no host sync).

    Returns table_BL int32 [B, L]. Writes size_1 int64 [1] (pinned host memory on a GPU, which the
    kernel writes through to; read it with `batch_size`): the epoch, the largest chunk count of any rank
    and the (row, slot) pairs received from all ranks (the batch's valid rows), or that a wait of this
    rank gave up. Reads b.recv_ids (local ids, -1 none; of parity epoch % 2 valid up to b.recv_count),
    and b.pairs / b.chunks (the pairs each rank sends here and its chunk count, per parity)."""
    recv_ids = b.recv_ids
    _, R, C, K = recv_ids.shape
    L, NB = num_local_experts, blocks.blocks
    table_BL = torch.empty(R * NB, L, dtype=torch.int32, device=recv_ids.device)
    _layout_count_kernel[(R, NB)](recv_ids, b.recv_count, epoch_1, table_BL, b.meta_flag, b.pairs, b.chunks, size_1,
                                  wait.err_1, wait.timeout_ns, R=R, C=C, K=K, L=L, NB=NB, BLOCK_S=blocks.block_s,
                                  BLOCK_K=blocks.block_k, BLOCK_L=triton.next_power_of_2(L),
                                  BLOCK_R=triton.next_power_of_2(R), INTERPRET=wait.interpret, num_warps=4)
    return table_BL


def batch_size(size: int, epoch: int) -> tuple[int, int] | None:
    """(the batch's valid rows, the largest chunk count of any rank) from a value of `layout_count`'s
    size_1: None if it is not yet epoch's (the word holds epoch - 2's until then); rows -1 if a wait of
    that layout's rank gave up."""
    if size >> 56 != epoch % SIZE_EPOCHS.value:
        return None
    low = size & 0xFFFFFFFF
    return -1 if low == SIZE_FAILED.value else low, (size >> 32) & (MAX_CHUNKS.value - 1)


def layout_scan(table_BL: torch.Tensor, recv_count: torch.Tensor, epoch_1: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the per-block counts table_BL int32 [B, L]: counts_L int32 [L], offsets_L1 int32 [L+1]
    (exclusive prefix sum), start_BL int32 [B, L] (batch row of each block's first pair of each
    expert) and recv_counts_R int32 [R] (rows received from each rank, parity epoch_1 % 2 of
    recv_count [2, R]; epoch_1 int64 [1]). One program per SCAN_EXPERTS experts, no host sync."""
    B, L = table_BL.shape
    R = recv_count.shape[1]
    dev = table_BL.device
    counts_L = torch.empty(L, dtype=torch.int32, device=dev)
    offsets_L1 = torch.empty(L + 1, dtype=torch.int32, device=dev)
    start_BL = torch.empty_like(table_BL)
    recv_counts_R = torch.empty(R, dtype=torch.int32, device=dev)
    BLOCK_L = triton.next_power_of_2(L)
    _layout_scan_kernel[(triton.cdiv(L, SCAN_EXPERTS),)](
        table_BL, recv_count, epoch_1, counts_L, offsets_L1, start_BL, recv_counts_R, B, R=R, L=L,
        BLOCK_T=max(1, SCAN_SUM_STEP // BLOCK_L), BLOCK_B=SCAN_BLOCKS, BLOCK_E=SCAN_EXPERTS, BLOCK_L=BLOCK_L,
        BLOCK_R=triton.next_power_of_2(R), num_warps=8)
    return counts_L, offsets_L1, start_BL, recv_counts_R


def layout_place(b: HtBuffers, epoch_1: torch.Tensor, start_BL: torch.Tensor, blocks: LayoutBlocks, max_rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert-sorted batch as an index, and combine's routing state. No host sync.

    Returns pos_PK int32 [P, K] (batch row of each received pair, -1 none; rows past a source's count
    are left unset), weights_PK float32 [P, K], and rows_N int32 [max_rows]: the batch's row index into
    recv_x viewed as [2 * R * C, D] (0 past the valid rows). start_BL: int32 [B, L], the batch row of
    each block's first pair of each expert; max_rows: at least the valid rows; epoch_1: int64 [1].
    """
    recv_ids = b.recv_ids
    _, R, C, K = recv_ids.shape
    L = start_BL.shape[1]
    dev = recv_ids.device
    pos_PK = torch.empty(R * C, K, dtype=torch.int32, device=dev)
    weights_PK = torch.empty(R * C, K, dtype=torch.float32, device=dev)
    rows_N = torch.zeros(max_rows, dtype=torch.int32, device=dev)
    _layout_place_kernel[(R, blocks.blocks)](
        recv_ids, b.recv_w, b.recv_count, epoch_1, start_BL, pos_PK, weights_PK, rows_N, max_rows, R=R, C=C, K=K,
        L=L, NB=blocks.blocks, BLOCK_S=blocks.block_s, BLOCK_K=blocks.block_k, num_warps=4)
    return pos_PK, weights_PK, rows_N
