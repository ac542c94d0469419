"""Host cost of one Triton launch on this machine: through the JIT (`kernel[grid](...)`: binding,
specialization key, cache lookup, launch) and through the compiled kernel's own launcher (what is left
when the JIT's work is skipped), for an ht kernel of 14 arguments that does nothing (0 received rows).
Also a torch op for scale. One GPU.

    python3 scripts/launch_probe.py [--n 2000]
"""
from __future__ import annotations

import argparse
import time

import torch
import triton

from epmoe.kernels import ht as k
from epmoe.kernels.ht import layout_blocks

try:  # triton >= 3.4
    from triton import knobs

    def _hooks():
        return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
except ImportError:  # older: hooks on CompiledKernel
    from triton.compiler.compiler import CompiledKernel

    def _hooks():
        return CompiledKernel.launch_enter_hook, CompiledKernel.launch_exit_hook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    R, C, K, L = 2, 4096, 8, 128
    blocks = layout_blocks(C, K)
    ids = torch.full((2, R, C, K), -1, dtype=torch.int32, device=dev)
    w = torch.zeros(2, R, C, K, device=dev)
    count = torch.zeros(2, R, dtype=torch.int32, device=dev)  # nothing received: the kernel returns at once
    seq = torch.zeros(1, dtype=torch.int32, device=dev)
    start = torch.zeros(R * blocks.blocks_per_rank, L, dtype=torch.int32, device=dev)
    pos = torch.empty(R * C, K, dtype=torch.int32, device=dev)
    w_out = torch.empty(R * C, K, device=dev)
    rows = torch.zeros(R * C * K, dtype=torch.int32, device=dev)
    grid = (R, blocks.blocks_per_rank)
    runtime = (ids, w, count, seq, start, pos, w_out, rows, R * C * K)
    consts = dict(R=R, C=C, K=K, L=L, NB=blocks.blocks_per_rank, BLOCK_S=blocks.block_s, BLOCK_K=blocks.block_k)

    def jit():
        return k._layout_place_kernel[grid](*runtime, **consts, num_warps=4)

    compiled = jit()
    torch.cuda.synchronize()
    names = k._layout_place_kernel.arg_names
    values = list(runtime) + [consts[n] for n in names[len(runtime):]]
    stream = torch.cuda.current_stream(dev).cuda_stream
    enter, leave = _hooks()

    def direct():
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values), enter, leave, *values)

    def torch_op():
        seq.add_(0)

    for name, fn in (("JIT launch", jit), ("compiled kernel's launcher", direct), ("torch add_", torch_op)):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.n):
            fn()
        us = (time.perf_counter() - t0) / args.n * 1e6
        torch.cuda.synchronize()
        print(f"{name:<28} {us:6.1f} us per call (triton {triton.__version__}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
