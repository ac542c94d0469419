"""`epmoe bench moe`: the MoE block on one GPU given router outputs, epmoe against transformers' own experts.

    epmoe bench moe [--shapes ...] [--tokens ...] [--quant bf16 fp8_block] [--repeats N] [--out DIR]

Shape letters: T tokens, D hidden size, E experts, K top-k, F expert intermediate size.

Per shape (SHAPES) and T, the same tensors go through every implementation: x_TD bf16, and the
top-k of a random router (softmax of random logits, top K, renormalized: weights_TK bf16, ids_TK
int64, as the models' own routers return them). Implementations:
  transformers grouped_mm / eager   the family's own experts module (`hf_peer`) running transformers'
                                    backend of that name (eager only for T <= EAGER_MAX_TOKENS); fp8:
                                    transformers' FP8 experts where they run (see `hf_peer`)
  epmoe auto / triton / grouped_mm  `FusedMoE(cfg, None, dispatcher="local", experts=name)` through the
                                    public API (`load_experts`, then `moe(x, weights_TK=w, ids_TK=ids)`),
                                    cfg.max_tokens_per_rank = T (one chunk; "auto" picks for this T)
Weights: one set per shape, made on the GPU from --seed, quantized to fp8_block (128x128 blocks) and
the bf16 weights set to the dequantized values, so that bf16 and fp8 rows compute the same function.

Per point and implementation:
  GPU us     median over >= --repeats calls of the CUDA-event interval between the end of the call
             before, of the same implementation, and its own: every call is queued back to back, the host
             at most QUEUED_CALLS calls ahead of the GPU (after warm-up), the implementations taking turns
             in short rounds of a lead-in call and ROUND_CALLS timed ones, each following each other one
             equally often (so
             that a drift of the GPU's clocks over the point, and what the implementation before leaves
             behind, reach all alike); an implementation's consecutive calls read different input sets
             (distinct x and routing), larger together than twice the L2, and every implementation
             reads the same sequence of them
  spread %   the interquartile range of those calls' GPU times over their median: two medians of the
             same code (auto where it runs `triton`, and `triton`) are apart by about this much or less
  host us    median over the same calls of perf_counter around each one (the CUDA event's record and
             the wait for the call QUEUED_CALLS back outside it): how long the host takes to queue a
             call (= GPU us where a call syncs the host; moe.json's alloc_retries counts the point's syncs
             by torch's caching allocator, which releases its cache when no free block fits a request)
  GEMM %     torch.profiler over PROFILE_CALLS calls: time of the GEMM kernels / time of all kernels
             (GEMM kernels: a name holding one of GEMM_KERNEL_PATTERNS, case-insensitive: epmoe's
             Triton `_grouped_gemm_kernel`, CUTLASS grouped GEMMs, cuBLAS `nvjet`/`xmma`/`gemv`
             kernels and its split-K reductions, Triton `matmul` kernels)
  floor us   max(flops / peak, bytes / copy bandwidth) with the GPU's ceilings (`epmoe.bench.ceilings`; an
             H200's, 686 (fp8 1276) TFLOP/s and 4.16 TB/s, on the CPU): flops = 6 * T*K * D * F, bytes =
             the weights of the experts the routing hits (fp8: 1 byte each) + x read + out written
  % floor    floor / GPU time; TFLOP/s = flops / GPU time
  x tf       transformers grouped_mm's GPU time / this one's (> 1: faster than transformers); fp8 rows
             against transformers' FP8 experts, or, where they do not run, its bf16 grouped_mm (said so)
  rel err    ||out - ref|| / ||ref|| against transformers' eager output on the first input set (epmoe's
             `reference` experts where transformers is not installed); over epmoe.testing.TOLERANCES
             is a FAIL, and the exit code is 1
An implementation whose first call raises is reported and left out of the rest of the run.
Writes moe.json, moe.md (the table as markdown) and moe.png (x tf against T per shape; matplotlib)
into --out. Needs one CUDA GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch
import triton

from .._table import format_table
from ..config import MoEConfig
from ..kernels import configs
from ..layer import FusedMoE
from ..quant import dequantize_weight_ref, quantize_weights_ref
from ..registry import list_experts
from ..testing import TOLERANCES, rel_error
from ..timing import sync
from . import hf_peer
from .ceilings import H200, Ceilings, device_ceilings, device_name
from .experts import Floor, floor_on, fmt
from .hf_peer import MoEShape

SHAPES = {s.name: s for s in (
    MoEShape(name="qwen3-30b-a3b", family="qwen3_moe", hidden_size=2048, num_experts=128, top_k=8,
             intermediate_size=768),
    MoEShape(name="deepseek-v2-lite", family="deepseek_v2", hidden_size=2048, num_experts=64, top_k=6,
             intermediate_size=1408),
    MoEShape(name="mixtral-8x7b", family="mixtral", hidden_size=4096, num_experts=8, top_k=2,
             intermediate_size=14336),
    MoEShape(name="deepseek-v3", family="deepseek_v3", hidden_size=7168, num_experts=256, top_k=8,
             intermediate_size=2048),
)}
TOKENS = (1, 16, 128, 256, 1024, 4096, 16384)
QUANTS = ("bf16", "fp8_block")
EPMOE_EXPERTS = ("auto", "triton", "grouped_mm")
EAGER_MAX_TOKENS = 256
WARMUP_CALLS = 2
ROUND_CALLS = 2  # timed calls of one run after its lead-in call, in a round of `time_in_turns`
# Calls `time_in_turns` lets the host queue ahead of the GPU: before queueing a call it waits (outside the
# call's host time) for the end of the call this many back. Unbounded, a host far ahead blocked inside
# calls on the full launch queue: at Mixtral-8x7B's eager 16384-token point the second epmoe
# implementation of the list, whichever it was, measured 5.6-6.6 ms of host time a call against 0.7-1.3
# for the same code in third place (scripts/host_order_probe.py, one H200).
QUEUED_CALLS = 3
PROFILE_CALLS = 2
L2_BYTES = 60e6  # an H200's L2 (BENCHMARKS.md, machines)
MAX_INPUT_SETS = 8
GEMM_KERNEL_PATTERNS = ("gemm", "gemv", "splitkreduce", "matmul", "nvjet", "xmma", "cutlass")
BASELINE = "transformers grouped_mm"


@dataclass(frozen=True)
class Inputs:
    """One call's tensors: x_TD bf16 [T, D], weights_TK bf16 [T, K], ids_TK int64 [T, K] in [0, E)."""

    x_TD: torch.Tensor
    weights_TK: torch.Tensor
    ids_TK: torch.Tensor


@dataclass(frozen=True)
class Impl:
    """One implementation of the block: `run(inputs) -> out_TD`; `runs` says what it ran (auto's pick,
    transformers' backend)."""

    name: str
    quant: str
    runs: str
    run: Callable[[Inputs], torch.Tensor]

    @property
    def key(self) -> str:
        return f"{self.name} {self.quant}"


@dataclass(frozen=True)
class ShapeWeights:
    """Global weights of one shape: bf16 w13_END [E, 2F, D] and w2_EDF [E, D, F]; with fp8, their
    fp8_block form (float8_e4m3fn, float32 128x128 block scales) and the bf16 ones dequantized from it."""

    w13_END: torch.Tensor
    w2_EDF: torch.Tensor
    fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # q13, s13, q2, s2


def block_floor(shape: MoEShape, T: int, experts_hit: float, fp8: bool, ceilings: Ceilings = H200) -> Floor:
    """The floor of one block call over T tokens whose routing hits `experts_hit` experts: every routed
    row's 6*D*F flops, and the hit experts' weights, x and the output through HBM once (default: on an
    H200)."""
    D, F = shape.hidden_size, shape.intermediate_size
    flops = 6.0 * T * shape.top_k * D * F
    nbytes = experts_hit * 3 * D * F * (1 if fp8 else 2) + 2 * T * D * 2
    return floor_on(ceilings, flops, nbytes, fp8)


def is_gemm_kernel(name: str) -> bool:
    """Whether a GPU kernel's name marks it as a GEMM (GEMM_KERNEL_PATTERNS)."""
    lower = name.lower()
    return any(p in lower for p in GEMM_KERNEL_PATTERNS)


def split_kernel_time(kernels: Sequence[tuple[str, float, float]],
                      windows: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """(GEMM kernel time, all kernel time) per window, from kernels (name, start, end) and windows
    {key: (start, end)} on one clock; a kernel belongs to the window holding its midpoint (the others
    count nowhere)."""
    split = {key: [0.0, 0.0] for key in windows}
    for name, start, end in kernels:
        mid = (start + end) / 2
        for key, (lo, hi) in windows.items():
            if lo <= mid <= hi:
                split[key][0] += (end - start) if is_gemm_kernel(name) else 0.0
                split[key][1] += end - start
                break
    return {key: (gemm, total) for key, (gemm, total) in split.items()}


def input_sets(T: int, D: int) -> int:
    """How many input sets the timed calls cycle through: x and out of all of them together at least
    twice the L2 cache, 2 to MAX_INPUT_SETS."""
    return max(2, min(MAX_INPUT_SETS, math.ceil(2 * L2_BYTES / (2 * T * D * 2))))


def make_weights(shape: MoEShape, fp8: bool, seed: int, device: torch.device) -> ShapeWeights:
    E, D, F = shape.num_experts, shape.hidden_size, shape.intermediate_size
    gen = torch.Generator(device).manual_seed(seed)
    w13_END = torch.randn(E, 2 * F, D, dtype=torch.bfloat16, device=device, generator=gen).mul_(D ** -0.5)
    w2_EDF = torch.randn(E, D, F, dtype=torch.bfloat16, device=device, generator=gen).mul_(F ** -0.5)
    if not fp8:
        return ShapeWeights(w13_END, w2_EDF, None)
    q13, s13 = quantize_weights_ref(w13_END)
    q2, s2 = quantize_weights_ref(w2_EDF)
    for w, q, s in ((w13_END, q13, s13), (w2_EDF, q2, s2)):
        for e in range(E):  # one expert at a time: the float32 temporaries stay one expert's size
            w[e].copy_(dequantize_weight_ref(q[e], s[e]))
    return ShapeWeights(w13_END, w2_EDF, (q13, s13, q2, s2))


def make_inputs(shape: MoEShape, T: int, gen: torch.Generator, device: torch.device) -> Inputs:
    x_TD = torch.randn(T, shape.hidden_size, dtype=torch.bfloat16, device=device, generator=gen)
    logits_TE = torch.randn(T, shape.num_experts, device=device, generator=gen)
    top_TK, ids_TK = logits_TE.softmax(-1).topk(shape.top_k, dim=-1)
    return Inputs(x_TD, (top_TK / top_TK.sum(-1, keepdim=True)).to(torch.bfloat16), ids_TK)


def layer_config(shape: MoEShape, quant: str, max_tokens: int) -> MoEConfig:
    return MoEConfig(num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden_size,
                     intermediate_size=shape.intermediate_size, dtype=torch.bfloat16,
                     quant=None if quant == "bf16" else quant, max_tokens_per_rank=max_tokens)


def epmoe_impls(shape: MoEShape, T: int, quant: str, weights: ShapeWeights, device: torch.device,
                skipped: dict[str, str]) -> list[Impl]:
    cfg = layer_config(shape, quant, T)
    available = list_experts(cfg, device)
    impls = []
    for name in EPMOE_EXPERTS:
        if name != "auto" and not available[name][0]:
            skipped[f"epmoe {name} {quant}"] = available[name][1]
            continue
        moe = FusedMoE(cfg, None, dispatcher="local", experts=name, device=device)
        if cfg.quant is None:
            moe.load_experts(weights.w13_END, weights.w2_EDF)
        else:
            q13, s13, q2, s2 = weights.fp8
            moe.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
        impls.append(Impl(f"epmoe {name}", quant, moe.experts.name,
                          lambda inp, moe=moe: moe(inp.x_TD, weights_TK=inp.weights_TK, ids_TK=inp.ids_TK)))
    return impls


def peer_modules(shape: MoEShape, weights: ShapeWeights, skipped: dict[str, str]) -> dict[str, torch.nn.Module]:
    """transformers' experts modules of the shape, by Impl.key (none where transformers is missing)."""
    if hf_peer.transformers_version() is None:
        return {}
    modules = {f"transformers {b} bf16": hf_peer.experts_module(shape, b, weights.w13_END, weights.w2_EDF)
               for b in ("grouped_mm", "eager")}
    if weights.fp8 is not None:
        reason = hf_peer.fp8_unavailable_reason()
        if reason is None:
            modules.update({f"transformers {b} fp8_block": hf_peer.fp8_experts_module(shape, b, *weights.fp8)
                            for b in ("grouped_mm", "eager")})
        else:
            skipped["transformers fp8_block"] = reason
    return modules


def peer_impls(modules: dict[str, torch.nn.Module], T: int) -> list[Impl]:
    impls = []
    for key, module in modules.items():
        _, backend, quant = key.split()
        if backend == "eager" and T > EAGER_MAX_TOKENS:
            continue
        impls.append(Impl(f"transformers {backend}", quant, backend,
                          lambda inp, m=module: m(inp.x_TD, inp.ids_TK, inp.weights_TK)))
    return impls


def turn_orders(runs: int) -> list[list[int]]:
    """Orders of `runs` runs, one a round, in which every run follows every other run equally often (a
    Williams design: `runs` orders for an even count, twice as many for an odd one), so that whatever a
    run leaves behind (the GPU's state, the host's garbage) falls on every other run alike."""
    first, low, high = [0], 1, runs - 1
    while len(first) < runs:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(v + r) % runs for v in first] for r in range(runs)]
    return orders + [order[::-1] for order in orders] if runs % 2 else orders


class CallTimes(NamedTuple):
    """Times per call of one run: GPU and host ms (medians), and the GPU times' spread (interquartile range
    over the median, in %)."""

    gpu_ms: float
    host_ms: float
    spread_pct: float


def time_in_turns(runs: Sequence[Callable[[Inputs], torch.Tensor]], inputs: Sequence[Inputs], repeats: int,
                  device: torch.device) -> list[CallTimes]:
    """CallTimes of each of `runs`: over at least `repeats` timed calls of each, after WARMUP_CALLS of each.
    The runs take turns in short rounds, in the orders of `turn_orders` (as many rounds as `repeats` needs,
    rounded up to whole sets of them): a lead-in call, untimed, then ROUND_CALLS timed calls, all queued
    back to back, a CUDA event after each call, the host at most QUEUED_CALLS calls ahead of the GPU (it
    waits for the event that many calls back before it queues the next, outside the call's host time; no
    sync otherwise). Call j of a run's turn in round m reads input set (m * (1 + ROUND_CALLS) + j) mod
    len(inputs): every run reads the same sequence of sets (a call's time depends on its set: where the
    experts' rows sit near a multiple of the row tile, one set's routing takes a tile more than
    another's), its consecutive calls different ones. A timed call's GPU time is the interval from the
    end of the call before it, of the same run, to its own end: what the call costs when the host keeps
    up (else the host's pace), whatever the run before the lead-in left the GPU doing; and a drift of the
    GPU's clocks over the point reaches every run alike. On a CPU both times are each call's wall time."""
    n = len(inputs)
    for run in runs:
        for i in range(WARMUP_CALLS):
            run(inputs[i % n])
    sync(device)
    orders = turn_orders(len(runs))
    rounds = -(-repeats // ROUND_CALLS)
    order: list[tuple[int, bool, int]] = []  # (run, timed, input set)
    per_turn = 1 + ROUND_CALLS
    for m in range(-(-rounds // len(orders)) * len(orders)):
        for i in orders[m % len(orders)]:
            order += [(i, j > 0, (m * per_turn + j) % n) for j in range(per_turn)]
    on_gpu = device.type == "cuda"
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(order) + 1)] if on_gpu else []
    host_all = []
    if on_gpu:
        marks[0].record()
    for c, (r, _, k) in enumerate(order):
        if on_gpu and c >= QUEUED_CALLS:
            marks[c + 1 - QUEUED_CALLS].synchronize()
        t0 = time.perf_counter()
        runs[r](inputs[k])
        host_all.append((time.perf_counter() - t0) * 1e3)
        if on_gpu:
            marks[c + 1].record()
    sync(device)
    gpu_all = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])] if on_gpu else host_all
    times = []
    for i in range(len(runs)):
        gpu = [gpu_all[c] for c, (r, t, _) in enumerate(order) if r == i and t]
        host = [host_all[c] for c, (r, t, _) in enumerate(order) if r == i and t]
        times.append(CallTimes(statistics.median(gpu), statistics.median(host), spread_pct(gpu)))
    return times


def spread_pct(values: Sequence[float]) -> float:
    """The interquartile range of `values` over their median, in % (0 for fewer than 2 values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return 100.0 * (q3 - q1) / statistics.median(values)


def time_calls(run: Callable[[Inputs], torch.Tensor], inputs: Sequence[Inputs], repeats: int,
               device: torch.device) -> CallTimes:
    """CallTimes of one run: `time_in_turns` of it alone."""
    return time_in_turns([run], inputs, repeats, device)[0]


def gemm_shares(impls: Sequence[Impl], inputs: Sequence[Inputs], device: torch.device) -> dict[str, float]:
    """Percent of kernel time in GEMM kernels per Impl.key, from one torch.profiler session: each
    implementation's calls run inside a record_function window that starts and ends on a synced GPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    labels = {f"epmoe-bench-moe/{i}": impl.key for i, impl in enumerate(impls)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for label, impl in zip(labels, impls):
            torch.cuda.synchronize(device)
            time.sleep(1e-3)  # a gap between the windows, far wider than the GPU/host clock skew
            with record_function(label):
                for i in range(PROFILE_CALLS):
                    impl.run(inputs[i % len(inputs)])
                torch.cuda.synchronize(device)
    events = prof.events()
    windows = {labels[e.name]: (e.time_range.start, e.time_range.end) for e in events
               if e.name in labels and e.device_type == DeviceType.CPU}
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA and e.name not in labels]
    return {key: 100.0 * gemm / total for key, (gemm, total) in split_kernel_time(kernels, windows).items()
            if total > 0}


def reference_fn(shape: MoEShape, modules: dict[str, torch.nn.Module], weights: ShapeWeights,
                 device: torch.device) -> tuple[str, Callable[[Inputs], torch.Tensor]]:
    """(name, run) of the reference: transformers' eager experts, else epmoe's `reference` experts."""
    if "transformers eager bf16" in modules:
        eager = modules["transformers eager bf16"]
        return "transformers eager", lambda inp: eager(inp.x_TD, inp.ids_TK, inp.weights_TK)
    moe = FusedMoE(layer_config(shape, "bf16", 4096), None, dispatcher="local", experts="reference", device=device)
    moe.load_experts(weights.w13_END, weights.w2_EDF)
    return "epmoe reference", lambda inp: moe(inp.x_TD, weights_TK=inp.weights_TK, ids_TK=inp.ids_TK)


def bench_point(shape: MoEShape, T: int, impls: Sequence[Impl], reference: Callable[[Inputs], torch.Tensor],
                inputs: Sequence[Inputs], repeats: int, device: torch.device, failed: dict[str, str],
                ceilings: Ceilings = H200) -> list[dict]:
    """One record per implementation that runs at (shape, T); see the module docstring for the fields. Floors
    on a GPU of `ceilings`."""
    ref_TD = reference(inputs[0])
    checked = []
    for impl in impls:
        t0 = time.perf_counter()
        try:
            out_TD = impl.run(inputs[0])
            sync(device)
        except Exception as exc:  # keep the sweep going; said once, in the skipped list
            failed[impl.key] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"# {shape.name} T={T} {impl.key} failed: {failed[impl.key]}", flush=True)
            continue
        first_s = time.perf_counter() - t0
        checked.append((impl, rel_error(out_TD, ref_TD), first_s))
        del out_TD
    retries = alloc_retries(device)
    times = time_in_turns([impl.run for impl, *_ in checked], inputs, repeats, device)
    retries = alloc_retries(device) - retries
    measured = [(impl, t.gpu_ms, t.host_ms, t.spread_pct, err, first_s)
                for (impl, err, first_s), t in zip(checked, times)]
    shares = gemm_shares([m[0] for m in measured], inputs, device) if device.type == "cuda" else {}
    gpu_of = {impl.key: gpu_ms for impl, gpu_ms, *_ in measured}
    hit = statistics.mean(torch.unique(inp.ids_TK).numel() for inp in inputs)
    records = []
    for impl, gpu_ms, host_ms, spread, err, first_s in measured:
        baseline = f"{BASELINE} {impl.quant}"
        if baseline not in gpu_of:
            baseline = f"{BASELINE} bf16"
        floor = block_floor(shape, T, hit, impl.quant == "fp8_block", ceilings)
        records.append({
            "shape": shape.name, "D": shape.hidden_size, "E": shape.num_experts, "K": shape.top_k,
            "F": shape.intermediate_size, "T": T, "quant": impl.quant, "impl": impl.name, "runs": impl.runs,
            "gpu_us": gpu_ms * 1e3, "spread_pct": spread, "host_us": host_ms * 1e3,
            "host_pct": 100.0 * host_ms / gpu_ms,
            "gemm_pct": shares.get(impl.key), "floor_us": floor.ms * 1e3, "pct_floor": 100.0 * floor.ms / gpu_ms,
            "tflops": floor.flops / gpu_ms / 1e9, "baseline": baseline if baseline in gpu_of else None,
            "x_transformers": gpu_of[baseline] / gpu_ms if baseline in gpu_of else None,
            "rel_err": err, "tolerance": TOLERANCES[impl.quant], "ok": err <= TOLERANCES[impl.quant],
            "first_call_s": first_s, "experts_hit": hit, "input_sets": len(inputs), "alloc_retries": retries})
    return records


def alloc_retries(device: torch.device) -> int:
    """How often torch's caching allocator has found no free block for a request on `device` so far and
    retried after releasing its cached blocks (a device sync, the host waiting for the GPU); 0 on a CPU."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


HEADERS = ["shape", "T", "quant", "impl", "runs", "GPU us", "spread %", "host us", "host %", "GEMM %", "floor us",
           "% floor", "TFLOP/s", "x tf", "rel err", "check"]


def table_rows(records: Sequence[dict]) -> list[list[str]]:
    return [[r["shape"], r["T"], r["quant"], r["impl"], r["runs"], fmt(r["gpu_us"]), fmt(r["spread_pct"], ".0f"),
             fmt(r["host_us"]), fmt(r["host_pct"], ".0f"), fmt(r["gemm_pct"], ".0f"), fmt(r["floor_us"]),
             fmt(r["pct_floor"], ".0f"), fmt(r["tflops"]), fmt(r["x_transformers"], ".2f"), f"{r['rel_err']:.1e}",
             "ok" if r["ok"] else "FAIL"]
            for r in records]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def write_plot(records: Sequence[dict], path: Path) -> str:
    """moe.png: x tf against T, one panel per shape, one line per epmoe implementation and precision."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib is not installed: no plot"
    if all(r["x_transformers"] is None for r in records):
        return "no ratio to transformers measured: no plot"
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    cols = min(2, len(shapes))
    rows = -(-len(shapes) // cols)
    fig = Figure(figsize=(6.5 * cols, 4.5 * rows))
    for i, name in enumerate(shapes):
        ax = fig.add_subplot(rows, cols, i + 1)
        mine = [r for r in records if r["shape"] == name and r["x_transformers"] is not None
                and not r["impl"].startswith(BASELINE)]
        for series in dict.fromkeys((r["impl"], r["quant"]) for r in mine):
            pts = sorted((r["T"], r["x_transformers"]) for r in mine if (r["impl"], r["quant"]) == series)
            ax.plot([t for t, _ in pts], [x for _, x in pts], marker="o", label=" ".join(series))
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        shape = SHAPES.get(name)
        sizes = "" if shape is None else (f" (D {shape.hidden_size}, E {shape.num_experts}, K {shape.top_k}, "
                                          f"F {shape.intermediate_size})")
        ax.set_title(name + sizes, fontsize=10)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(f"{BASELINE} GPU time / GPU time")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def run(shapes: Sequence[MoEShape], tokens: Sequence[int], quants: Sequence[str], repeats: int, seed: int,
        out: str | None, device: torch.device) -> int:
    """The whole sweep; prints the table, writes the files into `out`; 1 if any check failed, else 0."""
    t_start = time.perf_counter()
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    records: list[dict] = []
    ref_name = "-"
    ceilings = device_ceilings(device) if device.type == "cuda" else H200
    if hf_peer.transformers_version() is None:
        skipped["transformers"] = "not installed: no transformers rows, no ratios; checked against epmoe's reference"
    with torch.inference_mode():
        for shape in shapes:
            weights = make_weights(shape, "fp8_block" in quants, seed, device)
            modules = peer_modules(shape, weights, skipped)
            ref_name, reference = reference_fn(shape, modules, weights, device)
            gen = torch.Generator(device).manual_seed(seed + 1)
            for T in tokens:
                t0 = time.perf_counter()
                inputs = [make_inputs(shape, T, gen, device) for _ in range(input_sets(T, shape.hidden_size))]
                impls = [i for i in peer_impls(modules, T) if i.quant in quants or i.key == f"{BASELINE} bf16"]
                for quant in quants:
                    impls += epmoe_impls(shape, T, quant, weights, device, skipped)
                impls = [i for i in impls if i.key not in failed]
                records += bench_point(shape, T, impls, reference, inputs, repeats, device, failed, ceilings)
                print(f"# {shape.name} T={T}: {time.perf_counter() - t0:.1f}s", flush=True)
                del impls, inputs
                gc.collect()
            del weights, modules, reference
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    skipped.update(failed)
    rows = table_rows(records)
    print(format_table(HEADERS, rows))
    print(f"GPU us: median of {repeats} back-to-back calls; host us: time to queue one; GEMM %: kernels named "
          f"with {'/'.join(GEMM_KERNEL_PATTERNS)}; floor at {ceilings.bf16_tflops:g} (fp8 {ceilings.fp8_tflops:g}) "
          f"TFLOP/s and {ceilings.copy_tbps:g} TB/s ({ceilings.source}); rel err vs {ref_name}")
    baselines = dict.fromkeys((r["quant"], r["baseline"]) for r in records if r["baseline"] is not None)
    print("x tf: the baseline's GPU time / GPU time; " + "; ".join(f"{q} rows against {b}" for q, b in baselines))
    retried = dict.fromkeys(f"{r['shape']} T={r['T']} ({r['alloc_retries']})" for r in records if r["alloc_retries"])
    if retried:
        print("the allocator retried (released its cache: a device sync) during the timed calls at: "
              + ", ".join(retried))
    for key, reason in skipped.items():
        print(f"skipped: {key}: {reason}")
    fails = sum(not r["ok"] for r in records)
    seconds = time.perf_counter() - t_start
    print(f"# total {seconds:.0f}s; {len(records)} rows, {fails} over tolerance")
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        result = {"bench": "moe", "device": device_name(device),
                  "torch": torch.__version__, "triton": triton.__version__,
                  "transformers": hf_peer.transformers_version(), "gemm_table": str(configs.table_path()),
                  "repeats": repeats, "seed": seed,
                  "peaks": asdict(ceilings),
                  "gemm_kernel_patterns": list(GEMM_KERNEL_PATTERNS), "skipped": skipped, "seconds": seconds,
                  "points": records}
        (folder / "moe.json").write_text(json.dumps(result, indent=1) + "\n")
        (folder / "moe.md").write_text(markdown_table(HEADERS, rows))
        print(write_plot(records, folder / "moe.png"))
    return 1 if fails else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="epmoe bench moe", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="tokens T per call to sweep")
    p.add_argument("--quant", nargs="+", default=list(QUANTS), choices=list(QUANTS))
    p.add_argument("--repeats", type=int, default=10, help="timed back-to-back calls per point (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for moe.json, moe.md and moe.png")
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if not torch.cuda.is_available():
        print("epmoe bench moe: needs a CUDA GPU (it times GPU kernels), and none is visible here", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    return run([SHAPES[n] for n in args.shapes], args.tokens, args.quant, args.repeats, args.seed, args.out, device)


if __name__ == "__main__":
    sys.exit(main())
