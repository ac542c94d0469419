"""Where the host time of one `local` MoE block call goes, on one GPU.

    python3 scripts/host_profile.py [--shape qwen3-30b-a3b] [--tokens 1] [--quant bf16] [--calls 200] [--top 30]
    python3 scripts/host_profile.py --compare [--shape ...] [--tokens 256 1024] [--quant bf16 fp8_block]

Default: cProfile of a replayed call, function by function. The calls run back to back in batches of
50, with a sync after each batch outside the time (so that the host never waits for the GPU inside
it): the time and the profile are the host's alone.

--compare: the host time of a call under the conditions that differ between this script and `epmoe
bench moe`, per T and quant: batches of 50 (mean); `bench moe`'s timing (`time_calls`: the median of
--repeats calls after a sync, cycling its input sets, a CUDA event after each call) and the host time of
each of its first calls; the same through transformers' experts backend (`experts_implementation=
"epmoe"` on the family's experts module); the replay's parts alone (output allocation, table copy,
graph launch) over 50 calls each; the CUDA runtime calls' host time per call (torch.profiler).
"""
from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import time

import torch

from epmoe.bench.moe import SHAPES, input_sets, layer_config, make_inputs, make_weights, time_calls
from epmoe.layer import FusedMoE


def build(shape, quant: str, T: int, weights, dev: torch.device, experts: str = "triton") -> FusedMoE:
    moe = FusedMoE(layer_config(shape, quant, max(T, 1)), None, dispatcher="local", experts=experts, device=dev)
    if quant == "bf16":
        moe.load_experts(weights.w13_END, weights.w2_EDF)
    else:
        q13, s13, q2, s2 = weights.fp8
        moe.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
    return moe


def batched_us(call, n: int) -> float:
    """Host µs per call over n calls queued in batches of 50, a sync after each batch (outside the time)."""
    queued = 0.0
    for lo in range(0, n, 50):
        t0 = time.perf_counter()
        for _ in range(min(50, n - lo)):
            call()
        queued += time.perf_counter() - t0
        torch.cuda.synchronize()
    return queued / n * 1e6


def first_calls_us(call, n: int) -> list[float]:
    """Host µs of each of n calls queued right after a sync, a CUDA event recorded after each."""
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.Event().record()
    torch.cuda.synchronize()
    return out


def api_us(call, n: int) -> dict[str, float]:
    """Host µs per call of each CUDA runtime / driver call (torch.profiler, CPU side) over n calls."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        if ev.key.startswith("cu") and ev.count:
            rows[ev.key] = (ev.cpu_time_total / n, ev.count / n)
    return rows


def compare(args, dev: torch.device) -> None:
    import epmoe.hf  # noqa: F401  (registers the backend)
    from epmoe.bench import hf_peer

    shape = SHAPES[args.shape]
    for quant in args.quant:
        weights = make_weights(shape, quant == "fp8_block", 0, dev)
        for T in args.tokens:
            moe = build(shape, quant, T, weights, dev)
            gen = torch.Generator(dev).manual_seed(1)
            inputs = [make_inputs(shape, T, gen, dev) for _ in range(input_sets(T, shape.hidden_size))]
            inp = inputs[0]

            def one():
                return moe(inp.x_TD, weights_TK=inp.weights_TK, ids_TK=inp.ids_TK)

            sets = itertools.cycle(inputs)

            def cycled():
                x = next(sets)
                return moe(x.x_TD, weights_TK=x.weights_TK, ids_TK=x.ids_TK)

            for _ in range(5):
                one()
            torch.cuda.synchronize()
            gpu_ms, host_ms, _ = time_calls(lambda x: moe(x.x_TD, weights_TK=x.weights_TK, ids_TK=x.ids_TK),
                                         inputs, args.repeats, dev)
            print(f"\n## {shape.name} T={T} {quant}: GPU {gpu_ms * 1e3:.0f} us a call")
            print(f"batched, one input set   {batched_us(one, 200):7.1f} us")
            print(f"batched, input sets      {batched_us(cycled, 200):7.1f} us")
            print(f"bench time_calls median  {host_ms * 1e3:7.1f} us ({args.repeats} calls)")
            for _ in range(3):
                print(f"first calls after a sync {' '.join(f'{v:.0f}' for v in first_calls_us(cycled, 12))}")
            if quant == "bf16":
                module = hf_peer.experts_module(shape, "epmoe", weights.w13_END, weights.w2_EDF)

                def hf():
                    return module(inp.x_TD, inp.ids_TK, inp.weights_TK)

                with torch.no_grad():
                    for _ in range(5):
                        hf()
                    print(f"hf backend, batched      {batched_us(hf, 200):7.1f} us")
                    print(f"hf backend, first calls  {' '.join(f'{v:.0f}' for v in first_calls_us(hf, 12))}")
            # the replay's parts alone
            g = moe.graphs
            key = (g.bucket(T), inp.ids_TK.dtype, inp.weights_TK.dtype)
            cap = g._graphs[key]
            out = torch.empty(T, shape.hidden_size, dtype=torch.bfloat16, device=dev)
            parts = {
                "torch.empty":   lambda: torch.empty(T, shape.hidden_size, dtype=torch.bfloat16, device=dev),
                "io.point":      lambda: cap.static.io.point(inp.x_TD, inp.ids_TK, inp.weights_TK, out),
                "graph.replay":  cap.graph.replay,
                "check_tokens+": lambda: moe._check_inputs(inp.x_TD, None, inp.weights_TK, inp.ids_TK, None),
                "takes":         lambda: g.takes(inp.x_TD),
                "errors":        lambda: moe.dispatcher.check_device_errors(wait=False),
            }
            for name, fn in parts.items():
                print(f"part {name:14s}      {batched_us(fn, 100):7.1f} us")
            for name, (us, count) in sorted(api_us(cycled, 20).items(), key=lambda kv: -kv[1][0]):
                print(f"api {name:32s} {us:7.1f} us a call ({count:.1f} per call)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--quant", nargs="+", default=["bf16"], choices=["bf16", "fp8_block"])
    p.add_argument("--experts", default="triton")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--compare", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.compare:
        compare(args, dev)
        return
    shape = SHAPES[args.shape]
    T, quant = args.tokens[0], args.quant[0]
    moe = build(shape, quant, T, make_weights(shape, quant == "fp8_block", 0, dev), dev, args.experts)
    x = torch.randn(T, shape.hidden_size, device=dev).to(torch.bfloat16)
    w, ids = torch.topk(torch.randn(T, shape.num_experts, device=dev).softmax(-1), shape.top_k, dim=-1)
    w = w.to(torch.bfloat16)

    def call():
        return moe(x, weights_TK=w, ids_TK=ids)

    batched_us(call, 20)
    host = batched_us(call, args.calls)
    print(f"{args.shape} T={T} {quant} experts={args.experts}: {host:.1f} us of host time per call")
    prof = cProfile.Profile()
    prof.enable()
    batched_us(call, args.calls)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
