"""Grouped expert GEMMs in Triton: gate-up with SiLU-and-mul fused, and down; bf16/fp16/fp32 or fp8 block.

Shape letters: L local experts, R rows of the batch (contiguous N, or L*M for batched [L, M, ...]),
S source rows a gate-up reads through a row index (x_rows_R),
D hidden size, F intermediate size, N output columns of one GEMM, K its reduction size,
G = ceil(K / 128) activation scale groups, M rows per expert slot (batched layout).

One kernel serves both layouts. Each expert owns a run of rows [base_l, base_l + count_l): contiguous
base_l = offsets_L1[l], count_l = offsets_L1[l+1] - offsets_L1[l]; batched base_l = l*M, count_l =
counts_L[l]. Every program rebuilds the tile map on device from the L counts (`tile_map.tile_coords`),
so there is no host sync; the programs are persistent (at most a few per SM) and loop over the real
tiles only, so rows past the counts cost nothing even when the batched slots are mostly empty.

Two kernels: the pointer kernel below (any GPU and the interpreter, float32) and, on Hopper, the
warp-specialized Gluon kernel of grouped_gemm_ws.py (loader warps feeding wgmma consumers by TMA, and by
cp.async for rows read through a row index), which launch configs with `warp_specialize` set ask for;
launches it cannot serve run their config's `pointer_variant` here.

fp8 (e4m3, block 128): acc += dot(a, b) * a_scale[row] * b_scale[col] per K block (BLOCK_K divides 128,
so each K block lies in one scale group); weights carry one scale per 128x128 block, activations one
per row per 128 columns. Gate-up may emit h already quantized for the down GEMM when BLOCK_N == 128
(one scale group per column tile); otherwise the launcher quantizes h with `quantize_act`.

References: `gate_up_ref`, `down_ref` below (float32 torch, loops over experts on the host).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F_
import triton
import triton.language as tl

from ..config import FP8_BLOCK
from ..quant import FP8_DTYPE, dequantize_act_ref, dequantize_weight_ref, num_groups, quantize_act_ref
from .configs import GemmConfig, gemm_config, gpu_name
from .quant import FP8_MAX_C, MIN_AMAX_C, quantize_act, to_fp8
from .tile_map import tile_coords

try:  # the warp-specialized Hopper kernel is written in Gluon, which older Tritons lack
    from . import grouped_gemm_ws
except ImportError:
    grouped_gemm_ws = None
try:  # grid dependency control and the launcher's launch_pdl: triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


# Persistent programs per SM on the GPU; under the interpreter a few programs, so that tests exercise
# programs that loop over several tiles.
_PROGRAMS_PER_SM = 4
_INTERPRETER_PROGRAMS = 3
# Grid dependency control of a launch (`_gdc`): none, a gate-up that lets its programmatic dependent start
# early, a down launched as one.
GDC_NONE, GDC_TRIGGER, GDC_WAIT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# The tile map reads the L counts as one block of at least this many lanes, so that the common local
# expert counts (<= 128) share one compiled kernel.
_MIN_EXPERT_BLOCK = 128


@dataclass(frozen=True)
class ExpertRows:
    """Which rows of a [R, ...] activation tensor belong to which local expert (device tensors).

    index_L: int32 on the device: offsets [L+1] (contiguous) or counts [L] (batched).
    slot_rows: M for the batched layout (expert l's rows start at l*M); 0 for contiguous.
    """

    index_L: torch.Tensor
    batched: bool
    slot_rows: int

    @classmethod
    def contiguous(cls, offsets_L1: torch.Tensor) -> "ExpertRows":
        return cls(index_L=offsets_L1.to(torch.int32), batched=False, slot_rows=0)

    @classmethod
    def batched_slots(cls, counts_L: torch.Tensor, slot_rows: int) -> "ExpertRows":
        return cls(index_L=counts_L.to(torch.int32), batched=True, slot_rows=slot_rows)

    @property
    def num_experts(self) -> int:
        return self.index_L.shape[0] - (0 if self.batched else 1)

    def max_row_tiles(self, num_rows: int, block_m: int) -> int:
        """Upper bound on sum_l ceil(count_l / block_m), known on the host without reading counts."""
        L = self.num_experts
        if self.batched:
            return L * triton.cdiv(self.slot_rows, block_m)
        return min(triton.cdiv(num_rows, block_m) + L, num_rows)  # each tile holds >= 1 row

    def rows_hint(self, num_rows: int) -> int:
        """Default rows per expert for the launch config: M (batched) or the mean N / L (contiguous)."""
        return self.slot_rows if self.batched else triton.cdiv(num_rows, max(self.num_experts, 1))

    def ranges(self) -> list[tuple[int, int]]:
        """[(first_row, end_row)] per expert, read on the host (sync): for the references only."""
        idx = self.index_L.tolist()
        if self.batched:
            return [(l * self.slot_rows, l * self.slot_rows + n) for l, n in enumerate(idx)]
        return list(zip(idx[:-1], idx[1:]))


@triton.jit
def _grouped_gemm_kernel(
        a_ptr, a_desc, a_scale_ptr, a_rows_ptr, b_ptr, b_desc, b_scale_ptr, c_ptr, c_scale_ptr, row_scale_ptr,
        index_ptr, L, SLOT_ROWS, R, N, K,
        stride_bl, stride_bsl, stride_bsn, G_A, G_C,
        BATCHED: tl.constexpr, GATHER: tl.constexpr, GATE_UP: tl.constexpr, FP8: tl.constexpr, QUANT_OUT: tl.constexpr,
        TMA_A: tl.constexpr, TMA_B: tl.constexpr,
        HAS_ROW_SCALE: tl.constexpr, TILE_B_SCALE: tl.constexpr, QUANT_A: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
        L_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, SCALE_GROUP: tl.constexpr, GDC: tl.constexpr):
    """C[rows of l] = A[rows of l] @ B[l]^T (GATE_UP: silu(A B_gate^T) * (A B_up^T), B_up = rows N.. of B).

    A [R, K] row-major, or with GATHER [S, K] read through a_rows [R] (row i of the batch is A[a_rows[i]]);
    B [L, N (x2 for GATE_UP), K] K-contiguous; C [R, N].
    TMA_A / TMA_B: A tiles through a_desc ([R, K], block [BLOCK_M, BLOCK_K]; not with GATHER) and B tiles
    through b_desc (B viewed as [L * N (x2), K], block [BLOCK_N, BLOCK_K]) instead of pointer loads;
    rows and columns a tile reads past its expert's end belong to the next expert or are zeros past the
    tensor, and are never stored.
    TILE_B_SCALE: the column tile lies in one 128-row weight scale block (gate and up alike), so
    its weight scale is one scalar per K block instead of a vector.
    QUANT_A: A is unquantized and quantized here per row per 128 columns, one K block (BLOCK_K == 128)
    at a time, as `quantize_act` would (same scales and rounding); rows past the counts are never read.
    SWAP_AB: each K block's product is taken as B_tile A_tile^T ([BLOCK_N, BLOCK_M]: the weights' rows on the
    MMA's M side, the expert's rows on its N side) and the sum transposed before the epilogue; the same
    result, but a decode tile of 16 rows fills Hopper's 64-row wgmma with weights instead of padding rows.
    GDC (grid dependency control, on Hopper; `_gdc`): GDC_TRIGGER lets a programmatic dependent
    launch start as soon as every program has begun; GDC_WAIT (the kernel launched as one) builds the tile
    map, then waits for the grid before it to end before it reads A or writes.
    """
    tl.static_assert((not QUANT_OUT) or ((GATE_UP and FP8) and (BLOCK_N == SCALE_GROUP)),
                     "fp8 h output needs the gate-up fp8 kernel with BLOCK_N == 128")
    tl.static_assert(not FP8 or SCALE_GROUP % BLOCK_K == 0, "fp8 needs BLOCK_K to divide 128")
    tl.static_assert((not QUANT_A) or (FP8 and (BLOCK_K == SCALE_GROUP)), "QUANT_A needs fp8 and BLOCK_K == 128")

    if GDC == GDC_TRIGGER:
        gdc_launch_dependents()
    # Tile map, built on device from the L counts: expert l owns the row tiles
    # [tiles_end[l] - tiles[l], tiles_end[l]).
    e = tl.arange(0, L_POW2)
    e_mask = e < L
    if BATCHED:
        count = tl.load(index_ptr + e, mask=e_mask, other=0)
        base = e * SLOT_ROWS
    else:
        base = tl.load(index_ptr + e, mask=e_mask, other=0)
        count = tl.load(index_ptr + e + 1, mask=e_mask, other=0) - base
    tiles = (count + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    num_tiles_m = tl.sum(tiles, 0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    if GDC == GDC_WAIT:
        gdc_wait()
    # Persistent loop over the real tiles only (the grid is capped on the host).
    for tile in range(tl.program_id(0), num_tiles_m * num_tiles_n, tl.num_programs(0)):
        expert, row0, row_end, pid_n = tile_coords(tile, e, base, count, tiles, tiles_end, num_tiles_m,
                                                   num_tiles_n, GROUP_M, BLOCK_M)

        offs_m = row0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < row_end
        rows_a = tl.minimum(offs_m, R - 1).to(tl.int64)  # rows past the expert's end: in bounds, never stored
        if GATHER:
            rows_a = tl.load(a_rows_ptr + rows_a, mask=m_mask, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        cols_b = tl.minimum(offs_n, N - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        expert64 = expert.to(tl.int64)

        a_ptrs = a_ptr + rows_a[:, None] * K + offs_k[None, :]
        b_ptrs = b_ptr + expert64 * stride_bl + cols_b[None, :] * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        up_shift = N * K
        b_row = expert * (2 * N if GATE_UP else N) + pid_n * BLOCK_N  # B's first row of the tile, as [L * N, K]
        if FP8:
            if not QUANT_A:
                a_scale_ptrs = a_scale_ptr + rows_a * G_A
            if TILE_B_SCALE:
                b_scale_ptrs = b_scale_ptr + expert64 * stride_bsl + (pid_n * BLOCK_N // SCALE_GROUP) * stride_bsn
                up_scale_ptrs = b_scale_ptrs + (N // SCALE_GROUP) * stride_bsn
            else:
                b_scale_ptrs = b_scale_ptr + expert64 * stride_bsl + (cols_b // SCALE_GROUP) * stride_bsn
                up_scale_ptrs = b_scale_ptr + expert64 * stride_bsl + ((cols_b + N) // SCALE_GROUP) * stride_bsn

        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if TMA_A:
                a = a_desc.load([row0, k0])
            elif EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(offs_k < K - k0)[None, :], other=0.0)
            if TMA_B:
                b = b_desc.load([b_row, k0]).T
                if GATE_UP:
                    b_up = b_desc.load([b_row + N, k0]).T
            elif EVEN_K:
                b = tl.load(b_ptrs)
                if GATE_UP:
                    b_up = tl.load(b_ptrs + up_shift)
            else:
                b = tl.load(b_ptrs, mask=(offs_k < K - k0)[:, None], other=0.0)
                if GATE_UP:
                    b_up = tl.load(b_ptrs + up_shift, mask=(offs_k < K - k0)[:, None], other=0.0)
            if QUANT_A:
                a32 = a.to(tl.float32)
                a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a32), axis=1), MIN_AMAX_C), FP8_MAX_C)
                a = tl.minimum(tl.maximum(tl.math.div_rn(a32, a_s[:, None]), -FP8_MAX_C), FP8_MAX_C)
                a = to_fp8(a, b.dtype, UPCAST)
            if UPCAST:  # the interpreter's tl.dot is wrong on bf16/fp8 tiles
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                if GATE_UP:
                    b_up = b_up.to(tl.float32)
            if FP8:
                g = k0 // SCALE_GROUP
                if not QUANT_A:
                    a_s = tl.load(a_scale_ptrs + g)
                acc += _scaled_dot(a, b, a_s, b_scale_ptrs + g, TILE_B_SCALE, SWAP_AB)
                if GATE_UP:
                    acc_up += _scaled_dot(a, b_up, a_s, up_scale_ptrs + g, TILE_B_SCALE, SWAP_AB)
            else:
                acc = _dot(a, b, acc, IEEE, SWAP_AB)
                if GATE_UP:
                    acc_up = _dot(a, b_up, acc_up, IEEE, SWAP_AB)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        if GATE_UP:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if SWAP_AB:
            acc = tl.trans(acc)
        if HAS_ROW_SCALE:
            acc = acc * tl.load(row_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]

        rows_c = offs_m.to(tl.int64)
        c_ptrs = c_ptr + rows_c[:, None] * N + offs_n[None, :]
        c_mask = m_mask[:, None] & n_mask[None, :]
        if QUANT_OUT:
            # Columns past N repeat column N-1 (clamped pointer loads; the launcher keeps TMA off B here),
            # so the group's amax is that of its real columns.
            scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(acc), axis=1), MIN_AMAX_C), FP8_MAX_C)
            q = tl.minimum(tl.maximum(tl.math.div_rn(acc, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
            tl.store(c_ptrs, to_fp8(q, c_ptr.dtype.element_ty, UPCAST), mask=c_mask)
            tl.store(c_scale_ptr + rows_c * G_C + pid_n, scale, mask=m_mask)
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + a @ b, a [BLOCK_M, BLOCK_K] and b [BLOCK_K, BLOCK_N]; with SWAP_AB acc + b^T @ a^T."""
    if SWAP_AB:
        lhs, rhs = b.T, a.T
    else:
        lhs, rhs = a, b
    if IEEE:
        out = tl.dot(lhs, rhs, acc, input_precision="ieee")
    else:
        out = tl.dot(lhs, rhs, acc)
    return out


@triton.jit
def _scaled_dot(a, b, a_s, b_s_ptrs, TILE_B_SCALE: tl.constexpr, SWAP_AB: tl.constexpr):
    """One fp8 K block's product, a @ b (SWAP_AB: b^T @ a^T), times the rows' scales a_s [BLOCK_M] and the
    weights' scales at b_s_ptrs (one with TILE_B_SCALE, else [BLOCK_N]), loaded after the dot is issued."""
    if SWAP_AB:
        if TILE_B_SCALE:
            out = tl.dot(b.T, a.T) * (a_s * tl.load(b_s_ptrs))[None, :]
        else:
            out = tl.dot(b.T, a.T) * tl.load(b_s_ptrs)[:, None] * a_s[None, :]
    else:
        if TILE_B_SCALE:
            out = tl.dot(a, b) * (a_s * tl.load(b_s_ptrs))[:, None]
        else:
            out = tl.dot(a, b) * a_s[:, None] * tl.load(b_s_ptrs)[None, :]
    return out


def _check_operands(name: str, a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
                    w_scale: torch.Tensor | None, rows: ExpertRows, n_rows_w: int) -> None:
    if a.dim() != 2:
        raise ValueError(f"{name}: activations must be [R, K], got {tuple(a.shape)}")
    if w.dim() != 3 or w.shape[0] != rows.num_experts or w.shape[1] != n_rows_w or w.shape[2] != a.shape[1]:
        raise ValueError(f"{name}: weights must be [L={rows.num_experts}, {n_rows_w}, K={a.shape[1]}], "
                         f"got {tuple(w.shape)}")
    fp8 = w.dtype == FP8_DTYPE
    if a.dtype == FP8_DTYPE and not fp8:
        raise ValueError(f"{name}: fp8 activations need fp8 weights, got {w.dtype}")
    if fp8:
        if w_scale is None:
            raise ValueError(f"{name}: fp8 weights need w_scale")
        if a.dtype != FP8_DTYPE and a_scale is not None:
            raise ValueError(f"{name}: a_scale given for unquantized {a.dtype} activations")
        if a.dtype == FP8_DTYPE and a_scale is None:
            raise ValueError(f"{name}: fp8 activations need a_scale")
        want_a = (a.shape[0], num_groups(a.shape[1]))
        if a_scale is not None and (a_scale.shape != want_a or a_scale.dtype != torch.float32):
            raise ValueError(f"{name}: a_scale must be float32 {list(want_a)}, "
                             f"got {a_scale.dtype} {tuple(a_scale.shape)}")
        want = (w.shape[0], num_groups(w.shape[1]), num_groups(w.shape[2]))
        if w_scale.shape != want or w_scale.dtype != torch.float32:
            raise ValueError(f"{name}: w_scale must be float32 {list(want)}, got {w_scale.dtype} "
                             f"{tuple(w_scale.shape)}")
    elif a.dtype != w.dtype:
        raise ValueError(f"{name}: activations {a.dtype} and weights {w.dtype} differ")
    if rows.batched and a.shape[0] != rows.num_experts * rows.slot_rows:
        raise ValueError(f"{name}: batched activations need L*M = {rows.num_experts * rows.slot_rows} rows, "
                         f"got {a.shape[0]}")
    for t in (a, w, rows.index_L):
        if t.device != a.device:
            raise ValueError(f"{name}: all tensors must be on {a.device}, got one on {t.device}")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _descriptor(t: torch.Tensor, block: list[int]):
    """A TMA descriptor of the 2-D tensor t with tiles `block`, or None where TMA cannot read it: no
    TensorDescriptor in this Triton, a GPU before Hopper (the interpreter emulates it), strides or the
    base address not 16-byte aligned."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    if t.is_cuda and not _has_tma(t.device.index):
        return None
    if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    return TensorDescriptor.from_tensor(t, block)


@functools.cache
def _has_gdc(device_index: int) -> bool:
    """Grid dependency control (griddepcontrol, programmatic dependent launch) is used on Hopper, with a
    Triton that has it."""
    return gdc_wait is not None and torch.cuda.get_device_capability(device_index)[0] == 9


def _gdc(device: torch.device, gate_up: bool, dependent: bool) -> int:
    """A launch's grid dependency control: on a Hopper GPU, a gate-up lets its dependent start early (the
    trigger costs nothing where the next launch is not one) and a down launched as one waits."""
    if device.type != "cuda" or not _has_gdc(device.index):
        return GDC_NONE.value
    return GDC_TRIGGER.value if gate_up else GDC_WAIT.value if dependent else GDC_NONE.value


def _max_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index) * _PROGRAMS_PER_SM
    return _INTERPRETER_PROGRAMS


def _warp_specialized(cfg: GemmConfig, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rows: ExpertRows, *,
                      gate_up: bool, gathered: bool) -> bool:
    """Whether this launch runs the warp-specialized kernel (its config asks for it and it can serve it)."""
    return (cfg.warp_specialize is not None and grouped_gemm_ws is not None
            and grouped_gemm_ws.supported(a, w, out, rows.num_experts, gate_up=gate_up, block_n=cfg.block_n,
                                          block_k=cfg.block_k, gathered=gathered))


def _launch(a, a_scale, w, w_scale, rows: ExpertRows, out, out_scale, row_scale, *, gate_up: bool,
            cfg: GemmConfig, a_rows: torch.Tensor | None = None, follows_gate_up: bool = False) -> None:
    """One grouped GEMM on the warp-specialized kernel where it can serve it, else the pointer kernel; a down
    that follows its gate-up (`down`'s follows_gate_up) and whose config sets pdl as a programmatic dependent
    of the kernel before it."""
    R, N = out.shape
    K = a.shape[1]
    L = rows.num_experts
    max_tiles_m = rows.max_row_tiles(R, cfg.block_m)
    if R == 0 or N == 0 or L == 0 or max_tiles_m == 0:
        return
    fp8 = w.dtype == FP8_DTYPE
    a_scale = None if a_scale is None else a_scale.contiguous()
    w_scale = w_scale.contiguous() if fp8 else None
    gdc = _gdc(a.device, gate_up, cfg.pdl and follows_gate_up)
    if _warp_specialized(cfg, a, w, out, rows, gate_up=gate_up, gathered=a_rows is not None):
        grouped_gemm_ws.launch(a, a_scale, w, w_scale, rows.index_L, rows.batched, rows.slot_rows, out, out_scale,
                               row_scale, gate_up=gate_up, cfg=cfg,
                               programs=min(max_tiles_m * triton.cdiv(N, cfg.block_n), _sm_count(a.device.index)),
                               a_rows=a_rows, dependent=gdc == GDC_WAIT.value)
        return
    cfg = cfg.pointer_variant(a.element_size())
    dummy = out  # placeholder pointer for arguments a variant does not read
    a_desc = _descriptor(a, [cfg.block_m, cfg.block_k]) if cfg.tma and a_rows is None else None
    # The fused h quantization takes each row's amax over the whole column tile: pointer loads repeat
    # column N-1 past N, TMA would bring the next rows of B, so a partial last tile keeps pointer loads.
    tma_b = cfg.tma and (out_scale is None or N % cfg.block_n == 0)
    b_desc = _descriptor(w.view(-1, K), [cfg.block_n, cfg.block_k]) if tma_b else None
    grid = (min(max_tiles_m * triton.cdiv(N, cfg.block_n), _max_programs(a.device)),)
    dependent = {"launch_pdl": True} if gdc == GDC_WAIT.value else {}  # (Tritons before 3.4 take no launch_pdl)
    _grouped_gemm_kernel[grid](
        a, a_desc, dummy if a_scale is None else a_scale, dummy if a_rows is None else a_rows,
        w, b_desc, w_scale if fp8 else dummy, out,
        out_scale if out_scale is not None else dummy, row_scale if row_scale is not None else dummy,
        rows.index_L, L, rows.slot_rows, R, N, K,
        w.stride(0), w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0,
        num_groups(K), num_groups(N),
        BATCHED=rows.batched, GATHER=a_rows is not None, GATE_UP=gate_up,
        TMA_A=a_desc is not None, TMA_B=b_desc is not None, FP8=fp8, QUANT_OUT=out_scale is not None,
        HAS_ROW_SCALE=row_scale is not None,
        TILE_B_SCALE=fp8 and FP8_BLOCK % cfg.block_n == 0 and (not gate_up or N % FP8_BLOCK == 0),
        QUANT_A=fp8 and a.dtype != FP8_DTYPE, UPCAST=a.device.type == "cpu",
        IEEE=a.dtype == torch.float32, EVEN_K=K % cfg.block_k == 0, SWAP_AB=cfg.swap_ab,
        L_POW2=max(triton.next_power_of_2(L), _MIN_EXPERT_BLOCK), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SCALE_GROUP=FP8_BLOCK, GDC=gdc,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dependent)


def gate_up(x_RD: torch.Tensor, w13_LND: torch.Tensor, rows: ExpertRows, *, x_scale_RG: torch.Tensor | None = None,
            w13_scale: torch.Tensor | None = None, x_rows_R: torch.Tensor | None = None,
            rows_hint: int | None = None, config: GemmConfig | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h = silu(x W1^T) * (x W3^T) per expert, W1 = w13[l, :F], W3 = w13[l, F:]. No host sync.

    Args:
        x_RD: [R, D] activations (bf16/fp16/fp32, or float8_e4m3fn with x_scale_RG float32 [R, ceil(D/128)]);
            with x_rows_R, [S, D] source rows (and x_scale_RG [S, ceil(D/128)]).
        w13_LND: [L, 2F, D] weights in x's dtype, or float8_e4m3fn with w13_scale float32
            [L, ceil(2F/128), ceil(D/128)]. fp8 weights with unquantized x: x is quantized per token per
            128 columns, inside the kernel for the batched layout (padding slots are never read; needs
            block_k 128), else by `quantize_act` first.
        rows: the rows of each expert; rows outside every expert are not computed.
        x_rows_R: contiguous layout only, optional int32 [R] with values in [0, S): row i of the batch is
            x_RD[x_rows_R[i]], read through the index inside the kernel (no permuted copy). With fp8
            weights and unquantized x, all S source rows are quantized first.
        rows_hint: expected rows per expert, for the launch configuration (default `rows.rows_hint`; the
            contiguous layout's mean is taken for routed rows, which scatter around it: `gemm_config`'s
            `scattered`).
        config: launch configuration (default: `gemm_config` for these shapes).

    Returns:
        (h_RF, h_scale_RG): unquantized input gives h in x's dtype and None; fp8 input gives h as
        float8_e4m3fn [R, F] with float32 scales [R, ceil(F/128)] for the down GEMM. Rows outside the
        experts' rows are unspecified.
    """
    if w13_LND.dim() != 3 or w13_LND.shape[1] % 2:
        raise ValueError(f"gate_up: w13 must be [L, 2F, D], got {tuple(w13_LND.shape)}")
    F = w13_LND.shape[1] // 2
    _check_operands("gate_up", x_RD, x_scale_RG, w13_LND, w13_scale, rows, 2 * F)
    fp8 = w13_LND.dtype == FP8_DTYPE
    R = x_RD.shape[0]
    if x_rows_R is not None:
        if rows.batched or x_rows_R.dim() != 1 or x_rows_R.dtype != torch.int32 or x_rows_R.device != x_RD.device:
            raise ValueError(f"gate_up: x_rows_R must be int32 [R] on {x_RD.device} with the contiguous layout, "
                             f"got {x_rows_R.dtype} {tuple(x_rows_R.shape)} on {x_rows_R.device}")
        R = x_rows_R.shape[0]
    hint = rows.rows_hint(R) if rows_hint is None else rows_hint
    cfg = config or gemm_config("gate_up", fp8=fp8, rows_hint=hint, on_gpu=x_RD.is_cuda, gpu=gpu_name(x_RD.device),
                                element_size=x_RD.element_size(), indexed=x_rows_R is not None,
                                scattered=rows_hint is None and not rows.batched)
    fused_quant = fp8 and cfg.block_n == FP8_BLOCK
    # bf16 x with fp8 weights: quantized inside the pointer kernel for the batched layout (with 128-deep
    # K blocks), else first (the warp-specialized kernel takes fp8 x only).
    in_kernel_quant = rows.batched and cfg.block_k == FP8_BLOCK and cfg.warp_specialize is None
    if fp8 and x_RD.dtype != FP8_DTYPE and not in_kernel_quant:
        x_RD, x_scale_RG = quantize_act(x_RD)
    out_dtype = FP8_DTYPE if fused_quant else (torch.float32 if fp8 else x_RD.dtype)
    h = torch.empty(R, F, dtype=out_dtype, device=x_RD.device)
    h_scale = torch.empty(R, num_groups(F), dtype=torch.float32, device=x_RD.device) if fused_quant else None
    _launch(x_RD.contiguous(), x_scale_RG, w13_LND.contiguous(), w13_scale, rows, h, h_scale, None,
            gate_up=True, cfg=cfg, a_rows=None if x_rows_R is None else x_rows_R.contiguous())
    if fp8 and not fused_quant:
        return quantize_act(h)
    return h, h_scale


def down(h_RF: torch.Tensor, w2_LDF: torch.Tensor, rows: ExpertRows, *, h_scale_RG: torch.Tensor | None = None,
         w2_scale: torch.Tensor | None = None, row_scale_R: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, rows_hint: int | None = None,
         config: GemmConfig | None = None, follows_gate_up: bool = False) -> torch.Tensor:
    """y = h W2^T per expert, optionally times a per-row scale (the top-k weights). No host sync.

    Args:
        h_RF: [R, F] (bf16/fp16/fp32, or float8_e4m3fn with h_scale_RG float32 [R, ceil(F/128)]).
        w2_LDF: [L, D, F] in h's dtype, or float8_e4m3fn with w2_scale float32 [L, ceil(D/128), ceil(F/128)].
        rows: the rows of each expert.
        row_scale_R: optional float32 [R], multiplies each output row in the epilogue.
        out_dtype: y's dtype (default h's dtype; required for fp8 input).
        rows_hint, config: as for `gate_up`.
        follows_gate_up: h_RF (and h_scale_RG) come from the `gate_up` queued last on the current stream
            (or from the quantization of its h after it), and that last kernel writes neither `rows`' index
            nor the weights, which the down may read before it waits for that kernel to end. With a launch
            config that sets pdl (on Hopper) the down then launches as that kernel's programmatic dependent
            and starts while it ends (`GemmConfig`); the result is the same either way.

    Returns:
        y_RD [R, D] in out_dtype; rows outside the experts' rows are unspecified.
    """
    _check_operands("down", h_RF, h_scale_RG, w2_LDF, w2_scale, rows, w2_LDF.shape[1] if w2_LDF.dim() == 3 else -1)
    fp8 = w2_LDF.dtype == FP8_DTYPE
    if out_dtype is None:
        if fp8:
            raise ValueError("down: fp8 input needs an explicit out_dtype")
        out_dtype = h_RF.dtype
    R = h_RF.shape[0]
    if row_scale_R is not None and (row_scale_R.shape != (R,) or row_scale_R.dtype != torch.float32):
        raise ValueError(f"down: row_scale_R must be float32 [{R}], got {row_scale_R.dtype} "
                         f"{tuple(row_scale_R.shape)}")
    hint = rows.rows_hint(R) if rows_hint is None else rows_hint
    cfg = config or gemm_config("down", fp8=fp8, rows_hint=hint, on_gpu=h_RF.is_cuda, gpu=gpu_name(h_RF.device),
                                element_size=h_RF.element_size(), scattered=rows_hint is None and not rows.batched)
    y = torch.empty(R, w2_LDF.shape[1], dtype=out_dtype, device=h_RF.device)
    _launch(h_RF.contiguous(), h_scale_RG, w2_LDF.contiguous(), w2_scale, rows, y, None,
            None if row_scale_R is None else row_scale_R.contiguous(), gate_up=False, cfg=cfg,
            follows_gate_up=follows_gate_up)
    return y


def _dequant(t: torch.Tensor, scale: torch.Tensor | None, weight: bool) -> torch.Tensor:
    if scale is None:
        return t.float()
    return dequantize_weight_ref(t, scale) if weight else dequantize_act_ref(t, scale)


def gate_up_ref(x_RD, w13_LND, rows: ExpertRows, *, x_scale_RG=None, w13_scale=None, x_rows_R=None) -> torch.Tensor:
    """float32 h [R, F] of `gate_up`, before any output rounding; rows outside the experts are zero.
    fp8 weights with unquantized x: x is quantized first, as the kernels do."""
    if x_rows_R is not None:
        x_RD = x_RD[x_rows_R.long()]
        x_scale_RG = None if x_scale_RG is None else x_scale_RG[x_rows_R.long()]
    if w13_scale is not None and x_scale_RG is None:
        x_RD, x_scale_RG = quantize_act_ref(x_RD)
    x = _dequant(x_RD, x_scale_RG, weight=False)
    w = _dequant(w13_LND, w13_scale, weight=True)
    F = w.shape[1] // 2
    h = torch.zeros(x.shape[0], F, dtype=torch.float32, device=x.device)
    for l, (lo, hi) in enumerate(rows.ranges()):
        gu = x[lo:hi] @ w[l].t()
        h[lo:hi] = F_.silu(gu[:, :F]) * gu[:, F:]
    return h


def down_ref(h_RF, w2_LDF, rows: ExpertRows, *, h_scale_RG=None, w2_scale=None, row_scale_R=None) -> torch.Tensor:
    """float32 y [R, D] of `down`; rows outside the experts are zero."""
    h = _dequant(h_RF, h_scale_RG, weight=False)
    w = _dequant(w2_LDF, w2_scale, weight=True)
    y = torch.zeros(h.shape[0], w.shape[1], dtype=torch.float32, device=h.device)
    for l, (lo, hi) in enumerate(rows.ranges()):
        y[lo:hi] = h[lo:hi] @ w[l].t()
    if row_scale_R is not None:
        y = y * row_scale_R.float()[:, None]
    return y

