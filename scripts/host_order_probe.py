"""Whether `epmoe bench moe`'s host time at a point follows the code or the place in its list of implementations.

    python3 scripts/host_order_probe.py [--shape mixtral-8x7b] [--tokens 16384] [--order auto,triton,grouped_mm]

Builds the point's implementations as bench moe does (transformers' bf16 grouped_mm, then epmoe's in
--order, bf16 and fp8_block), times them with its `time_in_turns` (--repeats), and prints per
implementation the GPU and host medians and the host times' quartiles (each call timed again around
it), then what torch's caching allocator did during the timed calls (device allocations, frees,
retries). Run it twice with the order swapped: the same code in another place of the list.

--parts KEY[,KEY]: for those epmoe implementations (e.g. "epmoe triton fp8_block"), the medians of the
replayed call's parts over the timed calls too (the replay's whole host side, its table write and its
graph launch, and the input checks and `takes` where the call takes FusedMoE.forward's general path; the
rest of `replay_checked` is the output's allocation). The
wrappers that time the parts add their own cost to those implementations' host times.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Callable

import torch

from epmoe.bench import moe


def instrument(layer) -> tuple[dict[str, list[float]], Callable[[], None]]:
    """Time the host parts of the layer's replayed calls from now on: ({part: µs of each call}, a function
    that takes the timing wrappers off again)."""
    parts = collections.defaultdict(list)
    wrapped = []

    def wrap(obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = f(*a, **k)
            parts[label].append((time.perf_counter() - t0) * 1e6)
            return out

        setattr(obj, name, timed)  # an instance attribute over the class's method
        wrapped.append((obj, name))

    def undo() -> None:
        for obj, name in wrapped:
            delattr(obj, name)

    wrap(layer, "_check_inputs", "checks")
    wrap(layer.graphs, "takes", "takes")
    wrap(layer.graphs, "replay_checked", "replay_checked")
    for captured in layer.graphs._graphs.values():
        wrap(captured.static.io, "point", "point")
        wrap(captured.graph, "replay", "graph.replay")
    return parts, undo


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="mixtral-8x7b", choices=sorted(moe.SHAPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--order", default="auto,triton,grouped_mm")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--parts", default="")
    args = p.parse_args()
    dev = torch.device("cuda")
    moe.EPMOE_EXPERTS = tuple(args.order.split(","))
    shape, T = moe.SHAPES[args.shape], args.tokens
    with torch.inference_mode():
        weights = moe.make_weights(shape, True, 0, dev)
        modules = moe.peer_modules(shape, weights, {})
        gen = torch.Generator(dev).manual_seed(1)
        inputs = [moe.make_inputs(shape, T, gen, dev) for _ in range(moe.input_sets(T, shape.hidden_size))]
        impls = [i for i in moe.peer_impls(modules, T) if i.key == f"{moe.BASELINE} bf16"]
        for quant in ("bf16", "fp8_block"):
            impls += moe.epmoe_impls(shape, T, quant, weights, dev, {})
        for impl in impls:
            impl.run(inputs[0])
        torch.cuda.synchronize()
        host = {impl.key: [] for impl in impls}
        parts = {impl.key: instrument(impl.run.__defaults__[0])[0] for impl in impls
                 if impl.key in args.parts.split(",")}  # (epmoe's runs: `lambda inp, moe=moe: ...`)

        def timed(impl):
            def run(inp):
                t0 = time.perf_counter()
                out = impl.run(inp)
                host[impl.key].append((time.perf_counter() - t0) * 1e3)
                return out
            return run

        before = torch.cuda.memory_stats(dev)
        times = moe.time_in_turns([timed(impl) for impl in impls], inputs, args.repeats, dev)
        after = torch.cuda.memory_stats(dev)
    for impl, t in zip(impls, times):
        q1, med, q3 = statistics.quantiles(host[impl.key], n=4)
        print(f"{impl.key:32s} GPU {t.gpu_ms * 1e3:9.1f} us  host {t.host_ms * 1e3:9.1f} us  host ms of every call: "
              f"min {min(host[impl.key]):.2f} q1 {q1:.2f} median {med:.2f} q3 {q3:.2f} max {max(host[impl.key]):.2f}")
    for key, timed_parts in parts.items():
        print(f"{key}: median µs of " + ", ".join(f"{name} {statistics.median(v):.1f}"
                                                  for name, v in timed_parts.items()))
    for key in ("num_device_alloc", "num_device_free", "num_alloc_retries"):
        print(f"allocator {key}: {after.get(key, 0) - before.get(key, 0)}")


if __name__ == "__main__":
    main()
