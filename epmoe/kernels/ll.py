"""Triton kernels of the `ll` dispatcher: peer stores into fixed symmetric buffers, device-side signals.

Shape letters: T tokens on this rank, D hidden size, K top-k, E global experts, L local experts,
R ranks, Tmax = cfg.max_tokens_per_rank, M = R * Tmax rows per expert slot, G = ceil(D / 128).

Kernels (the protocol they implement is described in epmoe/dispatch/ll.py):
  dispatch: one program per token; remote atomic_add on the destination expert's counter gives
      the row; the row (fp8-quantized in registers when asked) is stored straight into the peer's
      recv_x; every program then signals every rank. With RECEIVE (the fused `dispatch` path) the
      last program also waits for every rank's signals and moves the counters out (counts_L).
  dispatch_recv: one program; the receive step alone (the split dispatch_send / dispatch_recv path).
  combine_send: a fixed grid (item programs x column chunks) striding over (source token, source
      rank); stores each slot's row (or the weighted sum of the slots held here) into the source
      rank's combine buffer; then every program signals every rank.
  combine_recv: one program per (token, column chunk); waits for the signals and sums in float32.

Peers' buffers are reached through their address tables (`*_peers`, int64 [R]: `sync.peer_ptr` and
`sync.peer_base`), the
waits give up as `sync.spin_until` does (`DeviceWait`: this rank's error flag and time-out).

Signals: signal[slot] (slot 0 dispatch, 1 combine) on every rank only grows. In each call every rank
adds exactly SIGNAL_UNIT to every rank's signal[slot], split over the programs that signal (program
0 adds SIGNAL_UNIT - (n - 1), the n - 1 others 1 each, each with release semantics at system scope
after its own stores). A receiver that has already added its own share of call n reads a value in
(R * SIGNAL_UNIT * (n - 1), R * SIGNAL_UNIT * n] (no rank can add for call n + 1 before this rank's
next call), so it waits for the next multiple of R * SIGNAL_UNIT: no sequence numbers, no finish
counters, nothing to reset, and graph replays continue the count.

Launchers validate nothing: the dispatcher (their only caller) owns the buffers and checks inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import FP8_BLOCK
from .sync import DeviceWait, peer_base, peer_ptr, spin_until

_SIGNAL_UNIT = 1 << 20  # what each rank adds per call to each signal; larger than any grid
SIGNAL_UNIT = tl.constexpr(_SIGNAL_UNIT)


@dataclass(frozen=True)
class LLLaunch:
    """Launch settings of the `ll` kernels for one shape on one device.

    send_chunk / send_warps: columns per inner step (a power of two >= 128) and warps of the
        dispatch kernel (one program per token: fewer, larger steps mean fewer serial load latencies).
    comb_chunk / comb_warps: columns per program and warps of combine_send / combine_recv (each
        program handles one column chunk, so a row is spread over cdiv(D, comb_chunk) programs).
    combine_programs: programs of combine_send along the item axis (about 2 per SM in all, one
        wave); they stride over the R * Tmax (token, rank) items.
    interpret: running under the Triton interpreter (CPU tensors): exact fp8 rounding path, and
        waits count polls instead of reading the GPU clock.
    """

    send_chunk: int
    send_warps: int
    comb_chunk: int
    comb_warps: int
    combine_programs: int
    interpret: bool


def ll_launch(hidden_size: int, world_size: int, max_tokens: int, device: torch.device) -> LLLaunch:
    """Launch settings as a pure function of (D, R, Tmax, device)."""
    width = max(FP8_BLOCK, triton.next_power_of_2(hidden_size))
    send_chunk, comb_chunk = min(4096, width), min(2048, width)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    chunks = triton.cdiv(hidden_size, comb_chunk)
    return LLLaunch(send_chunk=send_chunk, send_warps=8 if send_chunk >= 1024 else 4,
                    comb_chunk=comb_chunk, comb_warps=8 if comb_chunk >= 1024 else 4,
                    combine_programs=max(1, min(world_size * max_tokens, 2 * sms // chunks)),
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
def _signal(sig_peers, slot, rank, R, lin, n):
    """Add this program's share of SIGNAL_UNIT (program lin of the n signalling programs) to signal[slot]
    of every rank, release at system scope; returns this rank's signal value right after its add.

    Call after tl.debug_barrier(), so every thread's stores of the program are ordered before the adds.
    """
    weight = tl.where(lin == 0, SIGNAL_UNIT - (n - 1), 1).to(tl.int64)
    seen = weight * 0
    for r in range(R):
        old = tl.atomic_add(peer_ptr(sig_peers, r, tl.int64) + slot, weight, sem="release", scope="sys")
        seen = tl.where(r == rank, old + weight, seen)
    return seen


@triton.jit
def _wait(sig_ptr, seen, sig_unit, err_ptr, timeout_ns, INTERPRET: tl.constexpr):
    """Spin until the int64 signal at sig_ptr reaches the next multiple of sig_unit (= R * SIGNAL_UNIT)
    at or above `seen` (a value read after this rank's own share of the call was added), then acquire;
    gives up after timeout_ns and sets err_ptr[0] (sync.spin_until)."""
    spin_until(sig_ptr, (seen + sig_unit - 1) // sig_unit * sig_unit, err_ptr, timeout_ns, INTERPRET)


@triton.jit
def _take_counts(cnt_ptr, counts_ptr, L, M, BLOCK_L: tl.constexpr):
    """counts_L = cnt (clamped to M), and cnt = 0 for the next call (one atomic exchange)."""
    for l0 in range(0, L, BLOCK_L):
        ls = l0 + tl.arange(0, BLOCK_L)
        lm = ls < L
        c = tl.atomic_xchg(cnt_ptr + ls, 0, mask=lm, sem="relaxed", scope="sys")
        tl.store(counts_ptr + ls, tl.minimum(c, M), mask=lm)


@triton.jit(do_not_specialize=["T"])
def _dispatch_kernel(
    x_ptr, ids_ptr, w_ptr, T,
    recv_x_peers, recv_scale_peers, idx_peers, wtab_peers, cnt_peers, src_tokens_peers, sig_peers,
    cnt_ptr, sig_ptr, route_ptr, wloc_ptr, counts_ptr, err_ptr,
    rank, R, E, L, M, Tmax, D, K, G, sig_unit, timeout_ns,
    QUANT: tl.constexpr, SEND_WEIGHTS: tl.constexpr, RECEIVE: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    if pid < T:
        ids = tl.load(ids_ptr + pid * K + ks, mask=kmask, other=-1).to(tl.int32)
        valid = kmask & (ids >= 0) & (ids < E)
        dest = tl.where(valid, ids // L, 0)
        local = tl.where(valid, ids - dest * L, 0)
        cnt = peer_ptr(cnt_peers, dest, tl.int32) + local  # the destination's counter of each slot
        pos = tl.atomic_add(cnt, 1, mask=valid, sem="relaxed", scope="sys")
        sent = valid & (pos < M)  # pos >= M only if a token repeats an expert; such slots are dropped
        row = tl.where(sent, local.to(tl.int64) * M + pos, 0)
        w = tl.load(w_ptr + pid * K + ks, mask=kmask, other=0.0)
        tl.store(route_ptr + pid * K + ks, tl.where(sent, dest, -1), mask=kmask)
        tl.store(wloc_ptr + pid * K + ks, w, mask=kmask)
        for r in range(R):
            entry = (rank * Tmax + pid) * K + ks
            here = sent & (dest == r)
            tl.store(peer_ptr(idx_peers, r, tl.int32) + entry, tl.where(here, row, -1).to(tl.int32), mask=kmask)
            if SEND_WEIGHTS:
                tl.store(peer_ptr(wtab_peers, r, tl.float32) + entry, w, mask=kmask)
        # (peer_base: the alignment hint lets the row stores vectorize)
        if QUANT:
            xdst = peer_base(recv_x_peers, dest, tl.float8e4nv)
            sdst = peer_base(recv_scale_peers, dest, tl.float32)
        else:
            xdst = peer_base(recv_x_peers, dest, x_ptr.dtype.element_ty)
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
            tl.store(peer_ptr(src_tokens_peers, r, tl.int32) + rank, T)
    tl.debug_barrier()
    nprog = tl.num_programs(0)
    seen = _signal(sig_peers, 0, rank, R, pid, nprog)
    if RECEIVE:
        # The last program waits (under the interpreter, programs run one after another in order, so
        # this rank's other programs have signalled by then; on a GPU any program would do).
        if pid == nprog - 1:
            _wait(sig_ptr, seen, sig_unit, err_ptr, timeout_ns, INTERPRET)
            _take_counts(cnt_ptr, counts_ptr, L, M, BLOCK_L)


@triton.jit
def _dispatch_recv_kernel(sig_ptr, err_ptr, cnt_ptr, counts_ptr, L, M, sig_unit, timeout_ns,
                          INTERPRET: tl.constexpr, BLOCK_L: tl.constexpr):
    seen = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")  # holds this rank's share already
    _wait(sig_ptr, seen, sig_unit, err_ptr, timeout_ns, INTERPRET)
    _take_counts(cnt_ptr, counts_ptr, L, M, BLOCK_L)


@triton.jit
def _combine_send_kernel(
    y_ptr, idx_ptr, wtab_ptr, src_tokens_ptr, comb_peers, sig_peers,
    rank, R, Tmax, D, K,
    REDUCE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    c = tl.program_id(1)
    nchunk = tl.num_programs(1)
    rr = tl.arange(0, BLOCK_R)
    src_tokens = tl.load(src_tokens_ptr + rr, mask=rr < R, other=0, cache_modifier=".cg")
    n_items = tl.max(src_tokens, axis=0) * R
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    cols = c * CHUNK + tl.arange(0, CHUNK)
    cm = cols < D
    for j in range(pid, n_items, nprog):
        t = j // R
        s = j - t * R
        if t < tl.sum(tl.where(rr == s, src_tokens, 0), axis=0):
            idx = tl.load(idx_ptr + (s * Tmax + t) * K + ks, mask=kmask, other=-1, cache_modifier=".cg")
            valid = idx >= 0
            if tl.max(valid.to(tl.int32), axis=0) > 0:
                comb = peer_base(comb_peers, s, y_ptr.dtype.element_ty)
                m2 = valid[:, None] & cm[None, :]
                tile = tl.load(y_ptr + idx.to(tl.int64)[:, None] * D + cols[None, :], mask=m2, other=0.0)
                if REDUCE:
                    w = tl.load(wtab_ptr + (s * Tmax + t) * K + ks, mask=valid, other=0.0, cache_modifier=".cg")
                    acc = tl.sum(tile.to(tl.float32) * w[:, None], axis=0)
                    tl.store(comb + (t * R + rank).to(tl.int64) * D + cols, acc.to(tile.dtype), mask=cm)
                else:
                    tl.store(comb + (t * K + ks).to(tl.int64)[:, None] * D + cols[None, :], tile, mask=m2)
    tl.debug_barrier()
    # Every program signals, idle ones too: a peer may rewrite src_tokens, idx and wtab (its next
    # dispatch) once this call's signal is complete, so no program may still be about to read them.
    _signal(sig_peers, 1, rank, R, pid * nchunk + c, nprog * nchunk)


@triton.jit(do_not_specialize=["T"])
def _combine_recv_kernel(
    comb_ptr, route_ptr, wloc_ptr, out_ptr, T, sig_ptr, err_ptr,
    R, K, D, sig_unit, timeout_ns,
    REDUCE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    c = tl.program_id(1)
    seen = tl.atomic_add(sig_ptr + 1, 0, sem="acquire", scope="sys")  # holds this rank's share already
    _wait(sig_ptr + 1, seen, sig_unit, err_ptr, timeout_ns, INTERPRET)
    if pid < T:
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < K
        rr = tl.arange(0, BLOCK_R)
        route = tl.load(route_ptr + pid * K + ks, mask=kmask, other=-1)
        valid = route >= 0
        cols = c * CHUNK + tl.arange(0, CHUNK)
        cm = cols < D
        if REDUCE:
            used = tl.max(((route[None, :] == rr[:, None]) & valid[None, :]).to(tl.int32), axis=1) > 0
            tile = tl.load(comb_ptr + (pid * R + rr).to(tl.int64)[:, None] * D + cols[None, :],
                           mask=used[:, None] & cm[None, :], other=0.0, cache_modifier=".cg")
            acc = tl.sum(tile.to(tl.float32), axis=0)
        else:
            w = tl.load(wloc_ptr + pid * K + ks, mask=valid, other=0.0)
            tile = tl.load(comb_ptr + (pid * K + ks).to(tl.int64)[:, None] * D + cols[None, :],
                           mask=valid[:, None] & cm[None, :], other=0.0, cache_modifier=".cg")
            acc = tl.sum(tile.to(tl.float32) * w[:, None], axis=0)
        tl.store(out_ptr + pid.to(tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)


@dataclass(frozen=True)
class LLPeers:
    """int64 [R] address tables of the buffers peers write (each rank's address of the LLBuffers field
    of the same name; None where the LLBuffers field is None)."""

    recv_x: torch.Tensor
    recv_scale: torch.Tensor | None
    idx: torch.Tensor
    wtab: torch.Tensor | None
    cnt: torch.Tensor
    src_tokens: torch.Tensor
    comb: torch.Tensor
    signal: torch.Tensor


@dataclass(frozen=True)
class LLBuffers:
    """One rank's `ll` buffers (views of its workspace) and the address tables of the peer-written ones.

    recv_x [L, M, D] (float8_e4m3fn or cfg.dtype) and recv_scale [L, M, G] float32 (None without fp8);
    cnt [L] int32; idx [R, Tmax, K] int32; wtab [R, Tmax, K] float32 (None for combine="source");
    src_tokens [R] int32; comb [Tmax, K, D] ("source") or [Tmax, R, D] ("reduce"), cfg.dtype; signal [2]
    int64 (monotone). This rank's own: error [1] int32 (a wait gave up), counts [L] int32, route
    [Tmax, K] int32, wloc [Tmax, K] float32.
    """

    recv_x: torch.Tensor
    recv_scale: torch.Tensor | None
    cnt: torch.Tensor
    idx: torch.Tensor
    wtab: torch.Tensor | None
    src_tokens: torch.Tensor
    comb: torch.Tensor
    signal: torch.Tensor
    error: torch.Tensor
    counts: torch.Tensor
    route: torch.Tensor
    wloc: torch.Tensor
    peers: LLPeers


def _block_l(b: LLBuffers) -> int:
    return min(1024, triton.next_power_of_2(b.cnt.shape[0]))


def dispatch(b: LLBuffers, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, *, rank: int,
             num_experts: int, quant: bool, reduce: bool, receive: bool, wait: DeviceWait,
             launch: LLLaunch) -> None:
    """Launch the dispatch stores of T tokens (grid max(T, 1): a rank with 0 tokens still signals);
    with `receive`, the kernel's last program also waits for every rank and fills b.counts."""
    T, D = x_TD.shape
    L, M = b.recv_x.shape[0], b.recv_x.shape[1]
    R, Tmax, K = b.idx.shape
    p = b.peers
    _dispatch_kernel[(max(T, 1),)](
        x_TD, ids_TK, w_TK, T,
        p.recv_x, p.recv_scale, p.idx, p.wtab, p.cnt, p.src_tokens, p.signal,
        b.cnt, b.signal, b.route, b.wloc, b.counts, wait.err_1,
        rank, R, num_experts, L, M, Tmax, D, K, triton.cdiv(D, FP8_BLOCK), R * _SIGNAL_UNIT, wait.timeout_ns,
        QUANT=quant, SEND_WEIGHTS=reduce, RECEIVE=receive, INTERPRET=launch.interpret,
        BLOCK_K=triton.next_power_of_2(K), BLOCK_L=_block_l(b), CHUNK=launch.send_chunk,
        num_warps=launch.send_warps)


def dispatch_recv(b: LLBuffers, *, wait: DeviceWait, launch: LLLaunch) -> None:
    """Launch the wait for every rank's dispatch signal; then b.counts holds this call's counts_L."""
    L, M = b.recv_x.shape[0], b.recv_x.shape[1]
    R = b.idx.shape[0]
    _dispatch_recv_kernel[(1,)](b.signal, wait.err_1, b.cnt, b.counts, L, M, R * _SIGNAL_UNIT, wait.timeout_ns,
                                INTERPRET=launch.interpret, BLOCK_L=_block_l(b), num_warps=4)


def combine_send(b: LLBuffers, y_LMD: torch.Tensor, *, rank: int, reduce: bool, launch: LLLaunch) -> None:
    """Launch the stores of expert outputs back to their source ranks, and the signals."""
    R, Tmax, K = b.idx.shape
    D = y_LMD.shape[-1]
    grid = (launch.combine_programs, triton.cdiv(D, launch.comb_chunk))
    _combine_send_kernel[grid](
        y_LMD, b.idx, b.wtab, b.src_tokens, b.peers.comb, b.peers.signal,
        rank, R, Tmax, D, K,
        REDUCE=reduce, BLOCK_K=triton.next_power_of_2(K), BLOCK_R=triton.next_power_of_2(R),
        CHUNK=launch.comb_chunk, num_warps=launch.comb_warps)


def combine_recv(b: LLBuffers, out_TD: torch.Tensor, *, reduce: bool, wait: DeviceWait, launch: LLLaunch) -> None:
    """Launch the wait for every rank's combine signal and the weighted sum into out_TD [T, D]."""
    T, D = out_TD.shape
    R, _, K = b.idx.shape
    grid = (max(T, 1), triton.cdiv(D, launch.comb_chunk))
    _combine_recv_kernel[grid](
        b.comb, b.route, b.wloc, out_TD, T, b.signal, wait.err_1,
        R, K, D, R * _SIGNAL_UNIT, wait.timeout_ns,
        REDUCE=reduce, INTERPRET=launch.interpret, BLOCK_K=triton.next_power_of_2(K),
        BLOCK_R=triton.next_power_of_2(R), CHUNK=launch.comb_chunk, num_warps=launch.comb_warps)
