"""Tests of the `ht` dispatcher over real ranks, one GPU each (gpu_ranks.gpu_test_ranks(), default 2; real
symmetric memory): exact rows and sums with and without sync_free and in every mode, dense mode's edges,
random data against `alltoall`, a CUDA graph of the sync_free dispatcher.

Shape letters: T tokens, D hidden size, K top-k, E experts, L local experts, R ranks, N batch rows.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.quant import dequantize_act_ref, quantize_act_ref
from gpu_ranks import gpu_test_ranks, multiple_of
from ht_support import (INTERPRET, assert_fp8_close, exact_inputs, expected_batch_rows, expected_combine, expert_fn,
                        ht_cfg)


def _gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= gpu_test_ranks() and not INTERPRET


needs_gpus = pytest.mark.skipif(not _gpus(), reason=f"needs {gpu_test_ranks()} GPUs and TRITON_INTERPRET=0")


_GPU_EXACT_CASES = [  # (E, K, D bf16, D fp8, tokens of ranks 0, 1 (repeated for more ranks), routing)
    (8, 3, 256, 256, [37, 0], "holes"), (16, 8, 7168, 7168, [64, 129], "random"),
    (4, 4, 72, 208, [5, 9], "one_expert")]


def _gpu_exact(ctx, quant, calls):
    """Each case: `calls` dispatches with new inputs (zeroed and freed right after dispatch_send), two in
    flight at a time (dispatch n, dispatch n+1, then their combines), with and without sync_free; the
    first two cases also with one combine program per rank (its tickets alone must finish the combine:
    the ticket order is deadlock-free);
    bf16: every case with the copy engine and with the send kernel (the default picks one per K).
    No device-side wait gives up."""
    from epmoe.dispatch.ht import HtDispatcher
    from epmoe.kernels.ht import ht_launch
    R = ctx.world_size
    runs = [(case, sf, {}, None) for sf in (False, True) for case in _GPU_EXACT_CASES]
    runs += [(case, False, dict(combine_programs=1), None) for case in _GPU_EXACT_CASES[:2]]
    if quant is None:
        runs += [(case, False, {}, engine) for case in _GPU_EXACT_CASES for engine in (False, True)]
    for (E, K, D_bf16, D_fp8, Ts, routing), sync_free, changes, copy_engine in runs:
        D = D_fp8 if quant else D_bf16
        E, Ts = multiple_of(E, R), (Ts * R)[:R]  # a token count per rank
        cfg = ht_cfg(E=E, K=K, D=D, C=max(Ts) + 3, quant=quant)
        launch = dataclasses.replace(ht_launch(cfg.row_bytes, ctx.device), **changes)
        d = HtDispatcher(cfg, ctx.group, sync_free=sync_free, launch=launch, copy_engine=copy_engine,
                         wait_timeout_s=10.0)
        L = cfg.num_experts // R
        for first in range(0, calls, 2):
            in_flight = []
            for call in range(first, min(first + 2, calls)):
                case = (E, K, D, Ts, routing, sync_free, changes, d.copy_engine, call)
                inputs = [exact_inputs(cfg, r, T, routing, seed=20 + call) for r, T in enumerate(Ts)]
                x, ids, w = (t.to(ctx.device) for t in inputs[ctx.rank])
                pending = d.dispatch_send(x, ids, w)
                x.zero_()  # the caller may overwrite and free x once dispatch_send returns
                del x
                b = d.dispatch_recv(pending)
                rows, counts = expected_batch_rows(cfg, R, ctx.rank, inputs)
                assert b.counts_L.tolist() == counts, (case, b.counts_L.tolist(), counts)
                n = sum(counts)
                assert b.out_shape[0] == (d.max_recv_rows if sync_free else n), case
                m = b.materialize()
                want = torch.stack(rows) if rows else torch.empty(0, D, dtype=cfg.dtype)
                if quant is None:
                    assert torch.equal(m.x[:n].cpu(), want), case
                else:
                    q_ref, s_ref = quantize_act_ref(want)
                    torch.testing.assert_close(m.x_scale[:n].cpu(), s_ref, rtol=1e-6, atol=0)
                    assert_fp8_close(m.x[:n].cpu(), q_ref)
                in_flight.append((b, expert_fn(m, cfg, ctx.rank, L), inputs))
            for b, y, inputs in in_flight:
                out = d.combine(y, b)
                if quant is None:
                    expected, tol = expected_combine(cfg, R, *inputs[ctx.rank]), dict(rtol=0, atol=0)
                else:  # the rows are rounded to fp8 on the way (ties may differ by an fp8 step): tolerance
                    rowfn = lambda x: dequantize_act_ref(*quantize_act_ref(x))  # noqa: E731
                    expected, tol = expected_combine(cfg, R, *inputs[ctx.rank], rowfn), dict(rtol=0.13, atol=0.05)
                torch.testing.assert_close(out.cpu(), expected, **tol)
        assert not d.timed_out(), (E, K, D, Ts, routing, sync_free, changes, d.copy_engine)
    return True


@needs_gpus
@pytest.mark.gpu2
@pytest.mark.parametrize("quant", [None, "fp8_block"])
def test_gpu_exact(quant):
    """Exact rows and combine sums across gpu_test_ranks() GPUs, with and without sync_free, 3 calls each
    (the first two in flight together); 129 tokens on a rank: two numbering programs."""
    from epmoe.launch import spawn
    assert all(spawn(_gpu_exact, gpu_test_ranks(), "cuda", (quant, 3), timeout_s=240))


def _gpu_dense_edges(ctx, copy_engine):
    """Dense mode over real ranks, rows by the copy engine or the send kernel: (1) inputs made late on
    the stream (behind a 1 ms spin) and
    passed to _dispatch_send, which skips check_tokens' host sync, then x, ids and weights overwritten
    at once: the side stream's numbering and own-rows copy still read this call's inputs, the rows and
    sums are exact, and every rank gets the largest of the ranks' chunk counts; (2) a numbering that
    fails to queue after the rows and their flag have left marks the dispatcher failed on every rank:
    timed_out(), and the next dispatch raises; (3) the GPU has 64-bit stream memory operations, and
    without them copy_engine=None picks the send kernel and copy_engine=True is refused."""
    from unittest import mock

    from epmoe import cuda_driver
    from epmoe.dispatch.ht import HtDispatcher
    from epmoe.kernels.ht import send
    R = ctx.world_size
    E, K, D, T = multiple_of(8, R), 8, 256, 37
    cfg = ht_cfg(E=E, K=K, D=D, C=T)
    if not copy_engine:
        assert cuda_driver.can_write_value(ctx.device.index)
        with mock.patch.object(cuda_driver, "can_write_value", lambda index: False):
            forced_dense = HtDispatcher(cfg, ctx.group, dense=True)  # where copy_engine=None would pick the engine
            assert forced_dense.dense and not forced_dense.copy_engine
            with pytest.raises(ValueError, match="needs 64-bit stream memory operations"):
                HtDispatcher(cfg, ctx.group, copy_engine=True)
    d = HtDispatcher(cfg, ctx.group, copy_engine=copy_engine, wait_timeout_s=10.0)
    assert d.dense and d.copy_engine == copy_engine
    for call in range(2):
        inputs = [exact_inputs(cfg, r, T, "random", seed=40 + call) for r in range(R)]
        staged = [t.to(ctx.device) for t in inputs[ctx.rank]]
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
        x, ids, w = (t.clone() for t in staged)  # ready only after the spin
        counts = [1 + (3 * r + 2 * call) % 7 for r in range(R)]  # rank 0: 1 then 3; rank 1: 4 then 6
        pending = d._dispatch_send(x, ids, w.float(), counts[ctx.rank])
        x.zero_()
        ids.fill_(-1)
        w.zero_()
        b = d.dispatch_recv(pending)
        assert d.agreed_chunks(b) == max(counts), (call, d.agreed_chunks(b), counts)
        rows, counts = expected_batch_rows(cfg, R, ctx.rank, inputs)
        assert b.counts_L.tolist() == counts, (call, b.counts_L.tolist(), counts)
        assert torch.equal(b.materialize().x[:sum(counts)].cpu(), torch.stack(rows)), call
        out = d.combine(expert_fn(b.materialize(), cfg, ctx.rank, E // R), b)
        torch.testing.assert_close(out.cpu(), expected_combine(cfg, R, *inputs[ctx.rank]), rtol=0, atol=0)
    assert not d.timed_out()

    def fails(*args, **kwargs):
        raise RuntimeError("numbering failed to launch")
    x, ids, w = (t.to(ctx.device) for t in exact_inputs(cfg, ctx.rank, T, "random", seed=50))
    with mock.patch.object(send, "number_pairs", fails):
        with pytest.raises(RuntimeError, match="numbering failed"):
            d.dispatch_send(x, ids, w)
    assert d.timed_out()
    with pytest.raises(RuntimeError, match="rebuild the dispatcher"):
        d.dispatch(x, ids, w)
    return True


@needs_gpus
@pytest.mark.gpu2
@pytest.mark.parametrize("copy_engine", [True, False])
def test_gpu_dense_edges(copy_engine):
    from epmoe.launch import spawn
    assert all(spawn(_gpu_dense_edges, gpu_test_ranks(), "cuda", (copy_engine,), timeout_s=240))


def rows_by_expert(x: torch.Tensor, offsets_L1: torch.Tensor) -> torch.Tensor:
    """The valid rows of a contiguous batch of 2-byte values, each expert's rows in a canonical order
    (by their first 4 values' bit patterns): batches that differ only in the order of rows within an
    expert give equal results."""
    n = int(offsets_L1[-1])
    x = x[:n]
    expert_N = torch.searchsorted(offsets_L1[1:].long(), torch.arange(n, device=x.device), right=True)
    bits = x.view(torch.int16).long()
    order = torch.arange(n, device=x.device)
    for key in [bits[:, c] for c in reversed(range(min(4, x.shape[1])))] + [expert_N]:  # least significant first
        order = order[torch.argsort(key[order], stable=True)]
    return x[order]


def assert_combine_bounded(cfg: MoEConfig, R: int, out: torch.Tensor, x, ids, w) -> None:
    """Random data, experts y = dtype(x * (id + 1)) as in expert_fn: out[t] must be the float64 value
    sum_r dtype(p_r), p_r = sum_{k on rank r} w * y, within what rounding allows: each rank's fp32 partial
    may round to the other neighbour in dtype (summation order, fused multiply-add: one ulp, at most
    2^-7 |p_r| in bf16), fp32 sums lose 2^-20 of the magnitude of their terms, and the final sum rounds
    once more (at most 2^-7 |out|). A wrong row or weight is off by O(|terms|)."""
    L = cfg.num_experts // R
    ref = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    partials = torch.zeros_like(ref)
    terms = torch.zeros_like(ref)
    for r in range(R):
        p = torch.zeros_like(ref)
        for k in range(cfg.top_k):
            on = ((ids[:, k] >= 0) & (ids[:, k] // L == r)).unsqueeze(1)
            y = (x.float() * (ids[:, k] + 1).float().unsqueeze(1)).to(cfg.dtype).double()
            wy = torch.where(on, w[:, k].double().unsqueeze(1) * y, 0.0)
            p += wy
            terms += wy.abs()
        ref += p.to(cfg.dtype).double()
        partials += p.abs()
    bound = 2 ** -7 * (partials + ref.abs()) + 2 ** -20 * terms
    err = (out.double() - ref).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), \
        f"{int((err > bound).sum())} of {err.numel()} values off; worst: got {float(out.view(-1)[worst])}, " \
        f"float64 {float(ref.view(-1)[worst])}, bound {float(bound.view(-1)[worst])}"


def _gpu_vs_alltoall(ctx, cases, calls):
    """ht against the NCCL alltoall dispatcher on random data: same per-expert counts and row sets (the
    order of rows within an expert is not part of the contract), both combines within rounding of the
    float64 reference (their fp32 partial sums differ in order and fusion, so they may differ from each
    other by an ulp of each rank's partial, more than any fixed tolerance when the partials cancel)."""
    for T, D, E, K in cases:
        _vs_alltoall(ctx, T, D, E, K, calls)
    return True


def _vs_alltoall(ctx, T, D, E, K, calls):
    from epmoe.dispatch.alltoall import AllToAllDispatcher
    from epmoe.dispatch.ht import HtDispatcher
    R = ctx.world_size
    E = multiple_of(E, R)
    cfg = ht_cfg(E=E, K=K, D=D, C=T)
    L = E // R
    ht, a2a = HtDispatcher(cfg, ctx.group), AllToAllDispatcher(cfg, ctx.group)
    g = torch.Generator(device=ctx.device).manual_seed(ctx.rank + 7)
    for call in range(calls):
        Tc = T - 3 * call - ctx.rank  # T differs per call and rank (capacity stays T)
        x = torch.randn(Tc, D, device=ctx.device, generator=g).to(cfg.dtype)
        ids = torch.rand(Tc, E, device=ctx.device, generator=g).topk(K, dim=1).indices
        if call == 1:  # some -1 ids, and tokens with none at all
            ids[torch.rand(Tc, K, device=ctx.device, generator=g) < 0.3] = -1
            ids[: Tc // 10] = -1
        w = torch.rand(Tc, K, device=ctx.device, generator=g)
        b1, b2 = ht.dispatch(x, ids, w), a2a.dispatch(x, ids, w)
        assert torch.equal(b1.counts_L, b2.counts_L) and torch.equal(b1.offsets_L1, b2.offsets_L1)
        assert b1.out_shape == b2.x.shape
        x1 = b1.materialize().x
        assert torch.equal(rows_by_expert(x1, b1.offsets_L1), rows_by_expert(b2.x, b2.offsets_L1))
        out1 = ht.combine(expert_fn(b1, cfg, ctx.rank, L), b1)
        out2 = a2a.combine(expert_fn(b2, cfg, ctx.rank, L), b2)
        assert_combine_bounded(cfg, R, out1, x, ids, w)
        assert_combine_bounded(cfg, R, out2, x, ids, w)


@needs_gpus
@pytest.mark.gpu2
def test_gpu_random_matches_alltoall():
    from epmoe.launch import spawn
    cases = [(1024, 7168, 256, 8), (333, 2048, 16, 3)]  # (T, D, E, K); E rounded up to a multiple of R
    assert all(spawn(_gpu_vs_alltoall, gpu_test_ranks(), "cuda", (cases, 3), timeout_s=240))


def _gpu_graph(ctx, T, D, E, K, replays):
    """A sync_free dispatch + combine captured once, replayed with new x and routing: the eager call and
    every replay within rounding of the float64 expectation (assert_combine_bounded), and the first
    replays equal to an eager call on their inputs."""
    from epmoe.dispatch.ht import HtDispatcher
    E = multiple_of(E, ctx.world_size)
    cfg = ht_cfg(E=E, K=K, D=D, C=T)
    d = HtDispatcher(cfg, ctx.group, sync_free=True)
    L = E // ctx.world_size
    x = torch.randn(T, D, device=ctx.device).to(cfg.dtype)
    ids = torch.rand(T, E, device=ctx.device).topk(K, dim=1).indices
    w = torch.rand(T, K, device=ctx.device)

    def step():
        b = d.dispatch(x, ids, w)
        x_N = b.materialize().x
        mult = torch.searchsorted(b.offsets_L1[1:].long(), torch.arange(x_N.shape[0], device=ctx.device),
                                  right=True) + ctx.rank * L + 1
        return d.combine((x_N.float() * mult.unsqueeze(1)).to(cfg.dtype), b)

    assert_combine_bounded(cfg, ctx.world_size, step(), x, ids, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i in range(replays):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.rand(T, E, device=ctx.device).topk(K, dim=1).indices)
        ids[torch.rand(T, K, device=ctx.device) < 0.2] = -1
        w.copy_(torch.rand(T, K, device=ctx.device))
        graph.replay()
        assert_combine_bounded(cfg, ctx.world_size, out, x, ids, w)
        if i < 3:
            torch.testing.assert_close(out, step(), rtol=0, atol=0)
    return True


@needs_gpus
@pytest.mark.gpu2
def test_gpu_cuda_graph_sync_free():
    from epmoe.launch import spawn
    assert all(spawn(_gpu_graph, gpu_test_ranks(), "cuda", (256, 1024, 16, 4, 20), timeout_s=240))
