"""Host cost of one Triton launch on this machine: through the JIT (`kernel[grid](...)`: binding,
specialization key, cache lookup, launch) and through the compiled kernel's own launcher (what is left
when the JIT's work is skipped), for an ht kernel of 14 arguments that does nothing (0 received rows).
Also a torch op for scale. One GPU.

--gemm: the same for the grouped GEMM's gate-up launch at the ht layer's shapes (D 7168, F 2048, 128
experts, 8192 rows read through a row index; every expert empty, so the kernel returns at once): the
`gate_up` wrapper (checks, config, allocations, TMA descriptors, launch), the JIT launch alone, the
JIT's argument binding alone (`binder`, where this Triton exposes it) and the compiled launcher.

    python3 scripts/launch_probe.py [--n 2000] [--gemm]
"""
from __future__ import annotations

import argparse
import time

import torch
import triton

from epmoe.kernels import grouped_gemm as gg
from epmoe.kernels.grouped_gemm import ExpertRows, gate_up
from epmoe.kernels.ht import layout as k
from epmoe.kernels.layout import layout_blocks

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
    p.add_argument("--gemm", action="store_true", help="also the grouped GEMM's gate-up launch")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    R, C, K, L = 2, 4096, 8, 128
    blocks = layout_blocks(C, K)
    ids = torch.full((2, R, C, K), -1, dtype=torch.int32, device=dev)
    w = torch.zeros(2, R, C, K, device=dev)
    count = torch.zeros(2, R, dtype=torch.int32, device=dev)  # nothing received: the kernel returns at once
    seq = torch.zeros(1, dtype=torch.int32, device=dev)
    start = torch.zeros(R * blocks.blocks, L, dtype=torch.int32, device=dev)
    pos = torch.empty(R * C, K, dtype=torch.int32, device=dev)
    w_out = torch.empty(R * C, K, device=dev)
    rows = torch.zeros(R * C * K, dtype=torch.int32, device=dev)
    grid = (R, blocks.blocks)
    runtime = (ids, w, count, seq, start, pos, w_out, rows, R * C * K)
    consts = dict(R=R, C=C, K=K, L=L, NB=blocks.blocks, BLOCK_S=blocks.block_s, BLOCK_K=blocks.block_k)

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
        _report(name, fn, args.n)
    if args.gemm:
        _gemm(dev, args.n)


def _report(name: str, fn, n: int) -> None:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:<36} {us:6.1f} us per call (triton {triton.__version__}, torch {torch.__version__})", flush=True)


def _gemm(dev: torch.device, n: int) -> None:
    L, F, D, N = 128, 2048, 7168, 8192
    x = torch.randn(2 * N, D, dtype=torch.bfloat16, device=dev)
    w13 = torch.randn(L, 2 * F, D, dtype=torch.bfloat16, device=dev)
    rows = ExpertRows.contiguous(torch.zeros(L + 1, dtype=torch.int32, device=dev))  # every expert empty
    index = torch.arange(N, dtype=torch.int32, device=dev)
    kernel = gg._grouped_gemm_kernel
    captured = {}
    inner = kernel.run

    def capture(*a, **kw):
        captured.update(a=a, kw=kw)
        return inner(*a, **kw)
    kernel.run = capture
    try:
        gate_up(x, w13, rows, x_rows_R=index, rows_hint=256)
    finally:
        del kernel.run
    a, kw = captured["a"], captured["kw"]
    compiled = kernel.run(*a, **kw)
    meta = {k: v for k, v in kw.items() if k not in ("grid", "warmup")}
    grid = kw["grid"]
    _report("gate_up wrapper", lambda: gate_up(x, w13, rows, x_rows_R=index, rows_hint=256), n)
    _report("gate_up JIT launch", lambda: kernel.run(*a, **kw), n)
    try:
        binder = kernel.device_caches[dev.index][-1]
        bound, _, _ = binder(*a, **meta)
    except Exception as exc:  # this Triton's internals differ
        print(f"gate_up binder: not timed ({type(exc).__name__}: {exc})")
        return
    _report("gate_up JIT binding only", lambda: binder(*a, **meta), n)
    values = list(bound.values())
    stream = torch.cuda.current_stream(dev).cuda_stream
    enter, leave = _hooks()
    _report("gate_up compiled launcher", lambda: compiled.run(
        grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
        compiled.launch_metadata(grid, stream, *values), enter, leave, *values), n)


if __name__ == "__main__":
    main()
