"""Triton expert kernels and the `triton` / `grouped_mm` experts, against the torch references.

Without CUDA the kernels run under the Triton interpreter on CPU tensors at tiny shapes (TRITON_INTERPRET
is set below, before anything imports triton); with CUDA the same small cases run on the GPU, and the
`gpu`-marked cases add real model shapes.
"""
import dataclasses
import functools
import itertools
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from compile_run import OTHER_TRITONS, assert_compiles  # noqa: E402
from epmoe import FusedMoE, MoEConfig  # noqa: E402
from epmoe.experts.grouped_mm import GroupedMMExperts  # noqa: E402
from epmoe.experts.reference import ReferenceExperts  # noqa: E402
from epmoe.experts.triton import TritonExperts  # noqa: E402
from epmoe.interfaces import ExpertBatch, Layout  # noqa: E402
from epmoe.bench import experts_tune  # noqa: E402
from epmoe.bench.ceilings import Ceilings  # noqa: E402
from epmoe.kernels import configs  # noqa: E402
from epmoe.kernels import grouped_gemm  # noqa: E402
from epmoe.kernels.configs import GemmConfig, gemm_config  # noqa: E402
from epmoe.kernels.grouped_gemm import ExpertRows, _descriptor, down, down_ref, gate_up, gate_up_ref  # noqa: E402
from epmoe.kernels.quant import divide_rn, quantize_act  # noqa: E402
from epmoe.quant import dequantize_act_ref, quantize_act_ref, quantize_weight_ref  # noqa: E402
from epmoe.registry import auto_experts_order, list_experts, resolve_experts  # noqa: E402
from epmoe.testing import TOLERANCES, rel_error  # noqa: E402

# Padding rows (outside every expert) of kernel intermediates are uninitialized memory; the interpreter's
# numpy math warns on them, though their results are never stored.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (rtol, atol) for outputs of magnitude ~1 stored in each dtype.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 3e-2)}
# Outputs computed from fp8 h, stored in bf16: the kernel's and the reference's float32 values round to bf16
# apart by up to one bf16 step (2^-7 relative); measured over 12 seeds of the CPU cases (150k outputs): within
# 2^-7 |y| + 4e-8. Twice that, plus an absolute 2^-7 for an h value whose e4m3 rounding flips.
FP8_TOL = (2 ** -6, 2 ** -7)
FP8_H_TOL = (0.07, 0.01)  # fp8 h itself: e4m3 rounds within 2^-4 of the value
# rtol of h's scales (a row's amax / 448 per 128 columns) against those of the float32 reference's h: float32
# sums as the reference's under the interpreter; on the GPU the tensor cores accumulate each 128-deep fp8 block
# in less than float32 (measured in these small cases on an H100: up to 8.5e-3, a row of small values).
FP8_SCALE_RTOL = {"cpu": 1e-4, "cuda": 2e-2}

# Rows per expert: empty, single, crossing the 16-row tile, skewed, all empty.
COUNTS = [[0, 0, 0], [1, 0, 0], [5, 0, 17], [33, 1, 0]]


def weights(L, D, F, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(L, 2 * F, D, generator=g) / D ** 0.5
    w2 = torch.randn(L, D, F, generator=g) / F ** 0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def make_rows(counts, batched, pad=3):
    """ExpertRows and the number of activation rows: contiguous with `pad` padding rows, or batched
    with M = max(count) + pad slots."""
    counts_L = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    if batched:
        M = max(counts) + pad
        return ExpertRows.batched_slots(counts_L, M), len(counts) * M
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32, device=DEVICE)
    offsets[1:] = torch.cumsum(counts_L, 0)
    return ExpertRows.contiguous(offsets), sum(counts) + pad


def valid_mask(rows, R):
    mask = torch.zeros(R, dtype=torch.bool, device=DEVICE)
    for lo, hi in rows.ranges():
        mask[lo:hi] = True
    return mask


def record_pointer_launches(monkeypatch, what) -> list:
    """The pointer kernel, launching as before, appends what(its keyword arguments) to the list returned."""
    seen, real = [], grouped_gemm._grouped_gemm_kernel
    monkeypatch.setattr(grouped_gemm, "_grouped_gemm_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (lambda *a, **kw: (seen.append(what(kw)), real[grid](*a, **kw)))})())
    return seen


def record_ws_launches(monkeypatch, what) -> list:
    """`grouped_gemm_ws.launch`, launching as before, appends what(its keyword arguments) to the list returned."""
    seen, real = [], grouped_gemm.grouped_gemm_ws.launch
    monkeypatch.setattr(grouped_gemm.grouped_gemm_ws, "launch",
                        lambda *a, **kw: (seen.append(what(kw)), real(*a, **kw)))
    return seen


@pytest.mark.parametrize("shape", [(0, 128), (1, 7), (5, 300), (2, 3, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_act_matches_reference(shape, dtype):
    x = (torch.randn(shape) * 3).to(DEVICE, dtype)
    q, s = quantize_act(x)
    q_ref, s_ref = quantize_act_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0)


@triton.jit
def _divide_rn_kernel(x_ptr, s_ptr, q_ptr, GROUPS: tl.constexpr):
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    at = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(q_ptr + at, divide_rn(tl.load(x_ptr + at), tl.load(s_ptr + g)[:, None]))


@pytest.mark.parametrize("source", ["bf16", "fp32"])
def test_divide_rn_is_the_rounded_quotient(source):
    """divide_rn (the reciprocal and a fused correction, as the ht send kernel quantizes) against torch's
    division, as the fp8 quantization uses it: x over amax / 448 per group of 128, magnitudes spread over
    2^+-60 (bf16 rows) or 2^+-90, subnormal and signed-zero inputs. Bit-exact float32 quotients where
    they are at least 2^-10 (below, e4m3 rounds them to zero), and bit-exact fp8 values throughout."""
    g = torch.Generator().manual_seed(11)
    groups = 4096
    spread = 40.0 if source == "bf16" else 60.0
    x = torch.randn(groups, 128, generator=g) * torch.exp(torch.randn(groups, 1, generator=g) * spread / 3)
    if source == "bf16":
        x = x.bfloat16().float()
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39])
    x[1] = torch.tensor([1e-40, -1e-40]).repeat(64)
    x[2] = -0.0
    s = x.abs().amax(1).clamp_min(1e-10) / 448
    q = torch.empty_like(x, device=DEVICE)
    _divide_rn_kernel[(groups // 16,)](x.to(DEVICE), s.to(DEVICE), q, GROUPS=16)
    q, ref = q.cpu(), x / s[:, None]
    big = ref.abs() >= 2 ** -10
    assert torch.equal(q[big].view(torch.int32), ref[big].view(torch.int32))
    fp8 = lambda v: v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)  # noqa: E731
    assert torch.equal(fp8(q), fp8(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["bf16", "fp32"])
def test_divide_rn_is_the_rounded_quotient_gpu(source):
    """The same on the GPU, for the `gpu`-marked run there (it skips unmarked tests)."""
    test_divide_rn_is_the_rounded_quotient(source)


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gate_up_and_down_match_reference(counts, batched, dtype):
    L, D, F = len(counts), 40, 24  # K not a multiple of the 32-column K tile
    rows, R = make_rows(counts, batched)
    w13, w2 = weights(L, D, F, dtype)
    x = torch.randn(R, D).to(DEVICE, dtype)
    h, h_scale = gate_up(x, w13, rows)
    assert h_scale is None and h.shape == (R, F) and h.dtype == dtype
    mask = valid_mask(rows, R)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(h[mask].float(), gate_up_ref(x, w13, rows)[mask], rtol=rtol, atol=atol)
    row_scale = torch.rand(R, device=DEVICE)
    y = down(h, w2, rows, row_scale_R=row_scale)
    assert y.shape == (R, D) and y.dtype == dtype
    torch.testing.assert_close(y[mask].float(), down_ref(h, w2, rows, row_scale_R=row_scale)[mask],
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("counts", [[5, 0, 17], [0, 0, 0], [1, 0, 0]])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("block_n,block_k", [(32, 32), (64, 128), (128, 128)])  # 128 columns: h quantized in the
#   gate-up epilogue; 64 with 128-deep K blocks: bf16 x quantized in the batched kernel, float32 h quantized after
@pytest.mark.parametrize("F", [72, 128])  # 72: partial scale groups (per-column weight scales); 128: per tile
@pytest.mark.parametrize("x_fp8", [True, False])  # False: bf16 x quantized by the launcher or the kernel
def test_fp8_gate_up_and_down_match_reference(counts, batched, block_n, block_k, F, x_fp8):
    L, D = len(counts), 136  # a partial last scale group in K
    rows, R = make_rows(counts, batched)
    w13, w2 = weights(L, D, F)
    (q13, s13), (q2, s2) = quantize_weight_ref(w13), quantize_weight_ref(w2)
    x = torch.randn(R, D, device=DEVICE).bfloat16()
    xq, xs = quantize_act_ref(x)
    cfg = GemmConfig(block_m=16, block_n=block_n, block_k=block_k)
    mask = valid_mask(rows, R)
    if x_fp8:
        h, hs = gate_up(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, config=cfg)
    else:  # batched with block_k 128: quantized inside the gate-up kernel
        h, hs = gate_up(x, q13, rows, w13_scale=s13, config=cfg)
        h_given, hs_given = gate_up(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, config=cfg)
        # x quantized as the reference does: the same h as given the reference's, bit for bit
        assert torch.equal(h[mask].view(torch.uint8), h_given[mask].view(torch.uint8))
        assert torch.equal(hs[mask], hs_given[mask])
    assert h.dtype == torch.float8_e4m3fn and hs.shape == (R, -(-F // 128))
    h_ref = gate_up_ref(xq, q13, rows, x_scale_RG=xs, w13_scale=s13)
    assert_h_close(dequantize_act_ref(h, hs)[mask], h_ref[mask])
    torch.testing.assert_close(hs[mask], quantize_act_ref(h_ref)[1][mask], rtol=FP8_SCALE_RTOL[DEVICE.type], atol=0)
    y = down(h, q2, rows, h_scale_RG=hs, w2_scale=s2, out_dtype=torch.bfloat16, config=cfg)
    y_ref = down_ref(h, q2, rows, h_scale_RG=hs, w2_scale=s2)
    torch.testing.assert_close(y[mask].float(), y_ref[mask], rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("counts", [[5, 0, 17], [0, 0, 0]])
@pytest.mark.parametrize("layout", ["contiguous", "batched", "indexed"])  # indexed: A by pointers, B by TMA
@pytest.mark.parametrize("fp8,F", [(False, 48), (True, 128), (True, 80)])
def test_tma_loads_match_reference(counts, layout, fp8, F, monkeypatch):
    """Tiles loaded through TMA descriptors (GemmConfig.tma) give the pointer loads' results, with a
    partial last K tile (bf16: K = 80 with 32-column tiles) and a partial last column tile (F 80: the
    fp8 gate-up then keeps pointer loads for B, whose rows past F would enter h's scale)."""
    from epmoe.kernels import grouped_gemm
    built = []  # (block shape) of each descriptor the launcher made

    def spy(t, block):
        desc = _descriptor(t, block)
        if desc is not None:
            built.append(tuple(block))
        return desc
    monkeypatch.setattr(grouped_gemm, "_descriptor", spy)
    L, D = len(counts), (144 if fp8 else 80)
    rows, R = make_rows(counts, layout == "batched")
    w13, w2 = weights(L, D, F)
    x = torch.randn(R, D, device=DEVICE).bfloat16()
    x_rows = None
    if layout == "indexed":
        x_rows = torch.randint(0, R // 2 + 1, (R,), dtype=torch.int32).to(DEVICE)
        x = x[: R // 2 + 1]
    cfg = GemmConfig(block_m=16, block_n=128 if fp8 else 32, block_k=128 if fp8 else 32, tma=True)
    assert _descriptor(w13.view(-1, D), [cfg.block_n, cfg.block_k]) is not None
    mask = valid_mask(rows, R)
    if fp8:
        (q13, s13), (q2, s2) = quantize_weight_ref(w13), quantize_weight_ref(w2)
        xq, xs = quantize_act_ref(x)
        h, hs = gate_up(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=x_rows, config=cfg)
        h_ref = gate_up_ref(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=x_rows)
        torch.testing.assert_close(dequantize_act_ref(h, hs)[mask], h_ref[mask], rtol=FP8_H_TOL[0],
                                   atol=FP8_H_TOL[1])
        y = down(h, q2, rows, h_scale_RG=hs, w2_scale=s2, out_dtype=torch.bfloat16, config=cfg)
        y_ref = down_ref(h, q2, rows, h_scale_RG=hs, w2_scale=s2)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        h, _ = gate_up(x, w13, rows, x_rows_R=x_rows, config=cfg)
        torch.testing.assert_close(h[mask].float(), gate_up_ref(x, w13, rows, x_rows_R=x_rows)[mask],
                                   rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1])
        y = down(h, w2, rows, config=cfg)
        y_ref = down_ref(h, w2, rows)
    torch.testing.assert_close(y[mask].float(), y_ref[mask], rtol=2e-2, atol=3e-2)
    if sum(counts):  # TMA really loaded: B of both GEMMs (of the down GEMM only for fp8 with F 80), A of
        # the down GEMM and of the gate-up unless its rows come through the index
        assert built.count((cfg.block_n, cfg.block_k)) == (1 if fp8 and F % cfg.block_n else 2)
        assert built.count((cfg.block_m, cfg.block_k)) == (1 if layout == "indexed" else 2)


# quant: (F, D, block_n, block_k) of test_swapped_product_matches_reference
SWAP_CASES = {"fp32": (48, 80, 32, 32), "bf16": (48, 80, 32, 32), "fp8_tile": (128, 144, 128, 128),
              "fp8_partial": (192, 144, 128, 128), "fp8_columns": (80, 144, 64, 64), "fp8_bf16_x": (128, 144, 128, 128)}


@pytest.mark.parametrize("counts", [[5, 0, 17], [33, 1, 0]])
@pytest.mark.parametrize("layout", ["contiguous", "batched", "indexed"])
@pytest.mark.parametrize("quant", list(SWAP_CASES))
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("block_m", [16, 32])  # 32: square tiles of the unquantized cases
def test_swapped_product_matches_reference(counts, layout, quant, tma, block_m, monkeypatch):
    """GemmConfig.swap_ab (each K block's product with the weights on the MMA's M side, the sum transposed
    before the epilogue) gives the references' results in each variant of the pointer kernel: fp32 (ieee
    sums), bf16 (a partial last K block and column tile), fp8 with one weight scale per tile and h quantized
    in the gate-up's epilogue (with a partial last column tile: F 192), fp8 with per-column weight scales
    (F 80: h quantized after), bf16 x with fp8 weights (quantized in the batched kernel, else by the
    launcher); rows through a row index; pointer or TMA loads; the top-k weights in the down's epilogue."""
    swapped = record_pointer_launches(monkeypatch, lambda kw: kw["SWAP_AB"])
    F, D, block_n, block_k = SWAP_CASES[quant]
    rows, R = make_rows(counts, layout == "batched")
    w13, w2 = weights(len(counts), D, F)
    dtype = torch.float32 if quant == "fp32" else torch.bfloat16
    x = torch.randn(R, D, device=DEVICE).to(dtype)
    x_rows = None
    if layout == "indexed":
        x_rows = torch.randint(0, R // 2 + 1, (R,), dtype=torch.int32).to(DEVICE)
        x = x[: R // 2 + 1]
    cfg = GemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, tma=tma, swap_ab=True)
    mask = valid_mask(rows, R)
    row_scale = torch.rand(R, device=DEVICE)
    if quant.startswith("fp8"):
        (w13, s13), (w2, s2) = quantize_weight_ref(w13), quantize_weight_ref(w2)
        x, xs = (x, None) if quant == "fp8_bf16_x" else quantize_act_ref(x)
        h, hs = gate_up(x, w13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=x_rows, config=cfg)
        h_ref = gate_up_ref(x, w13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=x_rows)
        assert_h_close(dequantize_act_ref(h, hs)[mask], h_ref[mask])
        y = down(h, w2, rows, h_scale_RG=hs, w2_scale=s2, row_scale_R=row_scale, out_dtype=torch.bfloat16,
                 config=cfg)
        y_ref = down_ref(h, w2, rows, h_scale_RG=hs, w2_scale=s2, row_scale_R=row_scale)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
        h, _ = gate_up(x, w13, rows, x_rows_R=x_rows, config=cfg)
        torch.testing.assert_close(h[mask].float(), gate_up_ref(x, w13, rows, x_rows_R=x_rows)[mask],
                                   rtol=TOL[dtype][0], atol=TOL[dtype][1])
        y = down(h, w2, rows, row_scale_R=row_scale, config=cfg)
        y_ref = down_ref(h, w2, rows, row_scale_R=row_scale)
    assert_outputs_close(y[mask].float(), y_ref[mask], dtype, "fp8_block" if quant.startswith("fp8") else None)
    assert swapped == [True, True]  # both GEMMs ran the swapped product


def test_swapped_warp_specialized_configs_are_checked():
    """Swapped, the weights' block_n rows are the wgmma's M side (128: what the schedules are compiled and tested
    for) and the expert's block_m rows its N side (16 or more); not on the split schedule, whose consumers split
    a tile's rows."""
    GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=8, warp_specialize="cooperative", swap_ab=True)
    GemmConfig(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4, warp_specialize="interleaved",
               swap_ab=True)
    for block_n in (64, 256):
        with pytest.raises(ValueError, match="block_n 128"):
            GemmConfig(block_m=16, block_n=block_n, block_k=128, num_warps=8, warp_specialize="cooperative",
                       swap_ab=True)
    with pytest.raises(ValueError, match="block_m >= 64"):
        GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=8, warp_specialize="cooperative")
    with pytest.raises(ValueError, match="cooperative or interleaved"):
        GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=4, warp_specialize="split", swap_ab=True)


def test_row_index_is_validated():
    x = torch.randn(4, 8, device=DEVICE)
    counts = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    offsets = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    for rows in (torch.tensor([0, 1]), torch.tensor([[0, 1]], dtype=torch.int32)):  # int64; 2-D
        with pytest.raises(ValueError, match="row_index_N must be int32"):
            ExpertBatch(layout=Layout.CONTIGUOUS, x=x, x_scale=None, counts_L=counts, offsets_L1=offsets,
                        handle=None, row_index_N=rows.to(DEVICE))
    with pytest.raises(ValueError, match="contiguous layout"):
        ExpertBatch(layout=Layout.BATCHED, x=x.view(1, 4, 8), x_scale=None, counts_L=counts, offsets_L1=None,
                    handle=None, row_index_N=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    rows, _ = make_rows([2, 3], batched=False)
    w13, _ = weights(2, 8, 4)
    with pytest.raises(ValueError, match="x_rows_R must be int32"):
        gate_up(x, w13, rows, x_rows_R=torch.zeros(5, dtype=torch.int64, device=DEVICE))


def test_kernels_refuse_bad_operands():
    rows, R = make_rows([2, 3], batched=False)
    w13, w2 = weights(2, 32, 16)
    x = torch.randn(R, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weights must be"):
        gate_up(x, w13[:1], rows)
    with pytest.raises(ValueError, match="differ"):
        gate_up(x.bfloat16(), w13, rows)
    with pytest.raises(ValueError, match="need w_scale"):
        gate_up(quantize_act_ref(x)[0], quantize_weight_ref(w13)[0], rows)
    with pytest.raises(ValueError, match="need a_scale"):
        q13, s13 = quantize_weight_ref(w13)
        gate_up(quantize_act_ref(x)[0], q13, rows, w13_scale=s13)
    with pytest.raises(ValueError, match="need fp8 weights"):
        gate_up(quantize_act_ref(x)[0], w13, rows)
    with pytest.raises(ValueError, match="row_scale_R"):
        down(torch.randn(R, 16, device=DEVICE), w2, rows, row_scale_R=torch.ones(R + 1, device=DEVICE))
    batched_rows = ExpertRows.batched_slots(torch.tensor([1, 1], dtype=torch.int32, device=DEVICE), 4)
    with pytest.raises(ValueError, match="L\\*M"):
        gate_up(torch.randn(7, 32, device=DEVICE), w13, batched_rows)


def batch_for(counts, layout, D, dtype, pad=3, fp8_input=False, indexed=False):
    """A batch with random rows; `indexed` (contiguous): x holds fewer source rows than the batch, read
    through a random row_index_N (repeats, and padding entries, included)."""
    if indexed:
        plain = batch_for(counts, layout, D, dtype, pad, fp8_input)
        N = plain.x.shape[0]
        S = N // 2 + 1
        g = torch.Generator().manual_seed(N)
        source = batch_for([S], layout, D, dtype, 0, fp8_input)
        rows = torch.randint(0, S, (N,), generator=g, dtype=torch.int32).to(DEVICE)
        return ExpertBatch(layout=layout, x=source.x, x_scale=source.x_scale, counts_L=plain.counts_L,
                           offsets_L1=plain.offsets_L1, handle=None, row_index_N=rows)
    counts_L = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    if layout is Layout.BATCHED:
        x = torch.randn(len(counts), max(counts) + pad, D).to(DEVICE, dtype)
        offsets = None
    else:
        x = torch.randn(sum(counts) + pad, D).to(DEVICE, dtype)
        offsets = torch.zeros(len(counts) + 1, dtype=torch.int32, device=DEVICE)
        offsets[1:] = torch.cumsum(counts_L, 0)
    x_scale = None
    if fp8_input:
        x, x_scale = quantize_act_ref(x)
    return ExpertBatch(layout=layout, x=x, x_scale=x_scale, counts_L=counts_L, offsets_L1=offsets, handle=None)


def batch_rows_mask(batch):
    if batch.layout is Layout.BATCHED:
        M = batch.x.shape[1]
        return torch.arange(M, device=DEVICE)[None, :] < batch.counts_L[:, None]
    return torch.arange(batch.out_shape[0], device=DEVICE) < batch.offsets_L1[-1]


def loaded_experts(L, D, F, dtype, quant):
    """`triton` and `reference` experts of one config, with the same random weights loaded."""
    cfg = MoEConfig(num_experts=L, top_k=1, hidden_size=D, intermediate_size=F, dtype=dtype, quant=quant)
    w13, w2 = weights(L, D, F)
    pair = TritonExperts(cfg, L, DEVICE), ReferenceExperts(cfg, L, DEVICE)
    for experts in pair:
        experts.load(w13, w2)
    return pair


CASES = [  # (dtype, quant, fp8 input from the dispatcher)
    (torch.bfloat16, None, False), (torch.float32, None, False), (torch.float16, None, False),
    (torch.bfloat16, "fp8_block", False), (torch.bfloat16, "fp8_block", True),
]


@pytest.mark.parametrize("dtype,quant,fp8_input", CASES)
@pytest.mark.parametrize("layout", [Layout.CONTIGUOUS, Layout.BATCHED])
@pytest.mark.parametrize("counts", [[4, 0, 19], [0, 0, 0], [1, 0, 0]])
def test_triton_experts_match_reference_experts(dtype, quant, fp8_input, layout, counts):
    L, D = len(counts), 136
    triton_experts, reference = loaded_experts(L, D, 40, dtype, quant)
    batch = batch_for(counts, layout, D, dtype, fp8_input=fp8_input)
    y, y_ref = triton_experts(batch), reference(batch)
    assert y.shape == batch.x.shape and y.dtype == dtype
    mask = batch_rows_mask(batch)
    assert_outputs_close(y[mask].float(), y_ref[mask].float(), dtype, quant)


@pytest.mark.parametrize("dtype,quant,fp8_input", CASES)
@pytest.mark.parametrize("counts", [[4, 0, 19], [0, 0, 0]])
def test_triton_experts_read_rows_through_the_row_index(dtype, quant, fp8_input, counts):
    """A batch with row_index_N (as `ht` hands over) gives the rows of its materialized copy."""
    L, D = len(counts), 136
    triton_experts, reference = loaded_experts(L, D, 40, dtype, quant)
    batch = batch_for(counts, Layout.CONTIGUOUS, D, dtype, fp8_input=fp8_input, indexed=True)
    assert batch.x.shape[0] < batch.out_shape[0]
    y, y_ref = triton_experts(batch), reference(batch.materialize())
    assert y.shape == batch.out_shape and y.dtype == dtype
    mask = batch_rows_mask(batch)
    assert_outputs_close(y[mask].float(), y_ref[mask].float(), dtype, quant)


def test_fused_moe_with_triton_experts_matches_reference():
    """End to end through the local dispatcher: -1 ids, skewed routing, an odd token count."""
    E, K, D, F, T = 4, 2, 48, 32, 13
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=F)
    w13, w2 = weights(E, D, F)
    ids = torch.randint(0, 2, (T, K), device=DEVICE)  # only experts 0 and 1 get rows
    ids[:, 1] = torch.where(ids[:, 0] == 0, 1, 0)
    ids[::3, 1] = -1
    weights_TK = torch.rand(T, K, device=DEVICE)
    x = torch.randn(T, D, device=DEVICE).bfloat16()
    outs = []
    for name in ("triton", "reference"):
        moe = FusedMoE(cfg, dispatcher="local", experts=name, device=DEVICE)
        moe.load_experts(w13, w2)
        outs.append(moe(x, weights_TK=weights_TK, ids_TK=ids).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("counts", [[4, 0, 19], [0, 0, 0], [1, 0, 0]])
@pytest.mark.parametrize("indexed", [False, True])  # True: Experts.__call__ hands over the materialized batch
def test_grouped_mm_experts_match_reference_experts(counts, indexed):
    L, D, F = len(counts), 64, 32
    cfg = MoEConfig(num_experts=L, top_k=1, hidden_size=D, intermediate_size=F)
    if not GroupedMMExperts.availability(cfg, DEVICE)[0]:
        pytest.skip(GroupedMMExperts.availability(cfg, DEVICE)[1])
    w13, w2 = weights(L, D, F)
    experts, reference = GroupedMMExperts(cfg, L, DEVICE), ReferenceExperts(cfg, L, DEVICE)
    experts.load(w13, w2)
    reference.load(w13, w2)
    batch = batch_for(counts, Layout.CONTIGUOUS, D, torch.bfloat16, indexed=indexed)
    mask = batch_rows_mask(batch)
    y = experts(batch)
    assert y.shape == batch.out_shape
    torch.testing.assert_close(y[mask].float(), reference(batch.materialize())[mask].float(), rtol=2e-2, atol=3e-2)


def test_registry_lists_and_auto_choice():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    table = list_experts(cfg, DEVICE)
    assert {"reference", "triton", "grouped_mm"} <= set(table)
    assert table["triton"][0]
    small = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, max_tokens_per_rank=64)
    assert resolve_experts("auto", small, DEVICE) == ("triton" if DEVICE.type == "cuda" else "reference")
    odd = MoEConfig(num_experts=4, top_k=2, hidden_size=60, intermediate_size=32)
    assert not list_experts(odd, DEVICE)["grouped_mm"][0]
    assert not list_experts(MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32,
                                      quant="fp8_block"), DEVICE)["grouped_mm"][0]


def test_config_table_is_valid_and_choice_is_pure():
    for op in configs.OPS:
        for fp8 in (False, True):
            buckets = configs._table()[configs.table_key(op, fp8)]
            for key in {configs.table_key(op, fp8), configs.table_key(op, fp8, indexed=True)} & set(configs._table()):
                bounds = [bound for bound, _ in configs._table()[key]]
                assert bounds == sorted(bounds), key
                for _, cfg in configs._table()[key]:
                    assert not fp8 or 128 % cfg.block_k == 0
            assert gemm_config(op, fp8=fp8, rows_hint=1, on_gpu=True) == buckets[0][1]
            assert gemm_config(op, fp8=fp8, rows_hint=10 ** 12, on_gpu=True) == buckets[-1][1]
    assert gemm_config("down", fp8=False, rows_hint=64, on_gpu=False) == configs.INTERPRETER_CONFIG
    hand_set = configs.HAND_SET_ROWS
    for fp8 in (False, True):  # routed rows: the hand-set buckets for `routed_rows`, the tuned entries above
        plain, indexed = (configs._table()[configs.table_key("gate_up", fp8, indexed=i)] for i in (False, True))
        own = [(bound, cfg) for bound, cfg in indexed if bound <= hand_set]  # the indexed table's hand-set buckets
        tuned = indexed[len(own):]
        assert max(bound for bound, _ in plain if bound < tuned[0][0]) == hand_set
        assert not own or own[-1][0] == hand_set  # (they cover every hand-set routed_rows)
        for rows in (1, 5, 8, 12, 16, 32, hand_set - 8, hand_set - 4, hand_set, 100, 10 ** 6):
            wide = configs.routed_rows(rows)
            for op in configs.OPS:  # rows in order (scattered): the plain table
                want = gemm_config(op, fp8=fp8, rows_hint=wide if wide <= hand_set else rows, on_gpu=True)
                assert gemm_config(op, fp8=fp8, rows_hint=rows, on_gpu=True, scattered=True) == want, (op, rows)
            # through a row index: the indexed table's hand-set entry, else the pointer variant of the plain one;
            # above, the tuned indexed entry as it is (the warp-specialized ones gather the rows themselves)
            want = (next(cfg for bound, cfg in own if wide <= bound) if wide <= hand_set and own else
                    next(cfg for bound, cfg in plain if wide <= bound).pointer_variant(1 if fp8 else 2)
                    if wide <= hand_set else next((cfg for bound, cfg in tuned if rows <= bound), tuned[-1][1]))
            assert gemm_config("gate_up", fp8=fp8, rows_hint=rows, on_gpu=True, indexed=True) == want, rows
        for bound, cfg in tuned:
            assert gemm_config("gate_up", fp8=fp8, rows_hint=min(bound, 10 ** 6), on_gpu=True, indexed=True) == cfg
        for bound, cfg in own:  # a hand-set bucket is taken by the rows `routed_rows` widens into it
            rows = max(m for m in range(1, bound + 1) if configs.routed_rows(m) <= bound)
            if all(configs.routed_rows(rows) > b for b, _ in own if b < bound):
                assert gemm_config("gate_up", fp8=fp8, rows_hint=rows, on_gpu=True, indexed=True) == cfg
    assert [configs.routed_rows(m) for m in (0, 1, 12, 16, 24, 32, 60)] == [1, 2, 16, 20, 29, 38, 68]
    assert any(cfg.warp_specialize for _, cfg in configs._table()["gate_up_bf16_indexed"])
    wide = gemm_config("down", fp8=False, rows_hint=10 ** 6, on_gpu=True, element_size=4)
    assert wide.block_k == gemm_config("down", fp8=False, rows_hint=10 ** 6, on_gpu=True).block_k // 2
    with pytest.raises(ValueError, match="op must be"):
        gemm_config("up", fp8=False, rows_hint=1, on_gpu=True)
    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(block_m=24, block_n=32, block_k=32)


WS = GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=6, warp_specialize="interleaved")


def test_routed_rows_in_order_take_the_scattered_launch_config(monkeypatch):
    """gate_up and down ask `gemm_config` for the scattered rows' config where the contiguous layout's mean
    is the hint (routed rows), not for the batched layout or a hint the caller gives."""
    asked = []
    real = grouped_gemm.gemm_config
    monkeypatch.setattr(grouped_gemm, "gemm_config", lambda op, **kw: (asked.append((op, kw["scattered"])),
                                                                        real(op, **kw))[1])
    w13, w2 = weights(2, 32, 16)
    for batched, hint in ((False, None), (True, None), (False, 4)):
        rows, R = make_rows([3, 5], batched)
        h, _ = gate_up(torch.randn(R, 32, device=DEVICE), w13, rows, rows_hint=hint)
        down(h, w2, rows, rows_hint=hint)
    scattered = [(False, None), (True, None), (False, 4)]
    assert asked == [(op, not b and h is None) for b, h in scattered for op in ("gate_up", "down")]


def interleaved_ring(n_mine: int, steps: int, lone_stride: int) -> tuple[list[int], dict[int, int]]:
    """The interleaved schedule's ring as grouped_gemm_ws lays it out for one program of n_mine tiles of
    `steps` K blocks: (the positions its loader fills, in order; {position: the consumer that takes it}),
    `_ws_load`'s pairs and `_ring_slot`'s positions (a pair's tiles alternate; a lone last tile on every
    lone_stride-th position: 2 in the kernel)."""
    fills, owner = [], {}
    for p in range(-(-n_mine // 2)):
        full = 2 * p + 1 < n_mine
        for kk in range(steps):
            pos = 2 * p * steps + (2 if full else lone_stride) * kk
            fills += [pos, pos + 1] if full else [pos]
            owner.update({pos: 0, pos + 1: 1} if full else {pos: 0})
    return fills, owner


@pytest.mark.parametrize("lone_stride,stages,safe", [(2, 4, True), (2, 6, True), (2, 8, True), (1, 6, False),
                                                     (2, 5, False)])
def test_interleaved_consumers_keep_their_own_stages(lone_stride, stages, safe):
    """An mbarrier tells only its phase's parity, so a consumer's wait on a stage for position pos is sound
    only if the stage's fill before it (its last filled position below pos) was the same consumer's, which
    it waited for; else, with that fill still in flight, the wait passes at once. The kernel's layout (a
    lone tile on its consumer's own positions, an even count of stages) keeps that for every tile count and
    K; a lone tile on consecutive positions, or an odd count of stages, does not."""
    violations = 0
    for n_mine, steps in itertools.product(range(1, 8), (1, 2, 3, 5, 16)):
        fills, owner = interleaved_ring(n_mine, steps, lone_stride)
        assert fills == sorted(fills) and sorted(owner) == fills  # filled in order, each taken once
        last = {}  # stage -> its last filled position
        for pos in fills:
            stage = pos % stages
            violations += stage in last and owner[last[stage]] != owner[pos]
            last[stage] = pos
    assert (violations == 0) == safe


def test_warp_specialized_configs_are_validated_and_have_a_pointer_variant():
    for bad in (dict(warp_specialize="coop"), dict(num_warps=8), dict(block_m=32), dict(num_stages=2),
                dict(num_stages=5),  # (interleaved consumers keep their own stages: an even count)
                dict(warp_specialize="split")):  # (split consumers take half of block_m rows each: >= 128)
        with pytest.raises(ValueError, match="warp_specialize"):
            GemmConfig(**{**WS.to_dict(), **bad})
    assert GemmConfig(**{**WS.to_dict(), "warp_specialize": "split", "block_m": 128}).pointer_variant().num_warps == 8
    with pytest.raises(ValueError, match="pipe_mma needs warp_specialize"):
        GemmConfig(block_m=64, block_n=64, block_k=64, pipe_mma=True)
    ptr = WS.pointer_variant()
    assert (ptr.warp_specialize, ptr.num_warps, ptr.tma) == (None, 8, True)
    assert (ptr.block_m, ptr.block_n, ptr.block_k, ptr.num_stages) == (64, 128, 64, 4)
    assert GemmConfig(**{**WS.to_dict(), "block_m": 128, "block_n": 256}).pointer_variant().num_stages == 2
    assert ptr.pointer_variant() == ptr
    assert GemmConfig(**WS.to_dict()) == WS  # the table's form round-trips
    assert "pipe_mma" not in WS.to_dict() and "warp_specialize" not in ptr.to_dict()
    # claimed tiles: the cooperative schedule only, a tile-number slot per stage; the pointer kernel splits statically
    cooperative = {**WS.to_dict(), "warp_specialize": "cooperative", "num_warps": 8}
    for bad in (dict(WS.to_dict(), warp_specialize="interleaved"), dict(cooperative, num_stages=9),
                dict(block_m=64, block_n=64, block_k=64)):
        with pytest.raises(ValueError, match="claim_tiles needs"):
            GemmConfig(**bad, claim_tiles=True)
    claimed = GemmConfig(**cooperative, claim_tiles=True)
    assert not claimed.pointer_variant().claim_tiles and claimed.to_dict()["claim_tiles"] is True
    assert "+claim" in experts_tune.describe(claimed) and "+claim" not in experts_tune.describe(WS)


def test_row_index_launches_take_the_indexed_entry_or_a_pointer_variant(monkeypatch):
    table = {"gate_up_bf16": [[10 ** 9, WS]], "gate_up_fp8": [[10 ** 9, WS]], "down_bf16": [[10 ** 9, WS]],
             "gate_up_bf16_indexed": [[10 ** 9, configs.INTERPRETER_CONFIG]]}
    monkeypatch.setattr(configs, "_table", lambda path=None, gpu=None: table)
    assert gemm_config("gate_up", fp8=False, rows_hint=9, on_gpu=True) == WS
    assert gemm_config("gate_up", fp8=False, rows_hint=9, on_gpu=True, indexed=True) == configs.INTERPRETER_CONFIG
    assert gemm_config("gate_up", fp8=True, rows_hint=9, on_gpu=True, indexed=True) == WS.pointer_variant(1)
    table["gate_up_bf16_indexed"] = [[10 ** 9, WS]]  # a tuned warp-specialized entry stays warp-specialized
    assert gemm_config("gate_up", fp8=False, rows_hint=9, on_gpu=True, indexed=True) == WS
    table["gate_up_bf16_indexed"] = [[10 ** 9, configs.INTERPRETER_CONFIG]]
    wide = gemm_config("down", fp8=False, rows_hint=9, on_gpu=True, element_size=4)  # float32: pointer kernel
    assert wide.warp_specialize is None and wide.block_k == 32
    # decode sizes keep the plain table's hand-set buckets below the indexed entry's first bound
    small = GemmConfig(block_m=16, block_n=64, block_k=128, group_m=1)
    table["gate_up_bf16"] = [[64, small], [10 ** 9, WS]]
    table["gate_up_bf16_indexed"] = [[128, configs.INTERPRETER_CONFIG], [10 ** 9, configs.INTERPRETER_CONFIG]]
    assert gemm_config("gate_up", fp8=False, rows_hint=1, on_gpu=True, indexed=True) == small.pointer_variant(2)
    assert gemm_config("gate_up", fp8=False, rows_hint=65, on_gpu=True, indexed=True) == configs.INTERPRETER_CONFIG
    # an indexed table's own hand-set buckets serve gathered rows at decode sizes, as they are, and only there
    gathered = GemmConfig(block_m=32, block_n=64, block_k=128, group_m=1)
    table["gate_up_bf16_indexed"] = [[32, gathered], [64, WS], [128, configs.INTERPRETER_CONFIG]]
    assert gemm_config("gate_up", fp8=False, rows_hint=1, on_gpu=True, indexed=True) == gathered
    assert gemm_config("gate_up", fp8=False, rows_hint=32, on_gpu=True, indexed=True) == WS  # routed_rows: 38
    assert gemm_config("gate_up", fp8=False, rows_hint=64, on_gpu=True, indexed=True) == configs.INTERPRETER_CONFIG
    assert gemm_config("gate_up", fp8=False, rows_hint=32, on_gpu=True, scattered=True) == small  # the plain table
    # hand-set buckets that stop short of HAND_SET_ROWS: the plain entry's pointer variant past them, as
    # above them when the indexed table has nothing more
    table["gate_up_bf16_indexed"] = [[32, gathered]]
    assert gemm_config("gate_up", fp8=False, rows_hint=16, on_gpu=True, indexed=True) == gathered  # 21
    assert gemm_config("gate_up", fp8=False, rows_hint=50, on_gpu=True, indexed=True) == small.pointer_variant(2)
    assert gemm_config("gate_up", fp8=False, rows_hint=100, on_gpu=True, indexed=True) == WS.pointer_variant(2)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("swap", [False, True])
def test_warp_specialized_configs_fall_back_off_hopper(fp8, batched, swap, monkeypatch):
    """Launches the warp-specialized kernel cannot serve (here: no Hopper GPU, the interpreter) run its
    config's pointer variant, with the same results (swap: a swapped config's, swapped too); on a Hopper GPU
    `test_warp_specialized_kernel_gpu` runs the kernel itself."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("Hopper runs the warp-specialized kernel (test_warp_specialized_kernel_gpu)")
    ran = record_pointer_launches(monkeypatch, lambda kw: (kw["BLOCK_M"], kw["SWAP_AB"]))
    counts = [5, 0, 70]
    L, D, F = len(counts), 128, 128
    rows, R = make_rows(counts, batched)
    w13, w2 = weights(L, D, F)
    x = torch.randn(R, D, device=DEVICE).bfloat16()
    cfg = GemmConfig(**{**WS.to_dict(), "block_k": 128 if fp8 else 64, **({"block_m": 16, "swap_ab": True} if swap
                                                                          else {})})
    mask = valid_mask(rows, R)
    if fp8:
        (q13, s13), (q2, s2) = quantize_weight_ref(w13), quantize_weight_ref(w2)
        h, hs = gate_up(x, q13, rows, w13_scale=s13, config=cfg)
        h_ref = gate_up_ref(x, q13, rows, w13_scale=s13)
        torch.testing.assert_close(dequantize_act_ref(h, hs)[mask], h_ref[mask], rtol=FP8_H_TOL[0], atol=FP8_H_TOL[1])
        y = down(h, q2, rows, h_scale_RG=hs, w2_scale=s2, out_dtype=torch.bfloat16, config=cfg)
        y_ref = down_ref(h, q2, rows, h_scale_RG=hs, w2_scale=s2)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        h, _ = gate_up(x, w13, rows, config=cfg)
        torch.testing.assert_close(h[mask].float(), gate_up_ref(x, w13, rows)[mask], rtol=2e-2, atol=3e-2)
        y = down(h, w2, rows, config=cfg)
        y_ref = down_ref(h, w2, rows)
    torch.testing.assert_close(y[mask].float(), y_ref[mask], rtol=2e-2, atol=3e-2)
    assert ran == [(cfg.block_m, swap)] * 2  # both GEMMs ran the pointer kernel with the config's tiles


def _with_table_entries(cases: list, indexed: bool) -> list:
    """The tuner's candidates and the launch table's warp-specialized entries (hand-set ones too)."""
    for op in configs.OPS if not indexed else ("gate_up",):
        for fp8 in (False, True):
            for _, cfg in configs._table().get(configs.table_key(op, fp8, indexed), ()):
                case = (fp8, cfg) if indexed else (op, fp8, cfg)
                if cfg.warp_specialize and case not in cases:
                    cases.append(case)
    return cases


# (and the decode sweep's swapped tiles of the warp-specialized kernel)
WS_CASES = _with_table_entries([(op, fp8, cfg) for (op, fp8), cands in experts_tune.WS_CANDIDATES.items()
                                for cfg in cands + tuple(c for c in experts_tune.swap_candidates(op, fp8)
                                                         if c.warp_specialize)], indexed=False)


@pytest.mark.gpu
@pytest.mark.parametrize("op,fp8,cfg", WS_CASES, ids=[f"{op}-{'fp8' if fp8 else 'bf16'}-{experts_tune.describe(c)}"
                                                      for op, fp8, c in WS_CASES])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("k_blocks", [2, 3, 7, 17])
def test_warp_specialized_kernel_gpu(op, fp8, cfg, batched, k_blocks, monkeypatch):
    """The warp-specialized kernel (each tuner candidate) against the references on a Hopper GPU: empty,
    single-row, partial-tile and multi-tile experts, both layouts, numbers of 128-deep K blocks that give
    the pipelined fp8 loop 2, 3 and 4 blocks an iteration, with and without padding steps, few and many
    more than the ring's stages (the interleaved consumers' ring waits at long K), the down GEMM with a per-row scale, full tiles stored by TMA and
    partial ones from registers (candidates with `uses_tma_store`); and it really ran."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel needs a Hopper GPU")
    launched = record_ws_launches(monkeypatch, lambda kw: kw["gate_up"])
    counts = [0, 1, 7, 64, 300, 129, 2, 1000]
    L, D, F = len(counts), 128 * k_blocks, 128 * k_blocks  # K blocks of 128 in both GEMMs
    rows, R = make_rows(counts, batched)
    w13, w2 = weights(L, D, F)
    mask = valid_mask(rows, R)
    if op == "gate_up":
        x = torch.randn(R, D, device=DEVICE).bfloat16()
        if fp8:
            q13, s13 = quantize_weight_ref(w13)
            xq, xs = quantize_act_ref(x)
            h, hs = gate_up(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, config=cfg)
            h_ref = gate_up_ref(xq, q13, rows, x_scale_RG=xs, w13_scale=s13)
            assert_fp8_h_close(dequantize_act_ref(h, hs)[mask], h_ref[mask])
        else:
            h, _ = gate_up(x, w13.bfloat16(), rows, config=cfg)
            torch.testing.assert_close(h[mask].float(), gate_up_ref(x, w13.bfloat16(), rows)[mask], rtol=2e-2,
                                       atol=3e-2)
    else:
        h = torch.randn(R, F, device=DEVICE).bfloat16()
        row_scale = torch.rand(R, device=DEVICE)
        if fp8:
            q2, s2 = quantize_weight_ref(w2)
            hq, hs = quantize_act_ref(h)
            y = down(hq, q2, rows, h_scale_RG=hs, w2_scale=s2, row_scale_R=row_scale, out_dtype=torch.bfloat16,
                     config=cfg)
            y_ref = down_ref(hq, q2, rows, h_scale_RG=hs, w2_scale=s2, row_scale_R=row_scale)
        else:
            y = down(h, w2.bfloat16(), rows, row_scale_R=row_scale, config=cfg)
            y_ref = down_ref(h, w2.bfloat16(), rows, row_scale_R=row_scale)
        torch.testing.assert_close(y[mask].float(), y_ref[mask], rtol=2e-2, atol=3e-2)
    assert launched == [op == "gate_up"]


SWAP_16BIT_CASES = [(op, c) for op in configs.OPS for c in experts_tune.swap_candidates(op, False) if c.warp_specialize]


@pytest.mark.gpu
@pytest.mark.parametrize("op,cfg", SWAP_16BIT_CASES, ids=[f"{op}-{experts_tune.describe(c)}"
                                                         for op, c in SWAP_16BIT_CASES])
def test_swapped_warp_specialized_partial_tiles_gpu(op, cfg, monkeypatch):
    """The swapped warp-specialized tiles (bf16) where the weights' rows end inside a 128-row column tile and K
    inside a block (N = K = 200: TMA zero fill past K, the last column tile's rows past N computed, never
    stored), against the references; `test_warp_specialized_kernel_gpu` takes them at whole tiles."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel needs a Hopper GPU")
    launched = record_ws_launches(monkeypatch, lambda kw: kw["cfg"].swap_ab)
    counts = [0, 1, 7, 64, 300, 2]
    L, D, F = len(counts), 200, 200
    rows, R = make_rows(counts, False)
    w13, w2 = (w.bfloat16() for w in weights(L, D, F))
    mask = valid_mask(rows, R)
    if op == "gate_up":
        x = torch.randn(R, D, device=DEVICE).bfloat16()
        out, ref = gate_up(x, w13, rows, config=cfg)[0], gate_up_ref(x, w13, rows)
    else:
        h = torch.randn(R, F, device=DEVICE).bfloat16()
        row_scale = torch.rand(R, device=DEVICE)
        out = down(h, w2, rows, row_scale_R=row_scale, config=cfg)
        ref = down_ref(h, w2, rows, row_scale_R=row_scale)
    torch.testing.assert_close(out[mask].float(), ref[mask], rtol=2e-2, atol=3e-2)
    assert launched == [True]


GATHER_CASES = _with_table_entries([(fp8, cfg) for fp8, cands in experts_tune.INDEXED_CANDIDATES.items()
                                    for cfg in cands + tuple(experts_tune.swap_candidates("gate_up", fp8))
                                    if cfg.warp_specialize], indexed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,cfg", GATHER_CASES, ids=[f"{'fp8' if fp8 else 'bf16'}-{experts_tune.describe(c)}"
                                                        for fp8, c in GATHER_CASES])
@pytest.mark.parametrize("D", [384, 640])
def test_warp_specialized_gather_kernel_gpu(fp8, cfg, D, monkeypatch):
    """The warp-specialized gate-up reading its rows through a row index (cp.async loads) against the
    reference on a Hopper GPU: source rows repeated and out of order, empty, single-row, partial-tile and
    multi-tile experts, odd and even numbers of K blocks; and it really ran."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel needs a Hopper GPU")
    launched = record_ws_launches(monkeypatch, lambda kw: kw["a_rows"] is not None)
    counts = [0, 1, 7, 64, 300, 129, 2, 1000]
    L, F = len(counts), 256
    rows, R = make_rows(counts, False)
    S = R // 3 + 1
    x_rows = torch.randint(0, S, (R,), dtype=torch.int32, device=DEVICE)
    w13, _ = weights(L, D, F)
    x = torch.randn(S, D, device=DEVICE).bfloat16()
    mask = valid_mask(rows, R)
    if fp8:
        q13, s13 = quantize_weight_ref(w13)
        xq, xs = quantize_act_ref(x)
        h, hs = gate_up(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=x_rows, config=cfg)
        h_ref = gate_up_ref(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=x_rows)
        assert_fp8_h_close(dequantize_act_ref(h, hs)[mask], h_ref[mask])  # (fp8 gate_up always returns h's scales)
    else:
        h, _ = gate_up(x, w13.bfloat16(), rows, x_rows_R=x_rows, config=cfg)
        torch.testing.assert_close(h[mask].float(), gate_up_ref(x, w13.bfloat16(), rows, x_rows_R=x_rows)[mask],
                                   rtol=2e-2, atol=3e-2)
    assert launched == [True]


# The launch table's cooperative entries with their programs claiming tiles (those that set it and those that
# do not), the gate-up's also through a row index.
CLAIM_CASES = [(op, fp8, indexed, cfg) for op in configs.OPS
               for fp8 in (False, True) for indexed in ((False, True) if op == "gate_up" else (False,))
               for cfg in dict.fromkeys(dataclasses.replace(c, claim_tiles=True) for _, c in
                                        configs._table().get(configs.table_key(op, fp8, indexed), ())
                                        if c.warp_specialize == "cooperative")]


@pytest.mark.gpu
@pytest.mark.parametrize("op,fp8,indexed,cfg", CLAIM_CASES,
                         ids=[f"{op}-{'fp8' if fp8 else 'bf16'}{'-indexed' if ix else ''}-{experts_tune.describe(c)}"
                              for op, fp8, ix, c in CLAIM_CASES])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("counts", [[0, 1, 7, 64, 300, 129, 2, 1000], [5]])
def test_claimed_tiles_match_the_static_split_gpu(op, fp8, indexed, cfg, batched, counts):
    """Cooperative configs whose programs claim their tiles from the stream's counter: the same outputs, bit for
    bit, as the static split of the same tiles (many tiles a program, and fewer tiles than programs; both
    layouts, and the gate-up through a row index); the counter back at zero after each launch; captured into
    a CUDA graph with a counter of its own (its replays agree, between eager launches)."""
    if indexed and batched:
        pytest.skip("a row index is for the contiguous layout")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel needs a Hopper GPU")
    ws = grouped_gemm.grouped_gemm_ws
    static = dataclasses.replace(cfg, claim_tiles=False)
    L, D, F = len(counts), 384, 256
    rows, R = make_rows(counts, batched)
    w13, w2 = weights(L, D, F)
    if op == "gate_up":
        a = torch.randn(R, D, device=DEVICE).bfloat16()
        w, row_scale = w13, None
    else:
        a = torch.randn(R, F, device=DEVICE).bfloat16()
        w, row_scale = w2, torch.rand(R, device=DEVICE)
    if fp8:
        w, w_s = quantize_weight_ref(w)
        a, a_s = quantize_act_ref(a)
    else:
        w, w_s, a_s = w.bfloat16(), None, None

    a_rows = torch.randperm(R, device=DEVICE).int() if indexed else None

    def run(config):
        if op == "gate_up":
            return gate_up(a, w, rows, x_scale_RG=a_s, w13_scale=w_s, x_rows_R=a_rows, config=config)[0]
        return down(a, w, rows, h_scale_RG=a_s, w2_scale=w_s, row_scale_R=row_scale, out_dtype=torch.bfloat16,
                    config=config)

    valid = valid_mask(rows, R)  # padding rows: never written

    def outputs(config):
        return run(config)[valid].view(torch.uint8)

    want = outputs(static)
    for _ in range(3):  # the counter comes back to zero for the next launch on the stream
        got = outputs(cfg)
        torch.cuda.synchronize()
        assert ws.tile_counter(a.device).tolist() == [0, 0]
        assert torch.equal(got, want)
    eager = ws.tile_counter(a.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert ws.tile_counter(a.device).data_ptr() != eager.data_ptr()  # the launch's own, zeroed in the graph
        in_graph = run(cfg)
    for _ in range(2):  # replays beside eager launches
        graph.replay()
        got = outputs(cfg)
        torch.cuda.synchronize()
        assert torch.equal(in_graph[valid].view(torch.uint8), want) and torch.equal(got, want)
        assert eager.tolist() == [0, 0]


def test_a_down_is_launched_as_its_gate_ups_dependent_where_its_config_says(monkeypatch):
    """`_gdc`: on a GPU with grid dependency control a gate-up lets a dependent start early, and a down that
    follows its gate-up waits for it; nothing on other devices. The pointer kernel's launch: a down as a
    dependent (GDC wait, launch_pdl) only where its config sets pdl and the caller says it follows its
    gate-up. TritonExperts says that its down follows its gate-up."""
    monkeypatch.setattr(grouped_gemm, "_has_gdc", lambda index: index == 0)
    gpu, old_gpu, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    gdc = grouped_gemm._gdc
    trigger, wait, none = (v.value for v in (grouped_gemm.GDC_TRIGGER, grouped_gemm.GDC_WAIT, grouped_gemm.GDC_NONE))
    assert [gdc(d, True, False) for d in (gpu, old_gpu, cpu)] == [trigger, none, none]
    assert [gdc(d, False, True) for d in (gpu, old_gpu, cpu)] == [wait, none, none]
    assert gdc(gpu, False, False) == none

    kernels = []

    class Spy:  # the pointer kernel's launch, on the tensors as if they were on that GPU
        def __getitem__(self, grid):
            return lambda *args, **kwargs: kernels.append((kwargs["GATE_UP"], kwargs["GDC"],
                                                           kwargs.get("launch_pdl", False)))
    with monkeypatch.context() as patch:
        patch.setattr(grouped_gemm, "_grouped_gemm_kernel", Spy())
        patch.setattr(grouped_gemm, "_gdc", lambda device, gate_up, dependent: gdc(gpu, gate_up, dependent))
        w13, w2 = weights(2, 64, 32)
        rows, R = make_rows([3, 5], False)
        cfg = configs.INTERPRETER_CONFIG
        h, _ = gate_up(torch.randn(R, 64, device=DEVICE), w13, rows, config=cfg)
        for pdl, follows in ((True, True), (True, False), (False, True)):
            down(h, w2, rows, config=dataclasses.replace(cfg, pdl=pdl), follows_gate_up=follows)
    assert kernels == [(True, trigger, False), (False, wait, True), (False, none, False), (False, none, False)]

    launches = []
    real = grouped_gemm._launch
    monkeypatch.setattr(grouped_gemm, "_launch", lambda *a, **kw: (launches.append(
        (kw["gate_up"], kw.get("follows_gate_up", False))), real(*a, **kw))[1])
    triton_experts, reference = loaded_experts(2, 64, 32, torch.bfloat16, None)
    batch = batch_for([3, 5], Layout.CONTIGUOUS, 64, torch.bfloat16)
    torch.testing.assert_close(triton_experts(batch)[batch_rows_mask(batch)].float(),
                               reference(batch)[batch_rows_mask(batch)].float(), rtol=TOL[torch.bfloat16][0],
                               atol=TOL[torch.bfloat16][1])
    assert launches == [(True, False), (False, True)]


# The launch table's down entries as programmatic dependents of their gate-ups (the cooperative ones also
# claiming their tiles, from the same stream's counter as a claiming gate-up before them), and an fp8 down on
# the pointer kernel; for fp8 also after a gate-up whose h is quantized after it (64-column tiles).
_H_AFTER = GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
PDL_CASES = [(fp8, None, cfg) for fp8 in (False, True)
             for cfg in dict.fromkeys(dataclasses.replace(c, pdl=True, claim_tiles=claim) for _, c in
                                      configs._table()[configs.table_key("down", fp8)]
                                      for claim in ((False, True) if c.warp_specialize == "cooperative" else (False,)))]
PDL_CASES += [(True, None, dataclasses.replace(configs._table()["down_fp8"][-1][1].pointer_variant(1), pdl=True)),
              (True, _H_AFTER, PDL_CASES[-1][2])]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,up_cfg,cfg", PDL_CASES, ids=[
    f"{'fp8' if fp8 else 'bf16'}{'-h-quantized-after' if up else ''}-{experts_tune.describe(c)}"
    for fp8, up, c in PDL_CASES])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("counts", [[0, 1, 7, 64, 300, 129, 2, 3000], [5]])
def test_dependent_down_matches_gpu(fp8, up_cfg, cfg, batched, counts):
    """A down launched as its gate-up's programmatic dependent (it starts while the gate-up ends and reads h
    after it): bit for bit the outputs of the same config launched after it. The batches are queued behind a
    sleeping kernel, so that each pair runs back to back on the GPU, each batch's h where the last one's was
    (a down that read h early would see that one's), while the uneven gate-up's last tiles run on a few SMs;
    the gate-up claiming its tiles where the down does; the pair captured into a CUDA graph and replayed on
    each batch in turn."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("programmatic dependent launch is used on Hopper")
    L, D, F = len(counts), 1024, 256
    rows, R = make_rows(counts, batched)
    w13, w2 = weights(L, D, F)
    row_scale = torch.rand(R, device=DEVICE)
    if up_cfg is None:
        up_cfg = gemm_config("gate_up", fp8=fp8, rows_hint=rows.rows_hint(R), on_gpu=True)
    if cfg.claim_tiles and up_cfg.warp_specialize == "cooperative":
        up_cfg = dataclasses.replace(up_cfg, claim_tiles=True)
    if fp8:
        (w13, s13), (w2, s2) = quantize_weight_ref(w13), quantize_weight_ref(w2)
    else:
        w13, w2, s13, s2 = w13.bfloat16(), w2.bfloat16(), None, None
    xs = [torch.randn(R, D, device=DEVICE).bfloat16() for _ in range(6)]
    xs = [quantize_act_ref(x) if fp8 else (x, None) for x in xs]
    valid = valid_mask(rows, R)

    def mlp(x, x_s, down_cfg, follows):
        h, h_s = gate_up(x, w13, rows, x_scale_RG=x_s, w13_scale=s13, config=up_cfg)
        return down(h, w2, rows, h_scale_RG=h_s, w2_scale=s2, row_scale_R=row_scale, out_dtype=torch.bfloat16,
                    config=down_cfg, follows_gate_up=follows)

    def queued(calls):
        """The calls' outputs, queued behind a sleeping kernel with no host sync between them (the first call
        made once before, so that no compile holds the queue up)."""
        calls[0]()
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        outs = [call() for call in calls]
        torch.cuda.synchronize()
        return [out[valid].view(torch.uint8) for out in outs]

    after = dataclasses.replace(cfg, pdl=False)
    want = queued([functools.partial(mlp, x, x_s, after, False) for x, x_s in xs])
    for i, got in enumerate(queued([functools.partial(mlp, x, x_s, cfg, True) for x, x_s in xs])):
        assert torch.equal(got, want[i]), f"batch {i}"
    x_in, s_in = (t.clone() if t is not None else None for t in xs[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mlp(x_in, s_in, cfg, True)

    def replay(x, x_s):
        x_in.copy_(x)
        if x_s is not None:
            s_in.copy_(x_s)
        graph.replay()
        return y.clone()
    for i, got in enumerate(queued([functools.partial(replay, x, x_s) for x, x_s in xs])):
        assert torch.equal(got, want[i]), f"replay {i}"


def assert_h_close(h: torch.Tensor, h_ref: torch.Tensor) -> None:
    """Dequantized fp8 h of the small cases against the float32 reference: within e4m3's rounding under the
    interpreter (float32 sums, as the reference's); on the GPU, the tensor cores' fp8 sums, a value in 10^4
    (or one) a step off (`assert_fp8_h_close`: every case within it on an H100 since the references divide
    exactly, 57e8fc6)."""
    if DEVICE.type == "cpu":
        torch.testing.assert_close(h, h_ref, rtol=FP8_H_TOL[0], atol=FP8_H_TOL[1])
    else:
        assert_fp8_h_close(h, h_ref)


def assert_fp8_h_close(h: torch.Tensor, h_ref: torch.Tensor, flips: float = 1e-4) -> None:
    """fp8 h against the float32 reference: within e4m3's rounding (FP8_H_TOL), except a few values (at most
    the fraction `flips` of them, or one) that a sum in another order or precision rounds to the neighbouring
    e4m3 value (one step: 2^-3 relative)."""
    err = (h - h_ref).abs()
    bad = err > FP8_H_TOL[1] + FP8_H_TOL[0] * h_ref.abs()
    assert int(bad.sum()) <= max(1, flips * h.numel()), f"{int(bad.sum())} of {h.numel()} beyond e4m3 rounding"
    assert bool((err <= 0.13 * h_ref.abs() + FP8_H_TOL[1]).all())


@pytest.mark.parametrize("op,fp8,gather,schedule", [
    ("gate_up", False, False, None), ("down", True, False, None), ("gate_up", True, False, None),
    ("gate_up", False, True, None), ("gate_up", True, True, None), ("down", False, False, "split"),
    ("gate_up", True, False, "split"), ("gate_up", False, True, "claim"), ("gate_up", True, False, "claim"),
    ("down", True, False, "dependent"), ("gate_up", True, True, "swap"), ("down", False, False, "swap")])
def test_warp_specialized_launch_binds_the_kernel_signature(op, fp8, gather, schedule, monkeypatch):
    """The host side of the warp-specialized launch without a GPU: every argument binds to a parameter
    of the Gluon kernel, the descriptors have the config's tiles, and the constexprs say what the call is
    (gather: A's source rows and the row index passed as pointers; split: TMA stores of half tiles; claim: the
    stream's tile counter, zero, in place of the unread pointer; dependent: a programmatic dependent launch
    whose partitions wait; swap: products with the weights on the wgmma's M side, 16-row A tiles)."""
    import inspect
    ws = pytest.importorskip("epmoe.kernels.grouped_gemm_ws")
    calls = []
    signature = inspect.signature(ws._ws_gemm_kernel.fn)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                options = {k: kwargs.pop(k) for k in ("num_warps", "maxnreg", "launch_pdl")}
                calls.append((grid, signature.bind(*args, **kwargs).arguments, options))
            return launch
    monkeypatch.setattr(ws, "_ws_gemm_kernel", Spy())
    claim, dependent, swap = schedule == "claim", schedule == "dependent", schedule == "swap"
    if dependent or swap:
        schedule = None
    cfg = next(c for c in (experts_tune.swap_candidates(op, fp8) if swap else experts_tune.WS_CANDIDATES[(op, fp8)])
               if c.warp_specialize and ("cooperative" if claim else schedule) in (None, c.warp_specialize))
    if claim:
        cfg = dataclasses.replace(cfg, claim_tiles=True)
        schedule = "cooperative"
    claim = cfg.claim_tiles  # (the swapped gate-up's too)
    L, N, K, R = 3, 256, 384, 40
    w = torch.zeros(L, 2 * N if op == "gate_up" else N, K)
    a = torch.zeros(R, K)
    a_s = w_s = out_scale = None
    if fp8:
        w, w_s = quantize_weight_ref(w)
        a, a_s = quantize_act_ref(a)
    out = torch.empty(R, N, dtype=torch.float8_e4m3fn if op == "gate_up" and fp8 else torch.bfloat16)
    if out.dtype == torch.float8_e4m3fn:
        out_scale = torch.empty(R, N // 128)
    offsets = torch.tensor([0, 5, 5, 40], dtype=torch.int32)
    a = a.bfloat16() if not fp8 else a
    a_rows = torch.arange(R, dtype=torch.int32).flip(0) if gather else None
    ws.launch(a, a_s, w.bfloat16() if not fp8 else w, w_s, offsets, False, 0, out,
              out_scale, None, gate_up=op == "gate_up", cfg=cfg, programs=7, a_rows=a_rows, dependent=dependent)
    (grid, bound, options), = calls
    assert grid == (7, ) and options == {"num_warps": cfg.num_warps, "maxnreg": ws._MAX_REGISTERS,
                                         "launch_pdl": dependent}
    assert bound["a_desc"].block_shape == [cfg.block_m, cfg.block_k]
    assert bound["b_desc"].block_shape == [cfg.block_n, cfg.block_k] and bound["b_desc"].shape[0] == w.shape[0] * w.shape[1]
    assert (bound["L"], bound["R"], bound["N"], bound["K"]) == (L, R, N, K)
    meta = bound["META"]
    assert (meta.gate_up, meta.fp8, meta.quant_out, meta.has_row_scale) == (op == "gate_up", fp8,
                                                                            out_scale is not None, False)
    assert meta.gather == gather and bound["a_ptr"] is a
    assert bound["a_rows_ptr"] is (a_rows if gather else offsets)
    assert meta.claim == claim and meta.gdc_wait == dependent
    assert meta.swap == swap and (not swap or bound["a_desc"].block_shape == [16, cfg.block_k])
    assert bound["b_ptr"].data_ptr() == bound["b_desc"].base.data_ptr()  # (read by a dependent's L2 prefetch)
    assert bound["counter_ptr"] is (ws.tile_counter(a.device) if claim else offsets)
    assert not claim or bound["counter_ptr"].tolist() == [0, 0]
    # 16-bit outputs of the cooperative and split schedules store full tiles by TMA where the buffer fits (not
    # the fp8 h); a split consumer stores its half of a tile
    assert meta.tma_store == (cfg.warp_specialize in ("cooperative", "split") and out.dtype == torch.bfloat16
                              and ws.uses_tma_store(cfg, a.dtype, out, op == "gate_up", False))
    assert meta.tma_store or schedule != "split" or op == "gate_up"
    if meta.tma_store:
        c_desc = bound["c_desc"]
        rows = cfg.block_m // (2 if schedule == "split" else 1)
        assert list(c_desc.block_shape) == [rows, cfg.block_n] == ws.tma_store_block(cfg)
        assert list(c_desc.shape) == [R, N]
    assert (meta.schedule, meta.stages, meta.lanes) == (ws.SCHEDULES[cfg.warp_specialize], cfg.num_stages, 128)
    assert meta.pipe_blocks == (ws.pipe_blocks(K // 128, op == "gate_up") if fp8 and cfg.pipe_mma else 0)


def test_pipelined_fp8_loop_blocks_per_iteration():
    """The down GEMM's pipelined fp8 loop takes the fewest padding steps, then the most blocks an
    iteration; the gate-up's takes two (registers)."""
    ws = pytest.importorskip("epmoe.kernels.grouped_gemm_ws")
    down = {k: ws.pipe_blocks(k, False) for k in (1, 2, 3, 5, 6, 7, 11, 12, 16, 17, 56)}
    assert down == {1: 2, 2: 2, 3: 3, 5: 3, 6: 3, 7: 4, 11: 4, 12: 4, 16: 4, 17: 3, 56: 4}
    assert {ws.pipe_blocks(k, True) for k in (1, 6, 16, 17)} == {2}


def test_row_stores_where_the_consumers_tiles_fit():
    """Tiles stored from registers go through rows of 16 bytes a thread (`uses_row_stores`) in the fp8 decode
    entries (the gate-up's h, the interleaved down's y), not where a TMA store serves the tiles, where the
    consumers' tiles in C's dtype do not fit beside the ring, or where a row is over 32 such pieces."""
    ws = pytest.importorskip("epmoe.kernels.grouped_gemm_ws")
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    out8, out16, out32 = (torch.empty(4, 256, dtype=d) for d in (fp8, bf16, torch.float32))

    def cfg(schedule, m, n, k, stages):
        return configs.GemmConfig(block_m=m, block_n=n, block_k=k, group_m=8, num_warps=8 if schedule ==
                                  "cooperative" else 4, num_stages=stages, warp_specialize=schedule)
    assert ws.uses_row_stores(cfg("cooperative", 64, 128, 128, 5), fp8, out8, True, False)  # 214016 B
    assert ws.uses_row_stores(cfg("interleaved", 64, 128, 128, 6), fp8, out16, False, False)  # 181248 B
    assert ws.uses_row_stores(cfg("split", 128, 128, 128, 4), fp8, out8, True, False)  # 214016 B
    assert not ws.uses_row_stores(cfg("interleaved", 128, 128, 64, 6), bf16, out16, False, False)  # 263168 B
    assert not ws.uses_row_stores(cfg("split", 128, 256, 64, 3), bf16, out16, False, True)  # TMA store
    assert not ws.uses_row_stores(cfg("cooperative", 64, 256, 64, 3), bf16, out32, True, False)  # 1 KB rows


@pytest.mark.gpu
def test_warp_specialized_kernel_is_not_used_where_it_cannot_serve():
    """A down GEMM through a row index, float32, and a K row length TMA cannot address take the pointer
    kernel."""
    from epmoe.kernels.grouped_gemm_ws import supported
    w = torch.zeros(2, 256, 128, dtype=torch.bfloat16, device=DEVICE)
    x = torch.zeros(64, 128, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty(64, 128, dtype=torch.bfloat16, device=DEVICE)
    kw = dict(gate_up=True, block_n=128, block_k=64)
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert supported(x, w, out, 2, gathered=False, **kw) == hopper
    assert supported(x, w, out, 2, gathered=True, **kw) == hopper  # a gate-up through a row index: cp.async
    assert not supported(x, w[:, :128], out, 2, gathered=True, **{**kw, "gate_up": False})
    x_200, w_200 = (torch.zeros(*shape, 200, dtype=torch.bfloat16, device=DEVICE) for shape in ((64,), (2, 256)))
    assert supported(x_200, w_200, out, 2, gathered=False, **kw) == hopper
    assert not supported(x_200, w_200, out, 2, gathered=True, **kw)  # K not a multiple of block_k
    assert not supported(x.float(), w.float(), out, 2, gathered=False, **kw)
    x_odd, w_odd = torch.zeros(64, 124, dtype=torch.bfloat16, device=DEVICE), w[:, :, :124].contiguous()
    assert not supported(x_odd, w_odd, out, 2, gathered=False, **kw)  # rows of 248 B: not a multiple of 16
    assert not supported(x, w, out, 300, gathered=False, **kw)  # more experts than the tile map's lanes

def test_tuner_check_passes_good_configs_and_records_failures():
    """The tuner's correctness check (run on the GPU by worker processes) at a tiny shape: a candidate
    (here through its pointer variant) passes against the reference, one the compiler refuses is
    recorded with its error, and a task with no time left is reported as not finished."""
    good = GemmConfig(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=2)
    bad = GemmConfig(block_m=16, block_n=128, block_k=256)  # fp8 K blocks must divide 128
    for op in ("gate_up", "down"):
        task = {"op": op, "fp8": True, "indexed": op == "gate_up", "dims": (256, 128, 3), "device": str(DEVICE),
                "configs": [good.to_dict(), bad.to_dict()]}
        first, second = experts_tune._check_task(task)
        assert first["ok"] and first["rel_err"] < 1e-2, first
        assert not second["ok"] and "error" in second, second
    hung = experts_tune.run_checks([[task]], workers=1, budget_s=0.0)
    assert [e["ok"] for e in hung[0][0]] == [False, False] and "no result" in hung[0][0][0]["error"]

def test_tuner_runs_end_to_end_at_a_tiny_shape(tmp_path, monkeypatch):
    """`--tune` from checks to configs.json, at a tiny shape: the checks in a worker process (on the
    interpreter without a GPU; a warp-specialized candidate there runs its pointer variant), the timing
    (here a stand-in clock), the table."""
    from types import SimpleNamespace

    from epmoe.bench import experts as bench
    if torch.cuda.is_available():
        pytest.skip("the GPU run of --tune times the real kernels")
    monkeypatch.setitem(bench.SHAPES, "tiny", (128, 128, 3))
    monkeypatch.setattr(experts_tune, "POINTS", {b: (("tiny", 16),) for b in experts_tune.BUCKETS})
    monkeypatch.setattr(experts_tune, "INDEXED_POINTS", {b: (("tiny", 16),) for b in experts_tune.BUCKETS})
    monkeypatch.setattr(experts_tune, "WS_CANDIDATES", {k: v[:1] for k, v in experts_tune.WS_CANDIDATES.items()})
    monkeypatch.setattr(experts_tune, "POINTER_CANDIDATES", {k: () for k in experts_tune.POINTER_CANDIDATES})
    monkeypatch.setattr(experts_tune, "INDEXED_CANDIDATES", {k: v[:1] for k, v in experts_tune.INDEXED_CANDIDATES.items()})
    sweeps = [s for s in experts_tune._sweeps() if s[:3] in {("gate_up", False, False), ("gate_up", True, True),
                                                              ("down", True, False)}]
    monkeypatch.setattr(experts_tune, "_sweeps", lambda: sweeps)
    clock = iter(range(1, 10 ** 6))

    def fake_time(fn, rep_ms):  # later is slower: at each point the committed entry (timed first) wins
        fn()  # the launch must run
        return float(next(clock))
    monkeypatch.setattr(experts_tune, "flushed_ms", fake_time)
    args = SimpleNamespace(out=str(tmp_path), workers=2, check_s=600.0, stall_s=600.0, max_rows=1 << 20, rep_ms=1)
    result = experts_tune.run_tune(args, DEVICE)
    assert result["checks"] and all(c["ok"] for c in result["checks"]), [c for c in result["checks"] if not c["ok"]]
    assert {(p["op"], p["prec"], p["indexed"]) for p in result["points"]} == {
        ("gate_up", "bf16", False), ("gate_up", "fp8", True), ("down", "fp8", False)}
    for p in result["points"]:  # every candidate timed; the committed entry first
        assert [e["config"] for e in p["entries"]] == [c.to_dict() for c in experts_tune.candidates(
            p["op"], p["prec"] == "fp8", p["bucket"], p["indexed"])]
        assert all("ms" in e for e in p["entries"])
    written = configs._table(tmp_path / "configs.json")
    first = {(p["op"], p["prec"] == "fp8", p["indexed"], p["bucket"]): GemmConfig(**p["entries"][0]["config"])
             for p in result["points"]}
    for (op, fp8, indexed, bound), cfg in first.items():
        assert dict(written[configs.table_key(op, fp8, indexed)])[bound] == cfg
    for key in ("down_bf16", "gate_up_fp8"):  # not swept: as committed
        assert written[key] == configs._table()[key]

def test_tuner_picks_the_smallest_summed_slowdown_and_keeps_decode_buckets():
    """The tuner's table from synthetic times: per (GEMM, precision, bucket) the candidate whose time over
    the point's best, summed over the bucket's points, is smallest (one that is fastest at one point but
    missing or slow at another loses), keeping the committed bucket's pdl; buckets below 128 rows and untuned
    keys stay as committed."""
    a, b, c = (GemmConfig(block_m=64, block_n=n, block_k=64).to_dict() for n in (32, 64, 128))

    def point(op, prec, bucket, times, indexed=False):
        return {"op": op, "prec": prec, "indexed": indexed, "bucket": bucket,
                "entries": [{"config": cfg, "ms": ms} for cfg, ms in times]}
    points = []
    for key in ("gate_up", "down"):
        for prec in ("bf16", "fp8"):
            for bucket in experts_tune.BUCKETS:
                points += [point(key, prec, bucket, [(a, 1.0), (b, 1.1), (c, 0.9)]),   # c best here
                           point(key, prec, bucket, [(a, 1.0), (b, 1.05)]),           # c missing: inf
                           point(key, prec, bucket, [(a, 2.0), (b, 1.0), (c, 1.0)])]  # a slow
    points.append(point("gate_up", "bf16", 128, [(c, 1.0)], indexed=True))  # one bucket: not enough
    points += [point("gate_up", "fp8", bucket, [(a, 1.0), (c, 0.9)], indexed=True) for bucket in experts_tune.BUCKETS]
    built = experts_tune.build_table(points, "t", "NVIDIA H200")
    assert built["devices"] == ["NVIDIA H200"]  # the GPU it was tuned on, whose table it starts from
    table = built["tables"]
    committed = configs._table(gpu="NVIDIA H200")
    for key, buckets in table.items():
        assert [bound for bound, _ in buckets] == [bound for bound, _ in committed[key]]
        for (bound, cfg), (_, old) in zip(buckets, committed[key]):
            won = c if key == "gate_up_fp8_indexed" else b if not key.endswith("_indexed") else None
            assert cfg == ({**won, **({"pdl": True} if old.pdl else {})} if bound >= 128 and won else old.to_dict())
    # (the committed downs set pdl, so that the tuned downs above had it to keep)
    assert all(cfg.get("pdl") for _, cfg in table["down_fp8"]) and all(cfg.get("pdl") for _, cfg in table["down_bf16"])
    assert any(bound < 128 for bound, _ in table["gate_up_fp8_indexed"])  # a hand-set indexed bucket stays
    assert set(table) == set(committed)


# Real model shapes on the GPU (a few experts, to keep the reference cheap).
GPU_SHAPES = [(7168, 2048), (2048, 768)]  # DeepSeek-V3, Qwen3-30B-A3B


@pytest.mark.gpu
@pytest.mark.parametrize("D,F", GPU_SHAPES)
@pytest.mark.parametrize("quant", [None, "fp8_block"])
@pytest.mark.parametrize("layout,indexed", [(Layout.CONTIGUOUS, False), (Layout.CONTIGUOUS, True),
                                            (Layout.BATCHED, False)])
def test_triton_experts_real_shapes_gpu(D, F, quant, layout, indexed):
    counts = [0, 1, 7, 64, 300, 129, 2, 1000]
    L = len(counts)
    triton_experts, reference = loaded_experts(L, D, F, torch.bfloat16, quant)
    batch = batch_for(counts, layout, D, torch.bfloat16, pad=5, indexed=indexed)
    mask = batch_rows_mask(batch)
    y, y_ref = triton_experts(batch)[mask].float(), reference(batch)[mask].float()
    assert_outputs_close(y, y_ref, torch.bfloat16, quant)


def assert_outputs_close(y: torch.Tensor, y_ref: torch.Tensor, dtype: torch.dtype, quant: str | None) -> None:
    """The experts' outputs (stored in dtype) against the reference's: unquantized within TOL[dtype]; from fp8
    h elementwise within FP8_TOL under the interpreter (float32 sums, as the reference's), on the GPU as
    `assert_fp8_outputs_close`, since an h value whose e4m3 rounding flips there moves its whole output row
    (one row of 23 beyond FP8_TOL in 46 of 136 columns, relative L2 error 4.9e-3, in a small case on an H100)."""
    if not quant:
        torch.testing.assert_close(y, y_ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    elif DEVICE.type == "cpu":
        torch.testing.assert_close(y, y_ref, rtol=FP8_TOL[0], atol=FP8_TOL[1])
    else:
        assert_fp8_outputs_close(y, y_ref)


def assert_fp8_outputs_close(y: torch.Tensor, y_ref: torch.Tensor) -> None:
    """Outputs computed from fp8 h on the GPU, at millions of elements: the tensor cores accumulate each
    128-deep fp8 block in less than float32 precision before its promotion, and an h value at an e4m3
    rounding tie (or a group's amax) may round the other way than the reference's, so outputs differ by more
    than FP8_TOL elementwise (13% of them beyond 2^-7 + 2^-6 |y| on the H200 at these shapes): checked as
    the layer is, by the relative L2 error within TOLERANCES["fp8_block"]."""
    err = rel_error(y, y_ref)
    assert err <= TOLERANCES["fp8_block"], err


@pytest.mark.gpu
@pytest.mark.parametrize("D,F", GPU_SHAPES)
def test_grouped_mm_experts_real_shapes_gpu(D, F):
    counts = [0, 1, 7, 64, 300, 129, 2, 1000]
    L = len(counts)
    cfg = MoEConfig(num_experts=L, top_k=1, hidden_size=D, intermediate_size=F)
    w13, w2 = weights(L, D, F)
    experts, reference = GroupedMMExperts(cfg, L, DEVICE), ReferenceExperts(cfg, L, DEVICE)
    experts.load(w13, w2)
    reference.load(w13, w2)
    batch = batch_for(counts, Layout.CONTIGUOUS, D, torch.bfloat16, pad=5)
    mask = batch_rows_mask(batch)
    torch.testing.assert_close(experts(batch)[mask].float(), reference(batch)[mask].float(), rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("triton_dir", [None] + OTHER_TRITONS)
def test_kernels_compile_for_hopper_with_table_configs(triton_dir):
    """The interpreter does not exercise Triton's compiler front end, which rejects some code the
    interpreter accepts, and cannot run the warp-specialized Gluon kernel at all: compile the kernels
    for sm_90 (no GPU needed) in a process without it, with the installed triton and the GPU machine's
    (EPMOE_OTHER_TRITONS). With a GPU the other tests compile and run the kernels for real."""
    assert_compiles("compile_hopper.py", triton_dir)


def test_bench_floor_and_table_format(tmp_path, capsys):
    from epmoe.bench import experts as bench

    floor = bench.mlp_floor(R=128, L=128, D=7168, F=2048, fp8=False)
    assert floor.flops == 6.0 * 128 * 7168 * 2048
    assert floor.ms == pytest.approx(floor.bytes / (4.16 * 1e12) * 1e3)  # decode: bytes bound, an H200's
    big = bench.mlp_floor(R=131072, L=128, D=7168, F=2048, fp8=True)
    assert big.ms == pytest.approx(big.flops / (1276.0 * 1e12) * 1e3)  # flops bound
    slow = Ceilings(bf16_tflops=500.0, fp8_tflops=1000.0, copy_tbps=2.0, source="x")
    assert bench.mlp_floor(R=128, L=128, D=7168, F=2048, fp8=False, ceilings=slow).ms == pytest.approx(
        floor.bytes / (2.0 * 1e12) * 1e3)
    assert bench.mlp_floor(R=131072, L=128, D=7168, F=2048, fp8=True, ceilings=slow).ms == pytest.approx(
        big.flops / (1000.0 * 1e12) * 1e3)
    text = experts_tune.format_configs_json({"comment": "x", "tables": {key: [[b, c.to_dict()] for b, c in buckets]
                                                                 for key, buckets in configs._table().items()}})
    path = tmp_path / "configs.json"
    path.write_text(text)
    assert configs._table(path) == configs._table()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            bench.main(["--out", str(tmp_path)])
        assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def _write_table(path, tables, comment="x"):
    path.write_text(json.dumps({"comment": comment, "tables": tables}))
    return path


def test_the_launch_table_comes_from_the_file_the_environment_names(tmp_path, monkeypatch):
    """EPMOE_GEMM_TABLE: launches take their configs from that file (read at the first launch of the process,
    here again after each change), the committed table without it; a file that cannot serve every launch is
    refused with its name."""
    monkeypatch.setattr(configs, "_in_use", functools.cache(configs._in_use.__wrapped__))  # this test's own
    committed = {key: [[b, c.to_dict()] for b, c in buckets] for key, buckets in configs._table().items()}
    mine = GemmConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3)
    tables = {**committed, "gate_up_bf16": [[1000, mine.to_dict()]]}
    path = _write_table(tmp_path / "mine.json", tables)
    want = configs.gemm_config("gate_up", fp8=False, rows_hint=128, on_gpu=True)
    assert want != mine
    monkeypatch.setenv(configs.TABLE_ENV, str(path))
    configs._in_use.cache_clear()
    assert configs.table_path() == path
    assert configs.gemm_config("gate_up", fp8=False, rows_hint=128, on_gpu=True) == mine
    assert configs.gemm_config("gate_up", fp8=False, rows_hint=4096, on_gpu=True) == mine  # past the last bound
    monkeypatch.setenv(configs.TABLE_ENV, str(tmp_path / "absent.json"))  # read once: no change within a process
    assert configs.gemm_config("gate_up", fp8=False, rows_hint=128, on_gpu=True) == mine
    committed_here = configs._table(configs.device_tables().get(configs._current_gpu(), configs.TABLE_PATH))
    assert configs.gemm_config("down", fp8=True, rows_hint=128, on_gpu=True) == committed_here["down_fp8"][3][1]
    bad = {"missing": {k: v for k, v in tables.items() if k != "down_fp8"},
           "unordered": {**tables, "down_bf16": [[256, mine.to_dict()], [128, mine.to_dict()]]},
           "unknown field": {**tables, "down_bf16": [[256, {**mine.to_dict(), "blockm": 3}]]},
           "invalid config": {**tables, "down_bf16": [[256, {**mine.to_dict(), "block_m": 8}]]},
           "dependent gate-up": {**tables, "gate_up_fp8_indexed": [[256, {**mine.to_dict(), "pdl": True}]]}}
    says = {"dependent gate-up": "'gate_up_fp8_indexed' sets pdl, which only down GEMMs take"}
    for name, broken in bad.items():
        monkeypatch.setenv(configs.TABLE_ENV, str(_write_table(tmp_path / f"{name}.json", broken)))
        configs._in_use.cache_clear()
        with pytest.raises(ValueError, match=f"{name}.json \\(from EPMOE_GEMM_TABLE\\): {says.get(name, '')}"):
            configs.gemm_config("down", fp8=False, rows_hint=128, on_gpu=True)
    (tmp_path / "garbled.json").write_text("{")
    for name in ("garbled.json", "absent.json"):
        monkeypatch.setenv(configs.TABLE_ENV, str(tmp_path / name))
        configs._in_use.cache_clear()
        with pytest.raises(ValueError, match=name):
            configs.gemm_config("down", fp8=False, rows_hint=128, on_gpu=True)
    monkeypatch.delenv(configs.TABLE_ENV)
    configs._in_use.cache_clear()
    assert configs.table_path() == configs.device_tables().get(configs._current_gpu(), configs.TABLE_PATH)
    assert configs.table_path("a GPU no table lists") == configs.TABLE_PATH
    assert configs.gemm_config("gate_up", fp8=False, rows_hint=128, on_gpu=True) == want


def test_each_gpu_launches_with_the_committed_table_that_lists_it(tmp_path, monkeypatch):
    """A launch on a GPU takes the committed table whose `devices` list the GPU's name, else the default
    (configs.json, which lists the H200 it was tuned on); EPMOE_GEMM_TABLE serves every GPU in their place;
    two tables listing one GPU, or a malformed list, are refused with the files' names."""
    for cached in ("_in_use", "device_tables"):  # this test's own caches
        monkeypatch.setattr(configs, cached, functools.cache(getattr(configs, cached).__wrapped__))
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    committed = configs.device_tables()
    assert committed["NVIDIA H200"] == configs.TABLE_PATH
    for name, path in committed.items():  # every committed table serves every launch
        assert configs.table_path(name) == path and configs._table(gpu=name) == configs._table(path)
    assert sorted(configs.TABLE_PATH.parent.glob(configs.TABLE_GLOB)) == sorted(set(committed.values()))
    assert configs.table_path("a GPU no table lists") == configs.TABLE_PATH

    default = {key: [[b, c.to_dict()] for b, c in buckets]
               for key, buckets in configs._table(configs.TABLE_PATH).items()}
    mine = GemmConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3)
    (tmp_path / "configs.json").write_text(json.dumps({"comment": "x", "devices": ["GPU A"], "tables": default}))
    mine_down = {**default, "down_bf16": [[10 ** 9, mine.to_dict()]]}
    (tmp_path / "configs_b.json").write_text(json.dumps({"comment": "x", "devices": ["GPU B", "GPU C"],
                                                         "tables": mine_down}))
    (tmp_path / "other.json").write_text(json.dumps({"comment": "x", "devices": ["GPU B"], "tables": default}))
    monkeypatch.setattr(configs, "TABLE_PATH", tmp_path / "configs.json")
    configs.device_tables.cache_clear()
    configs._in_use.cache_clear()
    assert configs.device_tables() == {"GPU A": tmp_path / "configs.json", "GPU B": tmp_path / "configs_b.json",
                                       "GPU C": tmp_path / "configs_b.json"}  # (other.json is not a table name)
    want = configs._table(configs.TABLE_PATH)["down_bf16"][-1][1]
    for gpu, cfg in (("GPU A", want), ("GPU B", mine), ("GPU C", mine), ("GPU D", want)):
        assert configs.gemm_config("down", fp8=False, rows_hint=4096, on_gpu=True, gpu=gpu) == cfg, gpu
    monkeypatch.setenv(configs.TABLE_ENV, str(tmp_path / "configs.json"))
    configs._in_use.cache_clear()
    assert configs.gemm_config("down", fp8=False, rows_hint=4096, on_gpu=True, gpu="GPU B") == want
    monkeypatch.delenv(configs.TABLE_ENV)
    for name, devices, says in (("configs_c.json", ["GPU B"], "configs_b.json and .*configs_c.json both list the "
                                 "GPU 'GPU B'"), ("configs_c.json", "GPU E", '"devices" must be a list of GPU names'),
                                ("configs_c.json", None, "configs_c.json: not a JSON object")):
        (tmp_path / name).write_text(json.dumps([default] if devices is None else
                                                {"comment": "x", "devices": devices, "tables": default}))
        configs.device_tables.cache_clear()
        configs._in_use.cache_clear()
        with pytest.raises(ValueError, match=says):
            configs.gemm_config("down", fp8=False, rows_hint=4096, on_gpu=True, gpu="GPU A")


def test_auto_experts_order_by_device_and_layout():
    """On CUDA the Triton experts first at every size (they read the batches' row index and weight the rows
    in the down projection), torch._grouped_mm next; the reference on CPU; layouts an implementation does not
    take are dropped."""
    assert auto_experts_order(torch.device("cuda")) == ("triton", "grouped_mm", "reference")
    assert auto_experts_order(torch.device("cpu")) == ("reference",)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    if torch.cuda.is_available():
        assert resolve_experts("auto", cfg, "cuda", Layout.BATCHED) == "triton"
