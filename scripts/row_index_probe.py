"""Does a bf16 gate-up GEMM read its rows through a row index (`ht`'s batch: pointer loads, no TMA for
A) faster than a copy of the rows into batch order (`ExpertBatch.materialize`, index_select) followed
by the GEMM on the copy (TMA tile loads where the launch config has them)? One GPU, DeepSeek-V3 expert
shapes (D 7168, F 2048), L 128 experts with t rows each, gathered from S = N / 2 source rows (each
source row in two experts, as ht's receive buffer holds one row per (token, rank) at R 2, K 8).

    python3 scripts/row_index_probe.py [--rows-per-expert 128 256 512 1024]

Prints per t: gate-up through the index, the copy, gate-up on the copy, their sum, and the down GEMM
(the same in both), µs (CUDA events, median of 10 after 3 warm-ups).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from epmoe.kernels.grouped_gemm import ExpertRows, down, gate_up

D, F, L = 7168, 2048, 128


def _time_us(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows-per-expert", type=int, nargs="+", default=[128, 256, 512, 1024])
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(L, 2 * F, D, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(L, D, F, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    print(f"{'t':>5} {'N':>7} {'gate-up idx':>12} {'copy':>8} {'gate-up copy':>13} {'copy + gate-up':>15} "
          f"{'down':>8}   (µs)")
    for t in args.rows_per_expert:
        N = L * t
        S = N // 2
        x_SD = torch.randn(S, D, device=dev, generator=g, dtype=torch.bfloat16)
        # each expert's rows ascend in the source buffer, as ht's layout orders them (source rank, slot)
        rows_N = torch.cat([torch.randperm(S, device=dev, generator=g)[:t].sort().values for _ in range(L)])
        rows_N = rows_N.to(torch.int32)
        rows = ExpertRows.contiguous(torch.arange(0, N + 1, t, device=dev, dtype=torch.int32))
        idx_us = _time_us(lambda: gate_up(x_SD, w13, rows, x_rows_R=rows_N))
        copy_us = _time_us(lambda: x_SD.index_select(0, rows_N.long()))
        x_ND = x_SD.index_select(0, rows_N.long())
        dense_us = _time_us(lambda: gate_up(x_ND, w13, rows))
        h, _ = gate_up(x_ND, w13, rows)
        h_idx, _ = gate_up(x_SD, w13, rows, x_rows_R=rows_N)
        if not torch.equal(h, h_idx):
            raise SystemExit(f"t {t}: gate-up through the index differs from gate-up on the copy")
        down_us = _time_us(lambda: down(h, w2, rows, out_dtype=torch.bfloat16))
        print(f"{t:5d} {N:7d} {idx_us:12.0f} {copy_us:8.0f} {dense_us:13.0f} {copy_us + dense_us:15.0f} "
              f"{down_us:8.0f}", flush=True)


if __name__ == "__main__":
    main()
