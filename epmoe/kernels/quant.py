"""fp8 e4m3 activation quantization per token per 128 columns, in Triton.

Shape letters: R rows (any leading dims flattened), D columns, G = ceil(D / 128) column groups.
The torch reference is `epmoe.quant.quantize_act_ref`; this kernel computes the same scales
(amax / 448, amax floored at 1e-10) and the same quotient x / scale, rounded to e4m3.
Dispatchers may call `quantize_act` before sending; the experts call it on unquantized input.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import FP8_BLOCK
from ..quant import _MIN_AMAX, FP8_DTYPE, FP8_MAX, num_groups

_BLOCK_ROWS = 16
# Constants the kernels read (Triton kernels may only read globals that are tl.constexpr).
FP8_MAX_C = tl.constexpr(FP8_MAX)
MIN_AMAX_C = tl.constexpr(_MIN_AMAX)
_E4M3_MIN_NORMAL = tl.constexpr(2.0 ** -6)  # subnormals share the spacing of this binade
_E4M3_MANTISSA_BITS = tl.constexpr(3)


@triton.jit
def to_fp8(x, dtype: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Cast float32 `x` (already within +-448) to fp8 `dtype`.

    ROUND_FIRST (the launcher sets it for CPU tensors, i.e. under the Triton interpreter): round to the
    e4m3 grid in float32 first (half to even, as the hardware cast does), so that the cast is exact; the interpreter's own
    cast drops the carry when the mantissa rounds up into the next binade (7.9 -> 4.0).
    """
    if ROUND_FIRST:
        e = tl.floor(tl.log2(tl.maximum(tl.abs(x), _E4M3_MIN_NORMAL)))
        step = tl.exp2(e - _E4M3_MANTISSA_BITS)
        r = tl.abs(x) / step
        f = tl.floor(r)
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        up = ((r - f) > 0.5) | (((r - f) == 0.5) & odd)
        x = tl.where(x < 0, -1.0, 1.0) * tl.where(up, f + 1.0, f) * step
    return x.to(dtype)


@triton.jit
def divide_rn(x, s):
    """x / s rounded to nearest (as tl.math.div_rn and torch divide), float32, for x of shape S and a
    divisor s that broadcasts to S (one per fp8 group, say). One correctly rounded reciprocal y = 1 / s
    per divisor, then per element q0 = x * y (within an ulp) and Markstein's correction
    q = fma(fma(-q0, s, x), y, q0): exactly the rounded quotient while s, y, the quotient and the
    remainder x - q0 * s are normal (|x| >= 2^-100 or so; below that it may be an ulp off). In fp8
    quantization s >= 1e-10 / 448 (~2^-42), so every quotient that e4m3 does not round to zero
    (|q| >= 2^-10) has |x| >= 2^-52: the fp8 values are exact. A zero quotient keeps x's sign. Three
    flops an element instead of a full-range IEEE division."""
    y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    s_b = tl.broadcast_to(s, x.shape)
    y_b = tl.broadcast_to(y, x.shape)
    q0 = x * y_b
    residual = tl.fma(-q0, s_b, x)
    return tl.where(residual == 0.0, q0, tl.fma(residual, y_b, q0))


@triton.jit
def _quantize_act_kernel(x_ptr, q_ptr, scale_ptr, R, D, G,
                         BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr, ROUND_FIRST: tl.constexpr):
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # div_rn: correctly rounded division (Triton's `/` may be approximate), as torch divides.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX_C), FP8_MAX_C)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + offs, to_fp8(q, q_ptr.dtype.element_ty, ROUND_FIRST), mask=mask)
    tl.store(scale_ptr + rows.to(tl.int64) * G + g, scale, mask=rows < R)


def quantize_act(x_BD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., D] per row per 128 columns. No host sync.

    Args:
        x_BD: float activations (bf16, fp16 or fp32), any leading dims; made contiguous if it is not.

    Returns:
        (x_fp8 float8_e4m3fn [..., D], scale float32 [..., G]) with x ~= x_fp8 * scale per group.
    """
    if not x_BD.is_floating_point() or x_BD.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_act takes unquantized float input, got {x_BD.dtype}")
    if x_BD.dim() < 1:
        raise ValueError("quantize_act needs at least one dimension")
    D = x_BD.shape[-1]
    G = num_groups(D)
    x = x_BD.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((*x.shape[:-1], G), dtype=torch.float32, device=x.device)
    R = x.numel() // D if D else 0
    if R and D:
        grid = (triton.cdiv(R, _BLOCK_ROWS), G)
        _quantize_act_kernel[grid](x, q, scale, R, D, G, BLOCK_ROWS=_BLOCK_ROWS, GROUP=FP8_BLOCK,
                                   ROUND_FIRST=x.device.type == "cpu")
    return q, scale
