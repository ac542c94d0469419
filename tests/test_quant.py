"""fp8_block quantizers against the format's definition, independently of epmoe.quant: every block's (or
row group's) scale is amax(|block|) / 448 in float32, the block's largest magnitude maps to +-448 with its
sign, and every value comes back within half an e4m3 step (2^-4 relative; 2^-10 of the scale in the
subnormal range). Blocks of one sign (all negative, all positive), all-zero blocks, a single huge value,
partial blocks and leading batch dims included; for the torch references (which the `reference` and
`triton` experts load weights with) and the Triton activation kernel.

Shape letters: N rows, D columns, B leading batch dims.
"""
import itertools

import pytest
import torch

from epmoe.kernels.quant import quantize_act
from epmoe.quant import FP8_DTYPE, quantize_act_ref, quantize_weight_ref, quantize_weights_ref

E4M3_LARGEST = 448.0
HALF_STEP = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: rounding to nearest is within 2^-4 of the value
SUBNORMAL_HALF_STEP = 2.0 ** -10  # below 2^-6 the spacing is 2^-9


def blocks_of(w: torch.Tensor, rows: int, cols: int):
    """(index, block) over the last two dims of w, in row-major block order (partial blocks included)."""
    N, D = w.shape[-2:]
    for i, j in itertools.product(range(-(-N // rows)), range(-(-D // cols))):
        yield (i, j), w[..., i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]


def exact_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 (amax floored at 1e-10) correctly rounded to float32: divided in float64 (exact for a
    float32 quotient: 53 >= 2 * 24 + 2 bits)."""
    return (torch.clamp(amax.float(), min=1e-10).double() / E4M3_LARGEST).float()


def assert_round_trip(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """One block (or row group): w the original values, q their fp8 codes, scale a float32 scalar."""
    w = w.float()
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    amax = w.abs().max()
    want_scale = exact_scale(amax)
    assert scale.dtype == torch.float32 and float(scale) == float(want_scale), (float(scale), float(want_scale))
    back = q.float() * scale
    bound = HALF_STEP * w.abs() + SUBNORMAL_HALF_STEP * scale * (1 + 1e-6)
    assert bool(((back - w).abs() <= bound).all()), f"max error {float((back - w).abs().max())} at scale {float(scale)}"
    big = w.abs() > bound
    assert torch.equal(torch.sign(back[big]), torch.sign(w[big])), "a sign changed"
    if amax > 0:
        at = (w.abs() == amax).nonzero()[0]
        assert float(q[tuple(at)].float()) == E4M3_LARGEST * float(torch.sign(w[tuple(at)]))


def special_blocks(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """w with its first blocks made all negative, all positive, all zero, one huge value among tiny
    ones, and tiny (subnormal after scaling) values beside a normal one."""
    w = w.clone()
    blocks = [b for _, b in blocks_of(w, rows, cols)]
    fills = [lambda b: b.abs_().neg_().sub_(0.01), lambda b: b.abs_().add_(0.01), lambda b: b.zero_(),
             lambda b: b.mul_(1e-6)[..., -1, -1].fill_(-30.0), lambda b: b.mul_(1e-4)[..., 0, 0].fill_(1.0)]
    for block, fill in zip(blocks, fills):
        fill(block)
    return w


WEIGHT_SHAPES = [(128, 128), (300, 200), (2, 256, 136), (3, 72, 40)]  # partial blocks, leading dims


@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", [quantize_weight_ref, quantize_weights_ref], ids=["ref", "per_expert"])
def test_weight_quantizers_round_trip(shape, dtype, quantize):
    if quantize is quantize_weights_ref and len(shape) == 2:
        shape = (1, *shape)
    g = torch.Generator().manual_seed(sum(shape))
    w = special_blocks(torch.randn(shape, generator=g) * 3, 128, 128).to(dtype)
    q, scale = quantize(w)
    assert scale.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    for (i, j), block in blocks_of(w, 128, 128):
        q_block = q[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
        for b in itertools.product(*map(range, shape[:-2])):
            assert_round_trip(block[b], q_block[b], scale[b][i, j])


ACT_SHAPES = [(1, 128), (5, 300), (2, 3, 129), (4, 7)]


@pytest.mark.parametrize("shape", ACT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", [quantize_act_ref, pytest.param(quantize_act, marks=pytest.mark.interpreter)],
                         ids=["ref", "triton"])
def test_activation_quantizers_round_trip(shape, dtype, quantize):
    """Per row per 128 columns; rows made of one sign, zero, or one huge value (the special blocks at
    1 x 128)."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 5
    x = special_blocks(x.reshape(-1, shape[-1]), 1, 128).reshape(shape).to(dtype)
    q, scale = quantize(x)
    assert scale.shape == (*shape[:-1], -(-shape[-1] // 128))
    rows_x, rows_q, rows_s = x.reshape(-1, shape[-1]), q.reshape(-1, shape[-1]), scale.reshape(-1, scale.shape[-1])
    for (i, j), group in blocks_of(rows_x, 1, 128):
        assert_round_trip(group, rows_q[i:i + 1, j * 128:(j + 1) * 128], rows_s[i, j])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizers_divide_exactly_on_the_gpu(dtype):
    """On a CUDA device the scales are amax / 448 correctly rounded, and the torch activation reference and
    the Triton kernel give the same scales and fp8 codes bit for bit (CUDA divides by a host scalar as a
    multiply by its reciprocal: scales an ulp off in about half of the groups, and a few codes a step off)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4096, 384, device="cuda", generator=g) * 5).to(dtype)
    q_ref, s_ref = quantize_act_ref(x)
    q, s = quantize_act(x)
    want = exact_scale(x.float().unflatten(-1, (-1, 128)).abs().amax(-1))
    assert torch.equal(s_ref, want) and torch.equal(s, want)
    assert torch.equal(q_ref.view(torch.uint8), q.view(torch.uint8))
    _, w_scale = quantize_weight_ref(x)
    blocks = x.float().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))  # [32, 128, 3, 128]
    assert torch.equal(w_scale, exact_scale(blocks.abs().amax((1, 3))))
