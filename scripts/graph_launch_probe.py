"""What a CUDA graph replay costs the host, by the graph's make-up, and what a `local` layer's graph holds.

    python3 scripts/graph_launch_probe.py [--shape qwen3-30b-a3b] [--tokens 256 1024] [--quant fp8_block] [--out DIR]

1. Synthetic straight-line graphs of N small kernels (torch's in-place add, or a one-program Triton
   kernel; N in 1..16), with or without a ~100 µs spin kernel first (a GPU that is behind the host):
   host µs of `graph.replay()` in batches of back-to-back replays (a sync after each batch of 50,
   outside the time), and the median of replays each queued once the GPU finished the one before.
2. The layer's graph at each --tokens (`FusedMoE(cfg, None, dispatcher="local", experts="triton")`):
   the host µs of its table write and launch alone and of a whole call under the same two conditions, the kernels of
   one replay with their GPU µs (torch.profiler), and its nodes and edges (its DOT dump, written into
   --out).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import re
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import epmoe.graphs
from epmoe.bench.moe import SHAPES, make_inputs, make_weights

from host_profile import batched_us, build


def after_idle_us(call, n: int) -> float:
    """Median host µs of n calls, each queued once the call before has run (an event waited on first)."""
    times = []
    for _ in range(n):
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[n // 2]


@triton.jit
def _add_one(p):
    tl.store(p, tl.load(p) + 1)


def synthetic(dev: torch.device) -> None:
    print("## synthetic straight-line graphs: host µs of replay()")
    print("kernels  nodes  GPU-busy µs  batched  after-idle")
    t = torch.zeros(1, device=dev)
    for kind, n, spin in itertools.product(("torch", "triton"), (1, 4, 8, 16), (0, 200_000)):
        # spin: clock cycles of a spin kernel first (about 100 µs)

        def body():
            if spin:
                torch.cuda._sleep(spin)
            for _ in range(n):
                if kind == "torch":
                    t.add_(1)
                else:
                    _add_one[(1, )](t)

        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            body()
        torch.cuda.current_stream(dev).wait_stream(s)
        with torch.cuda.graph(g):
            body()
        for _ in range(5):
            g.replay()
        print(f"{kind:7s}  {n + bool(spin):5d}  {'~100' if spin else '0':>11s}  {batched_us(g.replay, 300):7.1f}  "
              f"{after_idle_us(g.replay, 100):9.1f}")


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph that keeps its cudaGraph_t after instantiating it, for the DOT dump."""

    def __new__(cls, keep_graph: bool = False):
        return super().__new__(cls, keep_graph=True)

    def __init__(self, keep_graph: bool = False) -> None:
        try:
            super().__init__(keep_graph=True)  # torch versions whose binding takes it at __init__
        except TypeError:
            super().__init__()

    def capture_end(self) -> None:
        super().capture_end()
        try:
            self.instantiate()
        except RuntimeError as e:  # keep_graph did not take: no DOT dump then
            print("no DOT dump:", e)


def graph_nodes(dot: str) -> tuple[collections.Counter, int]:
    """(count of each node label, edges) of a CUDA graph DOT dump."""
    kinds = collections.Counter()
    for m in re.finditer(r'label="([^"]*)"', dot):
        label = m.group(1)
        if re.fullmatch(r"graph_\d+", label):
            continue  # the graph's own label
        name = re.search(r"(_[A-Za-z0-9_]*kernel[A-Za-z0-9_]*|void [A-Za-z0-9_:<>]+|MEMSET|MEMCPY|HOST|EMPTY)", label)
        kinds[name.group(1)[:60] if name else label.split("\\n")[0][:60]] += 1
    return kinds, dot.count("->")


def layer(args, dev: torch.device, out: Path) -> None:
    shape = SHAPES[args.shape]
    epmoe.graphs.torch.cuda.CUDAGraph = _DebugGraph  # the module's own name for the class
    for quant in args.quant:
        weights = make_weights(shape, quant == "fp8_block", 0, dev)
        for T in args.tokens:
            moe = build(shape, quant, T, weights, dev)
            inp = make_inputs(shape, T, torch.Generator(dev).manual_seed(1), dev)

            def call():
                return moe(inp.x_TD, weights_TK=inp.weights_TK, ids_TK=inp.ids_TK)

            for _ in range(5):
                call()
            torch.cuda.synchronize()
            (captured, ) = moe.graphs._graphs.values()
            g, io = captured.graph, captured.static.io
            out_TD = torch.empty_like(inp.x_TD)

            def launch():  # the table pointed at this call's tensors (every replay must follow a point)
                io.point(inp.x_TD, inp.ids_TK, inp.weights_TK, out_TD)
                g.replay()

            print(f"\n## {shape.name} T={T} {quant}")
            print(f"table write + launch: batched {batched_us(launch, 300):.1f} µs, after idle "
                  f"{after_idle_us(launch, 100):.1f}")
            print(f"whole call:   batched {batched_us(call, 300):.1f} µs, after idle {after_idle_us(call, 100):.1f}")
            from torch.profiler import ProfilerActivity, profile
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                launch()
                torch.cuda.synchronize()
            print("one replay's GPU work:", [(e.name[:50], round(e.device_time, 1)) for e in prof.events()
                                             if e.device_type == torch.autograd.DeviceType.CUDA])
            path = out / f"graph_{shape.name}_{T}_{quant}.dot"
            g.debug_dump(str(path))
            if path.exists():
                kinds, edges = graph_nodes(path.read_text())
                print(f"{sum(kinds.values())} nodes, {edges} edges")
                for k, c in kinds.most_common():
                    print(f"  {c:3d}  {k}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--quant", nargs="+", default=["fp8_block"], choices=["bf16", "fp8_block"])
    p.add_argument("--out", default=".")
    args = p.parse_args()
    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        synthetic(dev)
        layer(args, dev, out)


if __name__ == "__main__":
    main()
