"""Does a bf16 gate-up GEMM read its rows through a row index (`ht`'s batch: pointer loads, no TMA for
A) faster than a copy of the rows into batch order (`ExpertBatch.materialize`, index_select) followed
by the GEMM on the copy (TMA tile loads where the launch config has them)? One GPU, DeepSeek-V3 expert
shapes (D 7168, F 2048), L 128 experts with t rows each on average, gathered from S = N / 2 source rows
(each source row in two experts on average; each expert's rows are drawn apart).
Sources: ordinary memory, or symmetric memory as ht's receive buffer is (epmoe.symm.torch_workspace
over a 1-rank process group); rows per expert: exactly t, or drawn as uniform random routing draws them
(multinomial; partial row tiles at each expert's end). Beside them, the batched layout as `ll` hands
it over ([L, M, D] slots, M = --slot-rows, TMA tile loads; ~15 GB at the defaults) on the same rows and counts.

    python3 scripts/row_index_probe.py [--rows-per-expert 256 1024] [--slot-rows 8192]
        [--gather-configs "BM,BN,BK,GROUP,WARPS,STAGES" ...]

Prints per case: gate-up through the index, the copy, gate-up on the copy, their sum, gate-up on the
batched layout (padding slots zero, then random), and the down GEMM on the copy and on the batched
layout, µs (CUDA events, median of 10 after 3 warm-ups); then gate-up through the index with each of
--gather-configs (checked against the table config's output within bf16 rounding).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from epmoe.kernels.configs import GemmConfig
from epmoe.kernels.grouped_gemm import ExpertRows, down, gate_up
from epmoe.launch import free_port

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


def _source(S: int, symmetric: bool, dev: torch.device, keep: list) -> torch.Tensor:
    if not symmetric:
        return torch.empty(S, D, device=dev, dtype=torch.bfloat16)
    from epmoe.symm import BufferSpec, torch_workspace
    ws = torch_workspace([BufferSpec("x", (S, D), torch.bfloat16)], dist.group.WORLD, dev)
    keep.append(ws)
    return ws.local("x")


def _offsets(t: int, random: bool, g: torch.Generator, dev: torch.device) -> torch.Tensor:
    if random:
        counts = torch.bincount(torch.randint(0, L, (L * t,), device=dev, generator=g), minlength=L)
    else:
        counts = torch.full((L,), t, device=dev)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows-per-expert", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--slot-rows", type=int, default=8192, help="M of the batched layout (ll's R * Tmax)")
    p.add_argument("--gather-configs", nargs="*", default=[], help="BM,BN,BK,GROUP,WARPS,STAGES each")
    args = p.parse_args()
    gather_cfgs = [GemmConfig(**dict(zip(("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages"),
                                         map(int, c.split(","))))) for c in args.gather_configs]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(L, 2 * F, D, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(L, D, F, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    keep = []
    print(f"{'t':>5} {'source':>9} {'counts':>7} {'gate-up idx':>12} {'copy':>8} {'gate-up copy':>13} "
          f"{'copy + gate-up':>15} {'gate-up bat':>12} {'bat rnd pad':>12} {'down':>8} {'down bat':>9}   (µs)")
    for t in args.rows_per_expert:
        N = L * t
        S = N // 2
        for symmetric in (False, True):
            x_SD = _source(S, symmetric, dev, keep)
            x_SD.copy_(torch.randn(S, D, device=dev, generator=g, dtype=torch.bfloat16))
            for random in (False, True):
                offsets = _offsets(t, random, g, dev)
                counts = offsets.diff().tolist()
                # each expert's rows ascend in the source buffer, as ht's layout orders them (source rank, slot)
                rows_N = torch.cat([torch.randperm(S, device=dev, generator=g)[:n].sort().values for n in counts])
                rows_N = rows_N.to(torch.int32)
                rows = ExpertRows.contiguous(offsets)
                idx_us = _time_us(lambda: gate_up(x_SD, w13, rows, x_rows_R=rows_N, rows_hint=t))
                copy_us = _time_us(lambda: x_SD.index_select(0, rows_N.long()))
                x_ND = x_SD.index_select(0, rows_N.long())
                dense_us = _time_us(lambda: gate_up(x_ND, w13, rows, rows_hint=t))
                h, _ = gate_up(x_ND, w13, rows, rows_hint=t)
                h_idx, _ = gate_up(x_SD, w13, rows, x_rows_R=rows_N, rows_hint=t)
                if not torch.equal(h, h_idx):
                    raise SystemExit(f"t {t}: gate-up through the index differs from gate-up on the copy")
                down_us = _time_us(lambda: down(h, w2, rows, out_dtype=torch.bfloat16, rows_hint=t))
                M = args.slot_rows
                if max(counts) > M:
                    raise SystemExit(f"--slot-rows {M} is below the largest expert's {max(counts)} rows")
                x_LMD = torch.zeros(L, M, D, device=dev, dtype=torch.bfloat16)
                slot_rows = torch.cat([torch.arange(n, device=dev) + l * M for l, n in enumerate(counts)])
                x_LMD.view(-1, D)[slot_rows] = x_ND
                bat = ExpertRows.batched_slots(offsets.diff(), M)
                bat_us = _time_us(lambda: gate_up(x_LMD.view(-1, D), w13, bat, rows_hint=t))
                h_bat, _ = gate_up(x_LMD.view(-1, D), w13, bat, rows_hint=t)
                if not torch.equal(h_bat[slot_rows], h):
                    raise SystemExit(f"t {t}: gate-up on the batched layout differs from gate-up on the copy")
                down_bat_us = _time_us(lambda: down(h_bat, w2, bat, out_dtype=torch.bfloat16, rows_hint=t))
                x_LMD.normal_()  # the padding slots random too: a tail tile's MMAs on data, not zeros
                x_LMD.view(-1, D)[slot_rows] = x_ND
                bat_pad_us = _time_us(lambda: gate_up(x_LMD.view(-1, D), w13, bat, rows_hint=t))
                print(f"{t:5d} {'symmetric' if symmetric else 'plain':>9} {'random' if random else 'exact':>7} "
                      f"{idx_us:12.0f} {copy_us:8.0f} {dense_us:13.0f} {copy_us + dense_us:15.0f} {bat_us:12.0f} "
                      f"{bat_pad_us:12.0f} {down_us:8.0f} {down_bat_us:9.0f}", flush=True)
                for cfg in gather_cfgs:
                    us = _time_us(lambda: gate_up(x_SD, w13, rows, x_rows_R=rows_N, config=cfg))
                    h_cfg = gate_up(x_SD, w13, rows, x_rows_R=rows_N, config=cfg)[0]
                    if not torch.allclose(h_cfg.float(), h.float(), rtol=2e-2, atol=2e-2):
                        raise SystemExit(f"t {t}: gate-up through the index with {cfg} differs")
                    print(f"      gate-up idx {cfg}: {us:.0f} µs", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
