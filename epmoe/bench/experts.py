"""`epmoe bench experts`: the Triton expert kernels against torch._grouped_mm and a dense cuBLAS matmul.

Shape letters: L local experts, t rows (tokens) per expert, R = L*t rows, D hidden size, F intermediate size.

One expert MLP is y = (silu(x W1^T) * (x W3^T)) W2^T: 6*R*D*F flops. For each model shape and t it
times, in one run (median over calls, L2 flushed before each, random data; `epmoe.timing.flushed_ms`: timed as
triton.testing.do_bench times them, but queued behind a GPU spin, so that a call whose launches take the host
longer than the flush takes the GPU is timed by the GPU, not at the host's pace):
  triton_bf16      gate-up (SiLU-and-mul fused) + down, contiguous layout
  triton_bf16_bat  the same on the batched layout [L, t, D] (decode sizes, t <= 64)
  triton_fp8       fp8 block: x already quantized (as a dispatcher sends it), h quantized in the
                   gate-up epilogue, bf16 out
  gmm              torch._grouped_mm gate-up + down, the GEMMs alone (SiLU-and-mul not counted)
  dense            one dense cuBLAS matmul pair of the same total size ([R, D] x [D, 2F], [R, F] x [F, D])
and prints TFLOP/s, the ratios triton/gmm and triton/dense, and the floor: max(flops / peak, bytes /
bandwidth) with the GPU's ceilings (`epmoe.bench.ceilings`: the measured ones of its kind, or measured at the
start of the run), as % of floor reached (floor time / measured time).
Bytes of the floor: weights + x + h written and read + y (fp8: weights, x, h in 1 byte).
Total rows are capped at --max-rows (default 131072): a point with L*t above the cap runs on the
first max_rows // t experts (reported as L_run), which keeps memory and runtime small.

Shapes (D, F, L): DeepSeek-V3 with 128 or 256 local experts, Qwen3-30B-A3B, Mixtral-8x7B,
DeepSeek-V2-Lite.

`--tune` instead checks and times candidate launch configs per (GEMM, precision, rows-per-expert
bucket) at these shapes, beside torch._grouped_mm and dense matmuls, and writes the winners as
`configs.json` (the format of epmoe/kernels/configs.json, listing the GPU it ran on) to --out; commit it
over the table that lists that GPU, or beside it as configs_<gpu>.json for a new one, to use it
(epmoe/bench/experts_tune.py; `--table-from` rebuilds configs.json from a run's experts_tune.json).

Run: python -m epmoe.bench.experts --out DIR [--tune]   (needs one CUDA GPU)
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from ..kernels import configs as configs_mod
from ..kernels.grouped_gemm import ExpertRows, down, gate_up
from ..kernels.quant import quantize_act
from ..quant import quantize_weights_ref
from ..timing import flushed_ms
from . import experts_tune
from .ceilings import H200, Ceilings, device_ceilings, device_name

SHAPES = {  # name: (D, F, L)
    "dsv3-128": (7168, 2048, 128),
    "dsv3-256": (7168, 2048, 256),
    "qwen3-30b": (2048, 768, 128),
    "mixtral-8x7b": (4096, 14336, 8),
    "dsv2-lite": (2048, 1408, 64),
}
TOKENS = (1, 16, 64, 128, 256, 512, 1024, 4096)
DECODE_MAX_TOKENS = 64


@dataclass(frozen=True)
class Floor:
    """The least time of work of `flops` and `bytes` through HBM on a GPU of these ceilings."""

    flops: float
    bytes: float
    peak_tflops: float
    copy_tbps: float

    @property
    def ms(self) -> float:
        return max(self.flops / (self.peak_tflops * 1e12), self.bytes / (self.copy_tbps * 1e12)) * 1e3


def floor_on(ceilings: Ceilings, flops: float, nbytes: float, fp8: bool) -> Floor:
    return Floor(flops, nbytes, ceilings.tflops(fp8), ceilings.copy_tbps)


def mlp_floor(R: int, L: int, D: int, F: int, fp8: bool, ceilings: Ceilings = H200) -> Floor:
    """The floor of one grouped expert MLP over R rows and L experts (default: on an H200)."""
    w_bytes = 1 if fp8 else 2
    flops = 6.0 * R * D * F
    nbytes = L * 3 * D * F * w_bytes + R * D * w_bytes + 2 * R * F * w_bytes + R * D * 2
    return floor_on(ceilings, flops, nbytes, fp8)


def random_weights(L: int, D: int, F: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(L, 2 * F, D, dtype=torch.bfloat16, device=device).mul_(D ** -0.5)
    w2 = torch.randn(L, D, F, dtype=torch.bfloat16, device=device).mul_(F ** -0.5)
    return w13, w2


def uniform_rows(L: int, t: int, device) -> tuple[ExpertRows, ExpertRows]:
    """(contiguous, batched) rows with exactly t rows per expert."""
    counts = torch.full((L,), t, dtype=torch.int32, device=device)
    offsets = torch.arange(0, (L + 1) * t, t, dtype=torch.int32, device=device)
    return ExpertRows.contiguous(offsets), ExpertRows.batched_slots(counts, t)


def bench_point(name: str, D: int, F: int, L: int, t: int, weights, max_rows: int, rep_ms: int,
                ceilings: Ceilings) -> dict:
    w13, w2, q13, s13, q2, s2 = weights
    L_run = min(L, max_rows // t)
    R = L_run * t
    w13, w2, q13, s13, q2, s2 = (w[:L_run] for w in (w13, w2, q13, s13, q2, s2))
    dev = w13.device
    contiguous, batched = uniform_rows(L_run, t, dev)
    x = torch.randn(R, D, dtype=torch.bfloat16, device=dev)
    xq, xs = quantize_act(x)
    offs = contiguous.index_L[1:].clone()  # a fresh (16-byte aligned) int32 buffer for torch._grouped_mm
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    dense13, dense2 = w13[0].t(), w2[0].t()  # one expert's weights as [D, 2F] and [F, D] views
    h_bf16 = torch.randn(R, F, dtype=torch.bfloat16, device=dev)

    def triton_bf16(rows=contiguous):
        h, _ = gate_up(x, w13, rows)
        return down(h, w2, rows, follows_gate_up=True)

    def triton_fp8():
        h, hs = gate_up(xq, q13, contiguous, x_scale_RG=xs, w13_scale=s13)
        return down(h, q2, contiguous, h_scale_RG=hs, w2_scale=s2, out_dtype=torch.bfloat16, follows_gate_up=True)

    def gmm():
        torch._grouped_mm(x, w13_t, offs=offs, out_dtype=torch.bfloat16)
        return torch._grouped_mm(h_bf16, w2_t, offs=offs, out_dtype=torch.bfloat16)

    def dense():
        torch.mm(x, dense13)
        return torch.mm(h_bf16, dense2)

    timings = {"triton_bf16": triton_bf16, "triton_fp8": triton_fp8, "dense": dense}
    if hasattr(torch, "_grouped_mm"):
        timings["gmm"] = gmm
    if t <= DECODE_MAX_TOKENS:
        timings["triton_bf16_bat"] = lambda: triton_bf16(batched)
    flops = 6.0 * R * D * F
    res = {"shape": name, "D": D, "F": F, "L": L, "L_run": L_run, "tokens_per_expert": t, "rows": R,
           "flops": flops}
    for op in configs_mod.OPS:
        for fp8 in (False, True):
            cfg = configs_mod.gemm_config(op, fp8=fp8, rows_hint=t, on_gpu=True, gpu=configs_mod.gpu_name(dev))
            res[f"config_{configs_mod.table_key(op, fp8)}"] = cfg.to_dict()
    for key, fn in timings.items():
        try:
            ms = flushed_ms(fn, rep_ms)
        except Exception as exc:  # keep the rest of the sweep; the error goes into the JSON
            res[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"# {name} t={t} {key} failed: {res[f'{key}_error']}", flush=True)
            continue
        res[f"{key}_ms"] = ms
        res[f"{key}_tflops"] = flops / ms / 1e9
    for fp8 in (False, True):
        floor = mlp_floor(R, L_run, D, F, fp8, ceilings)
        tag = "fp8" if fp8 else "bf16"
        res[f"floor_{tag}_ms"] = floor.ms
        res[f"floor_{tag}_bytes"] = floor.bytes
        if f"triton_{tag}_ms" in res:
            res[f"triton_{tag}_pct_floor"] = 100.0 * floor.ms / res[f"triton_{tag}_ms"]
    for ratio, num, den in (("bf16_vs_gmm", "gmm", "triton_bf16"), ("bf16_vs_dense", "dense", "triton_bf16"),
                            ("fp8_vs_bf16", "triton_bf16", "triton_fp8")):
        if f"{num}_ms" in res and f"{den}_ms" in res:
            res[ratio] = res[f"{num}_ms"] / res[f"{den}_ms"]
    if "triton_bf16_bat_ms" in res:
        w_bytes = L_run * 3 * D * F * 2
        res["bat_weight_tbps"] = w_bytes / res["triton_bf16_bat_ms"] / 1e9
        res["bat_pct_copy_bw"] = 100.0 * res["bat_weight_tbps"] / ceilings.copy_tbps
    return res


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    head = (f"{'shape':>10} {'t':>5} {'L_run':>5} {'bf16 TF':>8} {'gmm TF':>8} {'dense TF':>8} {'x gmm':>6} "
            f"{'x dense':>7} {'%floor':>6} {'fp8 TF':>8} {'x bf16':>6} {'%floor8':>7} {'bat TB/s':>8} {'%bw':>5}")
    print(head)
    for r in rows:
        print(f"{r['shape']:>10} {r['tokens_per_expert']:>5} {r['L_run']:>5} {fmt(r.get('triton_bf16_tflops')):>8} "
              f"{fmt(r.get('gmm_tflops')):>8} {fmt(r.get('dense_tflops')):>8} {fmt(r.get('bf16_vs_gmm'), '.2f'):>6} "
              f"{fmt(r.get('bf16_vs_dense'), '.2f'):>7} {fmt(r.get('triton_bf16_pct_floor')):>6} "
              f"{fmt(r.get('triton_fp8_tflops')):>8} {fmt(r.get('fp8_vs_bf16'), '.2f'):>6} "
              f"{fmt(r.get('triton_fp8_pct_floor')):>7} {fmt(r.get('bat_weight_tbps'), '.2f'):>8} "
              f"{fmt(r.get('bat_pct_copy_bw')):>5}")


def run_bench(args, dev: torch.device) -> dict:
    rows = []
    ceilings = device_ceilings(dev)
    print(f"# floors at {ceilings.bf16_tflops:g} (fp8 {ceilings.fp8_tflops:g}) TFLOP/s and {ceilings.copy_tbps:g} "
          f"TB/s: {ceilings.source}", flush=True)
    for name in args.shapes:
        D, F, L = SHAPES[name]
        w13, w2 = random_weights(L, D, F, dev)
        q13, s13 = quantize_weights_ref(w13)
        q2, s2 = quantize_weights_ref(w2)
        weights = (w13, w2, q13, s13, q2, s2)
        for t in args.tokens:
            t0 = time.perf_counter()
            rows.append(bench_point(name, D, F, L, t, weights, args.max_rows, args.rep_ms, ceilings))
            print(f"# {name} t={t}: {time.perf_counter() - t0:.1f}s", flush=True)
        del w13, w2, q13, s13, q2, s2, weights
        torch.cuda.empty_cache()
    print_table(rows)
    return {"device": device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
            "gemm_table": str(configs_mod.table_path()), "max_rows": args.max_rows,
            "peaks": asdict(ceilings),
            "points": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="epmoe bench experts", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for experts.json (and configs.json with --tune)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="rows per expert to sweep")
    p.add_argument("--max-rows", type=int, default=131072, help="cap on total rows per point (see L_run)")
    p.add_argument("--rep-ms", type=int, default=40, help="time budget (ms of calls) per measurement")
    p.add_argument("--tune", action="store_true", help="tune launch configs and write configs.json "
                   "(epmoe/bench/experts_tune.py)")
    p.add_argument("--workers", type=int, default=8, help="--tune: processes checking (and compiling) candidates")
    p.add_argument("--check-s", type=float, default=200.0, help="--tune: time allowed for all the checks")
    p.add_argument("--stall-s", type=float, default=60.0, help="--tune: end the run when one point takes this long")
    p.add_argument("--table-from", help="write configs.json from this experts_tune.json (no GPU needed)")
    args = p.parse_args(argv)
    if args.table_from:
        try:
            experts_tune.table_from(args.table_from, args.out)
        except (OSError, ValueError, KeyError, TypeError) as e:  # (json's errors are ValueErrors)
            p.error(f"--table-from {args.table_from}: not a readable experts_tune.json ({type(e).__name__}: {e})")
        return
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it times GPU kernels), and none is visible here")
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device())
    result = experts_tune.run_tune(args, dev) if args.tune else run_bench(args, dev)
    result["seconds"] = time.perf_counter() - t0
    print(f"# total {result['seconds']:.0f}s")
    if args.out:
        (Path(args.out) / ("experts_tune.json" if args.tune else "experts.json")).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
