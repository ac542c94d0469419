"""Whether a replayed call's host time follows how long the GPU makes the host wait between calls.

    python3 scripts/host_wait_probe.py [--shape qwen3-30b-a3b] [--tokens 256] [--quant fp8_block]

`epmoe bench moe` measured the same replayed call (epmoe's `local` layer, one CUDA graph) at 47 µs of
host time with one token and 87-212 µs at points whose calls keep the GPU busy for 0.3-5 ms. This probe
times one layer's calls (bench moe's layer and inputs, auto experts) queued as bench moe queues them: the
host at most `QUEUED_CALLS` (bench moe's) calls ahead, waiting for the end of the call that many back
before queueing the next (outside the timed call). Conditions, each over --calls timed calls:
- extra µs: a spin kernel (torch.cuda._sleep) queued before every call, outside its host time, making
  the GPU's work per call that much longer (so the host waits that much longer between calls);
- wait: `sync` (CUDA event synchronize, as bench moe) or `poll` (a Python loop on the event's query);
- gc: Python's garbage collector on or off during the timed calls.
Prints per condition the host time's median and quartiles, and the medians of the call's parts that ran
(the table write, the graph launch and the whole replay; the input checks and `takes` only where the
call takes FusedMoE.forward's general path; the wrappers timing them add their own cost).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_order_probe import instrument  # noqa: E402

from epmoe.bench import moe  # noqa: E402

def sleep_cycles_per_us() -> float:
    """The GPU clock cycles a torch.cuda._sleep spins per µs."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return 10_000_000 / (a.elapsed_time(b) * 1e3)


def run_condition(call, extra_cycles: int, wait: str, gc_on: bool, calls: int) -> list[float]:
    """Host µs of each of `calls` timed calls (after 20 untimed)."""
    marks: list[torch.cuda.Event] = []
    host: list[float] = []
    if not gc_on:
        gc.disable()
    try:
        for c in range(20 + calls):
            if c >= moe.QUEUED_CALLS:
                ev = marks[c - moe.QUEUED_CALLS]
                if wait == "sync":
                    ev.synchronize()
                else:
                    while not ev.query():
                        pass
            if extra_cycles:
                torch.cuda._sleep(extra_cycles)
            t0 = time.perf_counter()
            call()
            if c >= 20:
                host.append((time.perf_counter() - t0) * 1e6)
            marks.append(torch.cuda.Event())
            marks[-1].record()
        torch.cuda.synchronize()
    finally:
        gc.enable()
    return host


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(moe.SHAPES))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--quant", default="fp8_block", choices=["bf16", "fp8_block"])
    p.add_argument("--extra-us", type=float, nargs="+", default=[0, 250, 1000, 5000])
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    dev = torch.device("cuda")
    shape, T = moe.SHAPES[args.shape], args.tokens
    moe.EPMOE_EXPERTS = ("auto", )
    with torch.inference_mode():
        weights = moe.make_weights(shape, args.quant == "fp8_block", 0, dev)
        (impl, ) = moe.epmoe_impls(shape, T, args.quant, weights, dev, {})
        inp = moe.make_inputs(shape, T, torch.Generator(dev).manual_seed(1), dev)
        layer = impl.run.__defaults__[0]

        def call():
            return impl.run(inp)

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        cycles_per_us = sleep_cycles_per_us()
        print(f"{shape.name} T={T} {args.quant}; GPU clock {cycles_per_us:.0f} cycles per µs of _sleep")
        for extra, wait, gc_on in itertools.product(args.extra_us, ("sync", "poll"), (True, False)):
            parts, undo = instrument(layer)
            host = run_condition(call, int(extra * cycles_per_us), wait, gc_on, args.calls)
            undo()
            q1, med, q3 = statistics.quantiles(host, n=4)
            split = ", ".join(f"{k} {statistics.median(v[-args.calls:]):.1f}" for k, v in parts.items())
            print(f"extra {extra:6.0f} µs  wait {wait}  gc {'on ' if gc_on else 'off'}  host µs median {med:6.1f} "
                  f"(q1 {q1:6.1f}, q3 {q3:6.1f})  parts: {split}")


if __name__ == "__main__":
    main()
