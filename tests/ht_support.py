"""Inputs, references and emulated ranks shared by the `ht` tests (tests/test_ht*.py).

Emulated ranks (EmulatedGroup) run in one process, phases rank by rank (every rank's send, then every
rank's receive): on the CPU under TRITON_INTERPRET=1 (set in conftest.py), with CUDA on one GPU. Inputs are
checkable exactly: each row encodes its source rank and token, weights are powers of two, the "experts"
multiply by (global id + 1).

Shape letters: T tokens, D hidden size, K top-k, E experts, L local experts, R ranks, N batch rows.
"""
from __future__ import annotations

import os

import torch

from epmoe.config import MoEConfig
from epmoe.dispatch.ht import HtDispatcher
from epmoe.dispatch.ht.workspace import ht_buffers, ht_specs
from epmoe.kernels.ht import ht_launch
from epmoe.kernels.ht.buffers import HtBuffers
from epmoe.quant import dequantize_act_ref, quantize_act_ref
from epmoe.symm import EmulatedGroup

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
EMU_DEVICE = "cpu" if INTERPRET else "cuda"  # where emulated ranks keep their buffers
# The interpreter's fp32 -> bf16/fp16 cast rounds ties down (the GPU rounds to nearest even): combine
# results may then differ from the exact expectation by one ulp of each partial and of the sum (two
# ulps, 0.0139 relative, seen with R 2; a bf16 ulp is up to 2^-7 relative). On the GPU: exact.
COMBINE_TOL = dict(rtol=2 ** -5, atol=0) if INTERPRET else dict(rtol=0, atol=0)


def ht_cfg(E=8, K=2, D=64, C=8, dtype=torch.bfloat16, quant=None) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=16, dtype=dtype, quant=quant,
                     max_tokens_per_rank=C)


# -- inputs and the exact expected results ----------------------------------------------------------

def exact_inputs(cfg: MoEConfig, rank: int, T: int, routing: str, seed: int, device="cpu"):
    """x_TD rows: col 0 = rank + 1, col 1 = token + 1, the rest +-powers of two; weights 2^-j."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    D, K, E = cfg.hidden_size, cfg.top_k, cfg.num_experts
    sign = torch.randint(0, 2, (T, D), generator=g) * 2 - 1
    x = sign * torch.exp2(torch.randint(-2, 3, (T, D), generator=g).float())
    if T:
        x[:, 0] = rank + 1
        x[:, 1] = torch.arange(T) + 1
    if routing == "one_expert":
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[:, 0] = E - 1
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.empty(0, K, dtype=torch.int64)
        if routing == "holes" and T:
            ids[torch.rand(T, K, generator=g) < 0.3] = -1
    w = torch.exp2(-torch.randint(0, 4, (T, K), generator=g).float())
    return x.to(cfg.dtype).to(device), ids.to(device), w.to(device)


def expected_batch_rows(cfg: MoEConfig, R: int, dest: int, inputs) -> tuple[list[torch.Tensor], list[int]]:
    """Rows dest's experts get, in batch order (expert, source rank, token, slot), and per-expert counts."""
    L = cfg.num_experts // R
    rows, counts = [], []
    for lid in range(L):
        n = 0
        for (x, ids, _) in inputs:
            for t in range(x.shape[0]):
                for k in range(cfg.top_k):
                    if int(ids[t, k]) == dest * L + lid:
                        rows.append(x[t].cpu())
                        n += 1
        counts.append(n)
    return rows, counts


def fp8_exact_rows(T: int, D: int, seed: int) -> torch.Tensor:
    """bf16 rows that block quantization maps exactly: e4m3 values times 2^j per 128-column group, each
    group holding +-448, so the scale is 2^j and x / scale needs no rounding. (The interpreter's fp8
    cast rounds values just under a power of two down a binade, so inexact inputs are tested on GPU.)"""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (T, D), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    q = torch.where(q.isnan(), 0.0, q)
    q[:, ::128] = 448.0 * (torch.randint(0, 2, (T, 1), generator=g) * 2 - 1)
    j = torch.arange(D) // 128
    return (q * torch.exp2((j % 5 - 2).float())).to(torch.bfloat16)


def assert_fp8_close(q: torch.Tensor, q_ref: torch.Tensor) -> None:
    """fp8 values equal to the torch reference's but for rare rounding ties (the interpreter's casts) or
    an ulp of fp32 division (the GPU's): those may differ by one fp8 step."""
    a, b = q.float(), q_ref.float()
    assert int((a != b).sum()) <= 0.02 * a.numel(), f"{int((a != b).sum())} of {a.numel()} fp8 values differ"
    torch.testing.assert_close(a, b, rtol=0.13, atol=2 ** -9)


def expert_fn(batch, cfg: MoEConfig, rank: int, L: int) -> torch.Tensor:
    """The test's experts: y = x * (global expert id + 1) over the valid rows, fp32 -> cfg.dtype."""
    batch = batch.materialize()
    x = batch.x.float() if batch.x_scale is None else dequantize_act_ref(batch.x, batch.x_scale)
    mult = torch.zeros(x.shape[0], device=x.device)
    offs = batch.offsets_L1.tolist()
    for lid in range(L):
        mult[offs[lid]:offs[lid + 1]] = rank * L + lid + 1
    return (x * mult.unsqueeze(1)).to(cfg.dtype)


def expected_combine(cfg: MoEConfig, R: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                     rowfn=lambda x: x.float()) -> torch.Tensor:
    """out[t] = dtype(sum_r dtype(sum_{k on rank r} w * dtype(row(x) * (id + 1)))) in float64."""
    L = cfg.num_experts // R
    x, ids, w = x.cpu(), ids.cpu(), w.cpu()
    T, D = x.shape
    out = torch.zeros(T, D, dtype=torch.float64)
    xr = rowfn(x)
    for t in range(T):
        for r in range(R):
            part = torch.zeros(D, dtype=torch.float64)
            for k in range(cfg.top_k):
                e = int(ids[t, k])
                if e >= 0 and e // L == r:
                    part += float(w[t, k]) * (xr[t] * (e + 1)).to(cfg.dtype).double()
            out[t] += part.to(cfg.dtype).double()
    return out.to(cfg.dtype)


# -- emulated ranks ---------------------------------------------------------------------------------

def make_world(cfg: MoEConfig, R: int, **options) -> list[HtDispatcher]:
    """One dispatcher per rank of R emulated ranks."""
    return [HtDispatcher(cfg, g, device=EMU_DEVICE, **options) for g in EmulatedGroup.world(R)]


def emulate_dispatch(dispatchers, inputs):
    pending = [d.dispatch_send(*inp) for d, inp in zip(dispatchers, inputs)]
    return [d.dispatch_recv(p) for d, p in zip(dispatchers, pending)]


def emulate_combine(dispatchers, ys, batches):
    pending = [d.combine_send(y, b) for d, y, b in zip(dispatchers, ys, batches)]
    return [d.combine_recv(p) for d, p in zip(dispatchers, pending)]


def check_round_trip(cfg, dispatchers, inputs):
    R = len(dispatchers)
    L = cfg.num_experts // R
    batches = emulate_dispatch(dispatchers, inputs)
    for d, b in enumerate(batches):
        assert b.row_index_N is not None  # rows are read through the index, not copied per expert
        b = b.materialize()
        rows, counts = expected_batch_rows(cfg, R, d, inputs)
        assert b.counts_L.tolist() == counts
        assert b.offsets_L1.tolist() == [sum(counts[:i]) for i in range(L + 1)]
        n = sum(counts)
        if dispatchers[d].sync_free:
            assert b.x.shape[0] == dispatchers[d].max_recv_rows
        else:
            assert b.x.shape[0] == n
        want = torch.stack(rows) if rows else torch.empty(0, cfg.hidden_size, dtype=cfg.dtype)
        if cfg.quant is None:
            assert torch.equal(b.x[:n].cpu(), want)
            assert b.x_scale is None
        else:
            q_ref, s_ref = quantize_act_ref(want)
            assert b.x.dtype == torch.float8_e4m3fn and b.x_scale.dtype == torch.float32
            assert b.x_scale.shape == (b.x.shape[0], -(-cfg.hidden_size // 128))
            torch.testing.assert_close(b.x_scale[:n].cpu(), s_ref, rtol=1e-6, atol=0)
            assert_fp8_close(b.x[:n].cpu(), q_ref)
    ys = [expert_fn(b, cfg, r, L) for r, b in enumerate(batches)]
    outs = emulate_combine(dispatchers, ys, batches)
    rowfn = (lambda x: x.float()) if cfg.quant is None else (lambda x: dequantize_act_ref(*quantize_act_ref(x)))
    for r, (x, ids, w) in enumerate(inputs):
        assert outs[r].shape == x.shape and outs[r].dtype == cfg.dtype
        tol = dict(rtol=0, atol=0) if cfg.dtype == torch.float32 else COMBINE_TOL
        torch.testing.assert_close(outs[r].cpu(), expected_combine(cfg, R, x, ids, w, rowfn), **tol)


def size_word(epoch: int, chunks: int, low: int) -> int:
    """A value of layout_count's size word: 7 bits of the epoch, 24 of the chunk count, 32 of the rows."""
    return (epoch % 128) << 56 | chunks << 32 | low



def kernel_world(cfg: MoEConfig, R: int) -> list[HtBuffers]:
    """Every rank's HtBuffers of one emulated `ht` workspace for cfg, for tests that call the launchers."""
    device = torch.device(EMU_DEVICE)
    specs = ht_specs(cfg, R, ht_launch(cfg.row_bytes, device))
    return [ht_buffers(g.workspace("kernels", specs, device)) for g in EmulatedGroup.world(R)]
