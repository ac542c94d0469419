"""The layout engine: sort the (row, slot) pairs of a table of expert ids by local expert, on the device,
and the combine's sum of each row's K results.

Shape letters: P rows of the id table (tokens, or received rows), K slots per row (top-k), L local experts,
E experts in all, N = P*K batch rows (an upper bound: only offsets_L1[L] of them are valid), B blocks of
rows (one program each), D hidden size.

Three kernels, work proportional to the pairs, no host sync. The `ht` dispatcher runs the same three
steps over its receive buffers, behind its own prologue (a wait for the senders' signal), with the
helpers `block_pairs`, `count_block`, `place_block` and the scan kernel below (epmoe/kernels/ht/layout.py):
  count: program b takes BLOCK_S rows x BLOCK_K slots and writes table_BL[b, l] = its pairs of expert l;
  scan:  counts_L, offsets_L1 (their exclusive prefix sum) and start_BL[b, l] = offsets_L1[l] + the pairs
         of expert l in the blocks before b;
  place: pos_PK[p, k] = start_BL[b, l] + the pairs of block b with expert l before (p, k), so the rows of
         an expert keep the (row, slot) order (stable: the same ids give the same layout, bit for bit);
         rows_N[pos] = p and weights_N[pos] = weights_PK[p, k].
Ids are global: id - first_expert is the local expert when it lies in [0, L) (other experts' pairs are
not this layout's). With `num_experts` given, ids outside [-1, E) are caught on the device: such a pair
is skipped (it indexes nothing), its pos is BAD_POS (the combine then writes NaN into its row, so no
output of it looks valid), and the id is stored into a one-word error tensor the host reads later.

`gather_sum` is the combine: out[p] = sum over k of (weights_PK[p, k] *) y[pos_PK[p, k]] in float32,
stored once in the output dtype. References: `sort_pairs_ref`, `gather_sum_ref` (torch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# pos_PK of a pair whose id lies outside [-1, E)
BAD_POS = -2
BAD_POS_C = tl.constexpr(BAD_POS)
# (row, slot) pairs per layout program
BLOCK_PAIRS = 128
# scan: experts per program, blocks per step of the start pass, table elements per step of the sum
SCAN_EXPERTS = 8
SCAN_BLOCKS = 512
SCAN_SUM_STEP = 8192


def scan_warps(num_local_experts: int) -> int:
    """Warps of a scan program: 16 past 128 experts, so that a sum step's tile stays in registers."""
    return 8 if num_local_experts <= 128 else 16
# gather_sum: columns per program, and rows per program (about 4K elements of a row tile: no spills at K 8)
GATHER_COLUMNS = 1024
GATHER_ELEMENTS = 4096
GATHER_WARPS = 8


@dataclass(frozen=True)
class LayoutBlocks:
    """Blocking of the layout kernels: a program takes block_s rows x block_k slots (pairs)."""

    block_s: int
    block_k: int
    blocks: int  # programs for `rows` rows (see layout_blocks)


def layout_blocks(rows: int, top_k: int) -> LayoutBlocks:
    """About BLOCK_PAIRS (row, slot) pairs per program; pure function of the rows and K."""
    block_k = triton.next_power_of_2(top_k)
    block_s = max(1, BLOCK_PAIRS // block_k)
    return LayoutBlocks(block_s=block_s, block_k=block_k, blocks=-(-rows // block_s))


@triton.jit
def block_pairs(count, b, K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (row, slot) pairs of block b: rows s in [b * BLOCK_S, (b + 1) * BLOCK_S), slots k < BLOCK_K,
    flattened as j = (s - b * BLOCK_S) * BLOCK_K + k. Returns (j, s, k, pair): pair marks the real ones
    (s below count, k < K)."""
    j = tl.arange(0, BLOCK_S * BLOCK_K)
    s = b * BLOCK_S + j // BLOCK_K
    k = j % BLOCK_K
    return j, s, k, (s < count) & (k < K)


@triton.jit
def count_block(lid, table_row_ptr, L: tl.constexpr, BLOCK_L: tl.constexpr):
    """table_row[l] = how many entries of lid (local expert ids of a block's pairs, -1 none) are l."""
    ll = tl.arange(0, BLOCK_L)
    hits = tl.sum((lid[:, None] == ll[None, :]).to(tl.int32), axis=0)
    tl.store(table_row_ptr + ll, hits, mask=ll < L)


@triton.jit
def place_block(lid, j, start_row_ptr):
    """Batch row of each pair of a block with a local expert (lid >= 0; -1 elsewhere): start_row[lid] +
    the pairs before it (smaller j) with the same expert."""
    earlier = (lid[:, None] == lid[None, :]) & (j[None, :] < j[:, None])
    valid = lid >= 0
    start = tl.load(start_row_ptr + lid, mask=valid, other=0)
    return tl.where(valid, start + tl.sum(earlier.to(tl.int32), axis=1), -1)


@triton.jit
def _local_ids(ids_ptr, at, pair, first, L: tl.constexpr, E, CHECK: tl.constexpr):
    """(local expert of each pair or -1, whether its global id lies outside [-1, E) when CHECK)."""
    ids = tl.load(ids_ptr + at, mask=pair, other=-1).to(tl.int64)
    lid = ids - first
    mine = (lid >= 0) & (lid < L) & (ids < E)
    if CHECK:
        bad = pair & ((ids < -1) | (ids >= E))
    else:
        bad = pair & (ids != ids)
    return tl.where(mine & ~bad, lid, -1).to(tl.int32), bad, ids


@triton.jit
def _count_kernel(ids_ptr, table_ptr, bad_ptr, rows_ptr, P, first, E, K: tl.constexpr, L: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, CHECK: tl.constexpr):
    """Program b: table[b, l] = pairs of local expert l among rows [b * BLOCK_S, (b + 1) * BLOCK_S), and
    zeros into its share of rows [P * K] (batch rows b * BLOCK_S * K onwards; the place kernel, after it,
    overwrites the valid ones); with CHECK, an id outside [-1, E) of the block is stored into bad[0] (any
    one of them)."""
    b = tl.program_id(0)
    j, s, k, pair = block_pairs(P, b, K, BLOCK_S, BLOCK_K)
    lid, bad, ids = _local_ids(ids_ptr, s.to(tl.int64) * K + k, pair, first, L, E, CHECK)
    count_block(lid, table_ptr + b * L, L, BLOCK_L)
    n = b * (BLOCK_S * K) + j
    tl.store(rows_ptr + n, tl.zeros_like(j), mask=(j < BLOCK_S * K) & (n < P * K))
    if CHECK:
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            tl.store(bad_ptr, tl.max(tl.where(bad, ids, -(1 << 62)), axis=0), cache_modifier=".wt")


@triton.jit
def scan_experts(table_ptr, counts_ptr, offsets_ptr, start_ptr, B, L: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program e takes experts [e * BLOCK_E, (e + 1) * BLOCK_E): start[b, l] = offsets[l] +
    sum_{b' < b} table[b', l], offsets being the exclusive prefix sum of counts[l] = sum_b table[b, l],
    which every program sums itself (BLOCK_T blocks a step). Program 0 writes counts and offsets (L+1
    entries)."""
    ll = tl.arange(0, BLOCK_L)
    lmask = ll < L
    totals = tl.zeros([BLOCK_L], dtype=tl.int32)
    for b0 in range(0, B, BLOCK_T):
        bb = b0 + tl.arange(0, BLOCK_T)
        totals += tl.sum(tl.load(table_ptr + bb[:, None] * L + ll[None, :], mask=(bb < B)[:, None] & lmask[None, :],
                                 other=0), axis=0)
    if tl.program_id(0) == 0:
        ends = tl.cumsum(totals, axis=0)
        tl.store(counts_ptr + ll, totals, mask=lmask)
        tl.store(offsets_ptr + ll, ends - totals, mask=lmask)
        tl.store(offsets_ptr + L, tl.sum(totals, axis=0))
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < L
    running = tl.sum(tl.where(ll[None, :] < e[:, None], totals[None, :], 0), axis=1)  # offsets[e]
    for b0 in range(0, B, BLOCK_B):
        bb = b0 + tl.arange(0, BLOCK_B)
        m = (bb < B)[:, None] & emask[None, :]
        tile = tl.load(table_ptr + bb[:, None] * L + e[None, :], mask=m, other=0)
        tl.store(start_ptr + bb[:, None] * L + e[None, :], running[None, :] + tl.cumsum(tile, axis=0) - tile, mask=m)
        running += tl.sum(tile, axis=0)


@triton.jit
def _scan_kernel(table_ptr, counts_ptr, offsets_ptr, start_ptr, B, L: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_L: tl.constexpr):
    scan_experts(table_ptr, counts_ptr, offsets_ptr, start_ptr, B, L, BLOCK_T, BLOCK_B, BLOCK_E, BLOCK_L)


def scan(table_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts_L int32 [L], offsets_L1 int32 [L+1], start_BL int32 [B, L]) of the per-block counts
    table_BL int32 [B, L] (see scan_experts). One program per SCAN_EXPERTS experts, no host sync."""
    B, L = table_BL.shape
    dev = table_BL.device
    counts_L = torch.empty(L, dtype=torch.int32, device=dev)
    offsets_L1 = torch.empty(L + 1, dtype=torch.int32, device=dev)
    start_BL = torch.empty_like(table_BL)
    BLOCK_L = triton.next_power_of_2(L)
    _scan_kernel[(triton.cdiv(L, SCAN_EXPERTS),)](
        table_BL, counts_L, offsets_L1, start_BL, B, L=L, BLOCK_T=max(1, SCAN_SUM_STEP // BLOCK_L),
        BLOCK_B=SCAN_BLOCKS, BLOCK_E=SCAN_EXPERTS, BLOCK_L=BLOCK_L, num_warps=scan_warps(L))
    return counts_L, offsets_L1, start_BL


@triton.jit
def _place_kernel(ids_ptr, w_ptr, start_ptr, pos_ptr, rows_ptr, w_rows_ptr, P, first, E, K: tl.constexpr,
                  L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, CHECK: tl.constexpr,
                  HAS_W: tl.constexpr):
    """Program b: pos[p, k] of each pair of its block (-1: no local expert, BAD_POS: id outside [-1, E)),
    rows[pos] = p and w_rows[pos] = w[p, k] for the pairs with a local expert."""
    b = tl.program_id(0)
    j, s, k, pair = block_pairs(P, b, K, BLOCK_S, BLOCK_K)
    at = s.to(tl.int64) * K + k
    lid, bad, _ = _local_ids(ids_ptr, at, pair, first, L, E, CHECK)
    pos = place_block(lid, j, start_ptr + b * L)
    tl.store(pos_ptr + at, tl.where(bad, BAD_POS_C, pos), mask=pair)
    valid = pair & (pos >= 0)
    tl.store(rows_ptr + pos, s, mask=valid)
    if HAS_W:
        tl.store(w_rows_ptr + pos, tl.load(w_ptr + at, mask=valid, other=0.0).to(tl.float32), mask=valid)


@dataclass(frozen=True)
class PairLayout:
    """The expert-sorted layout of a [P, K] table of ids (device tensors; no host sync made them).

    counts_L: int32 [L] pairs of each local expert; offsets_L1: int32 [L+1] their exclusive prefix sum.
    pos_PK: int32 [P, K] batch row of pair (p, k), -1 if its expert is not local (or id -1), BAD_POS if
        its id lies outside [-1, E) (checked layouts only).
    rows_N: int32 [N = P*K] the table row of each batch row (0 at and past offsets_L1[L]: an index that
        is always in [0, P) when P > 0).
    weights_N: float32 [N] the pair's weight of each valid batch row (unset past offsets_L1[L]), or None
        when no weights were given.
    """

    counts_L: torch.Tensor
    offsets_L1: torch.Tensor
    pos_PK: torch.Tensor
    rows_N: torch.Tensor
    weights_N: torch.Tensor | None


def _check_ids(ids_PK: torch.Tensor, weights_PK: torch.Tensor | None, num_local_experts: int) -> None:
    if ids_PK.dim() != 2 or ids_PK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids_PK must be int32/int64 [P, K], got {ids_PK.dtype} {tuple(ids_PK.shape)}")
    if weights_PK is not None and (weights_PK.shape != ids_PK.shape or not weights_PK.is_floating_point()):
        raise ValueError(f"weights_PK must be float {list(ids_PK.shape)}, got {weights_PK.dtype} "
                         f"{tuple(weights_PK.shape)}")
    if num_local_experts < 1:
        raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")


def sort_pairs(ids_PK: torch.Tensor, num_local_experts: int, *, first_expert: int = 0,
               weights_PK: torch.Tensor | None = None, num_experts: int | None = None,
               bad_id_1: torch.Tensor | None = None) -> PairLayout:
    """Sort the (row, slot) pairs of ids_PK by local expert with the three layout kernels (any device the
    kernels run on: CUDA, or CPU tensors under the Triton interpreter). No host sync.

    Args:
        ids_PK: int32/int64 [P, K] global expert ids, -1 none; pair (p, k) belongs to local expert
            ids_PK[p, k] - first_expert when that lies in [0, num_local_experts).
        weights_PK: optional float [P, K]: gives weights_N.
        num_experts: E; with it, ids outside [-1, E) are caught (pos BAD_POS) and one of them is stored
            into bad_id_1 (int64 [1], which must be given; it is left as it was when every id is valid).
    """
    _check_ids(ids_PK, weights_PK, num_local_experts)
    check = num_experts is not None
    if check and (bad_id_1 is None or bad_id_1.dtype != torch.int64 or bad_id_1.numel() != 1):
        raise ValueError("a checked layout (num_experts given) needs bad_id_1, int64 [1]")
    P, K = ids_PK.shape
    L, dev = num_local_experts, ids_PK.device
    blocks = layout_blocks(P, K)
    ids_PK = ids_PK.contiguous()
    table_BL = torch.empty(blocks.blocks, L, dtype=torch.int32, device=dev)
    rows_N = torch.empty(P * K, dtype=torch.int32, device=dev)
    E = num_experts if check else 1 << 62
    bad = bad_id_1 if check else table_BL
    BLOCK_L = triton.next_power_of_2(L)
    if P:
        _count_kernel[(blocks.blocks,)](ids_PK, table_BL, bad, rows_N, P, first_expert, E, K=K, L=L,
                                        BLOCK_S=blocks.block_s, BLOCK_K=blocks.block_k, BLOCK_L=BLOCK_L, CHECK=check,
                                        num_warps=4)
    counts_L, offsets_L1, start_BL = scan(table_BL)
    pos_PK = torch.empty(P, K, dtype=torch.int32, device=dev)
    weights_N = None if weights_PK is None else torch.empty(P * K, dtype=torch.float32, device=dev)
    if P:
        w = weights_PK.contiguous() if weights_PK is not None else rows_N
        _place_kernel[(blocks.blocks,)](ids_PK, w, start_BL, pos_PK, rows_N, rows_N if weights_N is None else weights_N,
                                        P, first_expert, E, K=K, L=L, BLOCK_S=blocks.block_s, BLOCK_K=blocks.block_k,
                                        CHECK=check, HAS_W=weights_N is not None, num_warps=4)
    return PairLayout(counts_L=counts_L, offsets_L1=offsets_L1, pos_PK=pos_PK, rows_N=rows_N, weights_N=weights_N)


def sort_pairs_ref(ids_PK: torch.Tensor, num_local_experts: int, *, first_expert: int = 0,
                   weights_PK: torch.Tensor | None = None, num_experts: int | None = None,
                   bad_id_1: torch.Tensor | None = None) -> PairLayout:
    """`sort_pairs` in torch (any device; the layout the kernels make, bit for bit, except weights_N past
    the valid rows, which are zero here). No host sync."""
    _check_ids(ids_PK, weights_PK, num_local_experts)
    P, K = ids_PK.shape
    L, dev = num_local_experts, ids_PK.device
    ids = ids_PK.reshape(-1).long()
    local = ids - first_expert
    bad = torch.zeros_like(ids, dtype=torch.bool) if num_experts is None else (ids < -1) | (ids >= num_experts)
    mine = (local >= 0) & (local < L) & ~bad
    if num_experts is not None and bad_id_1 is not None and ids.numel():
        worst = torch.where(bad, ids, torch.full_like(ids, -(1 << 62))).max()
        bad_id_1.copy_(torch.where(bad.any(), worst, bad_id_1.reshape(())).reshape(1))
    key = torch.where(mine, local, torch.full_like(local, L))
    order_N = torch.argsort(key, stable=True)
    counts_L = torch.zeros(L + 1, dtype=torch.int32, device=dev).scatter_add_(
        0, key, torch.ones_like(key, dtype=torch.int32))[:L]
    offsets_L1 = torch.zeros(L + 1, dtype=torch.int32, device=dev)
    torch.cumsum(counts_L, 0, out=offsets_L1[1:])
    pos_N = torch.empty_like(order_N)
    pos_N[order_N] = torch.arange(order_N.numel(), device=dev)
    pos_N = torch.where(mine, pos_N, -1)
    pos_N = torch.where(bad, BAD_POS, pos_N)
    valid_N = torch.arange(P * K, device=dev) < offsets_L1[L]
    rows_N = torch.where(valid_N, order_N // K, 0).to(torch.int32)
    weights_N = None
    if weights_PK is not None:
        weights_N = torch.where(valid_N, weights_PK.reshape(-1).float()[order_N], 0.0)
    return PairLayout(counts_L=counts_L, offsets_L1=offsets_L1, pos_PK=pos_N.reshape(P, K).to(torch.int32),
                      rows_N=rows_N, weights_N=weights_N)


@triton.jit
def _gather_sum_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, P, D, K: tl.constexpr, WEIGHTED: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, c): rows [i * ROWS, (i + 1) * ROWS) of out, columns [c * BLOCK_D, (c + 1) * BLOCK_D):
    out[p] = sum_k (w[p, k] *) y[pos[p, k]] over pos >= 0, in float32; NaN where a pos is BAD_POS."""
    p = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    pmask = p < P
    cmask = c < D
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    poisoned = tl.zeros([ROWS], dtype=tl.int32)
    for k in tl.static_range(K):
        pos = tl.load(pos_ptr + p.to(tl.int64) * K + k, mask=pmask, other=-1)
        poisoned |= (pos == BAD_POS_C).to(tl.int32)
        take = pos >= 0
        rows = tl.load(y_ptr + pos.to(tl.int64)[:, None] * D + c[None, :], mask=take[:, None] & cmask[None, :],
                       other=0.0).to(tl.float32)
        if WEIGHTED:
            rows *= tl.load(w_ptr + p.to(tl.int64) * K + k, mask=pmask & take, other=0.0).to(tl.float32)[:, None]
        acc += rows
    acc = tl.where(poisoned[:, None] != 0, float("nan"), acc)
    tl.store(out_ptr + p.to(tl.int64)[:, None] * D + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=pmask[:, None] & cmask[None, :])


def gather_sum(y_ND: torch.Tensor, pos_PK: torch.Tensor, out_dtype: torch.dtype,
               weights_PK: torch.Tensor | None = None) -> torch.Tensor:
    """out_PD[p] = sum over k of (weights_PK[p, k] *) y_ND[pos_PK[p, k]], pairs with pos < 0 skipped, in
    float32 and stored once in out_dtype; rows with a pos of BAD_POS are NaN. One kernel, no host sync.

    y_ND: [N, D] any float dtype; pos_PK: int32 [P, K], each entry -1, BAD_POS or in [0, N);
    weights_PK: optional float [P, K]."""
    if pos_PK.dim() != 2 or pos_PK.dtype != torch.int32:
        raise ValueError(f"pos_PK must be int32 [P, K], got {pos_PK.dtype} {tuple(pos_PK.shape)}")
    if weights_PK is not None and weights_PK.shape != pos_PK.shape:
        raise ValueError(f"weights_PK must be [P, K] = {list(pos_PK.shape)}, got {tuple(weights_PK.shape)}")
    P, K = pos_PK.shape
    D = y_ND.shape[1]
    out = torch.empty(P, D, dtype=out_dtype, device=y_ND.device)
    if P == 0 or D == 0:
        return out
    if K == 0:
        return out.zero_()
    block_d = min(GATHER_COLUMNS, triton.next_power_of_2(D))
    rows = max(1, min(GATHER_ELEMENTS // block_d, triton.next_power_of_2(P)))
    w = weights_PK.contiguous() if weights_PK is not None else pos_PK
    _gather_sum_kernel[(triton.cdiv(P, rows), triton.cdiv(D, block_d))](
        y_ND.contiguous(), pos_PK.contiguous(), w, out, P, D, K=K, WEIGHTED=weights_PK is not None, ROWS=rows,
        BLOCK_D=block_d, num_warps=GATHER_WARPS)
    return out


def gather_sum_ref(y_ND: torch.Tensor, pos_PK: torch.Tensor, out_dtype: torch.dtype,
                   weights_PK: torch.Tensor | None = None) -> torch.Tensor:
    """`gather_sum` in torch (float32 sums in slot order, as the kernel adds them)."""
    P, K = pos_PK.shape
    out = torch.zeros(P, y_ND.shape[1], dtype=torch.float32, device=y_ND.device)
    for k in range(K):
        pos = pos_PK[:, k].long()
        take = pos >= 0
        rows = torch.where(take[:, None], y_ND[pos.clamp(min=0)].float() if y_ND.shape[0] else 0.0, 0.0)
        if weights_PK is not None:
            rows = rows * torch.where(take, weights_PK[:, k].float(), 0.0)[:, None]
        out += rows
    out[(pos_PK == BAD_POS).any(1)] = float("nan")
    return out.to(out_dtype)
