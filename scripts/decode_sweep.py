"""Launch configs of the weight-bound grouped GEMMs (decode sizes: the hand-set buckets, up to HAND_SET_ROWS
rows per expert, and the 128-row bucket) swept on routed rows, as `local` hands them over: one GPU, T
tokens of a random router sorted by the layout engine; the gate-up reads x through the batch's row
index, the down applies the top-k weights in its epilogue. --quant bf16 (default) or fp8_block (the
weights quantized per 128x128 block, x per token per 128 columns before the gate-up, h as the gate-up
hands it to the down). Candidates (--pool): "pointer", pointer-kernel tiles with the table config's
block_m (so that an expert's rows take as many row tiles as with the table's); "prefill" (bf16), for the
tuned buckets (128 rows and up) on routed counts, where an expert's rows past a multiple of the row tile
take a tile more (`epmoe bench experts --tune` times exactly t rows per expert): the tuner's
warp-specialized and pointer candidates, and 64-row tiles of both kernels; "ws", for the decode buckets:
the warp-specialized kernel's 64-row tiles (cooperative and interleaved; and the split schedule's 128-row
tiles), whose loader streams the weights through a ring that runs on from one tile to the next; "swap",
tiles with swap_ab (the weights on the wgmma's M side, 16 to 64 of an expert's rows on its N side) of both
kernels (`epmoe.bench.experts_tune.swap_candidates`); "table",
none (the table's config alone, to compare tables). --contiguous: the gate-up reads a copy of the routed
rows in order (as `epmoe bench experts` times it, with the plain table's entries) instead of through the
row index (the `_indexed` entries); --batched: the rows in ll's batched layout on one rank, a slot of T
rows per expert (the plain entries, chosen for the mean rows per expert as TritonExperts chooses them;
the down without the top-k weights).

    python3 scripts/decode_sweep.py [--points qwen3-30b-a3b:256 ...] [--quant bf16|fp8_block]
        [--pool pointer|prefill|ws|swap|table] [--contiguous | --batched] [--out DIR]

Per point (shape:T) and op, each candidate is checked against the table's config (the same output
within rounding: 1e-2 relative) and timed (the mean of --iters back-to-back calls queued behind a spin
kernel, so the GPU's time and not the host's pace; the weights far larger than L2); prints the table's
time (timed first and last), the best candidate's and the floor (the larger of the hit experts' weight
bytes at the GPU's copy bandwidth and the rows' flops at its dense peak, `epmoe.bench.ceilings`), and
writes decode_sweep.json into --out after each point.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from epmoe.bench.ceilings import device_ceilings
from epmoe.bench.experts_tune import (INDEXED_CANDIDATES, POINTER_CANDIDATES, WS_CANDIDATES, swap_candidates,
                                      ws_config)
from epmoe.bench.moe import SHAPES
from epmoe.kernels.configs import POINTER_STAGE_BYTES, SHARED_BYTES, GemmConfig, gemm_config
from epmoe.kernels.grouped_gemm import ExpertRows, down, gate_up
from epmoe.kernels.layout import sort_pairs
from epmoe.kernels.quant import quantize_act
from epmoe.quant import FP8_DTYPE, dequantize_act_ref, num_groups, quantize_weight_ref
from epmoe.testing import rel_error
from epmoe.timing import gpu_us

def candidates(block_m: int, gate: bool, fp8: bool = False) -> list[GemmConfig]:
    """Pointer-kernel tiles with this block_m (fp8: K blocks within one 128-deep scale group, and column
    tiles of 64 and 128: a gate-up's 128-column tile emits fp8 h itself, a 64-column one writes float32 h,
    quantized after)."""
    out = []
    grid = (((64, 128), (64, 128), (4, 8), (3, 4, 6)) if fp8 and gate else
            ((64, 128, 256), (64, 128), (4, 8), (3, 5)) if fp8 else ((32, 64, 128), (128, 256), (4, 8), (3, 4, 6)))
    for bn, bk, warps, stages in itertools.product(*grid):
        stage = (block_m + (2 if gate else 1) * bn) * bk * (1 if fp8 else 2)
        if stage * stages > POINTER_STAGE_BYTES:
            continue
        out.append(GemmConfig(block_m=block_m, block_n=bn, block_k=bk, group_m=1, num_warps=warps, num_stages=stages))
    return out


def prefill_candidates(gate: bool) -> list[GemmConfig]:
    """The tuner's bf16 candidates (a gate-up's: those for rows through an index) and 64-row tiles: pointer
    tiles of 128 and 256 columns, and the interleaved warp-specialized schedule's (two 4-warp consumers,
    a 64-row tile each) for the down (the tuner leaves the interleaved 64-row gate-up out)."""
    pool = list(INDEXED_CANDIDATES[False]) if gate else list(WS_CANDIDATES[("down", False)]) + list(
        POINTER_CANDIDATES[("down", False)])
    for bn, warps, stages in ((128, 4, 4), (256, 8, 3)):
        if (64 + (2 if gate else 1) * bn) * 64 * 2 * stages <= POINTER_STAGE_BYTES:
            pool.append(GemmConfig(block_m=64, block_n=bn, block_k=64, group_m=8, num_warps=warps, num_stages=stages))
    if not gate:
        pool += [GemmConfig(block_m=64, block_n=bn, block_k=64, group_m=8, num_warps=4, num_stages=stages,
                            warp_specialize="interleaved") for bn, stages in ((128, 6), (256, 4))]
    return list(dict.fromkeys(pool))


def ws_candidates(gate: bool, fp8: bool, gathered: bool) -> list[GemmConfig]:
    """Warp-specialized tiles for the decode buckets: 64-row tiles of the cooperative schedule (one 8-warp
    consumer) and of the interleaved one (two 4-warp consumers, a tile each; not for a gate-up), and the
    split schedule's 128-row tiles (64 rows a consumer), whose ring stages fit in the block's shared memory.
    fp8 takes 128-deep K blocks and, in a gate-up, 128-column tiles (h quantized in the epilogue), with and
    without pipe_mma (not on two interleaved consumers, nor a split gate-up: they spill, as in the tuner);
    no split fp8 gate-up through a row index (its loader spills)."""
    bk = 128 if fp8 else 64
    ns = (128,) if gate else (64, 128) if fp8 else (128, 256)
    pool = []
    for schedule, bm in (("cooperative", 64), ("interleaved", 64), ("split", 128)):
        if gate and (schedule == "interleaved" or (fp8 and schedule == "split" and gathered)):
            continue
        for bn, stages, pipe in itertools.product(ns, (4, 5) if gate else (4, 6), (False, True) if fp8 else (False,)):
            if pipe and (schedule == "interleaved" or (schedule == "split" and gate)):
                continue
            if (bm + (2 if gate else 1) * bn) * bk * (1 if fp8 else 2) * stages + 1024 > SHARED_BYTES:
                continue
            pool.append(ws_config(schedule, bm, bn, bk, stages, pipe))
    return pool


def point_ops(shape, T: int, weights: dict, g: torch.Generator, dev: torch.device, fp8: bool,
              contiguous: bool = False, batched: bool = False) -> tuple[dict, list]:
    """{op: (run(cfg), the output of run(cfg) to check, reference, hit experts' weight bytes, the table's
    config)} of one point, and the experts' row counts. contiguous: the gate-up reads a copy of the routed
    rows in order, not the rows through the row index; batched: the rows in ll's batched layout on one
    rank (a slot of T rows per expert, its rows first; the config for the mean, no top-k weights)."""
    E, K, D, F = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
    w13, w2 = weights["w13"], weights["w2"]
    x = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
    top, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(K, dim=-1)
    lay = sort_pairs(ids, E, weights_PK=top / top.sum(-1, keepdim=True))
    rows = ExpertRows.contiguous(lay.offsets_L1)
    hit = int((lay.counts_L > 0).sum())
    counts = lay.counts_L.tolist()
    rows_n = sum(counts)  # the experts' rows, [0, offsets_L1[L]) of the batch
    mean = -(-T * K // E)
    item = 1 if fp8 else 2
    x_rows, valid, hint, row_scale = lay.rows_N, slice(0, rows_n), None, lay.weights_N
    if contiguous or batched:
        x, x_rows = x[lay.rows_N[:rows_n].long()], None
    if batched:
        expert = torch.repeat_interleave(torch.arange(E, device=dev), lay.counts_L.long(), output_size=rows_n)
        valid = expert * T + torch.arange(rows_n, device=dev) - lay.offsets_L1[:-1].long()[expert]
        x = x.new_zeros(E * T, D).index_copy_(0, valid, x)
        rows, hint, row_scale = ExpertRows.batched_slots(lay.counts_L, T), mean, None
    if fp8:
        xq, xs = quantize_act(x)
        s13, s2 = weights["s13"], weights["s2"]

        def up(cfg):
            return gate_up(xq, w13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=x_rows, rows_hint=hint, config=cfg)

        h_ref, hs_ref = up(None)

        def up_out(cfg):  # h as the down reads it, dequantized
            h, hs = up(cfg)
            return dequantize_act_ref(h[valid], hs[valid])

        def dn(cfg):
            return down(h_ref, w2, rows, h_scale_RG=hs_ref, w2_scale=s2, row_scale_R=row_scale,
                        out_dtype=torch.bfloat16, rows_hint=hint, config=cfg)[valid]
    else:
        def up(cfg):
            return gate_up(x, w13, rows, x_rows_R=x_rows, rows_hint=hint, config=cfg)[0]

        def up_out(cfg):
            return up(cfg)[valid]

        h_ref, hs_ref = up(None), None

        def dn(cfg):
            return down(h_ref, w2, rows, row_scale_R=row_scale, out_dtype=torch.bfloat16, rows_hint=hint,
                        config=cfg)[valid]

    def table(op):
        if batched:
            return gemm_config(op, fp8=fp8, rows_hint=mean, on_gpu=True)
        return gemm_config(op, fp8=fp8, rows_hint=mean, on_gpu=True, indexed=op == "gate_up" and not contiguous,
                           scattered=True)

    ops = {"gate_up": (up, up_out, up_out(None), hit * 2 * F * D * item, table("gate_up")),
           "down": (dn, dn, dn(None), hit * D * F * item, table("down"))}
    return ops, counts


def make_weights(shape, g: torch.Generator, dev: torch.device, fp8: bool) -> dict:
    """Random expert weights of the shape: bf16 w13 [E, 2F, D] and w2 [E, D, F], or fp8 ones with their
    block scales (made one expert at a time: no bf16 copy of all of them)."""
    E, D, F = shape.num_experts, shape.hidden_size, shape.intermediate_size
    if not fp8:
        return {"w13": (torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).to(torch.bfloat16),
                "w2": (torch.randn(E, D, F, device=dev, generator=g) * F ** -0.5).to(torch.bfloat16)}
    out = {}
    for name, (n, k) in (("w13", (2 * F, D)), ("w2", (D, F))):
        q = torch.empty(E, n, k, dtype=FP8_DTYPE, device=dev)
        scale = torch.empty(E, num_groups(n), num_groups(k), dtype=torch.float32, device=dev)
        for l in range(E):
            q[l], scale[l] = quantize_weight_ref(torch.randn(n, k, device=dev, generator=g) * k ** -0.5)
        out[name], out["s13" if name == "w13" else "s2"] = q, scale
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", nargs="+", default=["qwen3-30b-a3b:256", "deepseek-v2-lite:256", "qwen3-30b-a3b:128",
                                                    "deepseek-v3:256", "qwen3-30b-a3b:1024", "deepseek-v2-lite:1024",
                                                    "mixtral-8x7b:128", "deepseek-v3:1024"])
    p.add_argument("--quant", choices=["bf16", "fp8_block"], default="bf16")
    p.add_argument("--pool", choices=["pointer", "prefill", "ws", "swap", "table"], default="pointer",
                   help="table: no candidates, the table's config timed first and last")
    layout = p.add_mutually_exclusive_group()
    layout.add_argument("--contiguous", action="store_true", help="the gate-up reads the routed rows copied in order")
    layout.add_argument("--batched", action="store_true", help="the rows in ll's batched layout, slots of T rows")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    fp8 = args.quant == "fp8_block"
    if fp8 and args.pool == "prefill":
        p.error("--quant fp8_block sweeps the pointer and ws pools (or the table) only")
    dev = torch.device("cuda", torch.cuda.current_device())
    ceilings = device_ceilings(dev)
    g = torch.Generator(dev).manual_seed(0)
    results = []
    weights: dict[str, dict] = {}
    for point in args.points:
        name, T = point.split(":")
        shape, T = SHAPES[name], int(T)
        if name not in weights:
            weights = {name: make_weights(shape, g, dev, fp8)}  # one shape's weights at a time
        D, F = shape.hidden_size, shape.intermediate_size
        ops, counts = point_ops(shape, T, weights[name], g, dev, fp8, args.contiguous, args.batched)
        rows_n = sum(counts)
        for op, (run, checked, ref, weight_bytes, table_cfg) in ops.items():
            flops = 2 * rows_n * D * F * (2 if op == "gate_up" else 1)
            floor_us = max(weight_bytes / (ceilings.copy_tbps * 1e12), flops / (ceilings.tflops(fp8) * 1e12)) * 1e6
            gate = op == "gate_up"
            pool = (candidates(table_cfg.block_m, gate, fp8) if args.pool == "pointer"
                    else ws_candidates(gate, fp8, gate and not (args.contiguous or args.batched)) if args.pool == "ws"
                    else swap_candidates(op, fp8) if args.pool == "swap"
                    else prefill_candidates(gate) if args.pool == "prefill" else [])
            table_first_us = gpu_us(lambda: run(None), args.iters)
            timed = []
            for cfg in pool:
                try:
                    out = checked(cfg)
                    torch.cuda.synchronize()
                except Exception as exc:  # a candidate the compiler or the GPU refuses
                    print(f"  {op} {cfg.to_dict()} failed: {type(exc).__name__}", flush=True)
                    continue
                err = rel_error(out, ref)
                if err > 1e-2:
                    print(f"  {op} {cfg.to_dict()} wrong: rel err {err:.3g}", flush=True)
                    continue
                timed.append((gpu_us(lambda c=cfg: run(c), args.iters), cfg))
            # the table's config timed again last: the same config measured up to 36% apart timed first and
            # after the candidates with bench moe's timer (DeepSeek-V2-Lite down at 2048 tokens, one H200),
            # within 3% with the spin's (the fp8 run of 2026-12-04)
            table_us = gpu_us(lambda: run(None), args.iters)
            timed.sort(key=lambda t: t[0])
            best_us, best = timed[0] if timed else (table_us, table_cfg)
            print(f"{name} T={T} {args.quant} {op}: rows/expert max {max(counts)} mean {T * shape.top_k / shape.num_experts:.1f}; "
                  f"table {table_us:.1f} us (first {table_first_us:.1f}; {100 * floor_us / table_us:.0f}% floor) "
                  f"{table_cfg.to_dict()}; best {best_us:.1f} us ({100 * floor_us / best_us:.0f}%) {best.to_dict()}",
                  flush=True)
            for us, cfg in timed[1:5]:
                print(f"    {us:.1f} us {cfg.to_dict()}")
            results.append({"shape": name, "T": T, "quant": args.quant, "contiguous": args.contiguous,
                            "batched": args.batched, "op": op,
                            "floor_us": floor_us,
                            "table_us": table_us, "table_first_us": table_first_us, "table": table_cfg.to_dict(),
                            "timed": [{"us": us, "config": cfg.to_dict()} for us, cfg in timed]})
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, "decode_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
