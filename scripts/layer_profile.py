"""Where a FusedMoE layer's time goes, per dispatcher, on 2 GPUs: torch.profiler over a few calls of
the GPU layer of `epmoe bench layer` (DeepSeek-V3, 4096 tokens per rank, bf16).

    python3 scripts/layer_profile.py OUT_DIR [--dispatchers ht,ll] [--experts auto] [--calls 3]

Per dispatcher, rank 0 writes OUT_DIR/layer_<dispatcher>.trace.json (chrome trace) and prints its
kernel table (GPU time per kernel name, summed over the profiled calls) and, for the last call, every
GPU op in order with its start and end relative to the call's first op (µs) and the GPU's idle gaps
longer than 5 µs (the stream waiting for the host, or for another stream).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from epmoe.bench.dispatch import NVLINK_ENV
from epmoe.launch import spawn
from epmoe.layer import FusedMoE
from epmoe.testing import GPU_SPEC, build_layer, rank_inputs

GAP_US = 5.0
MARKER = "layer_call"


def _timeline(prof) -> list[str]:
    """The last call's GPU ops (kernels, copies, memsets) as lines, and the idle gaps between them."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name != MARKER]
    calls = [e for e in prof.events() if e.name == MARKER and e.device_type == torch.autograd.DeviceType.CPU]
    start_host = calls[-1].time_range.start
    ops = sorted((e for e in events if e.time_range.start >= start_host), key=lambda e: e.time_range.start)
    if not ops:
        return ["(no GPU op after the last call's start)"]
    t0, busy_until, lines = ops[0].time_range.start, ops[0].time_range.start, []
    for e in ops:
        s, z = e.time_range.start, e.time_range.end
        if s - busy_until > GAP_US:
            lines.append(f"{'':>9} idle {s - busy_until:7.1f} us")
        lines.append(f"{s - t0:9.1f} .. {z - t0:9.1f}  {z - s:8.1f}  {e.name[:70]}")
        busy_until = max(busy_until, z)
    lines.append(f"call: {busy_until - t0:.1f} us from the first GPU op to the last one's end")
    return lines


def _profile_layer(ctx, args, inputs, name: str) -> FusedMoE:
    """Profile args.calls calls of `name`'s layer (after 3 warm-ups); rank 0 prints and writes them."""
    cfg, weights, x_TD, logits_TE = inputs.cfg, inputs.weights, inputs.x_TD, inputs.logits_TE
    moe = build_layer(cfg, weights, ctx.group, name, args.experts, ctx.device)

    def call():
        dist.barrier(group=ctx.group)
        torch.cuda.synchronize()
        with torch.profiler.record_function(MARKER):
            moe(x_TD, logits_TE, correction_bias_E=weights.correction_bias_E)
        torch.cuda.synchronize()

    for _ in range(3):
        call()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
    if ctx.rank == 0:
        prof.export_chrome_trace(os.path.join(args.out, f"layer_{name}.trace.json"))
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(f"=== {name} ({moe.experts.name} experts), {args.calls} calls\n{table}", flush=True)
        print("\n".join(_timeline(prof)), flush=True)
    return moe


def _rank(ctx, args):
    inputs = rank_inputs(GPU_SPEC, ctx.rank, ctx.world_size, ctx.device)
    # every layer (and its dispatcher's symmetric workspace) stays allocated to the end: no
    # symmetric-memory frees between dispatchers
    layers = [_profile_layer(ctx, args, inputs, name) for name in args.dispatchers]
    return [moe.dispatcher.name for moe in layers]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dispatchers", default="ht,ll")
    p.add_argument("--experts", default="auto")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240)
    args = p.parse_args()
    args.dispatchers = args.dispatchers.split(",")
    os.makedirs(args.out, exist_ok=True)
    for key, value in NVLINK_ENV.items():
        os.environ.setdefault(key, value)
    spawn(_rank, 2, "cuda", (args,), timeout_s=args.timeout)


if __name__ == "__main__":
    main()
