"""GPU probe of the grouped expert GEMMs' large-M launch configs at DeepSeek-V3 shapes.

Shape letters: L experts, t rows per expert, R = L*t rows, D hidden size, F intermediate size,
N output columns, K reduction size.

Times, on one GPU, at D=7168, F=2048, L=32 and t in --tokens (contiguous layout, x already quantized for
fp8 as a dispatcher sends it), each candidate of the tuner's large-M bucket (`candidates()` in
epmoe/bench/experts.py, the table's entry first; TMA and pointer loads) through
epmoe.kernels.grouped_gemm.gate_up / down, and torch._grouped_mm as the bf16 baseline; prints TFLOP/s
and the ratio to gmm (bf16) or to the 1276 TFLOP/s dense fp8 peak (fp8), best first, per (op,
precision, t). The first candidate of each list is checked against gate_up_ref / down_ref first
(relative Frobenius error). A candidate that fails to compile is recorded and skipped. Results go to
DIR/gemm_probe.json after every point. The fastest candidates went into epmoe/kernels/configs.json.

--random-counts: the rows per expert drawn as a uniform routing draws them (t on average), so that
each expert's last row tile is partly empty as in a real batch; --precs: the precisions to probe.

Run: python3 scripts/gemm_probe.py --out DIR   (one CUDA GPU; ~2 minutes on an H200, mostly compiles)
     python3 scripts/gemm_probe.py --selftest   (CPU, TRITON_INTERPRET=1: every candidate at tiny shapes)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--selftest" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from epmoe.bench.experts import TUNE_BUCKETS, candidates  # noqa: E402
from epmoe.kernels.grouped_gemm import ExpertRows, down, down_ref, gate_up, gate_up_ref  # noqa: E402
from epmoe.kernels.quant import quantize_act  # noqa: E402
from epmoe.quant import dequantize_act_ref, quantize_weight_ref  # noqa: E402

D, F, L = 7168, 2048, 32
PEAK_FP8 = 1276.0
TIME_BUDGET_S = 185.0  # start no candidate after this
OPS = [(op, prec) for prec in ("fp8", "bf16") for op in ("gate_up", "down")]


def make_weights(n_exp: int, d: int, f: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(n_exp, 2 * f, d, dtype=torch.bfloat16, device=device, generator=g).mul_(d ** -0.5)
    w2 = torch.randn(n_exp, d, f, dtype=torch.bfloat16, device=device, generator=g).mul_(f ** -0.5)
    pairs13 = [quantize_weight_ref(w) for w in w13]
    pairs2 = [quantize_weight_ref(w) for w in w2]
    q13, s13 = torch.stack([q for q, _ in pairs13]), torch.stack([s for _, s in pairs13])
    q2, s2 = torch.stack([q for q, _ in pairs2]), torch.stack([s for _, s in pairs2])
    return {"bf16": (w13, None, w2, None), "fp8": (q13, s13, q2, s2)}


def contiguous_rows(n_exp: int, t: int, device, random: bool = False) -> ExpertRows:
    """t rows per expert, or (random) n_exp * t rows drawn uniformly over the experts, as a uniform
    routing draws them (each expert's last row tile partly empty more often)."""
    if not random:
        return ExpertRows.contiguous(torch.arange(0, (n_exp + 1) * t, t, dtype=torch.int32, device=device))
    g = torch.Generator(device=device).manual_seed(t)
    counts = torch.bincount(torch.randint(0, n_exp, (n_exp * t,), device=device, generator=g), minlength=n_exp)
    return ExpertRows.contiguous(torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32))


def operands(op: str, prec: str, weights: dict, x_bf16: torch.Tensor, h_bf16: torch.Tensor):
    """(a, a_scale, w, w_scale) of one GEMM: gate-up reads x [R, D], down reads h [R, F]."""
    w13, s13, w2, s2 = weights[prec]
    a = x_bf16 if op == "gate_up" else h_bf16
    if prec == "fp8":
        aq, a_s = quantize_act(a)
        return aq, a_s, (w13 if op == "gate_up" else w2), (s13 if op == "gate_up" else s2)
    return a, None, (w13 if op == "gate_up" else w2), None


def run(op: str, a, a_s, w, w_s, rows: ExpertRows, cfg):
    """(out, out_scale) of the library kernel with launch config cfg."""
    if op == "gate_up":
        return gate_up(a, w, rows, x_scale_RG=a_s, w13_scale=w_s, config=cfg)
    return down(a, w, rows, h_scale_RG=a_s, w2_scale=w_s, out_dtype=torch.bfloat16, config=cfg), None


def rel_err(op: str, out, out_scale, a, a_s, w, w_s, rows: ExpertRows) -> float:
    """Relative Frobenius error of an output (fp8 h with its scales, or bf16) against the float32 reference."""
    ref = (gate_up_ref(a, w, rows, x_scale_RG=a_s, w13_scale=w_s) if op == "gate_up" else
           down_ref(a, w, rows, h_scale_RG=a_s, w2_scale=w_s))
    got = dequantize_act_ref(out, out_scale) if out_scale is not None else out.float()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def large_m_candidates(op: str, prec: str):
    return candidates(op, prec == "fp8", TUNE_BUCKETS[-1])


def selftest() -> None:
    """Every candidate vs the references under the interpreter (CPU, tiny shapes, an empty expert)."""
    torch.manual_seed(0)
    d, f, n_exp = 256, 256, 3
    weights = make_weights(n_exp, d, f, "cpu")
    rows = ExpertRows.contiguous(torch.tensor([0, 5, 5, 24], dtype=torch.int32))
    x = torch.randn(24, d, dtype=torch.bfloat16)
    h = torch.randn(24, f, dtype=torch.bfloat16)
    for op, prec in OPS:
        a, a_s, w, w_s = operands(op, prec, weights, x, h)
        for cfg in large_m_candidates(op, prec):
            err = rel_err(op, *run(op, a, a_s, w, w_s, rows, cfg), a, a_s, w, w_s, rows)
            print(f"selftest {op} {prec} {cfg}: rel err {err:.2e}", flush=True)
            assert err < 3e-2, (op, prec, cfg, err)
    print("selftest ok")


def describe(entry: dict) -> str:
    c = entry["config"]
    if c is None:
        return "torch._grouped_mm"
    return (f"m{c['block_m']} n{c['block_n']} k{c['block_k']} g{c['group_m']} w{c['num_warps']} "
            f"s{c['num_stages']}" + (" tma" if c.get("tma") else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for gemm_probe.json")
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096], help="rows per expert")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--budget-s", type=float, default=TIME_BUDGET_S, help="start no candidate after this")
    p.add_argument("--random-counts", action="store_true", help="rows per expert drawn as a uniform routing "
                   "draws them (t on average), not exactly t")
    p.add_argument("--precs", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    p.add_argument("--selftest", action="store_true")
    args = p.parse_args()
    if args.selftest:
        selftest()
        return
    if not torch.cuda.is_available():
        raise SystemExit("gemm_probe needs a CUDA GPU (or --selftest)")
    t_start = time.perf_counter()
    out_dir = Path(args.out or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    weights = make_weights(L, D, F, dev)
    t_max = max(args.tokens)
    x_all = torch.randn(L * t_max, D, dtype=torch.bfloat16, device=dev)
    h_all = torch.randn(L * t_max, F, dtype=torch.bfloat16, device=dev)
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "D": D, "F": F, "L": L, "random_counts": args.random_counts, "points": [], "errors": [], "checks": []}

    def save():
        result["seconds"] = time.perf_counter() - t_start
        (out_dir / "gemm_probe.json").write_text(json.dumps(result, indent=1) + "\n")

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median")

    check_rows = contiguous_rows(L, 128, dev)  # the table's entry against the reference first
    ops = [(op, prec) for op, prec in OPS if prec in args.precs]
    for op, prec in ops:
        a, a_s, w, w_s = operands(op, prec, weights, x_all[:L * 128], h_all[:L * 128])
        cfg = large_m_candidates(op, prec)[0]
        err = rel_err(op, *run(op, a, a_s, w, w_s, check_rows, cfg), a, a_s, w, w_s, check_rows)
        print(f"# check {op} {prec} {cfg}: rel err {err:.2e}", flush=True)
        result["checks"].append({"what": f"{op} {prec} {cfg}", "rel_err": err})
    save()

    for t in args.tokens:
        rows = contiguous_rows(L, t, dev, args.random_counts)
        R = L * t
        offs = rows.index_L[1:].clone()
        for op, prec in ops:
            a, a_s, w, w_s = operands(op, prec, weights, x_all[:R], h_all[:R])
            K, N = a.shape[1], w.shape[1]  # gate-up: N = both halves (2F), the GEMM's true columns
            flops = 2.0 * R * N * K
            entries = []
            if prec == "bf16" and hasattr(torch, "_grouped_mm"):
                w_t = w.transpose(1, 2)
                entries.append({"config": None,
                                "ms": bench(lambda: torch._grouped_mm(a, w_t, offs=offs, out_dtype=torch.bfloat16))})
            for cfg in large_m_candidates(op, prec):
                if time.perf_counter() - t_start > args.budget_s:
                    result["errors"].append({"what": f"{op} {prec} t={t} {cfg}", "error": "time budget"})
                    continue
                try:
                    ms = bench(lambda c=cfg: run(op, a, a_s, w, w_s, rows, c))
                except Exception as exc:  # a candidate the compiler refuses (shared memory, registers)
                    msg = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"# FAIL {op} {prec} t={t} {cfg}: {msg}", flush=True)
                    result["errors"].append({"what": f"{op} {prec} t={t} {cfg}", "error": msg})
                    continue
                entries.append({"config": cfg.to_dict(), "ms": ms})
            base = next((e["ms"] for e in entries if e["config"] is None), None)
            for e in entries:
                e["tflops"] = flops / e["ms"] / 1e9
                e["ratio"] = base / e["ms"] if base else e["tflops"] / PEAK_FP8
            entries.sort(key=lambda e: e["ms"])
            print(f"\n== {op} {prec} t={t} (R={R}, N={N}, K={K}) ==  ratio = {'x gmm' if base else 'x fp8 peak'}",
                  flush=True)
            for e in entries:
                print(f"  {e['tflops']:7.1f} TFLOP/s  {e['ratio']:5.3f}  {e['ms']:8.3f} ms  {describe(e)}", flush=True)
            result["points"].append({"op": op, "prec": prec, "t": t, "R": R, "N": N, "K": K, "flops": flops,
                                     "entries": entries})
            save()
    save()
    print(f"# total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
