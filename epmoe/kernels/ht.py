"""Triton kernels of the `ht` dispatcher: peer stores into symmetric buffers, device-side signals.

Every peer buffer is reached through an int64 table of its address on each rank (epmoe/symm.py); a
kernel casts `table[r]` to a pointer. Buffers that change per call exist twice (parity = epoch % 2,
the epoch being a device counter in the workspace), flags are monotonic: a sender adds 1 per
signalling program (or once) per call and a receiver waits until a flag reaches epoch * programs, or
(the combine's per-item flags) the sender stores the epoch and the receiver waits until it is there.

The sender numbers its (token, destination) pairs in two kernels (per-block counts, then the prefix
over blocks), the second of which also sends, ahead of the rows, each destination's token and pair
counts and the tokens' ids and weights (signalled once, by its last program to finish); then the rows'
kernel (dense mode: the rows' kernel first, `dispatch_send_dense`, the numbering beside it). So the
receiver knows its batch size and lays the batch out while the rows travel. The layout (expert-sorted
batch) costs work proportional to the (row, slot) pairs received, not to the capacity, and moves no
rows: a count kernel and a place kernel visit blocks of received rows (blocks past a source's count
do nothing) and write each batch row's index into the receive buffer, which the experts read through;
the counts are read on the device.

The combine is one kernel of items taken by ticket (`_combine_kernel`): remote items send peers their
tokens' partial rows, local items, trailing them, sum this rank's tokens as their partial rows arrive.

Shape letters: T tokens on this rank, D hidden size, K top-k, L local experts, R ranks,
C capacity (max tokens per rank), P = R*C receive rows, G = ceil(D / 128) fp8 scale groups,
B = R * ceil(C / BLOCK_S) blocks of received rows, N batch rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import FP8_BLOCK
from .quant import divide_rn
from .layout import (SCAN_BLOCKS, SCAN_EXPERTS, SCAN_SUM_STEP, LayoutBlocks, block_pairs, count_block, layout_blocks,
                     place_block, scan_experts)
from .sync import DeviceWait, spin_until


@dataclass(frozen=True)
class HtLaunch:
    """Launch config of the ht kernels (the same on every rank, fixed for a workspace's lifetime: flags
    count one signal per program and call, and the combine's ready flags are per item of its rows).

    programs, num_warps: persistent programs of the dispatch send kernel, and warps of each; `rows(D)`
        rows per program step there.
    combine_programs, combine_warps: programs of the combine kernel (they take items by ticket, so any
        number is deadlock-free), and warps of each.
    combine_registers: the most registers a combine thread may take (ptxas's maxnreg, up to the 255 a
        thread can have; None: ptxas's own choice), so that combine_programs fit on the SMs at once.
    combine_chunk, combine_step: the combine gathers rows in column chunks of combine_chunk elements,
        combine_step elements (rows x chunk) at a time; an item of its work is that many rows
        (`combine_tiles`).
    combine_lag: how far, in waves of combine_programs tickets, the combine's local items (sums of this
        rank's tokens) trail its remote items (partial rows sent to the peers), so that a local item
        rarely waits for the peers' partials.
    """

    programs: int
    num_warps: int
    combine_programs: int
    combine_warps: int
    combine_chunk: int = 1024
    combine_step: int = 2048
    combine_lag: float = 1.0
    combine_registers: int | None = None

    def __post_init__(self) -> None:
        for name in ("programs", "combine_programs"):
            if getattr(self, name) < 1:
                raise ValueError(f"HtLaunch.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_warps", "combine_warps", "combine_chunk", "combine_step"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"HtLaunch.{name} must be a power of two, got {value}")
        if not 0 <= self.combine_lag < float("inf"):  # a negative lag would hand out local items early
            raise ValueError(f"HtLaunch.combine_lag must be finite and >= 0, got {self.combine_lag}")
        if self.combine_registers is not None and not 1 <= self.combine_registers <= 255:
            raise ValueError(f"HtLaunch.combine_registers must be None or in [1, 255], got {self.combine_registers}")

    @staticmethod
    def rows(hidden: int) -> int:
        """Rows a dispatch send program has in flight per step: about 16K elements of (padded) row."""
        return max(1, min(4, 16384 // triton.next_power_of_2(hidden)))

    def combine_tiles(self, hidden: int) -> tuple[int, int]:
        """(columns per gathered load, rows per step and item) of the combine kernel for rows of `hidden`."""
        chunk = min(triton.next_power_of_2(hidden), self.combine_chunk)
        return chunk, max(1, self.combine_step // chunk)

    def combine_lag_iterations(self, world_size: int) -> int:
        """combine_lag in iterations of the ticket order (world_size tickets each)."""
        return -(-int(self.combine_lag * self.combine_programs) // world_size)


def ht_launch(row_bytes: int, device: torch.device) -> HtLaunch:
    """Pure function of the row size and the device: dispatch send programs on SEND_SM_SHARE of the SMs
    on a GPU, one each (peer stores measured 338-356 GB/s per direction with 132 programs on H200,
    297-328 with 66; the numbering and layout kernels run beside the send kernel, and with every SM
    sending they finished late: 2 H200s, fp8 dense dispatch, ready at 4096 / 8192 tokens 128-131 / 225
    us with 132 programs, 117-118 / 196 with 106, 114-115 / 212 with 92, scripts/ht_probe.py,
    2026-11-30; the default's 105 gave 112 / 195-196 in `epmoe bench dispatch`); COMBINE_PER_SM
    combine programs of COMBINE_WARPS warps per SM, their registers capped at what lets them all fit
    (`registers_per_thread`), items of COMBINE_STEP elements (one row of D 7168, in chunks of
    COMBINE_CHUNK), local items COMBINE_LAG waves behind; a few programs under the interpreter.
    A combine program spends ~20 µs (estimated: its share of the HBM rate over the bytes it gathers) on an
    item of two rows of D 7168 (K 8), so the ticket order's tail costs about half an item: smaller
    items (more fences and flags, a shorter tail) won. 2 H200s, bf16, combine at 4096 / 8192 tokens
    (scripts/ht_probe.py, notes/runs/2026-11-30-s15, calls 4-6):
    4 per SM, items of 2 rows x chunks of 1024, lag 1: 208-210 / 380-384 µs; 1 row x 1024: 204-205
    / 386-387; 1 row x 2048: 197-198 / 375; the same at 5, 6, 7 per SM: 192-194 / 362-365, 192-194 /
    361-363, 194-195 / 357-358; 6 per SM at lag 1.5, 2, 3: 190-191 / 352-353, 192-193 / 354-355,
    198-200 / 361-362; 8 per SM x 1024: 195-198 / 359; 3 x 8 warps: 210 / 403; items of 4 or 8 rows
    (a row tile of 2 looped, one release): 221-226 / 391-396, 258-272 / 427-431 (call 2). Capping
    the registers is what lets the programs share an SM: left to itself ptxas of triton 3.6 took 145
    registers for the 4-per-SM combine of 2-row items (three programs an SM), which cost 224-229 µs
    against 212-213 capped (notes/runs/2026-11-30-s13, call 5)."""
    if device.type != "cuda":
        return HtLaunch(programs=2, num_warps=1, combine_programs=3, combine_warps=1, combine_chunk=COMBINE_CHUNK,
                        combine_step=COMBINE_STEP, combine_lag=COMBINE_LAG)
    return gpu_launch(row_bytes, torch.cuda.get_device_properties(device).multi_processor_count)


def gpu_launch(row_bytes: int, sms: int) -> HtLaunch:
    """`ht_launch` on a GPU of `sms` SMs (a pure function of both: tests compile with it)."""
    return HtLaunch(programs=max(1, int(SEND_SM_SHARE * sms)), num_warps=8 if row_bytes >= 4096 else 4,
                    combine_programs=COMBINE_PER_SM * sms, combine_warps=COMBINE_WARPS,
                    combine_registers=registers_per_thread(COMBINE_PER_SM, COMBINE_WARPS),
                    combine_chunk=COMBINE_CHUNK, combine_step=COMBINE_STEP, combine_lag=COMBINE_LAG)


def registers_per_thread(programs: int, warps: int) -> int:
    """The most registers a thread of `programs` programs of `warps` warps each may take for them all to
    fit on one SM (SM_REGISTERS; ptxas allocates in steps of 8 a thread, at most 255)."""
    return min(255, SM_REGISTERS // (programs * warps * 32) // 8 * 8)


# share of the SMs that run a dispatch send program
SEND_SM_SHARE = 0.8
# combine programs an SM and warps of each
COMBINE_PER_SM = 6
COMBINE_WARPS = 4
# 32-bit registers of an SM (every NVIDIA GPU since Volta, H100 / H200 included)
SM_REGISTERS = 65536


# combine: columns per gathered load, elements (rows x columns) per program step and item, and how many
# waves of tickets its local items trail its remote ones
COMBINE_CHUNK = 2048
COMBINE_STEP = 2048
COMBINE_LAG = 1.5


# layout_count's size word: bits 56-62 the epoch mod SIZE_EPOCHS, 32-55 the largest chunk count of any
# rank (below MAX_CHUNKS), 0-31 the batch's valid rows, or SIZE_FAILED when a wait gave up. The host
# word of a parity holds epoch - 2's until the layout of epoch writes it: 7 bits tell them apart.
SIZE_FAILED = tl.constexpr(0xFFFFFFFF)
SIZE_EPOCHS = tl.constexpr(128)
MAX_CHUNKS = tl.constexpr(1 << 24)


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
            tl.store(_peer(recv_count_peers, r, tl.int32) + mine, tl.sum(tl.where(rr == r, rows, 0), axis=0))
            tl.store(_peer(pairs_peers, r, tl.int32) + mine, tl.sum(tl.where(rr == r, pairs, 0), axis=0))
            tl.store(_peer(chunks_peers, r, tl.int32) + mine, chunks)
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
        tl.store(_peer(recv_ids_peers, r, tl.int32) + row_at[:, None] * K + kk[None, :], lid, mask=smask)
        tl.store(_peer(recv_w_peers, r, tl.float32) + row_at[:, None] * K + kk[None, :], w, mask=smask)
    tl.debug_barrier()
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys") == NT - 1:  # the last program
        tl.store(done_ptr, 0)
        _signal(flag_peers, rank, R)


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
            dst = _peer(recv_x_peers, r, row_out.dtype) + row_at[:, None, None] * D + cols[None, :, :]
            tl.store(tl.multiple_of(dst, [1, 16, 16]), row_out, mask=xmask & sent[:, None, None])
            if FP8:
                tl.store(_peer(recv_scale_peers, r, tl.float32) + row_at[:, None] * G + gg[None, :], scale,
                         mask=sent[:, None] & (gg < G)[None, :])
    _signal(flag_peers, rank, R)


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
    dst = _peer(comb_peers, r, y_ptr.dtype.element_ty) + ((parity * R + rank) * C + s).to(tl.int64)[:, None] * D
    cols = tl.arange(0, CHUNK)
    for c0 in tl.static_range(0, D, CHUNK):
        c = c0 + cols
        cmask = c < D
        acc = _weighted_chunk(y_ptr, pos_RK, w_RK, c, cmask, D, K, BLOCK_K, CHUNK, ROWS)
        tl.store(tl.multiple_of(dst + c[None, :], [1, 16]), acc.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=smask[:, None] & cmask[None, :])
    tl.debug_barrier()  # every thread's stores are issued before the one release below
    tl.atomic_xchg(_peer(ready_peers, r, tl.int64) + rank * NI + i, epoch, sem="release", scope="sys")


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
    # invalidation each: combine 214-215 against 209-212 µs at 4096 tokens, 389-392 against 382-383 at 8192
    # (2 H200s, bf16, notes/runs/2026-11-30-s14 call 5)
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


# number_pairs: tokens per program, and blocks per step of the prefix over earlier blocks
NUMBER_BLOCK = 128
NUMBER_STEP = 1024


def number_pairs(ids_TK: torch.Tensor, weights_TK: torch.Tensor, seq_1: torch.Tensor, done_1: torch.Tensor,
                 world_size: int, capacity: int, num_local_experts: int, peers: dict[str, torch.Tensor], rank: int,
                 dense: bool = False, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Number the (token, destination rank) pairs, advance the epoch, and send every rank, ahead of the
    rows, what it needs to size and lay out its batch.

    Returns slot_TR int32 [T, R]: row of token t in rank r's receive region (tokens keep their order;
    dense: row t itself, every rank getting all T rows, those of tokens not meant for it with ids -1),
    -1 when none of its ids is on r; epoch_1 int64 [1]: this call's epoch (seq_1 after its increment
    on the device). Stores the tokens and the (token, slot) pairs sent to rank r, and `chunks` (the
    caller's chunk count, in [1, MAX_CHUNKS): `layout_count` passes the largest on to the host), into
    r's "recv_count", "pairs" and "chunks" buffers (int32 [2, R], at [epoch % 2, rank]) and each token's
    destination-local ids and weights into each destination's "recv_ids" / "recv_w" at the token's slot,
    then signals r's "meta_flag"[rank] once (peers: address tables, int64 [R], of those buffers).
    ids_TK: int32/int64 [T, K] global ids, -1 none; weights_TK: float32 [T, K]; seq_1: int64 [1], the
    previous call's epoch; done_1: int32 [1], zero: a counter of the second kernel's finished programs.
    Two kernels (T / NUMBER_BLOCK programs each), no host sync."""
    if not 1 <= chunks < MAX_CHUNKS.value:
        raise ValueError(f"chunks must be in [1, {MAX_CHUNKS.value}), got {chunks}")
    T, K = ids_TK.shape
    R = world_size
    dev = ids_TK.device
    slot_TR = torch.empty(T, R, dtype=torch.int32, device=dev)
    epoch_1 = torch.empty(1, dtype=torch.int64, device=dev)
    NT = max(1, triton.cdiv(T, NUMBER_BLOCK))
    table_2TR = torch.empty(2, NT, R, dtype=torch.int32, device=dev)
    BLOCK_R = triton.next_power_of_2(R)
    _number_block_kernel[(NT,)](ids_TK, slot_TR, table_2TR, seq_1, epoch_1, T, NT, R=R, K=K, L=num_local_experts,
                                BLOCK_T=NUMBER_BLOCK, BLOCK_R=BLOCK_R, DENSE=dense, num_warps=4)
    _number_fix_kernel[(NT,)](ids_TK, weights_TK, slot_TR, table_2TR, seq_1, epoch_1, done_1,
                              peers["recv_count"], peers["pairs"], peers["chunks"], peers["recv_ids"], peers["recv_w"],
                              peers["meta_flag"], T, NT, rank, chunks, R=R, C=capacity, K=K, L=num_local_experts,
                              BLOCK_K=triton.next_power_of_2(K), BLOCK_T=NUMBER_BLOCK, BLOCK_R=BLOCK_R,
                              BLOCK_NT=NUMBER_STEP, DENSE=dense, num_warps=4)
    return slot_TR, epoch_1


def dispatch_send(x_TD: torch.Tensor, slot_TR: torch.Tensor, seq_1: torch.Tensor, peers: dict[str, torch.Tensor],
                  rank: int, capacity: int, fp8: bool, launch: HtLaunch) -> None:
    """Store every token's row once into each destination rank's receive region and signal.

    x_TD: [T, D] cfg.dtype; slot_TR: int32 [T, R], the token's row at rank r (-1: not sent there);
    seq_1: int64 [1] this call's epoch (already incremented); peers: address tables (int64 [R]) of
    "recv_x", "recv_scale" (fp8), "dispatch_flag".
    """
    _send(x_TD, slot_TR, seq_1, peers, rank, slot_TR.shape[1], capacity, fp8, launch, dense_parity=-1)


def dispatch_send_dense(x_TD: torch.Tensor, epoch: int, peers: dict[str, torch.Tensor], rank: int, world_size: int,
                        capacity: int, fp8: bool, launch: HtLaunch) -> None:
    """dispatch_send with slot = t at every rank (number_pairs(dense=True)'s slots), needing neither the
    slots nor the device epoch: so it can run before the numbering (or beside it). epoch: this call's
    (the host's count, equal to the device's)."""
    # (x_TD stands in for the slot and epoch pointers, which the DENSE kernel does not read)
    _send(x_TD, x_TD, x_TD, peers, rank, world_size, capacity, fp8, launch, dense_parity=epoch % 2)


def _send(x_TD, slot_TR, seq_1, peers, rank, R, capacity, fp8, launch, dense_parity):
    T, D = x_TD.shape
    G = -(-D // FP8_BLOCK)
    _dispatch_send_kernel[(launch.programs,)](
        x_TD, slot_TR, seq_1, peers["recv_x"], peers["recv_scale"] if fp8 else peers["recv_x"],
        peers["dispatch_flag"], T, rank, dense_parity, R=R, C=capacity, D=D, G=G, FP8=fp8,
        BLOCK_G=triton.next_power_of_2(G), ROWS=launch.rows(D), PROGRAMS=launch.programs, DENSE=dense_parity >= 0,
        num_warps=launch.num_warps)


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


def combine_items(capacity: int, hidden: int, launch: HtLaunch) -> int:
    """NI: items (of combine_tiles(hidden)[1] rows) of one source rank's receive region: the combine's
    ready flags per source rank."""
    return -(-capacity // launch.combine_tiles(hidden)[1])


def combine(y_ND: torch.Tensor, pos_PK: torch.Tensor, weights_PK: torch.Tensor, counts_R: torch.Tensor,
            slot_TR: torch.Tensor, seq_1: torch.Tensor, comb_2RCD: torch.Tensor, ready_RI: torch.Tensor,
            control_3: torch.Tensor, peers: dict[str, torch.Tensor], out_TD: torch.Tensor, rank: int,
            launch: HtLaunch, wait: DeviceWait, remote: bool, local: bool) -> None:
    """The combine, or one half of it. remote: reduce each row received from a peer (its local
    results, weighted, fp32, rounded to y's dtype) into the peer's "comb" region and stamp the peer's
    "comb_ready" flag of its item with the epoch. local: out_TD[t] = this rank's own reduced row of
    token t + the peers' partial rows (rank order), once they are there (spins on ready_RI, or until
    `wait` gives up). Both at once (real ranks: one kernel, the local items trailing the remote ones by
    launch.combine_lag), or remote on every rank and then local (emulated ranks, which run in turn).

    y_ND: expert outputs [N, D] cfg.dtype; pos_PK: int32 [P, K] row of y for each received (row, slot)
    pair, -1 none; weights_PK: float32 [P, K]; counts_R: int32 [R] rows received from each rank;
    slot_TR: int32 [T, R] this rank's tokens' rows at each rank, -1 none; seq_1: int64 [1] the epoch
    (remote: of the previous call, advanced by the kernel, so that no other kernel needs to; local only:
    of this call); comb_2RCD: this rank's combine region; ready_RI: int64 [R, NI] this
    rank's ready flags (combine_items); control_3: int32 [3], the tickets and finished programs (zero,
    restored after) and then the error flag, which must be wait.err_1; peers: address tables of "comb"
    and "comb_ready"; out_TD: [T, D] y's dtype, written by the local half.
    """
    if wait.err_1.data_ptr() != control_3[2:].data_ptr():
        raise ValueError("the combine's error flag is control_3[2]: pass a DeviceWait on it")
    _, R, C, D = comb_2RCD.shape
    T, K = slot_TR.shape[0], pos_PK.shape[1]
    chunk, rows = launch.combine_tiles(D)
    _combine_kernel[(launch.combine_programs,)](
        y_ND, pos_PK, weights_PK, counts_R, slot_TR, seq_1, comb_2RCD, peers["comb"], ready_RI, peers["comb_ready"],
        control_3, out_TD, T, rank, launch.combine_lag_iterations(R) if remote and local else 0, R=R, C=C,
        NI=ready_RI.shape[1], D=D, K=K, BLOCK_K=triton.next_power_of_2(K), CHUNK=chunk, ROWS=rows,
        REMOTE=remote, LOCAL=local, TIMEOUT_NS=wait.timeout_ns, INTERPRET=wait.interpret,
        num_warps=launch.combine_warps, maxnreg=launch.combine_registers)


def layout_count(recv_ids: torch.Tensor, recv_count: torch.Tensor, seq_1: torch.Tensor, blocks: LayoutBlocks,
                 num_local_experts: int, flag_R: torch.Tensor, pairs_2R: torch.Tensor, chunks_2R: torch.Tensor,
                 size_1: torch.Tensor, wait: DeviceWait) -> torch.Tensor:
    """Per block of received rows, pairs of each local expert, once the rows' senders' numbering of
    epoch seq_1 (int64 [1]) has signalled flag_R (spins on the device, or until `wait` gives up; no host
    sync).

    Returns table_BL int32 [B, L]. Writes size_1 int64 [1] (pinned host memory on a GPU, which the
    kernel writes through to; read it with `batch_size`): the epoch, the largest chunk count of any rank
    and the (row, slot) pairs received from all ranks (the batch's valid rows), or that a wait of this
    rank gave up. recv_ids: int32 [2, R, C, K] local ids (-1 none), of parity seq_1 % 2 valid up to
    recv_count[parity, r]; flag_R: int64 [R] the numbering's signals ("meta_flag"); pairs_2R, chunks_2R:
    int32 [2, R] the pairs each rank sends here and its chunk count, per parity.
    """
    _, R, C, K = recv_ids.shape
    L, NB = num_local_experts, blocks.blocks
    table_BL = torch.empty(R * NB, L, dtype=torch.int32, device=recv_ids.device)
    _layout_count_kernel[(R, NB)](recv_ids, recv_count, seq_1, table_BL, flag_R, pairs_2R, chunks_2R, size_1,
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


def layout_scan(table_BL: torch.Tensor, recv_count: torch.Tensor, seq_1: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the per-block counts table_BL int32 [B, L]: counts_L int32 [L], offsets_L1 int32 [L+1]
    (exclusive prefix sum), start_BL int32 [B, L] (batch row of each block's first pair of each
    expert) and recv_counts_R int32 [R] (rows received from each rank, parity seq_1 % 2 of
    recv_count [2, R]; seq_1 int64 [1], the epoch). One program per SCAN_EXPERTS experts, no host sync."""
    B, L = table_BL.shape
    R = recv_count.shape[1]
    dev = table_BL.device
    counts_L = torch.empty(L, dtype=torch.int32, device=dev)
    offsets_L1 = torch.empty(L + 1, dtype=torch.int32, device=dev)
    start_BL = torch.empty_like(table_BL)
    recv_counts_R = torch.empty(R, dtype=torch.int32, device=dev)
    BLOCK_L = triton.next_power_of_2(L)
    _layout_scan_kernel[(triton.cdiv(L, SCAN_EXPERTS),)](
        table_BL, recv_count, seq_1, counts_L, offsets_L1, start_BL, recv_counts_R, B, R=R, L=L,
        BLOCK_T=max(1, SCAN_SUM_STEP // BLOCK_L), BLOCK_B=SCAN_BLOCKS, BLOCK_E=SCAN_EXPERTS, BLOCK_L=BLOCK_L,
        BLOCK_R=triton.next_power_of_2(R), num_warps=8)
    return counts_L, offsets_L1, start_BL, recv_counts_R


def layout_place(recv_ids: torch.Tensor, recv_w: torch.Tensor, recv_count: torch.Tensor, seq_1: torch.Tensor,
                 start_BL: torch.Tensor, blocks: LayoutBlocks, max_rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert-sorted batch as an index, and combine's routing state. No host sync.

    Returns pos_PK int32 [P, K] (batch row of each received pair, -1 none; rows past a source's count
    are left unset), weights_PK float32 [P, K], and rows_N int32 [max_rows]: the batch's row index into
    recv_x viewed as [2 * R * C, D] (0 past the valid rows). start_BL: int32 [B, L], the batch row of
    each block's first pair of each expert; max_rows: at least the valid rows; seq_1: int64 [1], the
    epoch.
    """
    _, R, C, K = recv_ids.shape
    L = start_BL.shape[1]
    dev = recv_ids.device
    pos_PK = torch.empty(R * C, K, dtype=torch.int32, device=dev)
    weights_PK = torch.empty(R * C, K, dtype=torch.float32, device=dev)
    rows_N = torch.zeros(max_rows, dtype=torch.int32, device=dev)
    _layout_place_kernel[(R, blocks.blocks)](
        recv_ids, recv_w, recv_count, seq_1, start_BL, pos_PK, weights_PK, rows_N, max_rows, R=R, C=C, K=K,
        L=L, NB=blocks.blocks, BLOCK_S=blocks.block_s, BLOCK_K=blocks.block_k, num_warps=4)
    return pos_PK, weights_PK, rows_N
