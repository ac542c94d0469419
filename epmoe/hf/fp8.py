"""A model's experts as an FP8 checkpoint loads them: transformers' FP8Experts with block-128 fp8 weights.

For runs without an FP8 checkpoint (random-weight presets, tests): each experts module's own weights are
quantized per 128x128 block (float8_e4m3fn, float32 `weight_scale_inv` scales, w ~= w_fp8 * scale) and
the module is replaced by transformers' FineGrainedFP8 experts module holding them, as
`from_pretrained` builds it for Qwen3-30B-A3B-FP8 or DeepSeek-V3. The dense layers stay as they are.

Shape letters: E experts, D hidden size, F expert intermediate size.
"""
from __future__ import annotations

import re

import torch
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

from ..config import FP8_BLOCK
from ..quant import quantize_weights_ref
from .experts import experts_weights
from .parallel import experts_modules


def quantize_experts(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every experts module of `model` by an FP8Experts module holding its weights quantized per
    128x128 block (gate_up_proj float8_e4m3fn [E, 2F, D] with gate_up_proj_scale_inv float32
    [E, 2F/128, ceil(D/128)], down_proj likewise); in place, on the weights' device. Needs F % 128 == 0
    (the gate and up halves are scaled in separate blocks, as in the checkpoints)."""
    weights = {}
    for name, module in experts_modules(model):
        w = experts_weights(module)
        if w.quant is not None:
            raise ValueError(f"{name} holds fp8 weights already")
        if w.shape[2] % FP8_BLOCK:
            raise ValueError(f"{name}: fp8 experts need an intermediate size divisible by {FP8_BLOCK}, "
                             f"got {w.shape[2]}")
        weights[name] = w
    dense = [re.escape(name) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    replace_with_fp8_linear(model, modules_to_not_convert=dense, pre_quantized=True,
                            quantization_config=FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK)))
    for name, w in weights.items():
        module = model.get_submodule(name)
        for param, tensor in (("gate_up_proj", w.w13_END), ("down_proj", w.w2_EDF)):
            q, scale = quantize_weights_ref(tensor)
            setattr(module, param, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, f"{param}_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
    return model


def dequantize_experts(fp8: torch.nn.Module, plain: torch.nn.Module) -> torch.nn.Module:
    """Set the experts of `plain` (a model of the same config with unquantized experts modules) to those of
    `fp8` dequantized: the reference an fp8 model is compared with. In place; returns `plain`."""
    with torch.no_grad():
        for (_, q), (_, p) in zip(experts_modules(fp8), experts_modules(plain)):
            w = experts_weights(q).dequantized(p.gate_up_proj.dtype)
            p.gate_up_proj.copy_(w.w13_END)
            p.down_proj.copy_(w.w2_EDF)
    return plain
