"""Where the GPU time of one `local` MoE block call goes, kernel by kernel (torch.profiler), on one GPU.

    python3 scripts/moe_profile.py [--shape qwen3-30b-a3b] [--tokens 4096] [--experts triton] [--quant bf16]
                                   [--calls 10] [--out DIR]

Prints each kernel's mean time per call and share, the GPU time per call (CUDA events over back-to-back
calls) and the host time per call; writes profile.json into --out. Shapes: epmoe.bench.moe.SHAPES.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from epmoe.bench.moe import SHAPES, layer_config, make_weights
from epmoe.layer import FusedMoE


def kernel_us(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """Mean µs per call of each CUDA kernel that fn launches, over `calls` back-to-back calls (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time / calls
    return dict(per_kernel)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--experts", default="triton")
    p.add_argument("--quant", default="bf16", choices=["bf16", "fp8_block"])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    shape = SHAPES[args.shape]
    weights = make_weights(shape, args.quant == "fp8_block", 0, dev)
    results = []
    for T in args.tokens:
        cfg = layer_config(shape, args.quant, T)
        moe = FusedMoE(cfg, None, dispatcher="local", experts=args.experts, device=dev)
        moe.load_experts(weights.w13_END, weights.w2_EDF)
        g = torch.Generator(dev).manual_seed(T)
        x = torch.randn(T, shape.hidden_size, device=dev, generator=g).to(torch.bfloat16)
        logits = torch.randn(T, shape.num_experts, device=dev, generator=g)
        w, ids = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
        for _ in range(3):
            moe(x, weights_TK=w, ids_TK=ids)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(args.calls):
            moe(x, weights_TK=w, ids_TK=ids)
        host_us = (time.perf_counter() - t0) / args.calls * 1e6
        end.record()
        torch.cuda.synchronize()
        gpu_us = start.elapsed_time(end) / args.calls * 1e3
        per_kernel = kernel_us(lambda: moe(x, weights_TK=w, ids_TK=ids), args.calls)
        total = sum(per_kernel.values())
        print(f"\n{args.shape} T={T} {args.quant} experts={args.experts}: GPU {gpu_us:.1f} us/call, "
              f"host {host_us:.1f} us/call, kernels {total:.1f} us/call")
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            print(f"  {us:9.1f} us  {100 * us / max(total, 1e-9):5.1f}%  {name[:110]}")
        results.append(dict(shape=args.shape, T=T, quant=args.quant, experts=args.experts, gpu_us=gpu_us,
                            host_us=host_us, kernels_us=dict(per_kernel)))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile-{args.shape}-{args.quant}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
