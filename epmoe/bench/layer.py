"""`epmoe bench layer`: FusedMoE end to end, per available dispatcher, against the single-rank local path.

    epmoe bench layer [--device cuda] [--nproc 2] [--out DIR] [layer sizes, as for `epmoe demo`]

Every rank runs its T tokens (default on GPUs: DeepSeek-V3's layer, T=4096) through FusedMoE with each
available dispatcher; the baseline is the same rank running the same tokens alone with the `local`
dispatcher and all E experts (what one GPU holding the whole layer would do). Where `ht` runs, also
`ht(sync_free)`: the same dispatcher without its host sync (the batch sized for the worst case); and
the layers built for capture (`ll`, `ht(sync_free)`, with `triton` experts) once more captured in a
CUDA graph (`+graph`: one replay per call, no host work in it). Time: the slowest rank's median over
--repeats calls after --warmup calls, each call between device synchronizations and lined up by a
barrier. Inputs are not rotated: each call streams the experts' weights (far beyond L2) anyway.
Also printed: how evenly the inputs route, (token, expert) rows per expert and per rank: the rank
with the most rows has the longest expert GEMMs, and every rank's combine waits for it; and, on GPUs,
the floor of that rank's expert MLP at the GPU's ceilings (epmoe.bench.experts.mlp_floor with
epmoe.bench.ceilings.device_ceilings: FLOPs at the measured dense peak, or weight and activation bytes at the
copy bandwidth, whichever is longer; in layer.json on any device, at an H200's on the CPU).
Writes layer.json into --out when given.

Shape letters: T tokens of this rank, D hidden size, E experts.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
from typing import Sequence

import torch
import torch.distributed as dist

from .._table import format_table
from ..demo import LayerSpec, describe, rank_inputs
from ..dispatch.ht import HtDispatcher
from .ceilings import H200, Ceilings, device_ceilings, device_name
from .experts import mlp_floor
from ..launch import RankContext
from ..registry import make_dispatcher, resolve_experts
from ..routing import route
from ..testing import build_layer, plan, rel_error
from ..timing import max_over_ranks, median_ms

# layers also replayed as CUDA graphs: those whose dispatcher is built for capture (with triton experts)
GRAPH_DISPATCHERS = ("ll", "ht(sync_free)")


def _expert_load(cfg, logits_TE: torch.Tensor, bias_E: torch.Tensor, group, ceilings: Ceilings) -> dict:
    """How evenly the inputs route: (token, expert) rows per expert over all ranks' tokens, and per rank
    of the expert-parallel layer (the rows its experts get), and the floor of the busiest rank's expert MLP
    at `ceilings`. A rank with more rows has longer expert GEMMs, and every rank's combine waits for it. One
    all-reduce, outside the timed calls."""
    _, ids_TK = route(logits_TE, cfg, correction_bias_E=bias_E)
    ids = ids_TK.flatten().long()
    rows_E = torch.bincount(ids[ids >= 0], minlength=cfg.num_experts)
    dist.all_reduce(rows_E, group=group)
    R = dist.get_world_size(group)
    rows_R = rows_E.view(R, -1).sum(1)
    floor = mlp_floor(int(rows_R.max()), cfg.num_experts // R, cfg.hidden_size, cfg.intermediate_size,
                      cfg.quant == "fp8_block", ceilings)
    return {"rows_per_expert": {"min": int(rows_E.min()), "median": int(rows_E.median()), "max": int(rows_E.max()),
                                "mean": float(rows_E.float().mean())},
            "rows_per_rank": rows_R.tolist(), "experts_floor_ms": floor.ms, "floor_ceilings": ceilings.source}


def _layer_rank(ctx: RankContext, spec: LayerSpec, experts: str, repeats: int, warmup: int,
                out_dir: str | None) -> int:
    dev, group = ctx.device, ctx.group
    inputs = rank_inputs(spec, ctx.rank, ctx.world_size, dev)
    cfg, weights, x_TD, logits_TE = inputs.cfg, inputs.weights, inputs.x_TD, inputs.logits_TE
    bias_E = weights.correction_bias_E
    load = _expert_load(cfg, logits_TE, bias_E, group, device_ceilings(dev) if dev.type == "cuda" else H200)

    def timed(moe) -> float:
        return max_over_ranks(median_ms(lambda: moe(x_TD, logits_TE, correction_bias_E=bias_E), repeats, dev,
                                        group, warmup), group, dev)

    base = build_layer(cfg, weights, None, "local", experts, dev)
    base_name = f"local/{base.experts.name} (1 rank, all {cfg.num_experts} experts)"
    base_TD = base(x_TD, logits_TE, correction_bias_E=bias_E)
    base_ms = timed(base)
    del base
    gc.collect()

    todo = plan(cfg, group, dev, experts=[experts])
    runs = [(d_name, functools.partial(make_dispatcher, d_name, cfg, group), e_name)
            for d_name, e_name in todo.runs]
    # ht also without its host sync (the worst-case batch), as a CUDA-graph-captured layer would run it
    runs += [("ht(sync_free)", functools.partial(HtDispatcher, cfg, group, sync_free=True), e_name)
             for d_name, e_name in todo.runs if d_name == "ht"]
    results = []
    for d_name, make, e_name in runs:
        moe = build_layer(cfg, weights, group, make(), e_name, dev)
        err = max_over_ranks(rel_error(moe(x_TD, logits_TE, correction_bias_E=bias_E), base_TD), group, dev)
        ms = timed(moe)
        results.append({"dispatcher": d_name, "experts": e_name, "ms": ms, "baseline_ms": base_ms,
                        "speedup_vs_baseline": base_ms / ms, "rel_err_vs_baseline": err})
        if dev.type == "cuda" and d_name in GRAPH_DISPATCHERS and e_name == "triton":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out_TD = moe(x_TD, logits_TE, correction_bias_E=bias_E)
            graph.replay()
            err = max_over_ranks(rel_error(out_TD, base_TD), group, dev)
            ms = max_over_ranks(median_ms(graph.replay, repeats, dev, group, warmup), group, dev)
            results.append({"dispatcher": f"{d_name}+graph", "experts": e_name, "ms": ms, "baseline_ms": base_ms,
                            "speedup_vs_baseline": base_ms / ms, "rel_err_vs_baseline": err})
            del graph, out_TD
        del moe
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    if ctx.rank == 0:
        print(describe(spec, ctx.world_size, dev))
        for d_name, e_name, reason in todo.skipped:
            print(f"skipped: dispatcher {d_name}, experts {e_name}: {reason}")
        rows_out = [[base_name, f"{base_ms:.3f}", "1.00", "-"]]
        rows_out += [[f"{r['dispatcher']}/{r['experts']} ({ctx.world_size} ranks)", f"{r['ms']:.3f}",
                      f"{r['speedup_vs_baseline']:.2f}", f"{r['rel_err_vs_baseline']:.1e}"] for r in results]
        print(format_table(["path", "ms/layer", "baseline/this", "rel err"], rows_out))
        print(f"ms/layer: the slowest rank's median of {repeats} calls after {warmup} warm-up calls")
        e, r = load["rows_per_expert"], load["rows_per_rank"]
        print(f"routing: (token, expert) rows per expert min / median / max {e['min']} / {e['median']} / {e['max']} "
              f"(mean {e['mean']:.0f}); per rank {' / '.join(map(str, r))} (largest / mean "
              f"{max(r) * len(r) / max(sum(r), 1):.2f})")
        if dev.type == "cuda":
            print(f"the busiest rank's expert MLP takes at least {load['experts_floor_ms']:.4g} ms (floor at the "
                  f"ceilings of {load['floor_ceilings']})")
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)
            record = {"bench": "layer", "device": dev.type, "device_name": device_name(dev),
                      "world_size": ctx.world_size, "torch": torch.__version__,
                      "spec": {k: str(v) if isinstance(v, torch.dtype) else v
                               for k, v in dataclasses.asdict(spec).items()},
                      "baseline": {"path": base_name, "ms": base_ms}, "results": results, "load": load,
                      "skipped": [list(s) for s in todo.skipped]}
            with open(os.path.join(out_dir, "layer.json"), "w") as f:
                json.dump(record, f, indent=2)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from ..cli import (add_launch_arguments, add_layer_arguments, at_least, fail, launch_world_size, layer_spec,
                       run_ranks)
    parser = argparse.ArgumentParser(prog="epmoe bench layer", description=__doc__.split("\n")[0])
    add_launch_arguments(parser)
    add_layer_arguments(parser)
    parser.add_argument("--experts", default="auto",
                        help="experts implementation: auto, reference, triton, grouped_mm (-E sets their number)")
    parser.add_argument("--repeats", type=at_least(1), default=None, help="timed calls (default: 20 on cuda, 5 on cpu)")
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--out", default=None, help="folder for layer.json")
    args = parser.parse_args(argv)
    repeats = args.repeats or (20 if args.device == "cuda" else 5)
    world_size = launch_world_size(parser, args.device, args.nproc)
    spec = layer_spec(parser, args, world_size)
    try:
        resolve_experts(args.experts, spec.config(), args.device)
    except ValueError as e:
        fail(parser, str(e))
    return run_ranks(_layer_rank, args.device, world_size, (spec, args.experts, repeats, args.warmup, args.out))
