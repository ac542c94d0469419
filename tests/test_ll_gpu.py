"""Tests of the `ll` dispatcher over real ranks, one GPU each (gpu_ranks.gpu_test_ranks(), default 2):
exact checks of consecutive eager calls, and 100 CUDA-graph replays with changing routing and token
counts. NVLink multicast stays off (conftest.py sets the environment).

Shape letters: T tokens, D hidden size, K top-k, E experts, R ranks.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from epmoe.config import MoEConfig
from epmoe.dispatch.ll import LLDispatcher
from epmoe.registry import make_dispatcher
from gpu_ranks import gpu_test_ranks, multiple_of
from ll_support import check_batch, check_out, fake_experts, make_inputs


GPU_CASES = [
    # (E, K, D, Tmax, quant, combine): DeepSeek-V3 and Qwen3-30B-A3B layer shapes, and an odd small one
    # (E rounded up to a multiple of the world size)
    (256, 8, 7168, 128, "fp8_block", "reduce"),
    (128, 8, 2048, 256, None, "source"),
    (6, 3, 200, 33, "fp8_block", "source"),
    (6, 3, 200, 33, None, "reduce"),
]
# (case, split phases): DeepSeek-V3 fp8 through the fused calls, the odd small shape through the split
# phases (two cases: each compiles its own kernels, and the run must stay within SPAWN_TIMEOUT_S)
GRAPH_CASES = [(GPU_CASES[0], False), (GPU_CASES[3], True)]
WAIT_TIMEOUT_S = 10.0  # device-side waits give up after this (the ranks compile the same kernels at once)
SPAWN_TIMEOUT_S = 240.0  # the whole multi-rank run, so a hang fails the test instead of stalling it


def _call(d: LLDispatcher, cfg: MoEConfig, x, ids, w, split: bool):
    """One dispatch + fake experts + combine, through the fused calls or the four phases."""
    if split:
        batch = d.dispatch_recv(d.dispatch_send(x, ids, w))
        return batch, d.combine_recv(d.combine_send(fake_experts(cfg, batch, d.first_expert), batch))
    batch = d.dispatch(x, ids, w)
    return batch, d.combine(fake_experts(cfg, batch, d.first_expert), batch)


def _timed_out(d: LLDispatcher, where: str, rank: int) -> list[str]:
    return [f"rank {rank}: a device-side wait timed out ({WAIT_TIMEOUT_S} s) {where}"] if d.timed_out() else []


def _gpu_eager(ctx, d: LLDispatcher, cfg: MoEConfig) -> list[str]:
    """Consecutive calls with 0, 1, Tmax/2+1 and Tmax tokens, skew, fused and split phases in turn."""
    R, Tmax = ctx.world_size, cfg.max_tokens_per_rank
    errors = []
    for i, tokens in enumerate([[Tmax] * R, [0] + [1] * (R - 1), [Tmax // 2 + 1] * R, [Tmax] * R]):
        inputs = make_inputs(cfg, R, tokens, seed=100 + i, skew=(i == 2))
        x, ids, w = (t.to(ctx.device) for t in inputs[ctx.rank])
        batch, out = _call(d, cfg, x, ids, w, split=i % 2 == 1)
        timeout = _timed_out(d, f"in eager call {i}", ctx.rank)
        if timeout:
            return errors + timeout
        errors += [f"eager call {i}: {e}" for e in check_batch(cfg, R, inputs, ctx.rank, batch)
                   + check_out(cfg, inputs, ctx.rank, out, d.combine_mode)]
    return errors


def _gpu_graph(ctx, d: LLDispatcher, cfg: MoEConfig, replays: int, split: bool) -> list[str]:
    """One captured graph, replayed with new routing and active token counts (unused tokens: ids -1);
    every replay checked."""
    R, Tmax, D, K, dev = ctx.world_size, cfg.max_tokens_per_rank, cfg.hidden_size, cfg.top_k, ctx.device
    x_s = torch.zeros(Tmax, D, dtype=cfg.dtype, device=dev)
    ids_s = torch.full((Tmax, K), -1, dtype=torch.int32, device=dev)
    w_s = torch.ones(Tmax, K, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up call outside capture (every rank makes it)
        _call(d, cfg, x_s, ids_s, w_s, split)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch_g, out_g = _call(d, cfg, x_s, ids_s, w_s, split)
    g = torch.Generator().manual_seed(1234)
    errors = []
    for i in range(replays):
        active = [Tmax] * R if i % 10 == 0 else [int(torch.randint(0, Tmax + 1, (1,), generator=g)) for _ in range(R)]
        inputs = make_inputs(cfg, R, [Tmax] * R, seed=1000 + i, skew=(i % 7 == 3))
        for r in range(R):
            inputs[r][1][active[r]:] = -1
        x, ids, w = inputs[ctx.rank]
        x_s.copy_(x)
        ids_s.copy_(ids)
        w_s.copy_(w)
        graph.replay()
        timeout = _timed_out(d, f"in replay {i}", ctx.rank)  # a host sync
        if timeout:
            return errors + timeout
        errs = check_batch(cfg, R, inputs, ctx.rank, batch_g) + check_out(cfg, inputs, ctx.rank, out_g,
                                                                          d.combine_mode)
        errors += [f"replay {i} (active {active}): {e}" for e in errs][:max(0, 10 - len(errors))]
    return errors


def _gpu_cases_worker(ctx, cases, replays: int) -> list[str]:
    """All cases in one launch (each launch costs process start-up and NCCL set-up). `cases`: a list of
    (case, split) with replays > 0 (graph test), else of cases (eager test). After each case the ranks
    agree whether either timed out, and then stop together with a clear message."""
    errors = []
    for item in cases:
        case, split = item if replays else (item, False)
        t0 = time.monotonic()
        E, K, D, Tmax, quant, combine = case
        E = multiple_of(E, ctx.world_size)
        cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=64, quant=quant,
                        max_tokens_per_rank=Tmax)
        d = make_dispatcher("ll", cfg, ctx.group, combine=combine, wait_timeout_s=WAIT_TIMEOUT_S)
        errs = _gpu_graph(ctx, d, cfg, replays, split) if replays else _gpu_eager(ctx, d, cfg)
        errors += [f"{case}{' split' if split else ''}: {e}" for e in errs]
        print(f"rank {ctx.rank}: {case}{' split' if split else ''} done in {time.monotonic() - t0:.0f} s", flush=True)
        flag = torch.tensor([int(d.timed_out())], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            return errors + [f"{case}: stopped after a device-side wait timed out on some rank"]
    return errors


def _run_gpus(cases, replays: int) -> None:
    """The cases on gpu_test_ranks() GPUs (default 2)."""
    from epmoe.launch import spawn
    ranks = gpu_test_ranks()
    results = spawn(_gpu_cases_worker, nprocs=ranks, device="cuda", args=(cases, replays),
                    timeout_s=SPAWN_TIMEOUT_S)
    assert results == [[]] * ranks, "\n".join(e for rank_errors in results for e in rank_errors)


@pytest.mark.gpu2
def test_gpus_eager():
    """Exact checks, random data, consecutive calls with 0, 1, Tmax/2+1 and Tmax tokens, skew; both
    combine modes, fp8 and bf16 dispatch, the fused calls and the split phases."""
    _run_gpus(GPU_CASES, replays=0)


@pytest.mark.gpu2
def test_gpus_graph_replays():
    """One captured graph per case (fused or split phases), 100 replays with new routing and active
    token counts, every replay checked."""
    _run_gpus(GRAPH_CASES, replays=100)
