"""Reading a transformers experts module: what epmoe can run, and its weights in epmoe's layout.

transformers 5 gives every MoE family one experts module (decorated by `use_experts_implementation`):
`gate_up_proj` [E, 2F, D] (F gate rows, then F up rows), `down_proj` [E, D, F], `act_fn`, and the flags
`has_gate`, `has_bias`, `is_transposed`, `is_concatenated` (and `has_post_expert_norm` in newer releases).
FP8 checkpoints load as transformers' `FP8Experts`: float8_e4m3fn weights with `*_scale_inv` float32
(or UE8M0) block scales. That is exactly epmoe's layout, so the weights are handed over as views (no copy).

Shape letters: E experts in the module, D hidden size, F expert intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.activations import SiLUActivation
from transformers.integrations.finegrained_fp8 import FP8Experts
from transformers.integrations.moe import _default_apply_gate

from ..config import FP8_BLOCK
from ..quant import FP8_DTYPE, dequantize_weight_ref, num_groups

_SILU = (torch.nn.SiLU, SiLUActivation)
# FP8Experts' gating options that change the activation (clamped or soft-capped SwiGLU).
_FP8_GATE_OPTIONS = ("swiglu_alpha", "limit", "gate_softcap", "up_softcap")


def is_experts_module(module: torch.nn.Module) -> bool:
    """Whether `module` is a transformers experts module (one that `experts_implementation` dispatches)."""
    return hasattr(module, "has_gate") and hasattr(module, "down_proj")


def describe(module: torch.nn.Module) -> str:
    """The experts class and the model it belongs to, for messages: "Qwen3MoeExperts of Qwen3MoeForCausalLM"."""
    config = getattr(module, "config", None)
    architectures = getattr(config, "architectures", None)
    model = architectures[0] if architectures else f"a {type(config).__name__} model"
    return f"{type(module).__name__} of {model}"


def _gating(module: torch.nn.Module) -> str | None:
    """None when the module gates as act_fn(gate) * up (transformers' default `_apply_gate`), else what it does
    instead. FP8Experts has its own `_apply_gate`: the default one unless a clamping or soft-capping option
    is set."""
    if isinstance(module, FP8Experts):
        options = [name for name in _FP8_GATE_OPTIONS if getattr(module, name, None) is not None]
        return f"a clamped or soft-capped gate ({', '.join(options)})" if options else None
    gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    return None if gate is _default_apply_gate else f"its own gating ({gate.__qualname__})"


def unsupported(module: torch.nn.Module) -> list[str]:
    """What keeps epmoe from running this experts module exactly (empty: it can)."""
    reasons = []
    if not getattr(module, "has_gate", True) or getattr(module, "gate_up_proj", None) is None:
        reasons.append("experts without a fused gate_up_proj (up_proj only)")
    if getattr(module, "has_bias", False) or any(
            getattr(module, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")):
        reasons.append("biases")
    if not getattr(module, "is_concatenated", True):
        reasons.append("interleaved gate/up rows")
    if getattr(module, "is_transposed", False):
        reasons.append("transposed weights ([E, D, 2F])")
    if getattr(module, "has_post_expert_norm", False):
        reasons.append("a norm after each expert")
    gating = _gating(module)
    act = getattr(module, "act_fn", None)
    if gating is not None:
        reasons.append(gating)
    elif not isinstance(act, _SILU):
        reasons.append(f"the activation {type(act).__name__} (epmoe's experts are SiLU-gated)")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        reasons.append(f"activation_scheme={module.activation_scheme!r} (epmoe quantizes activations per token "
                       "per 128 columns, 'dynamic')")
    block = getattr(module, "block_size", (FP8_BLOCK, FP8_BLOCK))  # FP8Experts' (None: one scale per tensor)
    if getattr(module, "gate_up_proj_scale_inv", None) is not None and tuple(block or ()) != (FP8_BLOCK, FP8_BLOCK):
        reasons.append(f"fp8 weight blocks {block} (epmoe's fp8_block is 128x128)")
    return reasons


@dataclass(frozen=True)
class ExpertsWeights:
    """An experts module's weights in epmoe's layout: views of the module's own tensors (no copy).

    Attributes:
        w13_END: [E, 2F, D], F gate rows then F up rows; the model's dtype, or float8_e4m3fn with
        w13_scale: float32 [E, ceil(2F/128), ceil(D/128)] block scales (w ~= w_fp8 * scale), else None.
        w2_EDF: [E, D, F]; with w2_scale float32 [E, ceil(D/128), ceil(F/128)] when fp8, else None.
    """

    w13_END: torch.Tensor
    w2_EDF: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None

    @property
    def quant(self) -> str | None:
        """epmoe's MoEConfig.quant for these weights: "fp8_block" or None."""
        return None if self.w13_scale is None else "fp8_block"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, D, F)."""
        E, D, F = self.w2_EDF.shape
        return E, D, F

    def experts(self, lo: int, hi: int) -> "ExpertsWeights":
        """Experts lo:hi (views)."""
        return ExpertsWeights(*(None if t is None else t[lo:hi] for t in self._tensors()))

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> "ExpertsWeights":
        """On `device`, unquantized weights cast to `dtype` (fp8 weights and their float32 scales as they are)."""
        cast = None if self.quant is not None else dtype
        w13, w2 = (w.to(device=device, dtype=cast) for w in (self.w13_END, self.w2_EDF))
        scales = (None if s is None else s.to(device) for s in (self.w13_scale, self.w2_scale))
        return ExpertsWeights(w13, w2, *scales)

    def dequantized(self, dtype: torch.dtype) -> "ExpertsWeights":
        """These weights unquantized, in `dtype` (fp8 ones dequantized block by block)."""
        if self.quant is None:
            return self
        return ExpertsWeights(dequantize_weight_ref(self.w13_END, self.w13_scale).to(dtype),
                              dequantize_weight_ref(self.w2_EDF, self.w2_scale).to(dtype), None, None)

    def clone(self) -> "ExpertsWeights":
        """A copy with storage of its own (a slice's clone frees the rest once the full tensors go)."""
        return ExpertsWeights(*(None if t is None else t.clone() for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.w13_END, self.w2_EDF, self.w13_scale, self.w2_scale


def _scale(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The module's block scales `name` as float32 (UE8M0 scales are powers of two: exact in float32)."""
    scale = getattr(module, name, None)
    if scale is None:
        return None
    scale = scale.detach()
    return scale if scale.dtype == torch.float32 else scale.float()


def experts_weights(module: torch.nn.Module) -> ExpertsWeights:
    """The weights of a transformers experts module, checked to be what epmoe computes.

    Raises ValueError, naming the module's class and model, for a module epmoe cannot run exactly
    (`unsupported`), or whose weights do not have epmoe's shapes.
    """
    reasons = unsupported(module)
    if reasons:
        raise ValueError(f"epmoe cannot run {describe(module)}: it has {'; '.join(reasons)}")
    w13, w2 = module.gate_up_proj.detach(), module.down_proj.detach()
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2] \
            or w13.shape[2] != w2.shape[1]:
        raise ValueError(f"{describe(module)}: gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} are "
                         "not [E, 2F, D] and [E, D, F]")
    E, D, F = w2.shape
    w13_scale, w2_scale = _scale(module, "gate_up_proj_scale_inv"), _scale(module, "down_proj_scale_inv")
    if (w13.dtype == FP8_DTYPE) != (w13_scale is not None) or (w2.dtype == FP8_DTYPE) != (w2_scale is not None):
        raise ValueError(f"{describe(module)}: fp8 weights need their block scales (weight_scale_inv), and only "
                         f"fp8 weights have them; got {w13.dtype}/{w2.dtype} weights")
    if w13_scale is not None:
        if F % FP8_BLOCK:
            raise ValueError(f"{describe(module)}: fp8 experts need an intermediate size divisible by {FP8_BLOCK} "
                             f"(the gate and up halves of gate_up_proj are scaled in separate blocks), got F={F}")
        for name, scale, rows, cols in (("gate_up_proj", w13_scale, 2 * F, D), ("down_proj", w2_scale, D, F)):
            want = (E, num_groups(rows), num_groups(cols))
            if tuple(scale.shape) != want:
                raise ValueError(f"{describe(module)}: {name}_scale_inv is {tuple(scale.shape)}, epmoe's 128x128 "
                                 f"blocks need {want}")
    elif not w13.is_floating_point() or not w2.is_floating_point():
        raise ValueError(f"{describe(module)}: weights of dtype {w13.dtype} (packed fp4?) are not supported")
    return ExpertsWeights(w13, w2, w13_scale, w2_scale)
