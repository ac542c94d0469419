"""The layout engine's kernels (epmoe/kernels/layout.py) against their torch references, exactly: on CPU
tensors under the Triton interpreter, on a GPU where there is one. T = 0 and 1, odd T and D, -1 ids, every
pair on one expert, K = 1, K = E, E = 1, experts of another rank (first_expert), ids outside [-1, E)."""
import pytest
import torch

from compile_run import OTHER_TRITONS, assert_compiles
from epmoe.kernels import layout

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter)] + (["cuda"] if torch.cuda.is_available() else [])


def _ids(T: int, K: int, E: int, g: torch.Generator, drop: float = 0.2, dtype=torch.int32) -> torch.Tensor:
    ids = torch.randint(0, E, (T, K), generator=g)
    return ids.masked_fill(torch.rand(T, K, generator=g) < drop, -1).to(dtype)


def _check(ids: torch.Tensor, L: int, first: int = 0, E: int | None = None, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(ids.numel())
    w = torch.rand(ids.shape, generator=g)
    ids, w = ids.to(device), w.to(device)
    bad_k, bad_r = (torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2))
    got = layout.sort_pairs(ids, L, first_expert=first, weights_PK=w, num_experts=E,
                            bad_id_1=bad_k if E is not None else None)
    want = layout.sort_pairs_ref(ids, L, first_expert=first, weights_PK=w, num_experts=E,
                                 bad_id_1=bad_r if E is not None else None)
    n = int(want.offsets_L1[-1])
    assert torch.equal(got.counts_L, want.counts_L)
    assert torch.equal(got.offsets_L1, want.offsets_L1)
    assert torch.equal(got.pos_PK, want.pos_PK)
    assert torch.equal(got.rows_N, want.rows_N)
    assert torch.equal(got.weights_N[:n], want.weights_N[:n])
    # independent of both: every valid pair sits in its expert's segment, at a row that holds it
    flat = ids.reshape(-1).long().cpu()
    pos = got.pos_PK.reshape(-1).long().cpu()
    offsets = got.offsets_L1.cpu()
    local = flat - first
    for j in range(flat.numel()):
        if E is not None and (flat[j] < -1 or flat[j] >= E):
            assert pos[j] == layout.BAD_POS
        elif 0 <= local[j] < L:
            assert offsets[local[j]] <= pos[j] < offsets[local[j] + 1]
            assert got.rows_N[pos[j]].item() == j // ids.shape[1]
        else:
            assert pos[j] == -1
    bad = flat[(flat < -1) | (flat >= E)] if E is not None else flat[:0]
    if bad.numel():
        assert bad_k.item() in bad.tolist()
    elif E is not None:
        assert bad_k.item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,K,E", [(0, 4, 8), (1, 1, 1), (1, 4, 8), (37, 3, 5), (300, 8, 128), (64, 6, 6),
                                   (5, 1, 3)])
def test_sort_pairs_matches_reference(T, K, E, device):
    g = torch.Generator().manual_seed(T * 100 + K)
    _check(_ids(T, K, E, g), E, E=E, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_sort_pairs_one_hot_expert_other_ranks_and_int64(device):
    g = torch.Generator().manual_seed(1)
    ids = torch.full((129, 4), 6, dtype=torch.int64)
    ids[::3, 1] = -1
    _check(ids, 8, E=8, device=device)  # every pair on one expert
    _check(_ids(77, 4, 24, g, dtype=torch.int64), 8, first=8, device=device)  # rank 1 of 3: experts 8..15
    _check(_ids(77, 4, 24, g), 8, first=16, E=24, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_sort_pairs_catches_ids_outside_the_experts(device):
    g = torch.Generator().manual_seed(2)
    ids = _ids(50, 3, 8, g)
    ids[7, 1], ids[33, 0], ids[49, 2] = 8, -5, 1 << 20
    _check(ids, 8, E=8, device=device)
    _check(ids, 4, first=4, E=8, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("P,K,D,N", [(0, 2, 16, 4), (1, 1, 7, 3), (33, 3, 130, 99), (9, 8, 2048, 40)])
@pytest.mark.parametrize("weighted", [False, True])
def test_gather_sum_matches_reference(P, K, D, N, weighted, device):
    g = torch.Generator().manual_seed(P + D)
    y = torch.randn(N, D, generator=g).to(torch.bfloat16).to(device)
    pos = torch.randint(-1, N, (P, K), generator=g, dtype=torch.int32)
    if P > 3:
        pos[3, K - 1] = layout.BAD_POS
    pos = pos.to(device)
    w = torch.rand(P, K, generator=g).to(device) if weighted else None
    for dtype in (torch.bfloat16, torch.float32):
        got = layout.gather_sum(y, pos, dtype, w)
        want = layout.gather_sum_ref(y, pos, dtype, w)
        assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
        # The GPU fuses each weight's product into its sum (an FMA), one float32 rounding fewer than the
        # reference's; the interpreter rounds float32 to bf16 towards zero, the GPU to nearest: an ulp apart.
        fused = weighted and device == "cuda"
        if not fused and (dtype == torch.float32 or device == "cuda"):
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
        else:
            torch.testing.assert_close(torch.nan_to_num(got), torch.nan_to_num(want),
                                       rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -20, atol=1e-6 if fused else 0)
    if P > 3:
        assert got[3].isnan().all() and not got[2].isnan().any()
    # independent of both, in float64
    exp = torch.zeros(P, D, dtype=torch.float64)
    for p in range(P):
        for k in range(K):
            if pos[p, k] >= 0:
                exp[p] += (1.0 if w is None else float(w[p, k])) * y[pos[p, k]].double().cpu()
    ok = ~(pos == layout.BAD_POS).any(1).cpu()
    torch.testing.assert_close(got.cpu().double()[ok], exp[ok], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("triton_dir", [None, *OTHER_TRITONS])
def test_layout_kernels_compile_for_hopper(triton_dir):
    """The layout kernels and gather_sum compile for sm_90 without spills (tests/compile_layout.py; with the
    installed triton, and the GPU machine's where EPMOE_OTHER_TRITONS names it)."""
    assert_compiles("compile_layout.py", triton_dir)
