"""Triton kernels of the `ll` dispatcher: peer stores into fixed symmetric buffers, device-side signals.

Shape letters: T tokens on this rank, D hidden size, K top-k, E global experts, L local experts,
R ranks, Tmax = cfg.max_tokens_per_rank, M = R * Tmax rows per expert slot, G = ceil(D / 128).

Four kernels, one per phase (the protocol they implement is described in epmoe/dispatch/ll.py):
  dispatch_send: one program per token; remote atomic_add on the destination expert's counter gives
      the row; the row (fp8-quantized in registers when asked) is stored straight into the peer's
      recv_x; the last program to finish signals every rank (release, system scope).
  dispatch_recv: one program; waits for R signals, moves the counters out (counts_L) and zeroes them.
  combine_send: a fixed grid striding over (source token, source rank); stores each slot's row (or
      the weighted sum of the slots held here) into the source rank's combine buffer; the last
      program signals every rank.
  combine_recv: one program per token; waits for R signals and sums the rows in float32.

Launchers validate nothing: the dispatcher (their only caller) owns the buffers and checks inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import FP8_BLOCK

# signal [2] and seq [2] hold slot 0 for dispatch, slot 1 for combine.
FINISH_SLOTS = 3  # int32 finish counters: dispatch_send, combine_send, combine_recv
SPIN_LIMIT = tl.constexpr(1 << 27)  # polls (a minute or more) before a wait gives up and flags an error


@dataclass(frozen=True)
class LLLaunch:
    """Launch settings of the `ll` kernels for one shape on one device.

    chunk: columns each inner step moves (a multiple of 128, a power of two).
    num_warps: warps per program.
    combine_programs: grid of combine_send (it strides over R * Tmax (token, rank) items).
    interpret: running under the Triton interpreter (CPU tensors); turns on an exact fp8 rounding path
        that works around the interpreter's float8 cast.
    """

    chunk: int
    num_warps: int
    combine_programs: int
    interpret: bool


def ll_launch(hidden_size: int, world_size: int, max_tokens: int, device: torch.device) -> LLLaunch:
    """Launch settings as a pure function of (D, R, Tmax, device)."""
    chunk = min(1024, max(FP8_BLOCK, triton.next_power_of_2(hidden_size)))
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    return LLLaunch(chunk=chunk, num_warps=8 if chunk >= 1024 else 4,
                    combine_programs=max(1, min(world_size * max_tokens, 2 * sms)),
                    interpret=device.type == "cpu")


@triton.jit
def _round_e4m3(v):
    """Round float32 values in [-448, 448] to the nearest e4m3 value (ties to even), in float32.

    Used only under the interpreter, whose float8 cast gets mantissa carries wrong; after this the
    cast is exact.
    """
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = v / ulp
    y = (y + 12582912.0) - 12582912.0  # round to an integer, ties to even (|y| < 2^22)
    return y * ulp


@triton.jit
def _wait_geq(ptr, target, err_ptr):
    """Spin until the int64 at ptr (written by other GPUs) reaches target, then acquire.

    After SPIN_LIMIT polls it stops waiting and sets err_ptr[0] = 1 (a peer is gone or the calls
    are out of order), so a protocol error shows up as a flag instead of a hung GPU; once the flag
    is set, waits stop spinning (results are garbage until the dispatcher is rebuilt). The limit is
    generous because a peer's first call may still be compiling its kernels.
    """
    healthy = tl.load(err_ptr, volatile=True) == 0  # after one time-out, later waits do not spin
    cur = tl.load(ptr, volatile=True)
    polls = 0
    while (cur < target) & (polls < SPIN_LIMIT) & healthy:
        cur = tl.load(ptr, volatile=True)
        polls += 1
    if cur < target:
        tl.atomic_xchg(err_ptr, 1, sem="relaxed", scope="gpu")
    tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _finish(fin_ptr, sig_ptr, sig_dR, slot, R):
    """Count this program done; the last program of the grid resets the counter and signals every rank.

    Call after tl.debug_barrier(), so the program's stores are ordered before its count (release) and
    so, through the last program's acquire, before the signal (release, system scope).
    """
    done = tl.atomic_add(fin_ptr, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(fin_ptr, 0, sem="relaxed", scope="sys")
        for r in range(R):
            tl.atomic_add(sig_ptr + tl.load(sig_dR + r) + slot, 1, sem="release", scope="sys")


@triton.jit
def _dispatch_send_kernel(
    x_ptr, ids_ptr, w_ptr, T,
    recv_x_ptr, recv_x_dR, recv_scale_ptr, recv_scale_dR, idx_ptr, idx_dR, wtab_ptr, wtab_dR,
    cnt_ptr, cnt_dR, src_tokens_ptr, src_tokens_dR, sig_ptr, sig_dR,
    route_ptr, wloc_ptr, fin_ptr,
    rank, R, E, L, M, Tmax, D, K, G,
    QUANT: tl.constexpr, SEND_WEIGHTS: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    if pid < T:
        ids = tl.load(ids_ptr + pid * K + ks, mask=kmask, other=-1).to(tl.int32)
        valid = kmask & (ids >= 0) & (ids < E)
        dest = tl.where(valid, ids // L, 0)
        local = tl.where(valid, ids - dest * L, 0)
        cnt = cnt_ptr + tl.load(cnt_dR + dest) + local  # the destination's counter of each slot
        pos = tl.atomic_add(cnt, 1, mask=valid, sem="relaxed", scope="sys")
        sent = valid & (pos < M)  # pos >= M only if a token repeats an expert; such slots are dropped
        row = tl.where(sent, local.to(tl.int64) * M + pos, 0)
        w = tl.load(w_ptr + pid * K + ks, mask=kmask, other=0.0)
        tl.store(route_ptr + pid * K + ks, tl.where(sent, dest, -1), mask=kmask)
        tl.store(wloc_ptr + pid * K + ks, w, mask=kmask)
        for r in range(R):
            entry = (rank * Tmax + pid) * K + ks
            here = sent & (dest == r)
            tl.store(idx_ptr + tl.load(idx_dR + r) + entry, tl.where(here, row, -1).to(tl.int32), mask=kmask)
            if SEND_WEIGHTS:
                tl.store(wtab_ptr + tl.load(wtab_dR + r) + entry, w, mask=kmask)
        # Peer buffers are this rank's buffer plus an element offset; the hint (offsets are multiples
        # of 256 bytes) lets the row stores vectorize.
        xdst = recv_x_ptr + tl.multiple_of(tl.load(recv_x_dR + dest), 16)
        if QUANT:
            sdst = recv_scale_ptr + tl.multiple_of(tl.load(recv_scale_dR + dest), 16)
        for c0 in range(0, D, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            cm = cols < D
            xv = tl.load(x_ptr + pid.to(tl.int64) * D + cols, mask=cm, other=0.0)
            if QUANT:
                xf = xv.to(tl.float32)
                amax = tl.max(tl.reshape(tl.abs(xf), (CHUNK // 128, 128)), axis=1)
                scale = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)
                s_full = tl.reshape(tl.broadcast_to(scale[:, None], (CHUNK // 128, 128)), (CHUNK,))
                v = tl.minimum(tl.maximum(tl.math.div_rn(xf, s_full), -448.0), 448.0)
                if INTERPRET:
                    v = _round_e4m3(v)
                q = v.to(tl.float8e4nv)
                gs = c0 // 128 + tl.arange(0, CHUNK // 128)
                tl.store(sdst[:, None] + row[:, None] * G + gs[None, :],
                         tl.broadcast_to(scale[None, :], (BLOCK_K, CHUNK // 128)),
                         mask=sent[:, None] & (gs < G)[None, :])
            else:
                q = xv
            tl.store(xdst[:, None] + row[:, None] * D + cols[None, :],
                     tl.broadcast_to(q[None, :], (BLOCK_K, CHUNK)), mask=sent[:, None] & cm[None, :])
    if pid == 0:
        for r in range(R):
            tl.store(src_tokens_ptr + tl.load(src_tokens_dR + r) + rank, T)
    tl.debug_barrier()
    _finish(fin_ptr, sig_ptr, sig_dR, 0, R)


@triton.jit
def _dispatch_recv_kernel(sig_ptr, seq_ptr, err_ptr, cnt_ptr, counts_ptr, L, M, R, BLOCK_L: tl.constexpr):
    seq = tl.load(seq_ptr + 0) + 1
    _wait_geq(sig_ptr + 0, seq * R, err_ptr)
    for l0 in range(0, L, BLOCK_L):
        ls = l0 + tl.arange(0, BLOCK_L)
        lm = ls < L
        c = tl.atomic_xchg(cnt_ptr + ls, 0, mask=lm, sem="relaxed", scope="sys")
        tl.store(counts_ptr + ls, tl.minimum(c, M), mask=lm)
    tl.store(seq_ptr + 0, seq)


@triton.jit
def _combine_send_kernel(
    y_ptr, idx_ptr, wtab_ptr, src_tokens_ptr, comb_ptr, comb_dR, sig_ptr, sig_dR, fin_ptr,
    rank, R, Tmax, D, K,
    REDUCE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rr = tl.arange(0, BLOCK_R)
    src_tokens = tl.load(src_tokens_ptr + rr, mask=rr < R, other=0, cache_modifier=".cg")
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    for j in range(pid, tl.max(src_tokens, axis=0) * R, nprog):
        t = j // R
        s = j - t * R
        if t < tl.sum(tl.where(rr == s, src_tokens, 0), axis=0):
            idx = tl.load(idx_ptr + (s * Tmax + t) * K + ks, mask=kmask, other=-1, cache_modifier=".cg")
            valid = idx >= 0
            if tl.max(valid.to(tl.int32), axis=0) > 0:
                comb = comb_ptr + tl.multiple_of(tl.load(comb_dR + s), 16)
                if REDUCE:
                    w = tl.load(wtab_ptr + (s * Tmax + t) * K + ks, mask=valid, other=0.0, cache_modifier=".cg")
                for c0 in range(0, D, CHUNK):
                    cols = c0 + tl.arange(0, CHUNK)
                    cm = cols < D
                    m2 = valid[:, None] & cm[None, :]
                    tile = tl.load(y_ptr + idx.to(tl.int64)[:, None] * D + cols[None, :], mask=m2, other=0.0)
                    if REDUCE:
                        acc = tl.sum(tile.to(tl.float32) * w[:, None], axis=0)
                        tl.store(comb + (t * R + rank).to(tl.int64) * D + cols, acc.to(tile.dtype), mask=cm)
                    else:
                        tl.store(comb + (t * K + ks).to(tl.int64)[:, None] * D + cols[None, :], tile, mask=m2)
    tl.debug_barrier()
    _finish(fin_ptr, sig_ptr, sig_dR, 1, R)


@triton.jit
def _combine_recv_kernel(
    comb_ptr, route_ptr, wloc_ptr, out_ptr, T, sig_ptr, seq_ptr, err_ptr, fin_ptr,
    R, K, D,
    REDUCE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    seq = tl.load(seq_ptr + 1) + 1
    _wait_geq(sig_ptr + 1, seq * R, err_ptr)
    if pid < T:
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < K
        rr = tl.arange(0, BLOCK_R)
        route = tl.load(route_ptr + pid * K + ks, mask=kmask, other=-1)
        valid = route >= 0
        if REDUCE:
            used = tl.max(((route[None, :] == rr[:, None]) & valid[None, :]).to(tl.int32), axis=1) > 0
        else:
            w = tl.load(wloc_ptr + pid * K + ks, mask=valid, other=0.0)
        for c0 in range(0, D, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            cm = cols < D
            if REDUCE:
                tile = tl.load(comb_ptr + (pid * R + rr).to(tl.int64)[:, None] * D + cols[None, :],
                               mask=used[:, None] & cm[None, :], other=0.0, cache_modifier=".cg")
                acc = tl.sum(tile.to(tl.float32), axis=0)
            else:
                tile = tl.load(comb_ptr + (pid * K + ks).to(tl.int64)[:, None] * D + cols[None, :],
                               mask=valid[:, None] & cm[None, :], other=0.0, cache_modifier=".cg")
                acc = tl.sum(tile.to(tl.float32) * w[:, None], axis=0)
            tl.store(out_ptr + pid.to(tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)
    tl.debug_barrier()
    done = tl.atomic_add(fin_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:  # every program has read seq: advance it
        tl.atomic_xchg(fin_ptr, 0, sem="relaxed", scope="gpu")
        tl.store(seq_ptr + 1, seq)


@dataclass(frozen=True)
class LLBuffers:
    """One rank's `ll` buffers: local tensors, and for the peer-written ones an int64 [R] table
    (`*_dR`) of element offsets from this rank's buffer to each rank's (peer address - own address,
    divided by the element size; 0 for this rank).

    recv_x [L, M, D] (float8_e4m3fn or cfg.dtype) and recv_scale [L, M, G] float32 (a [1] stand-in
    without fp8); cnt [L] int32; idx [R, Tmax, K] int32; wtab [R, Tmax, K] float32 (a [1] stand-in for
    combine="source"); src_tokens [R] int32; comb [Tmax, K, D] ("source") or [Tmax, R, D] ("reduce"),
    cfg.dtype; signal [2] int64 (monotone). This rank's own: seq [2] int64, finish [3] int32,
    error [1] int32 (a wait gave up), counts [L] int32, route [Tmax, K] int32, wloc [Tmax, K] float32.
    """

    recv_x: torch.Tensor
    recv_scale: torch.Tensor
    cnt: torch.Tensor
    idx: torch.Tensor
    wtab: torch.Tensor
    src_tokens: torch.Tensor
    comb: torch.Tensor
    signal: torch.Tensor
    seq: torch.Tensor
    finish: torch.Tensor
    error: torch.Tensor
    counts: torch.Tensor
    route: torch.Tensor
    wloc: torch.Tensor
    recv_x_dR: torch.Tensor
    recv_scale_dR: torch.Tensor
    idx_dR: torch.Tensor
    wtab_dR: torch.Tensor
    cnt_dR: torch.Tensor
    src_tokens_dR: torch.Tensor
    comb_dR: torch.Tensor
    signal_dR: torch.Tensor


def dispatch_send(b: LLBuffers, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, *, rank: int,
                  num_experts: int, quant: bool, reduce: bool, launch: LLLaunch) -> None:
    """Launch the dispatch stores of T tokens (grid max(T, 1); a rank with 0 tokens still signals)."""
    T, D = x_TD.shape
    L, M = b.recv_x.shape[0], b.recv_x.shape[1]
    R, Tmax, K = b.idx.shape
    _dispatch_send_kernel[(max(T, 1),)](
        x_TD, ids_TK, w_TK, T,
        b.recv_x, b.recv_x_dR, b.recv_scale, b.recv_scale_dR, b.idx, b.idx_dR, b.wtab, b.wtab_dR,
        b.cnt, b.cnt_dR, b.src_tokens, b.src_tokens_dR, b.signal, b.signal_dR,
        b.route, b.wloc, b.finish[0:],
        rank, R, num_experts, L, M, Tmax, D, K, triton.cdiv(D, FP8_BLOCK),
        QUANT=quant, SEND_WEIGHTS=reduce, INTERPRET=launch.interpret,
        BLOCK_K=triton.next_power_of_2(K), CHUNK=launch.chunk, num_warps=launch.num_warps)


def dispatch_recv(b: LLBuffers) -> None:
    """Launch the wait for every rank's dispatch signal; then b.counts holds this call's counts_L."""
    L, M = b.recv_x.shape[0], b.recv_x.shape[1]
    _dispatch_recv_kernel[(1,)](b.signal, b.seq, b.error, b.cnt, b.counts, L, M, b.idx.shape[0],
                                BLOCK_L=min(1024, triton.next_power_of_2(L)), num_warps=4)


def combine_send(b: LLBuffers, y_LMD: torch.Tensor, *, rank: int, reduce: bool, launch: LLLaunch) -> None:
    """Launch the stores of expert outputs back to their source ranks."""
    R, Tmax, K = b.idx.shape
    _combine_send_kernel[(launch.combine_programs,)](
        y_LMD, b.idx, b.wtab, b.src_tokens, b.comb, b.comb_dR, b.signal, b.signal_dR, b.finish[1:],
        rank, R, Tmax, y_LMD.shape[-1], K,
        REDUCE=reduce, BLOCK_K=triton.next_power_of_2(K), BLOCK_R=triton.next_power_of_2(R),
        CHUNK=launch.chunk, num_warps=launch.num_warps)


def combine_recv(b: LLBuffers, out_TD: torch.Tensor, *, reduce: bool, launch: LLLaunch) -> None:
    """Launch the wait for every rank's combine signal and the weighted sum into out_TD [T, D]."""
    T, D = out_TD.shape
    R, _, K = b.idx.shape
    _combine_recv_kernel[(max(T, 1),)](
        b.comb, b.route, b.wloc, out_TD, T, b.signal, b.seq, b.error, b.finish[2:],
        R, K, D,
        REDUCE=reduce, BLOCK_K=triton.next_power_of_2(K), BLOCK_R=triton.next_power_of_2(R),
        CHUNK=launch.chunk, num_warps=launch.num_warps)
