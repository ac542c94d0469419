"""transformers' own MoE experts, the peer of `epmoe bench moe`: a model family's experts module built for
a shape, running its own forward through transformers' experts backends.

Shape letters: E experts, K top-k, D hidden size, F expert intermediate size, T tokens.

A family's experts class (e.g. `Qwen3MoeExperts`) is built from the family's config class with the
shape's sizes and `experts_implementation=backend`, on the meta device, and then given the caller's
weights as its parameters (no copy): its own `forward(hidden_states, top_k_index, top_k_weights)` then
picks the backend from transformers' `ExpertsInterface` (`transformers.integrations.moe`): "grouped_mm"
(torch's grouped GEMM) or "eager" (the class's own loop over experts). Its weights have epmoe's layout:
`gate_up_proj` [E, 2F, D] (F gate rows, then F up rows), `down_proj` [E, D, F].

fp8: transformers' FP8 experts (`transformers.integrations.finegrained_fp8.FP8Experts`, as its fp8
quantizer builds them: wrapped by `use_experts_implementation` with the FP8 experts interface) take
float8_e4m3fn weights with float32 128x128 block scales (`*_scale_inv`, w ~= w_fp8 * scale), the
format epmoe loads as it is. Their GEMMs (every backend, eager included) are the hub kernel
`kernels-community/finegrained-fp8` (or DeepGEMM, also from the hub), so they run only where the
`kernels` package is installed and the kernel can be fetched or is cached; transformers 5.17 and 5.24
are alike in this.

transformers is imported inside the functions, so that epmoe imports without it.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

# How each family's config names its sizes: (config class, experts class, field of E, field of F).
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeExperts", "num_experts", "moe_intermediate_size"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2Experts", "n_routed_experts", "moe_intermediate_size"),
    "mixtral": ("MixtralConfig", "MixtralExperts", "num_local_experts", "intermediate_size"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3Experts", "n_routed_experts", "moe_intermediate_size"),
}
FP8_BLOCK_SIZE = (128, 128)


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """One MoE block's sizes and the transformers model family whose experts module runs it."""

    name: str
    family: str  # a key of FAMILIES
    hidden_size: int  # D
    num_experts: int  # E
    top_k: int  # K
    intermediate_size: int  # F

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"MoEShape.family must be one of {sorted(FAMILIES)}, got {self.family!r}")


def transformers_version() -> str | None:
    """The installed transformers' version, or None where it is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def _config(shape: MoEShape, backend: str):
    config_name, _, experts_field, inter_field = FAMILIES[shape.family]
    module = importlib.import_module(f"transformers.models.{shape.family}.configuration_{shape.family}")
    return getattr(module, config_name)(
        hidden_size=shape.hidden_size, num_experts_per_tok=shape.top_k, hidden_act="silu",
        experts_implementation=backend, **{experts_field: shape.num_experts, inter_field: shape.intermediate_size})


def _with_weights(module: torch.nn.Module, **weights: torch.Tensor) -> torch.nn.Module:
    for name, w in weights.items():
        setattr(module, name, torch.nn.Parameter(w, requires_grad=False))
    return module


def experts_module(shape: MoEShape, backend: str, w13_END: torch.Tensor, w2_EDF: torch.Tensor) -> torch.nn.Module:
    """The family's own experts module running `backend` ("grouped_mm", "eager", or any name of
    transformers' ExpertsInterface) on the given weights (bf16 [E, 2F, D] and [E, D, F], shared, not
    copied). Called as module(x_TD, ids_TK int64, weights_TK) -> out_TD."""
    _, experts_name, _, _ = FAMILIES[shape.family]
    module = importlib.import_module(f"transformers.models.{shape.family}.modeling_{shape.family}")
    with torch.device("meta"):
        experts = getattr(module, experts_name)(_config(shape, backend))
    return _with_weights(experts, gate_up_proj=w13_END, down_proj=w2_EDF)


@functools.cache
def _fp8_experts_class() -> type[torch.nn.Module]:
    """FP8Experts wrapped as transformers' fp8 quantizer wraps it (on a subclass: FP8Experts itself is
    left as it is)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    class BenchFP8Experts(FP8Experts):
        """transformers' FP8Experts, unchanged."""

    return use_experts_implementation(BenchFP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)


def fp8_experts_module(shape: MoEShape, backend: str, w13_END: torch.Tensor, w13_scale: torch.Tensor,
                       w2_EDF: torch.Tensor, w2_scale: torch.Tensor) -> torch.nn.Module:
    """transformers' FP8 experts running `backend` on fp8_block weights: float8_e4m3fn [E, 2F, D] and
    [E, D, F] with float32 block scales [E, ceil(2F/128), ceil(D/128)] and [E, ceil(D/128), ceil(F/128)]
    (shared, not copied). Same call as `experts_module`; see the module docstring for where it runs."""
    with torch.device("meta"):
        experts = _fp8_experts_class()(_config(shape, backend), block_size=FP8_BLOCK_SIZE)
    return _with_weights(experts, gate_up_proj=w13_END, gate_up_proj_scale_inv=w13_scale, down_proj=w2_EDF,
                         down_proj_scale_inv=w2_scale)


def fp8_unavailable_reason() -> str | None:
    """Why transformers' FP8 experts cannot run here, where that is known without running them
    (the `kernels` package missing); None otherwise (they may still fail when first called)."""
    from transformers.utils.import_utils import is_kernels_available
    if not is_kernels_available():
        return ("transformers' FP8 experts run the hub kernel kernels-community/finegrained-fp8, which needs "
                "the `kernels` package (not installed)")
    return None
