"""Where the host time of one `local` MoE block call goes (cProfile), on one GPU: what the host does to
queue a call, function by function.

    python3 scripts/host_profile.py [--shape qwen3-30b-a3b] [--tokens 1] [--quant bf16] [--calls 200] [--top 30]

The calls run back to back in batches of 50, with a sync after each batch outside the time (so that the
host never waits for the GPU inside it): the time and the profile are the host's alone.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from epmoe.bench.moe import SHAPES, layer_config, make_weights
from epmoe.layer import FusedMoE


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--quant", default="bf16", choices=["bf16", "fp8_block"])
    p.add_argument("--experts", default="triton")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    dev = torch.device("cuda")
    shape = SHAPES[args.shape]
    weights = make_weights(shape, args.quant == "fp8_block", 0, dev)
    cfg = layer_config(shape, args.quant, max(args.tokens, 1))
    moe = FusedMoE(cfg, None, dispatcher="local", experts=args.experts, device=dev)
    moe.load_experts(weights.w13_END, weights.w2_EDF)
    T = args.tokens
    x = torch.randn(T, shape.hidden_size, device=dev).to(torch.bfloat16)
    w, ids = torch.topk(torch.randn(T, shape.num_experts, device=dev).softmax(-1), shape.top_k, dim=-1)
    w = w.to(torch.bfloat16)

    def calls(n: int) -> float:
        """Seconds the host took to queue n calls, in batches of 50 with a sync after each (outside the
        time), so that the queue stays short and the host never waits for the GPU inside the time."""
        queued = 0.0
        for lo in range(0, n, 50):
            t0 = time.perf_counter()
            for _ in range(min(50, n - lo)):
                moe(x, weights_TK=w, ids_TK=ids)
            queued += time.perf_counter() - t0
            torch.cuda.synchronize()
        return queued

    calls(20)
    host = calls(args.calls) / args.calls * 1e6
    print(f"{args.shape} T={T} {args.quant} experts={args.experts}: {host:.1f} us of host time per call")
    prof = cProfile.Profile()
    prof.enable()
    calls(args.calls)
    prof.disable()
    stats = pstats.Stats(prof).sort_stats("tottime")
    stats.print_stats(args.top)


if __name__ == "__main__":
    main()
