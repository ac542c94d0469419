"""How fast TMA boxes stream an expert GEMM's fp8 weights, in the GEMM's layout against a tile-packed one.

    python3 scripts/box_stream_probe.py [--points qwen3-30b dsv2-lite dsv3-256] [--rep-ms 20]

The warp-specialized kernel reads an expert's weights [N, K] as boxes of BN rows by 128 bytes: rows K bytes
apart, a box at (n0, k0). Packed, each box's bytes lie together ([L, N/BN, K/128, BN, 128]), so a tile's
stream is one contiguous run. Per shape and weight (the gate-up's w13 [L, 2F, D], the down's w2 [L, D, F],
fp8), a persistent Triton kernel (one program per SM, tiles in order, a flattened pipelined loop of descriptor
loads each feeding an fp8 dot with a 64-row zero A, as a decode tile does) streams the weights both ways;
printed: µs (L2 flushed by zeroing 256 MiB, as the bench; `epmoe.timing.flushed_ms`), TB/s, % of a plain
read of the same bytes timed the same way, and the real MLP's gate-up and down at 16 rows per expert
(`scripts/mlp_parts.py`' inputs) beside them.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from epmoe.timing import flushed_ms
from flush_probe import plain_read  # scripts/, on sys.path as the running script's folder
from mlp_parts import mlp_calls


@triton.jit
def _stream_kernel(desc, out_ptr, n_tiles, k_steps, PACKED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   STAGES: tl.constexpr):
    """Program p streams tiles p, p + G, ...: k_steps boxes [BN, BK] each, through one pipelined loop."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    n_mine = (n_tiles - pid + grid - 1) // grid
    a = tl.zeros([64, BK], tl.float32).to(tl.float8e4nv)
    acc = tl.zeros([64, BN], tl.float32)
    for it in tl.range(0, n_mine * k_steps, num_stages=STAGES):
        tile = pid + (it // k_steps) * grid
        k = it % k_steps
        if PACKED:
            b = desc.load([(tile * k_steps + k) * BN, 0])
        else:
            b = desc.load([tile * BN, k * BK])
        acc = tl.dot(a, b.T, acc)
        if k == k_steps - 1:
            tl.store(out_ptr + tile, tl.sum(tl.sum(acc, 1), 0))
            acc = tl.zeros([64, BN], tl.float32)


def stream(w: torch.Tensor, packed: bool, bn: int, stages: int):
    """A call streaming w [L, N, K] (fp8, N a multiple of bn, K of 128) as the kernel above does."""
    L, N, K = w.shape
    bk = 128
    rows = w.view(-1, bk) if packed else w.view(L * N, K)
    desc = TensorDescriptor.from_tensor(rows, [bn, bk])
    n_tiles, k_steps = L * N // bn, K // bk
    out = torch.empty(n_tiles, dtype=torch.float32, device=w.device)
    grid = (torch.cuda.get_device_properties(w.device).multi_processor_count,)

    def call() -> None:
        _stream_kernel[grid](desc, out, n_tiles, k_steps, PACKED=packed, BN=bn, BK=bk, STAGES=stages, num_warps=4)
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", nargs="+", default=["qwen3-30b", "dsv2-lite", "dsv3-256"])
    p.add_argument("--rep-ms", type=int, default=20)
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; µs flushed (zeroing 256 MiB)")
    for name in args.points:
        calls, (_, _, _, (w13, w2)) = mlp_calls(name, 16, True, 1 << 30)
        real = {tag: flushed_ms(calls[op], args.rep_ms) * 1e3 for tag, op in (("w13", "gate_up"), ("w2", "down"))}
        for tag, w in (("w13", w13), ("w2", w2)):
            plain = flushed_ms(plain_read([w]), args.rep_ms) * 1e3
            line = [f"{name} {tag} {tuple(w.shape)} {w.numel() / 1e6:.0f} MB: plain {plain:.1f} µs "
                    f"({w.numel() / plain / 1e6:.2f} TB/s); real kernel at 16 rows {real[tag]:.1f} µs"]
            for bn, stages in ((128, 5), (128, 8), (64, 8)):
                for packed in (False, True):
                    us = flushed_ms(stream(w, packed, bn, stages), args.rep_ms) * 1e3
                    line.append(f"  {'packed ' if packed else 'strided'} bn {bn} stages {stages}: {us:.1f} µs "
                                f"{w.numel() / us / 1e6:.2f} TB/s {100 * plain / us:.0f}% of plain")
            print("\n".join(line), flush=True)


if __name__ == "__main__":
    main()
