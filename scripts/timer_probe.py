"""Does a timer measure the GPU or the host's pace? The whole expert MLP of `epmoe bench experts` (exactly t
rows per expert, x pre-quantized for fp8) timed three ways, with the host's time to queue one call.

    python3 scripts/timer_probe.py qwen3-30b:128 dsv2-lite:128 qwen3-30b:1024 dsv3-256:128

Columns: triton.testing.do_bench (median, L2 flushed before each call: what the bench used before
epmoe.timing.flushed_ms), flushed_ms (the same calls queued behind a GPU spin), gpu_us (back-to-back
calls behind a spin, L2 not flushed), the host's µs per call (`host_us`: 20 calls queued behind a spin), and TFLOP/s by gpu_us and by do_bench. Where do_bench reads well above flushed_ms, the host
paced it. Shapes: epmoe.bench.experts.SHAPES.
"""
from __future__ import annotations

import sys

import torch
import triton.testing

from epmoe.bench.experts import SHAPES, random_weights, uniform_rows
from epmoe.kernels.grouped_gemm import down, gate_up
from epmoe.kernels.quant import quantize_act
from epmoe.quant import quantize_weights_ref
from epmoe.timing import flushed_ms, gpu_us, host_us


def main(points: list[str]) -> None:
    dev = torch.device("cuda")
    print(f"{'shape':>12} {'t':>5} {'prec':>5} {'do_bench us':>11} {'flushed us':>10} {'gpu us':>8} {'host us':>8} "
          f"{'gpu TF':>7} {'db TF':>7}")
    weights: dict = {}
    for point in points:
        name, t = point.split(":")
        t = int(t)
        D, F, L_all = SHAPES[name]
        L = min(L_all, 131072 // t)
        if name not in weights:  # one shape's weights at a time
            weights.clear()
            w13, w2 = random_weights(L_all, D, F, dev)
            weights[name] = (w13, w2, *quantize_weights_ref(w13), *quantize_weights_ref(w2))
        w13, w2, q13, s13, q2, s2 = (w[:L] for w in weights[name])
        rows, _ = uniform_rows(L, t, dev)
        x = torch.randn(L * t, D, dtype=torch.bfloat16, device=dev)
        xq, xs = quantize_act(x)

        def bf16():
            return down(gate_up(x, w13, rows)[0], w2, rows)

        def fp8():
            h, hs = gate_up(xq, q13, rows, x_scale_RG=xs, w13_scale=s13)
            return down(h, q2, rows, h_scale_RG=hs, w2_scale=s2, out_dtype=torch.bfloat16)

        flops = 6.0 * L * t * D * F
        for prec, fn in (("bf16", bf16), ("fp8", fp8)):
            db = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3
            fl = flushed_ms(fn, 20) * 1e3
            g = gpu_us(fn, 20)
            print(f"{name:>12} {t:>5} {prec:>5} {db:>11.1f} {fl:>10.1f} {g:>8.1f} {host_us(fn):>8.1f} "
                  f"{flops / g / 1e6:>7.0f} {flops / db / 1e6:>7.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b:128", "dsv2-lite:128", "qwen3-30b:1024", "dsv3-256:128"])
