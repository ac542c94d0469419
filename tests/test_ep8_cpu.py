"""Eight ranks on the CPU (issue 6's part that needs no 8-GPU machine): the gloo dispatchers on 8 real
processes, and the NVLink dispatchers' kernels on 8 ranks emulated in one process (Triton interpreter).

Inputs are exact: row t of rank r is r*1000 + t + column/64 in float32, the stand-in experts multiply by
(global expert id + 1), weights are powers of two, so every received row and every combined output can be
compared with an fp64 expectation.

Shape letters: T tokens, D hidden size, K top-k, E experts, L local experts, R ranks.
"""
import pytest
import torch

import epmoe
from epmoe.interfaces import ExpertBatch, Layout
from epmoe.launch import spawn
from epmoe.symm import EmulatedGroup

R = 8
E, K, D = 16, 3, 64


def _cfg(max_tokens: int = 8) -> epmoe.MoEConfig:
    return epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=32, dtype=torch.float32,
                           max_tokens_per_rank=max_tokens)


def exact_inputs(rank: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_TD, ids_TK (skewed towards expert 0, some -1), weights_TK (powers of two) for `rank`."""
    g = torch.Generator().manual_seed(100 + rank)
    t = torch.arange(T, dtype=torch.float32)
    x_TD = rank * 1000 + t[:, None] + torch.arange(D, dtype=torch.float32)[None, :] / 64
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32) \
        if T else torch.empty(0, K, dtype=torch.int32)
    if T:
        ids_TK[0, 0] = 0
        ids_TK[T // 2, K - 1] = -1
    weights_TK = 2.0 ** -torch.randint(0, 4, (T, K), generator=g).float()
    return x_TD, ids_TK, weights_TK


def tokens_of(rank: int) -> int:
    return (0, 1, 5, 8, 3, 7, 2, 6)[rank]


def expected_out(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    scale_TK = torch.where(ids_TK >= 0, weights_TK.double() * (ids_TK.double() + 1), 0.0)
    return (x_TD.double()[:, None, :] * scale_TK[:, :, None]).sum(1)


def fake_experts(batch: ExpertBatch, first_expert: int) -> torch.Tensor:
    """y = x * (global expert id + 1) for every valid row of `batch`, in either layout."""
    L = batch.num_local_experts
    batch = batch.materialize()
    scale_L = torch.arange(first_expert + 1, first_expert + L + 1, dtype=torch.float32, device=batch.x.device)
    if batch.layout is Layout.BATCHED:
        return batch.x * scale_L[:, None, None]
    counts = batch.counts_L.long()
    expert_N = torch.repeat_interleave(torch.arange(L, device=batch.x.device), counts)
    y = torch.zeros_like(batch.x)
    n = expert_N.shape[0]
    y[:n] = batch.x[:n] * scale_L[expert_N][:, None]
    return y


def received_rows(batch: ExpertBatch) -> list[torch.Tensor]:
    """Each local expert's rows, sorted (row order within an expert is the dispatcher's choice)."""
    batch = batch.materialize()
    out = []
    for l, n in enumerate(batch.counts_L.tolist()):
        rows = batch.x[l, :n] if batch.layout is Layout.BATCHED else \
            batch.x[int(batch.offsets_L1[l]):int(batch.offsets_L1[l + 1])]
        out.append(rows[rows[:, 0].argsort()])
    return out


def expected_rows(rank: int) -> list[torch.Tensor]:
    L = E // R
    rows = [[] for _ in range(L)]
    for src in range(R):
        x_TD, ids_TK, _ = exact_inputs(src, tokens_of(src))
        for t in range(x_TD.shape[0]):
            for e in ids_TK[t].tolist():
                if rank * L <= e < (rank + 1) * L:
                    rows[e - rank * L].append(x_TD[t])
    out = [torch.stack(r) if r else torch.empty(0, D) for r in rows]
    return [r[r[:, 0].argsort()] for r in out]


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["ht", "ll"])
def test_symmetric_dispatchers_emulated_8_ranks(name):
    cfg = _cfg()
    groups = EmulatedGroup.world(R)
    dispatchers = [epmoe.make_dispatcher(name, cfg, g) for g in groups]
    inputs = [exact_inputs(r, tokens_of(r)) for r in range(R)]
    for _call in range(2):  # the second call reuses the buffers
        pending = [d.dispatch_send(*inp) for d, inp in zip(dispatchers, inputs)]
        batches = [d.dispatch_recv(p) for d, p in zip(dispatchers, pending)]
        for r, batch in enumerate(batches):
            for got, want in zip(received_rows(batch), expected_rows(r)):
                torch.testing.assert_close(got.float(), want, rtol=0, atol=0)
        ys = [fake_experts(b, d.first_expert) for b, d in zip(batches, dispatchers)]
        pending = [d.combine_send(y, b) for d, y, b in zip(dispatchers, ys, batches)]
        outs = [d.combine_recv(p) for d, p in zip(dispatchers, pending)]
        for out, inp in zip(outs, inputs):
            torch.testing.assert_close(out.double(), expected_out(*inp), rtol=1e-6, atol=1e-6)


def _gloo_rank(ctx) -> list[str]:
    cfg = _cfg()
    failures = []
    x_TD, ids_TK, weights_TK = exact_inputs(ctx.rank, tokens_of(ctx.rank))
    for name in ("allgather", "alltoall"):
        d = epmoe.make_dispatcher(name, cfg, ctx.group)
        batch = d.dispatch(x_TD, ids_TK, weights_TK)
        for l, (got, want) in enumerate(zip(received_rows(batch), expected_rows(ctx.rank))):
            if not torch.equal(got, want):
                failures.append(f"{name} rank {ctx.rank} expert {l}: rows differ")
        out = d.combine(fake_experts(batch, d.first_expert), batch)
        err = (out.double() - expected_out(x_TD, ids_TK, weights_TK)).abs().max().item() if out.numel() else 0.0
        if err > 1e-6 * 8000:
            failures.append(f"{name} rank {ctx.rank}: combine off by {err}")
    return failures


def test_gloo_dispatchers_8_ranks():
    failures = [f for rank_failures in spawn(_gloo_rank, R, device="cpu") for f in rank_failures]
    assert not failures, failures
