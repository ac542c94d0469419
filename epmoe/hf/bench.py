"""`epmoe generate --bench`: whole-model steps and the MoE layers' own time, epmoe against transformers.

For each preset (or the `--model` folder, unquantized) and precision, on every rank's own device:
- a prefill step: one forward of `--bench-prefill` tokens (one sequence, no cache, the last position's
  logits, as generation asks for);
- a decode-sized step: one forward of `--bench-decode` single tokens continuing a one-token cache (a decode
  call: the decode dispatcher under expert parallelism);
through transformers' `grouped_mm` experts (the model alone on the device) and through epmoe (one rank:
`experts_implementation="epmoe"`, the two taken in turn within each repeat; R ranks: grouped_mm first,
then the model made expert-parallel, each rank its own tokens).
fp8: the experts quantized per 128x128 block as an FP8 checkpoint loads them; transformers' fp8 grouped_mm
needs its hub kernel (reported unavailable when it cannot load), so the fp8 rows are also compared with the
bf16 grouped_mm of the same run. Attention and the dense layers are transformers' own in both.

Times: CUDA events (wall time on a CPU) around each step, the median of `--repeats` after `--warmup`; the
MoE time is the sum over the experts modules of events recorded by forward hooks around each experts call
(the experts' GEMMs and, under expert parallelism, dispatch and combine; the router is outside). In a
host-paced step those events also hold the host's queueing of the call. On one rank, the MoE time alone
is measured too: each experts call of one step, on the inputs the model gave it, repeated back to back
(`experts_alone_ms`), summed over the layers.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import time
from typing import Callable

import torch

from .._table import format_table
from ..launch import RankContext
from ..timing import sync
from .parallel import expert_parallel, experts_modules
from .run import DTYPES, RunSpec, preset_model


class _Clock:
    """Marks on a device's timeline: CUDA events on a GPU, host wall time on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


class _MoETime:
    """Marks around every experts call of a model (forward hooks), summed per step."""

    def __init__(self, model: torch.nn.Module, clock: _Clock) -> None:
        self.clock, self.marks = clock, []
        self.handles = []
        for _, module in experts_modules(model):
            self.handles.append(module.register_forward_pre_hook(lambda m, a: self.marks.append(self.clock.mark())))
            self.handles.append(module.register_forward_hook(lambda m, a, o: self.marks.append(self.clock.mark())))

    def take(self) -> float:
        """ms of the experts calls since the last take (after the device is synchronized)."""
        marks, self.marks = self.marks, []
        return sum(self.clock.ms(a, b) for a, b in zip(marks[::2], marks[1::2]))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The name the model's forward takes its cache by ("cache" in transformers 5.24, else "past_key_values")."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def experts_alone_ms(model: torch.nn.Module, step: Callable[[], object], device: torch.device,
                     repeats: int = 20) -> list[float]:
    """The ms each experts call of one run of `step` takes alone, in call order: the call repeated back to
    back `repeats` times on the inputs the model gave it (clones; after 3 untimed), the mean."""
    clock, calls = _Clock(device), []
    handles = [module.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((m, tuple(a.clone() for a in args),
                                              {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})),
        with_kwargs=True) for _, module in experts_modules(model)]
    try:
        with torch.no_grad():
            step()
    finally:
        for h in handles:
            h.remove()
    out = []
    with torch.no_grad():
        for module, args, kwargs in calls:
            for _ in range(3):
                module(*args, **kwargs)
            sync(device)
            start = clock.mark()
            for _ in range(repeats):
                module(*args, **kwargs)
            end = clock.mark()
            sync(device)
            out.append(clock.ms(start, end) / repeats)
    return out


def measure(model: torch.nn.Module, spec: RunSpec, device: torch.device,
            modes: dict[str, Callable[[], object]], alone: bool = False) -> dict[str, dict]:
    """{mode: {"prefill": {"step_ms", "moe_ms"[, "moe_alone_ms"]}, "decode": {...}}}: medians over
    spec.repeats after spec.warmup. Each repeat runs every mode's step in turn, set up by its callable
    (e.g. the model's experts implementation): the steps are paced by the host, whose speed drifts, and
    taking the modes in turn lets the drift fall on all of them alike. `alone`: also the sum of
    `experts_alone_ms` of one step (one rank only: under expert parallelism a call is a collective)."""
    clock = _Clock(device)
    moe = _MoETime(model, clock)
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(spec.seed)
    prefill_ids = torch.randint(vocab, (1, spec.bench_prefill), generator=g).to(device)
    decode_ids = torch.randint(vocab, (spec.bench_decode, 1), generator=g).to(device)
    cache_name = _cache_kwarg(model)
    results: dict[str, dict] = {mode: {} for mode in modes}
    with torch.no_grad():
        next(iter(modes.values()))()
        cache = getattr(model(decode_ids, use_cache=True), cache_name)  # one token per sequence
    steps = {"prefill": lambda: model(prefill_ids, use_cache=False, logits_to_keep=1),
             "decode": lambda: (model(decode_ids, use_cache=True, **{cache_name: cache}), cache.crop(-1))}
    try:
        with torch.no_grad():
            for name, step in steps.items():
                times = {mode: ([], []) for mode in modes}
                for i in range(spec.warmup + spec.repeats):
                    for mode, enter in modes.items():
                        enter()
                        sync(device)
                        moe.take()
                        start = clock.mark()
                        step()
                        end = clock.mark()
                        sync(device)
                        if i >= spec.warmup:
                            times[mode][0].append(clock.ms(start, end))
                            times[mode][1].append(moe.take())
                for mode, (step_ms, moe_ms) in times.items():
                    results[mode][name] = dict(step_ms=statistics.median(step_ms), moe_ms=statistics.median(moe_ms))
    finally:
        moe.close()
    for name, step in steps.items() if alone else ():  # (with the step's event hooks gone)
        for mode, enter in modes.items():
            enter()
            results[mode][name]["moe_alone_ms"] = sum(experts_alone_ms(model, step, device))
    return results


def grouped_mm_unavailable(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why transformers' grouped_mm experts cannot run the model here (its fp8 experts load a hub kernel,
    unreachable offline), or None: one token through the model with them."""
    model.set_experts_implementation("grouped_mm")
    try:
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    except Exception as e:
        return f"{type(e).__name__}: {e}".splitlines()[0][:160]
    return None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _bench_model(source: str, spec: RunSpec, quant: str, device: torch.device) -> torch.nn.Module:
    if spec.model is None:
        return preset_model(source, spec, quant, device)
    from transformers import AutoModelForCausalLM
    from .fp8 import quantize_experts
    model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=DTYPES[spec.dtype]).to(device).eval()
    return quantize_experts(model) if quant == "fp8" else model


def _ratios(base: dict | None, ours: dict) -> dict | None:
    """{step: {"step": base / ours, "moe": ..., "moe_alone": ... where both have it}}: the speed-up of epmoe
    over the baseline (None: no baseline)."""
    if base is None:
        return None
    return {step: {key: base[step][f"{key}_ms"] / ours[step][f"{key}_ms"]
                   for key in ("step", "moe", "moe_alone") if f"{key}_ms" in base[step] and f"{key}_ms" in ours[step]}
            for step in ("prefill", "decode")}


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def bench_rank(ctx: RankContext, spec: RunSpec) -> int:
    """The benchmark on one rank; rank 0 prints the table and writes generate_bench.json into spec.out."""
    device, world = ctx.device, ctx.world_size
    group = ctx.group if world > 1 else None
    records = []
    for source in (spec.presets or (spec.model,)):
        bf16_base = None
        for quant in spec.quants:
            model = _bench_model(source, spec, quant, device)
            record = dict(source=source, quant=quant, dtype=spec.dtype, world_size=world, rank=ctx.rank,
                          prefill_tokens=spec.bench_prefill, decode_batch=spec.bench_decode,
                          moe_layers=len(experts_modules(model)))
            # one rank: both implementations in one loop, in turn; R ranks: grouped_mm alone first (the
            # model whole), then the model made expert-parallel (for good)
            modes = {name: functools.partial(model.set_experts_implementation, name)
                     for name in ("grouped_mm", "epmoe")[:2 if group is None else 1]}
            why = grouped_mm_unavailable(model, device)
            if why is not None:
                record["grouped_mm_unavailable"] = why
                modes.pop("grouped_mm")
            got = measure(model, spec, device, modes, alone=group is None) if modes else {}
            if group is not None:
                expert_parallel(model, group, options=spec.options)
                got.update(measure(model, spec, device, {"epmoe": lambda: None}))
            record["grouped_mm"], record["epmoe"] = got.get("grouped_mm"), got["epmoe"]
            if quant == "none":
                bf16_base = record["grouped_mm"]
            record["speedup"] = _ratios(record.get("grouped_mm"), record["epmoe"])
            if quant == "fp8":
                record["speedup_vs_bf16_grouped_mm"] = _ratios(bf16_base, record["epmoe"])
            records.append(record)
            del model
            _free(device)
    rows = []
    for r in records:
        base, ours, up, up16 = r.get("grouped_mm"), r["epmoe"], r["speedup"], r.get("speedup_vs_bf16_grouped_mm")
        for step, size in (("prefill", r["prefill_tokens"]), ("decode", r["decode_batch"])):
            rows.append([r["source"], r["quant"], f"{step} {size}",
                         _cell(base and base[step]["step_ms"], ".2f"), f"{ours[step]['step_ms']:.2f}",
                         _cell(up and up[step]["step"], ".2f"),
                         _cell(base and base[step]["moe_ms"], ".2f"), f"{ours[step]['moe_ms']:.2f}",
                         _cell(up and up[step]["moe"], ".2f"), _cell(up and up[step].get("moe_alone"), ".2f"),
                         _cell(up16 and up16[step]["step"], ".2f"), _cell(up16 and up16[step]["moe"], ".2f"),
                         _cell(up16 and up16[step].get("moe_alone"), ".2f")])
    if ctx.rank == 0:
        print(f"epmoe against transformers' grouped_mm experts: {world} rank(s), {spec.dtype}, ms per step (median of "
              f"{spec.repeats} after {spec.warmup}); x = grouped_mm / epmoe; moe = the experts calls in the step (CUDA "
              "events around each, summed over the layers); alone = the same calls repeated back to back on their "
              "inputs (one rank); x bf16 = fp8 epmoe against bf16 grouped_mm", flush=True)
        print(format_table(["model", "quant", "step", "grouped_mm", "epmoe", "x", "moe grouped_mm", "moe epmoe",
                            "moe x", "alone x", "x bf16", "moe x bf16", "alone x bf16"], rows), flush=True)
        for r in records:
            if "grouped_mm_unavailable" in r:
                print(f"{r['source']} {r['quant']}: transformers' grouped_mm unavailable: {r['grouped_mm_unavailable']}",
                      flush=True)
    if spec.out and ctx.rank == 0:
        os.makedirs(spec.out, exist_ok=True)
        with open(os.path.join(spec.out, "generate_bench.json"), "w") as f:
            json.dump(records, f, indent=1)
    return 0
