"""`epmoe demo`: a DeepSeek-shaped MoE layer through every available dispatcher, checked and timed.

Each rank makes the same global weights and tokens from the seed, runs its own tokens through FusedMoE
with each (dispatcher, experts) pair, and compares with the single-rank reference (`local` dispatcher,
`reference` experts holding all E experts) computed on its own device. Rank 0 prints the table.

The layer is a LayerSpec: CPU_SPEC (small enough for a laptop's cores) or GPU_SPEC (DeepSeek-V3's MoE
layer); `epmoe bench layer` times the same layers.

Shape letters: T tokens of this rank, D hidden size, E experts.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from ._table import format_table
from .config import MoEConfig
from .launch import RankContext
from .testing import (LayerWeights, build_layer, make_tokens, make_weights, plan, precision, rank_rows,
                      reference_layer, rel_error, tolerance)
from .timing import max_over_ranks, median_ms


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
        """The layer's MoEConfig (ValueError for sizes it refuses)."""
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


def describe(spec: LayerSpec, world_size: int, device: torch.device | str) -> str:
    """One line naming the layer, its precision, the tokens and the ranks."""
    return (f"MoE layer E={spec.num_experts} K={spec.top_k} D={spec.hidden_size} F={spec.intermediate_size} "
            f"groups={spec.num_groups}/{spec.topk_groups} scaling={spec.routed_scaling_factor} "
            f"+1 shared expert, {precision(spec.config())}, T={spec.tokens_per_rank}/rank x {world_size} "
            f"ranks on {torch.device(device).type}")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def demo_rank(ctx: RankContext, spec: LayerSpec, repeats: int, warmup: int) -> int:
    """Run the demo on one rank; returns the exit code (1 if any pair misses its tolerance or fails)."""
    dev, group = ctx.device, ctx.group
    inputs = rank_inputs(spec, ctx.rank, ctx.world_size, dev)
    cfg, weights, x_TD, logits_TE = inputs.cfg, inputs.weights, inputs.x_TD, inputs.logits_TE
    bias_E = weights.correction_bias_E

    def timed(moe) -> float:  # this rank's median; every rank lined up by a barrier before each call
        return median_ms(lambda: moe(x_TD, logits_TE, correction_bias_E=bias_E), repeats, dev, group, warmup)

    ref_moe = reference_layer(cfg, weights, dev)
    ref_TD = ref_moe(x_TD, logits_TE, correction_bias_E=bias_E)
    ref_ms = max_over_ranks(timed(ref_moe), group, dev)
    del ref_moe
    _free(dev)

    todo = plan(cfg, group, dev, experts=["auto", "reference"])
    table = [["single-rank reference", "reference", "0 (oracle)", f"{ref_ms:.3f}", ""]]
    failed = False
    for d_name, e_name in todo.runs:
        err, ms, note = float("inf"), float("inf"), ""
        try:
            moe = build_layer(cfg, weights, group, d_name, e_name, dev)
            out_TD = moe(x_TD, logits_TE, correction_bias_E=bias_E)
            err = rel_error(out_TD, ref_TD)
            ms = timed(moe)
            del moe, out_TD
        except Exception as e:  # report the pair as failed and go on with the others
            note = f"ERROR {type(e).__name__}: {e}"
        _free(dev)
        err, ms = max_over_ranks(err, group, dev), max_over_ranks(ms, group, dev)
        ok = err <= tolerance(cfg)
        failed |= not ok
        table.append([d_name, e_name, f"{err:.2e}" if err < float("inf") else "-",
                      f"{ms:.3f}" if ms < float("inf") else "-", "ok" if ok else note or "FAIL"])

    if ctx.rank == 0:
        print(describe(spec, ctx.world_size, dev))
        for d_name, e_name, reason in todo.skipped:
            print(f"skipped: dispatcher {d_name}, experts {e_name}: {reason}")
        print(format_table(["dispatcher", "experts", "max rel err", "ms/layer", f"tol {tolerance(cfg):.0e}"],
                           table))
        print(f"ms/layer: the slowest rank's median of {repeats} calls after {warmup} warm-up calls; one call = "
              "routing, dispatch, experts, combine and the shared expert")
        if dev.type == "cpu":
            print(f"on cpu the {ctx.world_size} ranks share this machine's cores and talk over gloo: the times "
                  "show that every path runs, not how fast epmoe is (GPU numbers: BENCHMARKS.md)")
    return int(failed)
