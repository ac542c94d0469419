"""Helpers shared by the tests, `epmoe demo`, `epmoe check` and `epmoe bench layer`.

- A layer's global weights and every rank's tokens are made from a seed, identically on every rank, so
  each rank can cut out its own tokens and compute the single-rank reference for them.
- The error measure is the relative L2 norm error, with one tolerance per precision (TOLERANCES).
- `plan` lists the (dispatcher, experts) pairs that can run for a config, and why the others cannot.

Shape letters: E global experts, D hidden size, F intermediate size, N global tokens (all ranks), T tokens
of one rank.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .config import MoEConfig
from .interfaces import Dispatcher, check_pairing
from .layer import FusedMoE, GatedMLP
from .oracle import MoERef
from .registry import dispatcher_class, experts_class, list_dispatchers, list_experts, resolve_experts

# Relative L2 norm error ||out - ref|| / ||ref|| allowed against the float64 oracle (`epmoe.oracle`): about twice
# the largest measured on the CPU (`epmoe check` and `epmoe soak`: every dispatcher and experts that run there,
# gloo and emulated ranks, the Triton kernels under the interpreter, whose bf16 casts round ties down; a call's
# error is largest with one or two tokens on a rank): fp32 3.9e-7 (summation order), fp16 4.9e-4, bf16 1.34e-2
# (h, partial sums between ranks and the output rounded to bf16), fp8_block 9.6e-3 (as bf16, and an h value next
# to an e4m3 rounding boundary may round the other way than in the oracle, which rounds through fp8 as the
# format says).
TOLERANCES = {"fp32": 1e-6, "fp16": 1e-3, "bf16": 3e-2, "fp8_block": 2e-2}
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device,
              group: dist.ProcessGroup | None = None, warmup: int = 1) -> float:
    """Median wall time of fn() in ms over `repeats` runs after `warmup`, ranks lined up by a barrier and
    the device synchronized around each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_over_ranks(value: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """The largest `value` over the ranks of `group` (value itself when group is None)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """A DeepSeek-V3-style layer (sigmoid scores + correction bias, grouped top-k, renormalized weights,
    routed scaling, one shared expert) and the tokens each rank feeds it."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    tokens_per_rank: int
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    dtype: torch.dtype = torch.bfloat16
    quant: str | None = None
    seed: int = 0

    def config(self) -> MoEConfig:
        return MoEConfig(num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
                         intermediate_size=self.intermediate_size, dtype=self.dtype, quant=self.quant,
                         max_tokens_per_rank=max(1, self.tokens_per_rank), scoring="sigmoid",
                         renormalize=True, num_groups=self.num_groups, topk_groups=self.topk_groups,
                         routed_scaling_factor=self.routed_scaling_factor)


# Small enough for two CPU cores; and DeepSeek-V3's layer (4096 tokens per rank) for GPUs.
CPU_SPEC = LayerSpec(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, tokens_per_rank=64,
                     num_groups=4, topk_groups=2, routed_scaling_factor=2.5)
GPU_SPEC = LayerSpec(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, tokens_per_rank=4096,
                     num_groups=8, topk_groups=4, routed_scaling_factor=2.5)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class RankInputs:
    """One rank's share of a LayerSpec run: the config, the global weights and this rank's tokens."""

    cfg: MoEConfig
    weights: LayerWeights
    x_TD: torch.Tensor
    logits_TE: torch.Tensor


def rank_inputs(spec: LayerSpec, rank: int, world_size: int, device: torch.device) -> RankInputs:
    """Build `spec`'s weights and rank `rank`'s tokens (every rank draws the same global batch)."""
    cfg = spec.config()
    tokens = [spec.tokens_per_rank] * world_size
    weights = make_weights(cfg, spec.seed, device)
    x_all, logits_all = make_tokens(cfg, spec.seed, tokens, device)
    rows = rank_rows(tokens, rank)
    return RankInputs(cfg, weights, x_all[rows].contiguous(), logits_all[rows].contiguous())


def add_layer_arguments(parser) -> None:
    """Options of LayerSpec for an argparse parser (defaults: CPU_SPEC on cpu, GPU_SPEC on cuda)."""
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quant", choices=["none", "fp8_block"], default="none")
    parser.add_argument("--experts-count", "-E", type=int, dest="num_experts", help="E routed experts")
    parser.add_argument("--topk", "-K", type=int, dest="top_k", help="K experts per token")
    parser.add_argument("--hidden", "-D", type=int, dest="hidden_size", help="D hidden size")
    parser.add_argument("--intermediate", "-F", type=int, dest="intermediate_size", help="F expert width")
    parser.add_argument("--tokens", "-T", type=int, dest="tokens_per_rank", help="T tokens per rank")
    parser.add_argument("--groups", type=int, dest="num_groups", help="expert groups for grouped top-k")
    parser.add_argument("--topk-groups", type=int, dest="topk_groups", help="groups each token picks from")
    parser.add_argument("--scaling", type=float, dest="routed_scaling_factor", help="routed scaling factor")
    parser.add_argument("--seed", type=int, default=0)


def layer_spec(args, device: str) -> LayerSpec:
    """The LayerSpec an argparse namespace from add_layer_arguments asks for on `device` ("cpu"/"cuda")."""
    base = GPU_SPEC if device == "cuda" else CPU_SPEC
    fields = {name: getattr(args, name) for name in (
        "num_experts", "top_k", "hidden_size", "intermediate_size", "tokens_per_rank", "num_groups",
        "topk_groups", "routed_scaling_factor") if getattr(args, name) is not None}
    return dataclasses.replace(base, dtype=DTYPES[args.dtype], quant=None if args.quant == "none" else args.quant,
                               seed=args.seed, **fields)


def describe(spec: LayerSpec, world_size: int, device: torch.device | str) -> str:
    return (f"MoE layer E={spec.num_experts} K={spec.top_k} D={spec.hidden_size} F={spec.intermediate_size} "
            f"groups={spec.num_groups}/{spec.topk_groups} scaling={spec.routed_scaling_factor} "
            f"+1 shared expert, {precision(spec.config())}, T={spec.tokens_per_rank}/rank x {world_size} "
            f"ranks on {torch.device(device).type}")
