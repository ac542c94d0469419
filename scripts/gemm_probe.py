"""GPU probe of the grouped expert GEMMs at DeepSeek-V3 shapes: launch configs and an experimental fp8 kernel.

Shape letters: L experts, t rows per expert, R = L*t rows, D hidden size, F intermediate size,
N output columns, K reduction size, G = K / 128 scale groups.

Times, on one GPU, at D=7168, F=2048, L=32 and t in --tokens (contiguous layout, x already quantized for fp8
as a dispatcher sends it):
  cur      epmoe.kernels.grouped_gemm.gate_up / down with an explicit GemmConfig (candidates below)
  exp      EXPERIMENTAL private kernel `_probe_kernel` of this file (not library code): the same tile map
           and loop, plus: dot2 (fp8: two K blocks of 128 per iteration, both dots issued before the
           scaled accumulate), defer (fp8: the previous block's dot scaled after this block's dot is
           issued), tma (A and B tiles through host tensor descriptors), maxnreg (128 registers per
           thread, so that two 8-warp programs share an SM and overlap one's scaling with the other's MMAs)
  gmm      torch._grouped_mm (bf16 baseline; gate-up without the SiLU-and-mul)
and prints TFLOP/s and the ratio to gmm (bf16) or to 1276 TFLOP/s dense fp8 peak (fp8), best first, per
(op, precision, t). Each experimental variant is checked against gate_up_ref / down_ref first (relative
Frobenius error over the experts' rows, printed next to the current kernel's error); a variant that fails
to compile or to match is skipped. Results go to DIR/gemm_probe.json after every point.

Run: python3 scripts/gemm_probe.py --out DIR   (one CUDA GPU; ~3 minutes on an H200, mostly compiles)
     python3 scripts/gemm_probe.py --selftest   (CPU, TRITON_INTERPRET=1: the experimental kernel at tiny shapes)
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
import triton.language as tl

SCALE_GROUP = 128
SCALE_GROUP_C = tl.constexpr(SCALE_GROUP)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from epmoe.bench.experts import TUNE_BUCKETS, candidates  # noqa: E402
from epmoe.kernels.configs import GemmConfig  # noqa: E402
from epmoe.kernels.grouped_gemm import ExpertRows, down, down_ref, gate_up, gate_up_ref  # noqa: E402
from epmoe.kernels.quant import FP8_MAX_C, MIN_AMAX_C, quantize_act, to_fp8  # noqa: E402
from epmoe.quant import FP8_DTYPE, dequantize_act_ref, quantize_weight_ref  # noqa: E402

D, F, L = 7168, 2048, 32
DEVICE = "cuda"
PEAK_FP8 = 1276.0
TIME_BUDGET_S = 185.0  # stop starting new candidates after this (the lead's call is ~4 minutes)


def C(bm, bn, bk, gm, w, s):
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=s)


# Current kernel candidates per (op, precision): the --tune list of the large-M bucket (the table's entry
# first), fp8 first since it matters most. See LARGE_M_CANDIDATES in epmoe/bench/experts.py for sources.
CURRENT = {(op, prec): candidates(op, prec == "fp8", TUNE_BUCKETS[-1])
           for prec in ("fp8", "bf16") for op in ("gate_up", "down")}
# Experimental kernel candidates: (config, mode, TMA, maxnreg). mode "plain" is the library's loop; "dot2"
# holds two K blocks per pipeline stage (twice the shared memory per stage, hence fewer stages); "defer"
# scales the previous block's dot after issuing this one. maxnreg=128 with <= ~110 KB of shared memory lets
# two programs share an SM, so one program's scale-and-add overlaps the other's wgmma (Triton waits for
# each non-chained dot right after issuing it, so within one program they do not overlap).
_2CTA = 128  # maxnreg for two 8-warp programs per SM
EXPERIMENTAL = {
    ("gate_up", "fp8"): [(C(64, 128, 128, 32, 8, 2), "plain", False, _2CTA),
                         (C(64, 128, 128, 32, 8, 2), "plain", True, _2CTA),
                         (C(64, 128, 128, 32, 8, 4), "plain", True, None),
                         (C(64, 128, 128, 32, 8, 2), "dot2", True, None),
                         (C(128, 128, 128, 16, 8, 3), "plain", True, None)],
    ("down", "fp8"): [(C(128, 128, 128, 16, 8, 3), "plain", False, _2CTA),
                      (C(128, 128, 128, 16, 8, 3), "plain", True, _2CTA),
                      (C(128, 128, 128, 16, 8, 4), "plain", True, None),
                      (C(128, 128, 128, 16, 8, 3), "dot2", True, None),
                      (C(128, 128, 128, 16, 8, 4), "defer", True, None),
                      (C(64, 128, 128, 32, 4, 4), "plain", True, None)],
    ("gate_up", "bf16"): [(C(128, 128, 64, 16, 8, 4), "plain", True, None)],
    ("down", "bf16"): [(C(128, 256, 64, 16, 8, 3), "plain", True, None)],
}
MODES = ("plain", "dot2", "defer")


# ---------------------------------------------------------------------------------------------------
# EXPERIMENTAL kernel: a private, simplified copy of epmoe's _grouped_gemm_kernel (contiguous layout
# only, K a multiple of 2*BLOCK_K, fp8 with BLOCK_K == 128 and gate-up N a multiple of 128). Probe only.
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _load_ab(a_ptrs, b_ptrs, a_desc, b_desc, row0, brow, k0, up_shift, up_row,
             GATE_UP: tl.constexpr, TMA: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] and B (and B_up) as [BLOCK_K, BLOCK_N] tiles at reduction offset k0."""
    if TMA:
        a = a_desc.load([row0, k0])
        b = b_desc.load([brow, k0]).T
        b_up = b
        if GATE_UP:
            b_up = b_desc.load([brow + up_row, k0]).T
    else:
        a = tl.load(a_ptrs + k0)
        b = tl.load(b_ptrs + k0)
        b_up = b
        if GATE_UP:
            b_up = tl.load(b_ptrs + k0 + up_shift)
    return a, b, b_up


@triton.jit
def _probe_kernel(a_ptr, a_desc, a_scale_ptr, b_ptr, b_desc, b_scale_ptr, c_ptr, c_scale_ptr, index_ptr,
                  L, R, N, K, stride_bsl, stride_bsn, G_A, G_C,
                  GATE_UP: tl.constexpr, FP8: tl.constexpr, DOT2: tl.constexpr, DEFER: tl.constexpr,
                  TMA: tl.constexpr, STEP: tl.constexpr, UPCAST: tl.constexpr, L_POW2: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[rows of l] = A[rows of l] @ B[l]^T (GATE_UP: silu(A B_gate^T) * (A B_up^T), fp8 h quantized per
    row per 128 columns when FP8). A [R, K]; B [L, N (x2 gate-up), K]; contiguous offsets [L+1]."""
    tl.static_assert(not FP8 or BLOCK_K == 128, "probe: fp8 needs BLOCK_K == 128")
    tl.static_assert(not (FP8 and GATE_UP) or BLOCK_N == 128, "probe: fp8 gate-up needs BLOCK_N == 128")
    tl.static_assert(not (DOT2 or DEFER) or FP8, "probe: DOT2 and DEFER are fp8 modes")
    tl.static_assert(not DEFER or (BLOCK_N <= 128 and not DOT2), "probe: DEFER needs BLOCK_N <= 128, no DOT2")
    e = tl.arange(0, L_POW2)
    e_mask = e < L
    base = tl.load(index_ptr + e, mask=e_mask, other=0)
    count = tl.load(index_ptr + e + 1, mask=e_mask, other=0) - base
    tiles = (count + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    num_tiles_m = tl.sum(tiles, 0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_tiles_n
    if GATE_UP:
        n_rows_b = 2 * N
    else:
        n_rows_b = N
    for tile in range(tl.program_id(0), num_tiles_m * num_tiles_n, tl.num_programs(0)):
        first_m = (tile // in_group) * GROUP_M
        group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % group_size
        pid_n = (tile % in_group) // group_size
        expert = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)
        mine = e == expert
        tile0 = tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)
        row0 = tl.sum(tl.where(mine, base, 0), 0) + (pid_m - tile0) * BLOCK_M
        row_end = tl.sum(tl.where(mine, base + count, 0), 0)

        offs_m = row0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < row_end
        rows_a = tl.minimum(offs_m, R - 1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        cols_b = tl.minimum(offs_n, N - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        expert64 = expert.to(tl.int64)
        a_ptrs = a_ptr + rows_a[:, None] * K + offs_k[None, :]
        b_ptrs = b_ptr + expert64 * n_rows_b * K + cols_b[None, :] * K + offs_k[:, None]
        brow = expert * n_rows_b + pid_n * BLOCK_N  # first row of the B tile in the [L * rows, K] view
        if FP8:
            a_scale_ptrs = a_scale_ptr + rows_a * G_A
            if BLOCK_N <= SCALE_GROUP_C:  # one weight scale per K block (gate and up alike)
                b_scale_ptrs = b_scale_ptr + expert64 * stride_bsl + (pid_n * BLOCK_N // SCALE_GROUP_C) * stride_bsn
            else:
                b_scale_ptrs = b_scale_ptr + expert64 * stride_bsl + (cols_b // SCALE_GROUP_C) * stride_bsn
            up_scale_ptrs = b_scale_ptrs + (N // SCALE_GROUP_C) * stride_bsn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # DEFER: the previous K block's unscaled dot and its row scales, accumulated one iteration late.
        d_prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        u_prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        s_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)
        su_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, STEP):
            a, b, b_up = _load_ab(a_ptrs, b_ptrs, a_desc, b_desc, row0, brow, k0, N * K, N, GATE_UP, TMA)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                b_up = b_up.to(tl.float32)
            if FP8:
                g = k0 // SCALE_GROUP_C
                a_s = tl.load(a_scale_ptrs + g)
                if DOT2:
                    # Second K block loaded and both dots issued before either result is scaled.
                    a2, b2, b2_up = _load_ab(a_ptrs, b_ptrs, a_desc, b_desc, row0, brow, k0 + BLOCK_K, N * K, N,
                                             GATE_UP, TMA)
                    if UPCAST:
                        a2 = a2.to(tl.float32)
                        b2 = b2.to(tl.float32)
                        b2_up = b2_up.to(tl.float32)
                    a_s2 = tl.load(a_scale_ptrs + g + 1)
                    d = tl.dot(a, b)
                    d2 = tl.dot(a2, b2)
                    if BLOCK_N <= SCALE_GROUP_C:
                        acc += d * (a_s * tl.load(b_scale_ptrs + g))[:, None] \
                            + d2 * (a_s2 * tl.load(b_scale_ptrs + g + 1))[:, None]
                    else:
                        acc += d * a_s[:, None] * tl.load(b_scale_ptrs + g)[None, :] \
                            + d2 * a_s2[:, None] * tl.load(b_scale_ptrs + g + 1)[None, :]
                    if GATE_UP:
                        u = tl.dot(a, b_up)
                        u2 = tl.dot(a2, b2_up)
                        acc_up += u * (a_s * tl.load(up_scale_ptrs + g))[:, None] \
                            + u2 * (a_s2 * tl.load(up_scale_ptrs + g + 1))[:, None]
                elif DEFER:
                    # This block's dot is issued before the previous block's scaled accumulate.
                    d = tl.dot(a, b)
                    acc += d_prev * s_prev[:, None]
                    d_prev = d
                    s_prev = a_s * tl.load(b_scale_ptrs + g)
                    if GATE_UP:
                        u = tl.dot(a, b_up)
                        acc_up += u_prev * su_prev[:, None]
                        u_prev = u
                        su_prev = a_s * tl.load(up_scale_ptrs + g)
                else:
                    if BLOCK_N <= SCALE_GROUP_C:
                        acc += tl.dot(a, b) * (a_s * tl.load(b_scale_ptrs + g))[:, None]
                    else:
                        acc += tl.dot(a, b) * a_s[:, None] * tl.load(b_scale_ptrs + g)[None, :]
                    if GATE_UP:
                        acc_up += tl.dot(a, b_up) * (a_s * tl.load(up_scale_ptrs + g))[:, None]
            else:
                acc = tl.dot(a, b, acc)
                if GATE_UP:
                    acc_up = tl.dot(a, b_up, acc_up)
        if DEFER:
            acc += d_prev * s_prev[:, None]
            if GATE_UP:
                acc_up += u_prev * su_prev[:, None]

        if GATE_UP:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        rows_c = offs_m.to(tl.int64)
        c_ptrs = c_ptr + rows_c[:, None] * N + offs_n[None, :]
        c_mask = m_mask[:, None] & n_mask[None, :]
        if FP8 and GATE_UP:
            scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(acc), axis=1), MIN_AMAX_C), FP8_MAX_C)
            q = tl.minimum(tl.maximum(tl.math.div_rn(acc, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
            tl.store(c_ptrs, to_fp8(q, c_ptr.dtype.element_ty, UPCAST), mask=c_mask)
            tl.store(c_scale_ptr + rows_c * G_C + pid_n, scale, mask=m_mask)
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def probe_launch(op: str, a, a_scale, w, w_scale, rows: ExpertRows, cfg: GemmConfig, mode: str, tma: bool,
                 maxnreg: int | None = None):
    """Launch the experimental kernel; returns (out, out_scale) (out_scale only for fp8 gate-up)."""
    if mode not in MODES:
        raise ValueError(f"probe: mode must be one of {MODES}, got {mode!r}")
    R, K = a.shape
    gate = op == "gate_up"
    N = w.shape[1] // 2 if gate else w.shape[1]
    fp8 = w.dtype == FP8_DTYPE
    step = cfg.block_k * (2 if mode == "dot2" else 1)
    if K % step:
        raise ValueError(f"probe: K={K} must be a multiple of {step}")
    if fp8 and gate:
        out = torch.empty(R, N, dtype=FP8_DTYPE, device=a.device)
        out_scale = torch.empty(R, N // SCALE_GROUP, dtype=torch.float32, device=a.device)
    else:
        out = torch.empty(R, N, dtype=torch.bfloat16, device=a.device)
        out_scale = None
    w2d = w.reshape(-1, K)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor.from_tensor(w2d, [cfg.block_n, cfg.block_k])
    else:
        a_desc = b_desc = None
    n_rows = rows.num_experts
    tiles = rows.max_row_tiles(R, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count * 4 if a.is_cuda else 3
    dummy = out
    _probe_kernel[(min(tiles, programs),)](
        a, a_desc, a_scale if fp8 else dummy, w, b_desc, w_scale if fp8 else dummy, out,
        out_scale if out_scale is not None else dummy, rows.index_L,
        n_rows, R, N, K, w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0,
        K // SCALE_GROUP, N // SCALE_GROUP,
        GATE_UP=gate, FP8=fp8, DOT2=mode == "dot2", DEFER=mode == "defer", TMA=tma, STEP=step,
        UPCAST=not a.is_cuda,
        L_POW2=max(triton.next_power_of_2(n_rows), 128), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if maxnreg is None or not a.is_cuda else {"maxnreg": maxnreg}))
    return out, out_scale


# ---------------------------------------------------------------------------------------------------
# Inputs, references, timing
# ---------------------------------------------------------------------------------------------------
def make_weights(n_exp, d, f, device):
    g = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(n_exp, 2 * f, d, dtype=torch.bfloat16, device=device, generator=g).mul_(d ** -0.5)
    w2 = torch.randn(n_exp, d, f, dtype=torch.bfloat16, device=device, generator=g).mul_(f ** -0.5)
    pairs13 = [quantize_weight_ref(w) for w in w13]
    pairs2 = [quantize_weight_ref(w) for w in w2]
    q13, s13 = torch.stack([q for q, _ in pairs13]), torch.stack([s for _, s in pairs13])
    q2, s2 = torch.stack([q for q, _ in pairs2]), torch.stack([s for _, s in pairs2])
    return {"bf16": (w13, None, w2, None), "fp8": (q13, s13, q2, s2)}


def contiguous_rows(n_exp, t, device) -> ExpertRows:
    return ExpertRows.contiguous(torch.arange(0, (n_exp + 1) * t, t, dtype=torch.int32, device=device))


def operands(op, prec, weights, x_bf16, h_bf16):
    """(a, a_scale, w, w_scale) of one GEMM: gate-up reads x [R, D], down reads h [R, F]."""
    w13, s13, w2, s2 = weights[prec]
    a = x_bf16 if op == "gate_up" else h_bf16
    if prec == "fp8":
        aq, a_s = quantize_act(a)
        return aq, a_s, (w13 if op == "gate_up" else w2), (s13 if op == "gate_up" else s2)
    return a, None, (w13 if op == "gate_up" else w2), None


def run_current(op, a, a_s, w, w_s, rows, cfg):
    if op == "gate_up":
        return gate_up(a, w, rows, x_scale_RG=a_s, w13_scale=w_s, config=cfg)
    return down(a, w, rows, h_scale_RG=a_s, w2_scale=w_s, out_dtype=torch.bfloat16, config=cfg), None


def reference(op, a, a_s, w, w_s, rows) -> torch.Tensor:
    if op == "gate_up":
        return gate_up_ref(a, w, rows, x_scale_RG=a_s, w13_scale=w_s)
    return down_ref(a, w, rows, h_scale_RG=a_s, w2_scale=w_s)


def err_vs(ref, out, out_scale) -> float:
    """Relative Frobenius error of an output (fp8 h with its scales, or bf16) against the float32 reference."""
    got = dequantize_act_ref(out, out_scale) if out_scale is not None else out.float()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def rel_err(op, out, out_scale, a, a_s, w, w_s, rows) -> float:
    return err_vs(reference(op, a, a_s, w, w_s, rows), out, out_scale)


def selftest() -> None:
    """Experimental kernel vs the references under the interpreter (CPU, tiny shapes, an empty expert)."""
    torch.manual_seed(0)
    d, f, n_exp = 512, 256, 3
    weights = make_weights(n_exp, d, f, "cpu")
    rows = ExpertRows.contiguous(torch.tensor([0, 5, 5, 24], dtype=torch.int32))
    x = torch.randn(24, d, dtype=torch.bfloat16)
    h = torch.randn(24, f, dtype=torch.bfloat16)
    block_n = {("gate_up", "fp8"): (128,), ("down", "fp8"): (16, 256), ("gate_up", "bf16"): (16, 32),
               ("down", "bf16"): (32,)}
    worst = 0.0
    for (op, prec), bns in block_n.items():
        a, a_s, w, w_s = operands(op, prec, weights, x, h)
        ref_out = run_current(op, a, a_s, w, w_s, rows, None)
        cur_err = rel_err(op, *ref_out, a, a_s, w, w_s, rows)
        for bn in bns:
            for mode in (MODES if prec == "fp8" else ("plain",)):
                if mode == "defer" and bn > 128:
                    continue
                for tma in (False, True):
                    cfg = C(16, bn, 128 if prec == "fp8" else 32, 2, 1, 1)
                    out, out_s = probe_launch(op, a, a_s, w, w_s, rows, cfg, mode, tma)
                    err = rel_err(op, out, out_s, a, a_s, w, w_s, rows)
                    print(f"selftest {op} {prec} bn={bn} {mode} tma={tma}: rel err {err:.2e} "
                          f"(current kernel {cur_err:.2e})", flush=True)
                    assert err < max(3 * cur_err, 1e-2), (op, prec, bn, mode, tma, err)
                    worst = max(worst, err)
    print(f"selftest ok (worst rel err {worst:.2e})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for gemm_probe.json")
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096], help="rows per expert")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--budget-s", type=float, default=TIME_BUDGET_S, help="start no candidate after this")
    p.add_argument("--selftest", action="store_true")
    args = p.parse_args()
    if args.selftest:
        selftest()
        return
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gemm_probe needs a CUDA GPU (or --selftest)")
    t_start = time.perf_counter()
    out_dir = Path(args.out or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device(DEVICE)
    weights = make_weights(L, D, F, dev)
    t_max = max(args.tokens)
    x_all = torch.randn(L * t_max, D, dtype=torch.bfloat16, device=dev)
    h_all = torch.randn(L * t_max, F, dtype=torch.bfloat16, device=dev)
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev), "torch": torch.__version__, "triton": triton.__version__,
              "D": D, "F": F, "L": L, "points": [], "errors": [], "checks": []}

    def save():
        result["seconds"] = time.perf_counter() - t_start
        (out_dir / "gemm_probe.json").write_text(json.dumps(result, indent=1) + "\n")

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median")

    # Correctness of each experimental variant (and of the current kernel's first candidate) at t=128.
    check_rows = contiguous_rows(L, 128, dev)
    bad = set()
    for (op, prec), variants in EXPERIMENTAL.items():
        a, a_s, w, w_s = operands(op, prec, weights, x_all[:L * 128], h_all[:L * 128])
        ref = reference(op, a, a_s, w, w_s, check_rows)
        cur_err = err_vs(ref, *run_current(op, a, a_s, w, w_s, check_rows, CURRENT[(op, prec)][0]))
        for cfg, mode, tma, nreg in variants:
            tag = f"{op} {prec} exp {cfg} {mode} tma={tma} maxnreg={nreg}"
            try:
                err = err_vs(ref, *probe_launch(op, a, a_s, w, w_s, check_rows, cfg, mode, tma, nreg))
            except Exception as exc:  # compile failure: record, skip the variant
                msg = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"# FAIL {tag}: {msg}", flush=True)
                result["errors"].append({"what": tag, "error": msg})
                bad.add((op, prec, cfg, mode, tma, nreg))
                continue
            ok = err < max(3 * cur_err, 1e-2)
            print(f"# check {tag}: rel err {err:.2e} (current kernel {cur_err:.2e}) {'ok' if ok else 'MISMATCH'}",
                  flush=True)
            result["checks"].append({"what": tag, "rel_err": err, "current_rel_err": cur_err, "ok": ok})
            if not ok:
                bad.add((op, prec, cfg, mode, tma, nreg))
        del ref
        save()
    del check_rows
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    for t in args.tokens:
        rows = contiguous_rows(L, t, dev)
        R = L * t
        offs = rows.index_L[1:].clone()
        for (op, prec), cur_list in CURRENT.items():
            a, a_s, w, w_s = operands(op, prec, weights, x_all[:R], h_all[:R])
            K = a.shape[1]
            N = w.shape[1]  # gate-up: both halves (2F), the GEMM's true columns
            flops = 2.0 * R * N * K
            entries = []
            if prec == "bf16" and hasattr(torch, "_grouped_mm"):
                w_t = w.transpose(1, 2)
                try:
                    ms = bench(lambda: torch._grouped_mm(a, w_t, offs=offs, out_dtype=torch.bfloat16))
                    entries.append({"impl": "gmm", "config": None, "ms": ms})
                except Exception as exc:
                    print(f"# FAIL torch._grouped_mm {op} t={t}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            runs = [("cur", cfg, "", False, None) for cfg in cur_list]
            runs += [("exp", cfg, mode, tm, nreg) for cfg, mode, tm, nreg in EXPERIMENTAL.get((op, prec), [])
                     if (op, prec, cfg, mode, tm, nreg) not in bad]
            for impl, cfg, mode, tma, nreg in runs:
                if time.perf_counter() - t_start > args.budget_s:
                    result["errors"].append({"what": f"{op} {prec} t={t} {impl} {cfg}", "error": "time budget"})
                    continue
                fn = ((lambda c=cfg: run_current(op, a, a_s, w, w_s, rows, c)) if impl == "cur" else
                      (lambda c=cfg, md=mode, tm=tma, nr=nreg: probe_launch(op, a, a_s, w, w_s, rows, c, md, tm, nr)))
                try:
                    ms = bench(fn)
                except Exception as exc:
                    msg = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"# FAIL {op} {prec} t={t} {impl} {cfg}: {msg}", flush=True)
                    result["errors"].append({"what": f"{op} {prec} t={t} {impl} {cfg} {mode} tma={tma} maxnreg={nreg}",
                                             "error": msg})
                    continue
                entries.append({"impl": impl, "config": cfg.to_dict(), "mode": mode, "tma": tma, "maxnreg": nreg,
                                "ms": ms})
            base = next((e["ms"] for e in entries if e["impl"] == "gmm"), None)
            for e in entries:
                e["tflops"] = flops / e["ms"] / 1e9
                e["ratio"] = base / e["ms"] if base else e["tflops"] / PEAK_FP8
            entries.sort(key=lambda e: e["ms"])
            ratio_name = "x gmm" if base else "x fp8 peak"
            print(f"\n== {op} {prec} t={t} (R={R}, N={N}, K={K}) ==  ratio = {ratio_name}", flush=True)
            for e in entries:
                c = e["config"]
                desc = ("torch._grouped_mm" if c is None else
                        f"{e['impl']} m{c['block_m']} n{c['block_n']} k{c['block_k']} g{c['group_m']} "
                        f"w{c['num_warps']} s{c['num_stages']}" + (f" {e['mode']}" if e.get("mode") else "")
                        + (" tma" if e.get("tma") else "")
                        + (f" maxnreg{e['maxnreg']}" if e.get("maxnreg") else ""))
                print(f"  {e['tflops']:7.1f} TFLOP/s  {e['ratio']:5.3f}  {e['ms']:8.3f} ms  {desc}", flush=True)
            result["points"].append({"op": op, "prec": prec, "t": t, "R": R, "N": N, "K": K, "flops": flops,
                                     "entries": entries})
            save()
    save()
    print(f"# total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
