"""Every experts implementation that can run here against the float64 oracle (epmoe.oracle), at odd and
non-power-of-two sizes (D 37 and 97 with F 23: partial tiles and partial fp8 groups everywhere; D 40 with
F 24 for grouped_mm, which needs multiples of 8), in both
layouts, with empty experts and a one-row expert; fp32, bf16 and fp8_block. The Triton kernels run under
the interpreter on CPU tensors (tests/conftest.py), compiled on a GPU.

Shape letters: L local experts, D hidden size, F intermediate size, N batch rows, M rows per expert slot.
"""
import pytest
import torch

from epmoe import MoEConfig, list_experts, make_experts
from epmoe.interfaces import ExpertBatch, Layout
from epmoe.oracle import MoERef
from epmoe.testing import TOLERANCES, precision, rel_error

# Padding rows of kernel intermediates are uninitialized memory; the interpreter's numpy math warns on them.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
COUNTS = [3, 0, 1, 6]  # rows per local expert
PAD = 2  # padding rows past the experts' rows (contiguous) or past each count (batched)
# The reference experts round where the oracle does (bf16 activations, fp8 blocks of weights and of x and h):
# what is left is the output's bf16 rounding, measured 1.6e-3 to 1.9e-3 here; 5e-3 allows 2.6x (skipping h's
# fp8 rounding measured 1.5e-2 to 2.4e-2). Other implementations: epmoe.testing.TOLERANCES.
REFERENCE_16BIT_TOLERANCE = 5e-3


def batch(layout: Layout, D: int, dtype: torch.dtype, g: torch.Generator) -> tuple[ExpertBatch, torch.Tensor]:
    """A batch of random rows, and the local expert of each valid row (in the order of `valid_rows`)."""
    counts_L = torch.tensor(COUNTS, dtype=torch.int32)
    expert_n = torch.repeat_interleave(torch.arange(len(COUNTS)), counts_L.long())
    if layout is Layout.BATCHED:
        x = torch.randn(len(COUNTS), max(COUNTS) + PAD, D, generator=g)
        offsets = None
    else:
        x = torch.randn(sum(COUNTS) + PAD, D, generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts_L, 0).to(torch.int32)])
        offsets = offsets.to(DEVICE)
    b = ExpertBatch(layout=layout, x=x.to(DEVICE, dtype), x_scale=None, counts_L=counts_L.to(DEVICE),
                    offsets_L1=offsets, handle=None)
    return b, expert_n


def valid_rows(b: ExpertBatch, t: torch.Tensor) -> torch.Tensor:
    """The rows of `t` (in b's layout) that hold an expert's output, expert by expert."""
    if b.layout is Layout.BATCHED:
        return torch.cat([t[l, :n] for l, n in enumerate(COUNTS)])
    return t[:sum(COUNTS)]


@pytest.mark.parametrize("layout", [Layout.CONTIGUOUS, Layout.BATCHED])
@pytest.mark.parametrize("D,F", [(37, 23), (97, 23), (40, 24)])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp8_block"])
@pytest.mark.parametrize("name", ["reference", "triton", "grouped_mm"])
def test_experts_match_the_oracle(name, prec, D, F, layout):
    L = len(COUNTS)
    dtype = torch.float32 if prec == "fp32" else torch.bfloat16
    cfg = MoEConfig(num_experts=L, top_k=1, hidden_size=D, intermediate_size=F, dtype=dtype,
                    quant="fp8_block" if prec == "fp8_block" else None)
    ok, reason = list_experts(cfg, DEVICE)[name]
    if not ok:
        pytest.skip(reason)
    experts = make_experts(name, cfg, L, DEVICE, layout)
    if layout not in experts.layouts:
        pytest.skip(f"{name} does not take the {layout.value} layout")
    g = torch.Generator().manual_seed(D)
    w13, w2 = torch.randn(L, 2 * F, D, generator=g) / D ** 0.5, torch.randn(L, D, F, generator=g) / F ** 0.5
    experts.load(w13.to(DEVICE), w2.to(DEVICE))
    b, expert_n = batch(layout, D, dtype, g)
    y = experts(b)
    assert y.shape == b.out_shape and y.dtype == dtype
    oracle = MoERef.build(w13, w2, fp8=prec == "fp8_block")
    x_n = valid_rows(b, b.x).cpu()
    want = oracle(x_n, expert_n[:, None], torch.ones(len(expert_n), 1))
    tol = REFERENCE_16BIT_TOLERANCE if name == "reference" and prec != "fp32" else TOLERANCES[precision(cfg)]
    assert rel_error(valid_rows(b, y).cpu(), want) <= tol
