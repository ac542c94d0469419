"""fp8 e4m3 block quantization, torch reference implementations.

Activations: one fp32 scale per row per 128 columns (1x128 groups). Weights: one fp32 scale per
128x128 block. The last group or block may be partial. x ~= x_fp8.float() * scale.

Shape letters: N rows, D columns, G = ceil(D / 128) column groups, B leading batch dims.
"""
from __future__ import annotations

import torch

from .config import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_AMAX = 1e-10


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 (amax floored at _MIN_AMAX), correctly rounded on every device, as the Triton quantizers
    divide (`tl.math.div_rn`): the divisor is a tensor because CUDA divides by a host scalar as a multiply by
    its rounded reciprocal, an ulp off for some amax (then the scales and a few fp8 values differ from the
    kernels')."""
    return amax.clamp_min(_MIN_AMAX) / torch.full_like(amax, FP8_MAX)


def num_groups(d: int) -> int:
    return -(-d // FP8_BLOCK)


def _pad_cols(x: torch.Tensor) -> torch.Tensor:
    pad = num_groups(x.shape[-1]) * FP8_BLOCK - x.shape[-1]
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_act_ref(x_BD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., D] per row per 128 columns: returns (x_fp8 [..., D], scale float32 [..., G])."""
    D = x_BD.shape[-1]
    xp = _pad_cols(x_BD.float())
    groups = xp.unflatten(-1, (-1, FP8_BLOCK))
    scale = _scale(groups.abs().amax(dim=-1))
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2)[..., :D].contiguous(), scale


def dequantize_act_ref(q_BD: torch.Tensor, scale_BG: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_act_ref, float32 [..., D]."""
    D = q_BD.shape[-1]
    s = scale_BG.repeat_interleave(FP8_BLOCK, dim=-1)[..., :D]
    return q_BD.float() * s


def quantize_weight_ref(w_BNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., N, K] per 128x128 block: returns (w_fp8 [..., N, K], scale float32 [..., ceil(N/128), ceil(K/128)])."""
    N, K = w_BNK.shape[-2:]
    gn, gk = num_groups(N), num_groups(K)
    wp = torch.nn.functional.pad(w_BNK.float(), (0, gk * FP8_BLOCK - K, 0, gn * FP8_BLOCK - N))
    blocks = wp.unflatten(-1, (gk, FP8_BLOCK)).unflatten(-3, (gn, FP8_BLOCK))  # [..., gn, 128, gk, 128]
    scale = _scale(blocks.abs().amax(dim=(-3, -1)))  # [..., gn, gk]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.flatten(-2).flatten(-3, -2)[..., :N, :K].contiguous()
    return q, scale


def quantize_weights_ref(w_LNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight_ref of [L, N, K] weights one [N, K] matrix at a time, so the float32 temporaries stay
    one matrix's size."""
    pairs = [quantize_weight_ref(w_NK) for w_NK in w_LNK]
    if not pairs:
        return quantize_weight_ref(w_LNK)
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def dequantize_weight_ref(q_BNK: torch.Tensor, scale_BNK: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_weight_ref, float32 [..., N, K]."""
    N, K = q_BNK.shape[-2:]
    s = scale_BNK.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)[..., :N, :K]
    return q_BNK.float() * s
