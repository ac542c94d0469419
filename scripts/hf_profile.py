"""Where a transformers model's step time goes with each experts backend, on one GPU: the numbers behind
`epmoe generate --bench`'s whole-model ratios.

    python3 scripts/hf_profile.py [--preset qwen3-30b-a3b] [--layers 4] [--prefill 4096] [--decode 256]
                                  [--backends grouped_mm epmoe] [--out DIR]

For each preset, backend and step (a prefill of --prefill tokens; a decode-sized step of --decode single
tokens continuing a one-token cache, as `epmoe.hf.bench` runs them), prints:
- step: GPU time (CUDA events), the host's time to queue it (no sync inside), and the host time spent in
  the experts calls (forward hooks);
- the routing the model's own router made (per MoE layer: the most tokens on one expert, experts used);
- the experts calls replayed alone on the inputs the model gave them (20 back-to-back calls each, CUDA
  events): GPU time per layer, to tell the routing's effect from the model's;
- syncs: the host-synchronizing operations of one step (`torch.cuda.set_sync_debug_mode`), with where;
- a torch.profiler table of one step's kernels and host operations; the GPU's busy share of the step.
Writes hf_profile.json (and the chrome traces of --trace-backends' profiled steps) into --out.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings
from pathlib import Path

import torch

import epmoe.hf  # noqa: F401  (registers the "epmoe" experts backend)
from epmoe.hf.bench import _cache_kwarg, _Clock, experts_alone_ms
from epmoe.hf.parallel import experts_modules
from epmoe.hf.presets import build, preset_config
from epmoe.timing import sync


class _Calls:
    """Forward hooks on every experts module: the host time of each call, and (when `keep`) its inputs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.host_s, self.inputs, self.keep, self._t0 = 0.0, [], False, 0.0
        self.handles = []
        for _, module in experts_modules(model):
            self.handles.append(module.register_forward_pre_hook(self._pre))
            self.handles.append(module.register_forward_hook(self._post))

    def _pre(self, module, args) -> None:
        if self.keep:
            self.inputs.append((module, tuple(a.clone() for a in args)))
        self._t0 = time.perf_counter()

    def _post(self, module, args, out) -> None:
        self.host_s += time.perf_counter() - self._t0


def _gpu_busy_us(prof) -> float:
    """Length of the union of the profiled kernels' intervals (µs)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def _syncs(step) -> list[str]:
    """The distinct Python stacks at which one run of `step` synchronized the host with the GPU."""
    seen: dict[str, int] = {}
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=9)[:-2])
        seen[stack] = seen.get(stack, 0) + 1

    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return [f"{n}x\n{stack}" for stack, n in seen.items()]


def profile_step(model: torch.nn.Module, name: str, step, calls: _Calls, clock: _Clock, out: Path | None, tag: str,
                 trace: bool) -> dict:
    for _ in range(3):
        step()
    sync(clock.device)
    calls.host_s = 0.0
    t0 = time.perf_counter()
    start = clock.mark()
    step()
    end = clock.mark()
    host_ms = (time.perf_counter() - t0) * 1e3
    sync(clock.device)
    gpu_ms = clock.ms(start, end)
    experts_host_ms = calls.host_s * 1e3
    calls.keep, calls.inputs = True, []
    step()
    sync(clock.device)
    calls.keep = False
    routing = []
    for module, (x, ids, w) in calls.inputs:
        counts = torch.bincount(ids.flatten().clamp_min(0), minlength=module.num_experts)
        routing.append(dict(max_tokens_on_one_expert=int(counts.max()), experts_used=int((counts > 0).sum())))
    calls.inputs = []
    alone = [ms * 1e3 for ms in experts_alone_ms(model, step, clock.device)]
    syncs = _syncs(step) if clock.cuda else []
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if clock.cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync(clock.device)
    busy_ms = _gpu_busy_us(prof) / 1e3
    if out is not None and trace:
        prof.export_chrome_trace(str(out / f"trace-{tag}.json"))
    print(f"\n=== {tag}: device {gpu_ms:.2f} ms, host queueing {host_ms:.2f} ms (experts calls {experts_host_ms:.2f} ms), "
          f"GPU busy {busy_ms:.2f} ms in the profiled step")
    print("routing (per MoE layer):", routing)
    print("experts calls alone, device us per layer:", [round(u, 1) for u in alone], f"sum {sum(alone) / 1e3:.2f} ms")
    print(f"host syncs in one step: {len(syncs)} distinct places")
    for s in syncs[:6]:
        print(s)
    if clock.cuda:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
    return dict(step=name, gpu_ms=gpu_ms, host_ms=host_ms, experts_host_ms=experts_host_ms, busy_ms=busy_ms,
                routing=routing, experts_alone_us=alone, syncs=syncs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--backends", nargs="+", default=["grouped_mm", "epmoe"])
    p.add_argument("--trace-backends", nargs="*", default=["epmoe"], help="backends whose steps' chrome traces "
                   "are written into --out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    clock = _Clock(dev)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    results = []
    for preset in args.preset:
        model = build(preset_config(preset, args.layers), dtype=torch.bfloat16, device=dev, seed=0)
        vocab = model.config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(0)
        prefill_ids = torch.randint(vocab, (1, args.prefill), generator=g).to(dev)
        decode_ids = torch.randint(vocab, (args.decode, 1), generator=g).to(dev)
        cache_name = _cache_kwarg(model)
        calls = _Calls(model)
        with torch.no_grad():
            for backend in args.backends:
                model.set_experts_implementation(backend)
                cache = getattr(model(decode_ids, use_cache=True), cache_name)
                steps = {"prefill": lambda m=model: m(prefill_ids, use_cache=False, logits_to_keep=1),
                         "decode": lambda m=model, c=cache: (m(decode_ids, use_cache=True, **{cache_name: c}),
                                                             c.crop(-1))}
                for name, step in steps.items():
                    r = profile_step(model, name, step, calls, clock, out, f"{preset}-{backend}-{name}",
                                     trace=backend in args.trace_backends)
                    results.append(dict(preset=preset, backend=backend, **r))
        del model, calls
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if out is not None:
        (out / "hf_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
