"""Test support: the layers, inputs, error measure and plans that the tests, `epmoe check`, `epmoe demo`
and `epmoe bench layer` check against.

- A layer's global weights and every rank's tokens are made from a seed, identically on every rank, so
  each rank can cut out its own tokens and compute the single-rank reference for them.
- The error measure is the relative L2 norm error, with one tolerance per precision (TOLERANCES).
- `plan` lists the (dispatcher, experts) pairs that can run for a config, and why the others cannot.

Shape letters: E global experts, D hidden size, F intermediate size, N global tokens (all ranks), T tokens
of one rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .config import MoEConfig
from .interfaces import Dispatcher, check_pairing
from .layer import FusedMoE, GatedMLP
from .oracle import MoERef
from .registry import dispatcher_class, experts_class, list_dispatchers, list_experts, resolve_experts

# Relative L2 norm error ||out - ref|| / ||ref|| allowed against the float64 oracle (`epmoe.oracle`), above the
# largest measured (`epmoe check` and `epmoe soak`; a call's error is largest with one or two tokens on a rank):
# on the CPU (every dispatcher and experts that run there, gloo and emulated ranks, the Triton kernels under the
# interpreter, whose bf16 casts round ties down) fp32 3.9e-7, fp16 4.9e-4, bf16 1.34e-2, fp8_block 9.6e-3; on an
# H200 (emulated ht and ll ranks in CUDA graphs, one-token calls) fp32 1.07e-6 (summation order), bf16 3.8e-3 and
# fp8_block 4.8e-2: an h value next to an e4m3 rounding boundary may round the other way than in the oracle
# (which rounds through fp8 as the format says), and with few outputs one such flip weighs. Margins: fp32 and
# fp16 2-3x, bf16 2x, fp8_block 1.25x.
TOLERANCES = {"fp32": 3e-6, "fp16": 1e-3, "bf16": 3e-2, "fp8_block": 6e-2}
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def precision(cfg: MoEConfig) -> str:
    """"fp8_block" when quantized, else the dtype's short name (a key of TOLERANCES)."""
    return cfg.quant if cfg.quant is not None else _DTYPE_NAMES[cfg.dtype]


def tolerance(cfg: MoEConfig) -> float:
    return TOLERANCES[precision(cfg)]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (the plain norm of out when ref is all zeros or empty)."""
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    diff = (out.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    return diff / scale if scale > 0 else diff


@dataclass(frozen=True)
class LayerWeights:
    """Global weights of one MoE layer (the same on every rank).

    w13_END: [E, 2F, D] (F gate rows, then F up rows); w2_EDF: [E, D, F]; both cfg.dtype.
    shared_w13_ND: [2F, D] and shared_w2_DF: [D, F], one shared expert of width F (cfg.dtype).
    correction_bias_E: float32 [E], the sigmoid-scoring correction bias (DeepSeek-V3).
    """

    w13_END: torch.Tensor
    w2_EDF: torch.Tensor
    shared_w13_ND: torch.Tensor
    shared_w2_DF: torch.Tensor
    correction_bias_E: torch.Tensor


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, scale: float, dtype: torch.dtype, g: torch.Generator, device: torch.device) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def make_weights(cfg: MoEConfig, seed: int, device: torch.device | str) -> LayerWeights:
    """Random weights scaled so every layer output is O(1); made one expert at a time (no fp32 copy of all)."""
    device = torch.device(device)
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    g = _generator(seed, device)
    w13 = torch.empty(E, 2 * F, D, dtype=cfg.dtype, device=device)
    w2 = torch.empty(E, D, F, dtype=cfg.dtype, device=device)
    for e in range(E):
        w13[e] = _randn((2 * F, D), D ** -0.5, cfg.dtype, g, device)
        w2[e] = _randn((D, F), F ** -0.5, cfg.dtype, g, device)
    return LayerWeights(w13_END=w13, w2_EDF=w2,
                        shared_w13_ND=_randn((2 * F, D), D ** -0.5, cfg.dtype, g, device),
                        shared_w2_DF=_randn((D, F), F ** -0.5, cfg.dtype, g, device),
                        correction_bias_E=_randn((E,), 0.1, torch.float32, g, device))


def make_tokens(cfg: MoEConfig, seed: int, tokens_per_rank: Sequence[int],
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Global x_ND (cfg.dtype) and router logits_NE (float32) for N = sum(tokens_per_rank) tokens;
    rank r's tokens are rows `rank_rows(tokens_per_rank, r)`."""
    device = torch.device(device)
    g = _generator(seed + 1, device)
    N = sum(tokens_per_rank)
    x = _randn((N, cfg.hidden_size), 1.0, cfg.dtype, g, device)
    logits = _randn((N, cfg.num_experts), 1.0, torch.float32, g, device)
    return x, logits


def rank_rows(tokens_per_rank: Sequence[int], rank: int) -> slice:
    start = sum(tokens_per_rank[:rank])
    return slice(start, start + tokens_per_rank[rank])


def shared_expert(cfg: MoEConfig, weights: LayerWeights, device: torch.device | str) -> GatedMLP:
    mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype, device)
    mlp.w13.copy_(weights.shared_w13_ND)
    mlp.w2.copy_(weights.shared_w2_DF)
    return mlp


def build_layer(cfg: MoEConfig, weights: LayerWeights, group: dist.ProcessGroup | None, dispatcher: str | Dispatcher,
                experts: str, device: torch.device | str, shared: bool = True) -> FusedMoE:
    """A FusedMoE over `group` with `weights` loaded (and the shared expert when `shared`)."""
    moe = FusedMoE(cfg, group, dispatcher=dispatcher, experts=experts, device=device,
                   shared_experts=shared_expert(cfg, weights, device) if shared else None)
    moe.load_experts(weights.w13_END, weights.w2_EDF)
    return moe


def layer_oracle(cfg: MoEConfig, weights: LayerWeights, shared: bool = True,
                 device: torch.device | str | None = None) -> MoERef:
    """The float64 oracle of build_layer's layer (routed experts scaled by cfg.routed_scaling_factor, plus the
    shared expert when `shared`), called as oracle(x_TD, ids_TK, weights_TK)."""
    return MoERef.build(weights.w13_END, weights.w2_EDF, fp8=cfg.quant == "fp8_block",
                        routed_scaling_factor=cfg.routed_scaling_factor,
                        shared=(weights.shared_w13_ND, weights.shared_w2_DF) if shared else None, device=device)


def reference_layer(cfg: MoEConfig, weights: LayerWeights, device: torch.device | str,
                    shared: bool = True) -> FusedMoE:
    """The single-rank oracle: `local` dispatcher and `reference` experts holding all E experts."""
    return build_layer(cfg, weights, None, "local", "reference", device, shared)


@dataclass(frozen=True)
class Plan:
    """What can run for one config: `runs` are (dispatcher, experts) names; `skipped` are
    (dispatcher, experts or "*", reason)."""

    runs: list[tuple[str, str]]
    skipped: list[tuple[str, str, str]]


def plan(cfg: MoEConfig, group: dist.ProcessGroup | None, device: torch.device | str,
         experts: Sequence[str] | None = None) -> Plan:
    """Every available dispatcher paired with `experts` (names, "auto" allowed; None = every available
    experts implementation), filtered by the library's own availability and pairing checks."""
    device = torch.device(device)
    experts_table = list_experts(cfg, device)
    runs, skipped = [], []
    if experts is None:
        names = []
        for name, (ok, reason) in experts_table.items():
            if ok:
                names.append(name)
            else:
                skipped.append(("*", name, reason))
    else:
        names = []
        for name in experts:
            try:
                resolved = resolve_experts(name, cfg, device)
            except ValueError as e:
                skipped.append(("*", name, str(e)))
                continue
            if resolved not in names:
                names.append(resolved)
    for d_name, (ok, reason) in list_dispatchers(cfg, group).items():
        if not ok:
            skipped.append((d_name, "*", reason))
            continue
        for e_name in names:
            try:
                check_pairing(dispatcher_class(d_name), experts_class(e_name))
            except ValueError as e:
                skipped.append((d_name, e_name, str(e)))
                continue
            runs.append((d_name, e_name))
    return Plan(runs, skipped)
