"""Launch configs of the weight-bound grouped GEMMs (decode sizes: the hand-set buckets, up to HAND_SET_ROWS
rows per expert, and the 128-row bucket) swept on routed rows, as `local` hands them over: one GPU, bf16,
T tokens of a random router sorted by the layout engine; the gate-up reads x through the batch's row
index, the down applies the top-k weights in its epilogue. Candidates (--pool): "pointer", pointer-kernel
tiles with the table config's block_m (so that an expert's rows take as many row tiles as with the
table's); "prefill", for the tuned buckets (128 rows and up) on routed counts, where an expert's rows
past a multiple of the row tile take a tile more (`epmoe bench experts --tune` times exactly t rows per
expert): the tuner's warp-specialized and pointer candidates, and 64-row tiles of both kernels.

    python3 scripts/decode_sweep.py [--points qwen3-30b-a3b:256 ...] [--pool pointer|prefill] [--out DIR]

Per point (shape:T) and op, each candidate is checked against the table's config (the same output
within bf16 rounding) and timed (`epmoe.bench.moe.time_calls`: the median of at least --iters
back-to-back calls, the weights far larger than L2); prints the table's time (timed first and last), the
best candidate's and the floor (the larger of the hit experts' weight bytes at 4.16 TB/s and the rows'
flops at 686 TFLOP/s), and writes decode_sweep.json into --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from epmoe.bench.experts_tune import INDEXED_CANDIDATES, POINTER_CANDIDATES, WS_CANDIDATES
from epmoe.bench.moe import SHAPES, time_calls
from epmoe.kernels.configs import GemmConfig, gemm_config
from epmoe.kernels.grouped_gemm import ExpertRows, down, gate_up
from epmoe.kernels.layout import sort_pairs

COPY_BYTES_PER_S = 4.16e12
PEAK_BF16_FLOPS = 686e12
SMEM_BYTES = 200 * 1024


def _time_us(fn, iters: int) -> float:
    """GPU µs of fn() as bench moe times a call: the median interval of back-to-back calls."""
    return time_calls(lambda _: fn(), [None], iters, torch.device("cuda")).gpu_ms * 1e3


def candidates(block_m: int, gate: bool) -> list[GemmConfig]:
    out = []
    for bn, bk, warps, stages in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4, 6)):
        stage = (block_m + (2 if gate else 1) * bn) * bk * 2
        if stage * stages > SMEM_BYTES:
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
        if (64 + (2 if gate else 1) * bn) * 64 * 2 * stages <= SMEM_BYTES:
            pool.append(GemmConfig(block_m=64, block_n=bn, block_k=64, group_m=8, num_warps=warps, num_stages=stages))
    if not gate:
        pool += [GemmConfig(block_m=64, block_n=bn, block_k=64, group_m=8, num_warps=4, num_stages=stages,
                            warp_specialize="interleaved") for bn, stages in ((128, 6), (256, 4))]
    return list(dict.fromkeys(pool))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", nargs="+", default=["qwen3-30b-a3b:256", "deepseek-v2-lite:256", "qwen3-30b-a3b:128",
                                                    "deepseek-v3:256", "qwen3-30b-a3b:1024", "deepseek-v2-lite:1024",
                                                    "mixtral-8x7b:128", "deepseek-v3:1024"])
    p.add_argument("--pool", choices=["pointer", "prefill"], default="pointer")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    results = []
    for point in args.points:
        name, T = point.split(":")
        shape, T = SHAPES[name], int(T)
        E, K, D, F = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
        w13 = (torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, D, F, device=dev, generator=g) * F ** -0.5).to(torch.bfloat16)
        x = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        top, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(K, dim=-1)
        lay = sort_pairs(ids, E, weights_PK=top / top.sum(-1, keepdim=True))
        rows = ExpertRows.contiguous(lay.offsets_L1)
        hit = int((lay.counts_L > 0).sum())
        counts = lay.counts_L.tolist()
        rows_n = sum(counts)  # the experts' rows, [0, offsets_L1[L]) of the batch
        h_ref, _ = gate_up(x, w13, rows, x_rows_R=lay.rows_N)
        y_ref = down(h_ref, w2, rows, row_scale_R=lay.weights_N, out_dtype=torch.bfloat16)
        mean = -(-T * K // E)
        ops = {
            "gate_up": (lambda cfg: gate_up(x, w13, rows, x_rows_R=lay.rows_N, config=cfg)[0], h_ref,
                        hit * 2 * F * D * 2, gemm_config("gate_up", fp8=False, rows_hint=mean, on_gpu=True,
                                                         indexed=True, scattered=True)),
            "down": (lambda cfg: down(h_ref, w2, rows, row_scale_R=lay.weights_N, out_dtype=torch.bfloat16,
                                      config=cfg), y_ref, hit * D * F * 2,
                     gemm_config("down", fp8=False, rows_hint=mean, on_gpu=True, scattered=True)),
        }
        for op, (run, ref, weight_bytes, table_cfg) in ops.items():
            flops = 2 * rows_n * D * F * (2 if op == "gate_up" else 1)
            floor_us = max(weight_bytes / COPY_BYTES_PER_S, flops / PEAK_BF16_FLOPS) * 1e6
            table_first_us = _time_us(lambda: run(None), args.iters)
            timed = []
            pool = (candidates(table_cfg.block_m, op == "gate_up") if args.pool == "pointer"
                    else prefill_candidates(op == "gate_up"))
            for cfg in pool:
                try:
                    out = run(cfg)
                    torch.cuda.synchronize()
                except Exception as exc:  # a candidate the compiler or the GPU refuses
                    print(f"  {op} {cfg.to_dict()} failed: {type(exc).__name__}", flush=True)
                    continue
                err = ((out[:rows_n].float() - ref[:rows_n].float()).norm() / ref[:rows_n].float().norm()).item()
                if err > 1e-2:
                    print(f"  {op} {cfg.to_dict()} wrong: rel err {err:.3g}", flush=True)
                    continue
                timed.append((_time_us(lambda c=cfg: run(c), args.iters), cfg))
            # the table's config timed again last: the same config measured up to 36% apart timed first and
            # after the candidates (DeepSeek-V2-Lite down at 2048 tokens, one H200)
            table_us = _time_us(lambda: run(None), args.iters)
            timed.sort(key=lambda t: t[0])
            best_us, best = timed[0]
            print(f"{name} T={T} {op}: rows/expert max {max(counts)} mean {T * K / E:.1f}; table {table_us:.1f} us "
                  f"(first {table_first_us:.1f}; {100 * floor_us / table_us:.0f}% floor) {table_cfg.to_dict()}; "
                  f"best {best_us:.1f} us ({100 * floor_us / best_us:.0f}%) {best.to_dict()}", flush=True)
            for us, cfg in timed[1:5]:
                print(f"    {us:.1f} us {cfg.to_dict()}")
            results.append({"shape": name, "T": T, "op": op, "floor_us": floor_us, "table_us": table_us,
                            "table_first_us": table_first_us,
                            "table": table_cfg.to_dict(),
                            "timed": [{"us": us, "config": cfg.to_dict()} for us, cfg in timed]})
        del w13, w2
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "decode_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
