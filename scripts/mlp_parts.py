"""The whole fp8 (or bf16) expert MLP of `epmoe bench experts` against its two GEMMs timed apart.

    python3 scripts/mlp_parts.py [--points qwen3-30b:1024 dsv3-256:4096 qwen3-30b:16:256] [--quant fp8_block]
        [--rep-ms 20]

Per point (exactly t rows per expert, the bench's inputs): medians (L2 flushed, GPU-paced: the bench's
`epmoe.timing.flushed_ms`) of the gate-up alone, the down alone on the gate-up's own h, the down on random h of the same
dtype and scale layout, and the whole MLP; the TFLOP/s the two parts would give together; and each kernel's mean time in
back-to-back MLP calls (torch.profiler, L2 not flushed). Each timing's wall-clock span is printed, to
line it up with a clock and power log (`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv
-lms 20`). Shapes: epmoe.bench.experts.SHAPES; a point shape:t:L takes L experts of the shape's size
instead of its own count (more or fewer weight bytes per launch at the same expert shape).
"""
from __future__ import annotations

import argparse
from datetime import datetime

import torch

from epmoe.bench.experts import SHAPES, random_weights, uniform_rows
from epmoe.kernels.grouped_gemm import down, gate_up
from epmoe.kernels.quant import quantize_act
from epmoe.quant import quantize_weights_ref
from epmoe.timing import flushed_ms
from moe_profile import kernel_us  # scripts/, on sys.path as the running script's folder


def clock() -> str:
    """Local wall time to the ms, as nvidia-smi's timestamp column prints it."""
    return datetime.now().strftime("%H:%M:%S.%f")[:-3]


def mlp_calls(name: str, t: int, fp8: bool, max_rows: int, experts: int | None = None) -> tuple[dict, tuple]:
    """The bench's inputs at exactly t rows per expert over L experts of shape `name` (`experts` of them when
    given, at most max_rows // t), and calls on them: {"gate_up", "down" (on the gate-up's own h),
    "down_random_h", "mlp"}; with (L, D, F, [w13, w2]) (the weights, fp8 when fp8)."""
    D, F, L = SHAPES[name]
    L = min(experts or L, max_rows // t)
    dev = torch.device("cuda")
    w13, w2 = random_weights(L, D, F, dev)
    rows, _ = uniform_rows(L, t, dev)
    x = torch.randn(L * t, D, dtype=torch.bfloat16, device=dev)
    h_random = torch.randn(L * t, F, dtype=torch.bfloat16, device=dev)
    if fp8:  # weights and x as `bench experts` quantizes them; h in the gate-up's fp8 and scale layout
        (w13, s13), (w2, s2) = quantize_weights_ref(w13), quantize_weights_ref(w2)
        x, xs = quantize_act(x)
        h_random, hs_random = quantize_act(h_random)
    else:
        s13 = s2 = xs = hs_random = None

    def up():
        return gate_up(x, w13, rows, x_scale_RG=xs, w13_scale=s13)

    def dn(h, hs, follows_gate_up=False):
        return down(h, w2, rows, h_scale_RG=hs, w2_scale=s2, out_dtype=torch.bfloat16, follows_gate_up=follows_gate_up)

    h, hs = up()
    parts = {"gate_up": up, "down": lambda: dn(h, hs), "down_random_h": lambda: dn(h_random, hs_random),
             "mlp": lambda: dn(*up(), follows_gate_up=True)}
    return parts, (L, D, F, [w13, w2])


def run_point(name: str, t: int, fp8: bool, rep_ms: int, max_rows: int, experts: int | None = None) -> None:
    parts, (L, D, F, _) = mlp_calls(name, t, fp8, max_rows, experts)
    R = L * t
    fl_up, fl_dn = 4.0 * R * D * F, 2.0 * R * D * F
    ms = {}
    for k, f in parts.items():
        t0 = clock()
        ms[k] = flushed_ms(f, rep_ms)
        print(f"# {k}: local time {t0} - {clock()}", flush=True)

    def tf(flops: float, ms_: float) -> float:
        return flops / ms_ / 1e9

    print(f"## {name} t={t} L={L} {'fp8' if fp8 else 'bf16'}")
    print(f"gate_up {ms['gate_up'] * 1e3:8.1f} us {tf(fl_up, ms['gate_up']):6.0f} TFLOP/s")
    print(f"down    {ms['down'] * 1e3:8.1f} us {tf(fl_dn, ms['down']):6.0f} TFLOP/s"
          f"   (random h: {ms['down_random_h'] * 1e3:.1f} us, {tf(fl_dn, ms['down_random_h']):.0f})")
    summed = ms["gate_up"] + ms["down"]
    print(f"mlp     {ms['mlp'] * 1e3:8.1f} us {tf(fl_up + fl_dn, ms['mlp']):6.0f} TFLOP/s"
          f"   parts summed {summed * 1e3:.1f} us {tf(fl_up + fl_dn, summed):.0f}")
    for k, us in sorted(kernel_us(parts["mlp"], 20).items(), key=lambda kv: -kv[1]):
        print(f"   kernel {us:8.1f} us  {k[:70]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", nargs="+", default=["qwen3-30b:1024", "dsv3-256:4096"],
                   help="shape:t or shape:t:L (L experts)")
    p.add_argument("--quant", default="fp8_block", choices=["bf16", "fp8_block"])
    p.add_argument("--rep-ms", type=int, default=20)
    p.add_argument("--max-rows", type=int, default=131072)
    args = p.parse_args()
    for point in args.points:
        name, t, *experts = point.split(":")
        run_point(name, int(t), args.quant == "fp8_block", args.rep_ms, args.max_rows,
                  int(experts[0]) if experts else None)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
