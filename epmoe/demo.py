"""`epmoe demo`: a DeepSeek-shaped MoE layer through every available dispatcher, checked and timed.

Each rank makes the same global weights and tokens from the seed, runs its own tokens through FusedMoE
with each (dispatcher, experts) pair, and compares with the single-rank reference (`local` dispatcher,
`reference` experts holding all E experts) computed on its own device. Rank 0 prints the table.

Shape letters: T tokens of this rank, D hidden size, E experts.
"""
from __future__ import annotations

import gc

import torch

from ._table import format_table
from .launch import RankContext
from .testing import (LayerSpec, build_layer, describe, max_over_ranks, median_ms, plan, rank_inputs,
                      reference_layer, rel_error, tolerance)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def demo_rank(ctx: RankContext, spec: LayerSpec, repeats: int) -> int:
    """Run the demo on one rank; returns the exit code (1 if any pair misses its tolerance or fails)."""
    dev, group = ctx.device, ctx.group
    inputs = rank_inputs(spec, ctx.rank, ctx.world_size, dev)
    cfg, weights, x_TD, logits_TE = inputs.cfg, inputs.weights, inputs.x_TD, inputs.logits_TE
    bias_E = weights.correction_bias_E

    ref_moe = reference_layer(cfg, weights, dev)
    ref_TD = ref_moe(x_TD, logits_TE, correction_bias_E=bias_E)
    ref_ms = max_over_ranks(median_ms(lambda: ref_moe(x_TD, logits_TE, correction_bias_E=bias_E),
                                      repeats, dev), group, dev)
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
            ms = median_ms(lambda: moe(x_TD, logits_TE, correction_bias_E=bias_E), repeats, dev, group)
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
        print(f"ms/layer: the slowest rank's median of {repeats} calls after 1 warm-up; one call = routing, "
              "dispatch, experts, combine and the shared expert")
    return int(failed)
