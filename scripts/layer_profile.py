"""Where a FusedMoE layer's time goes, per dispatcher, on 2 GPUs: torch.profiler over a few calls of
the GPU layer of `epmoe bench layer` (DeepSeek-V3, 4096 tokens per rank, bf16).

    python3 scripts/layer_profile.py OUT_DIR [--dispatchers ht,ll] [--experts auto] [--calls 3]

Per dispatcher, rank 0 writes OUT_DIR/layer_<dispatcher>.trace.json (chrome trace) and prints its
kernel table (GPU time per kernel name, summed over the profiled calls) and, for the last call, every
GPU op in order with its start and end relative to the call's first op (µs) and the GPU's idle gaps
longer than 5 µs (the stream waiting for the host, or for another stream).

--host: no profiler (whose own host cost paces the layer): CUDA events and the host clock at each
phase's start and end (chunk count, shared experts, route, dispatch send / batch size / receive,
expert GEMMs, combine), medians over --calls calls. A phase whose GPU start is within a few µs of
its host start found the GPU waiting for the host. --cprofile (with --host): then cProfile over
--calls more calls on rank 0, the functions with the most cumulative and own host time; --deep:
also marks inside the dispatch and the GEMMs (each mark costs the host a few µs).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import epmoe.experts.triton as triton_experts
import epmoe.kernels.grouped_gemm as grouped_gemm
from epmoe.kernels.ht import combine as ht_combine, layout as ht_layout, send as ht_send
import epmoe.layer
from epmoe.bench.dispatch import NVLINK_ENV
from epmoe.demo import GPU_SPEC, rank_inputs
from epmoe.launch import spawn
from epmoe.layer import FusedMoE
from epmoe.testing import build_layer

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


class _Marks:
    """Host clock and a CUDA event at named points of one call."""

    def __init__(self) -> None:
        self.points: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.points.append((name, time.perf_counter(), event))

    def wrap(self, owner, attr: str, label: str) -> None:
        """owner.attr marks `label >` before and `label <` after each call (an instance attribute)."""
        inner = getattr(owner, attr)

        def marked(*a, **k):
            self.mark(f"{label} >")
            result = inner(*a, **k)
            self.mark(f"{label} <")
            return result
        setattr(owner, attr, marked)

    def times(self) -> list[tuple[str, float, float]]:
        """[(name, host µs, GPU µs)] relative to the first point (the GPU idle there)."""
        torch.cuda.synchronize()
        _, h0, e0 = self.points[0]
        return [(n, (h - h0) * 1e6, e0.elapsed_time(e) * 1e3) for n, h, e in self.points]


def _deep_marks(moe: FusedMoE) -> list[tuple[object, str, str]]:
    """(owner, attribute, label) of the functions --deep marks too: the ht kernels' wrappers, the copy
    engine, the grouped GEMMs' launch steps and the Triton launch of their kernel."""
    names = [(ht_send, ("number_pairs", "copy_rows", "wait_flags")),
             (ht_layout, ("layout_count", "layout_scan", "layout_place")), (ht_combine, ("combine",))]
    found = [(module, n, f"kernels.{n}") for module, ns in names for n in ns]
    engine = getattr(getattr(getattr(moe.dispatcher, "_schedule", None), "transport", None), "engine", None)
    if engine is not None:
        found.append((engine, "send_rows", "engine.send_rows"))
    return found + [(grouped_gemm, "_launch", "gemm _launch"), (grouped_gemm, "_descriptor", "gemm _descriptor"),
                    (grouped_gemm._grouped_gemm_kernel, "run", "gemm jit run")]


def _host_timeline(ctx, args, inputs, name: str) -> FusedMoE:
    """Medians over args.calls calls (after 3 warm-ups) of each mark's host and GPU time; rank 0 prints."""
    cfg, weights, x_TD, logits_TE = inputs.cfg, inputs.weights, inputs.x_TD, inputs.logits_TE
    moe = build_layer(cfg, weights, ctx.group, name, args.experts, ctx.device)
    marks = _Marks()
    start_chunk_count = moe.dispatcher.start_chunk_count

    def chunk_count(*a):
        marks.mark("chunk count start >")
        read = start_chunk_count(*a)
        marks.mark("chunk count start <")

        def marked_read(batch):
            marks.mark("chunk count read >")
            n = read(batch)
            marks.mark("chunk count read <")
            return n
        return marked_read
    marked = [(moe.shared_experts, "forward", "shared experts"), (moe.experts, "_forward", "experts"),
              (moe.dispatcher, "combine", "combine"), (epmoe.layer, "route", "route"),
              (triton_experts, "gate_up", "gate_up"), (triton_experts, "down", "down")]
    marked += [(moe.dispatcher, attr, attr.lstrip("_")) for attr in ("_dispatch_send", "dispatch_recv")
               if hasattr(moe.dispatcher, attr)]
    schedule = getattr(moe.dispatcher, "_schedule", None)  # ht: the batch size's host read
    marked += [(schedule, "batch_size", "batch_size")] if hasattr(schedule, "batch_size") else []
    marked += _deep_marks(moe) if args.deep else []
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in marked]  # restored before --cprofile
    saved.append((moe.dispatcher, "start_chunk_count", start_chunk_count))
    moe.dispatcher.start_chunk_count = chunk_count
    for owner, attr, label in marked:
        marks.wrap(owner, attr, label)
    runs = []
    try:
        for i in range(3 + args.calls):
            dist.barrier(group=ctx.group)
            torch.cuda.synchronize()
            marks.points.clear()
            marks.mark("call >")
            moe(x_TD, logits_TE, correction_bias_E=weights.correction_bias_E)
            marks.mark("call <")
            if i >= 3:
                runs.append(marks.times())
    finally:
        for owner, attr, inner in saved:
            setattr(owner, attr, inner)
    if args.cprofile:
        prof = cProfile.Profile()
        for _ in range(args.calls):
            dist.barrier(group=ctx.group)
            torch.cuda.synchronize()
            prof.enable()
            moe(x_TD, logits_TE, correction_bias_E=weights.correction_bias_E)
            prof.disable()
        if ctx.rank == 0:
            for key, rows in (("cumulative", 60), ("tottime", 30)):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(rows)
                print(f"=== {name}: cProfile of {args.calls} calls by {key}\n{text.getvalue()}", flush=True)
    if ctx.rank == 0:
        print(f"=== {name} ({moe.experts.name} experts): host and GPU time of each mark, µs from the call's "
              f"start, medians of {args.calls} calls; gpu-host: how far the GPU trails the host there", flush=True)
        print(f"{'mark':28} {'host':>8} {'gpu':>8} {'gpu-host':>9}", flush=True)
        for j, (label, _, _) in enumerate(runs[0]):
            host = statistics.median(r[j][1] for r in runs)
            gpu = statistics.median(r[j][2] for r in runs)
            print(f"{label:28} {host:8.1f} {gpu:8.1f} {gpu - host:9.1f}", flush=True)
    return moe


def _rank(ctx, args):
    inputs = rank_inputs(GPU_SPEC, ctx.rank, ctx.world_size, ctx.device)
    # every layer (and its dispatcher's symmetric workspace) stays allocated to the end: no
    # symmetric-memory frees between dispatchers
    run = _host_timeline if args.host else _profile_layer
    layers = [run(ctx, args, inputs, name) for name in args.dispatchers]
    return [moe.dispatcher.name for moe in layers]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dispatchers", default="ht,ll")
    p.add_argument("--experts", default="auto")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--host", action="store_true", help="host and GPU time per phase, no profiler")
    p.add_argument("--deep", action="store_true", help="with --host: also mark the ht kernels' wrappers and "
                   "the grouped GEMMs' launch steps")
    p.add_argument("--cprofile", action="store_true", help="with --host: cProfile of the host, rank 0")
    args = p.parse_args()
    args.dispatchers = args.dispatchers.split(",")
    os.makedirs(args.out, exist_ok=True)
    for key, value in NVLINK_ENV.items():
        os.environ.setdefault(key, value)
    spawn(_rank, 2, "cuda", (args,), timeout_s=args.timeout)


if __name__ == "__main__":
    main()
