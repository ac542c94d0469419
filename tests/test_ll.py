"""Tests of the `ll` dispatcher: R ranks emulated in one process (CPU interpreter, or one GPU), and
real ranks on several GPUs ($EPMOE_GPU_RANKS, default 2), including 100 CUDA-graph replays with changing
routing and token counts.

Shape letters: T tokens, D hidden size, K top-k, E experts, L local experts, M rows per expert slot,
R ranks.

Checks are exact where the data allows: every rank's received rows are compared, as a multiset per
expert, with the rows the senders hold (quantized by epmoe.quant.quantize_act_ref for fp8); combine
outputs against a float32 reference from the same expert outputs.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from epmoe.config import MoEConfig
from epmoe.dispatch.ll import COMBINE_MODES, LLDispatcher
from epmoe.quant import dequantize_act_ref, quantize_act_ref
from epmoe.registry import list_dispatchers, make_dispatcher
from epmoe.symm import EmulatedGroup
from gpu_ranks import gpu_test_ranks, multiple_of

EMU_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- inputs and references (shared by the emulated and the multi-GPU tests) --------------------

def make_inputs(cfg: MoEConfig, R: int, tokens: list[int], seed: int, skew: bool = False,
                drop: float = 0.1) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per rank (x_TD, ids_TK int32, weights_TK float32) on the CPU; ids distinct per token, some -1.

    skew: every token's first choice is expert 0 (one hot expert). Deterministic in `seed`, so every
    rank of a real run can build every rank's inputs.
    """
    g = torch.Generator().manual_seed(seed)
    E, K, D = cfg.num_experts, cfg.top_k, cfg.hidden_size
    out = []
    for r in range(R):
        T = tokens[r]
        x = torch.randn(T, D, generator=g).to(cfg.dtype)
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
        if skew and T:
            first = ids[:, :1].clone()
            ids = torch.where(ids == 0, first, ids)
            ids[:, 0] = 0
        ids = torch.where(torch.rand(T, K, generator=g) < drop, -1, ids)
        w = torch.rand(T, K, generator=g) + 0.1
        out.append((x, ids.to(torch.int32), w))
    return out


def as_sent(cfg: MoEConfig, x_TD: torch.Tensor) -> torch.Tensor:
    """float32 rows as the experts see them after dispatch (fp8 round trip when quantized)."""
    if cfg.quant == "fp8_block":
        return dequantize_act_ref(*quantize_act_ref(x_TD))
    return x_TD.float()


def expert_scale(E: int, device="cpu") -> torch.Tensor:
    """The stand-in expert: expert e multiplies its rows by (e + 1) / E."""
    return (torch.arange(E, dtype=torch.float32, device=device) + 1) / E


def fake_experts(cfg: MoEConfig, batch, first_expert: int) -> torch.Tensor:
    """y [L, M, D] = scale(e) * x for rows below counts_L, NaN in padding rows. No host sync."""
    x = batch.x.float() if batch.x_scale is None else dequantize_act_ref(batch.x, batch.x_scale)
    L, M = x.shape[:2]
    s = expert_scale(cfg.num_experts, x.device)[first_expert:first_expert + L]  # no copy: graph-safe
    pad = torch.arange(M, device=x.device)[None, :] >= batch.counts_L[:, None]
    y = torch.where(pad[..., None], float("nan"), x * s[:, None, None])
    return y.to(cfg.dtype)


def sent_rows(cfg: MoEConfig, R: int, inputs, dest: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank `dest` must receive, on `device`: (local expert [n] int64, rows [n, D] float32 as the
    experts see them), in no particular order. References are computed on the CPU (as_sent)."""
    L = cfg.num_experts // R
    experts, rows = [], []
    for x, ids, _ in inputs:
        t, k = (ids >= 0).nonzero(as_tuple=True)
        e = ids[t, k].long()
        mine = e // L == dest
        experts.append((e[mine] - dest * L).to(device))
        rows.append(as_sent(cfg, x).to(device)[t[mine].to(device)])
    return torch.cat(experts), torch.cat(rows)


def expected_out(cfg: MoEConfig, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 [T, D]: sum_k w * y, with y as fake_experts rounds it."""
    s = expert_scale(cfg.num_experts)
    xs = as_sent(cfg, x)
    out = torch.zeros(x.shape[0], cfg.hidden_size)
    for k in range(ids.shape[1]):
        valid = ids[:, k] >= 0
        e = ids[:, k].clamp_min(0).long()
        y = (xs * s[e][:, None]).to(cfg.dtype).float()
        out += torch.where(valid[:, None], w[:, k:k + 1] * y, 0.0)
    return out


def _canonical(experts: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (expert, row) pairs by expert, then by a random projection of the row (a multiset's order)."""
    g = torch.Generator().manual_seed(0)
    proj = torch.rand(rows.shape[1], generator=g, dtype=torch.float64).to(rows.device)
    order = (rows.double() * proj).sum(dim=1).argsort(stable=True)
    order = order[experts[order].argsort(stable=True)]
    return experts[order], rows[order]


def check_batch(cfg: MoEConfig, R: int, inputs, dest: int, batch) -> list[str]:
    """Compare one rank's ExpertBatch with what the senders hold, exactly, as a multiset of rows per
    expert; vectorized on the batch's device. Returns failure messages."""
    dev = batch.x.device
    exp_e, exp_rows = sent_rows(cfg, R, inputs, dest, dev)
    L, M = batch.x.shape[:2]
    counts = batch.counts_L.long()
    want = torch.bincount(exp_e, minlength=L)
    if not torch.equal(counts, want):
        bad = (counts != want).nonzero()[:, 0].tolist()[:5]
        return [f"rank {dest}: counts differ at local experts {bad}: got {counts[bad].tolist()}, "
                f"want {want[bad].tolist()}"]
    held = torch.arange(M, device=dev)[None, :] < counts[:, None]
    got_e = held.nonzero()[:, 0]
    if batch.x_scale is None:
        got_rows = batch.x[held].float()
    else:  # index the fp8 bytes (indexing float8 tensors is not implemented everywhere)
        q = batch.x.view(torch.uint8)[held].view(batch.x.dtype)
        got_rows = dequantize_act_ref(q, batch.x_scale[held])
    exp_e, exp_rows = _canonical(exp_e, exp_rows)
    got_e, got_rows = _canonical(got_e, got_rows)
    if not torch.equal(got_rows, exp_rows):
        bad = sorted(set(exp_e[(got_rows != exp_rows).any(dim=1)].tolist()))[:5]
        return [f"rank {dest}: rows of local experts {bad} differ"]
    return []


def check_out(cfg: MoEConfig, inputs, src: int, out: torch.Tensor, combine: str) -> list[str]:
    x, ids, w = inputs[src]
    ref = expected_out(cfg, x, ids, w)
    # "reduce" rounds each rank's partial sum to cfg.dtype once more than "source" does.
    tol = {"source": 1e-2, "reduce": 2e-2}[combine] if cfg.dtype != torch.float32 else 1e-5
    try:
        torch.testing.assert_close(out.cpu().float(), ref, rtol=tol, atol=tol)
    except AssertionError as exc:
        return [f"rank {src}: combine output: {str(exc)[:300]}"]
    return []


# ---- emulated ranks ----------------------------------------------------------------------------

def emulate_dispatch(dispatchers: list[LLDispatcher], inputs, device) -> list:
    """Every rank's dispatch_send, then every rank's dispatch_recv (so waits are already satisfied)."""
    handles = [d.dispatch_send(x.to(device), ids.to(device), w.to(device))
               for d, (x, ids, w) in zip(dispatchers, inputs)]
    return [d.dispatch_recv(h) for d, h in zip(dispatchers, handles)]


def emulate_combine(dispatchers: list[LLDispatcher], ys: list[torch.Tensor], batches: list) -> list[torch.Tensor]:
    handles = [d.combine_send(y, b) for d, y, b in zip(dispatchers, ys, batches)]
    return [d.combine_recv(h) for d, h in zip(dispatchers, handles)]


def make_world(cfg: MoEConfig, R: int, combine: str) -> list[LLDispatcher]:
    return [LLDispatcher(cfg, g, combine=combine, device=EMU_DEVICE) for g in EmulatedGroup.world(R)]


def run_calls(dispatchers, cfg: MoEConfig, calls) -> list[str]:
    """Run consecutive dispatch/combine calls (like consecutive layers) and check every one."""
    R = len(dispatchers)
    errors = []
    for inputs in calls:
        batches = emulate_dispatch(dispatchers, inputs, EMU_DEVICE)
        for r, b in enumerate(batches):
            errors += check_batch(cfg, R, inputs, r, b)
        ys = [fake_experts(cfg, b, d.first_expert) for d, b in zip(dispatchers, batches)]
        outs = emulate_combine(dispatchers, ys, batches)
        for r, out in enumerate(outs):
            errors += check_out(cfg, inputs, r, out, dispatchers[0].combine_mode)
    assert not any(d.timed_out() for d in dispatchers)
    return errors


CASES = [
    # (R, E, K, D, Tmax, quant, combine)
    (2, 4, 2, 128, 4, None, "source"),
    (2, 4, 2, 128, 4, None, "reduce"),
    (2, 6, 3, 200, 5, "fp8_block", "reduce"),
    (2, 6, 3, 200, 5, "fp8_block", "source"),
    (3, 6, 1, 72, 3, None, "reduce"),
    (3, 9, 4, 130, 4, "fp8_block", "source"),
]


@pytest.mark.parametrize("R,E,K,D,Tmax,quant,combine", CASES)
def test_emulated_consecutive_calls(R, E, K, D, Tmax, quant, combine):
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=32, quant=quant,
                    max_tokens_per_rank=Tmax)
    dispatchers = make_world(cfg, R, combine)
    tokens = [[Tmax] * R, [1] + [0] * (R - 1), [Tmax - 1, 0] + [Tmax] * (R - 2), [Tmax] * R]
    calls = [make_inputs(cfg, R, t, seed=i, skew=(i == 3), drop=0.0 if i == 0 else 0.25)
             for i, t in enumerate(tokens)]
    assert run_calls(dispatchers, cfg, calls) == []


def test_emulated_static_max_size_inputs():
    """What graph replays do: T stays Tmax, unused tokens carry ids -1, the active count changes."""
    cfg = MoEConfig(num_experts=8, top_k=3, hidden_size=256, intermediate_size=8, quant="fp8_block",
                    max_tokens_per_rank=6)
    dispatchers = make_world(cfg, 2, "reduce")
    calls = []
    for i, active in enumerate([(6, 6), (2, 0), (0, 5), (1, 1), (6, 3)]):
        inputs = make_inputs(cfg, 2, [6, 6], seed=50 + i, drop=0.0)
        for (_, ids, _), n in zip(inputs, active):
            ids[n:] = -1
        calls.append(inputs)
    assert run_calls(dispatchers, cfg, calls) == []


@pytest.mark.parametrize("combine", COMBINE_MODES)
def test_emulated_int64_ids_and_bf16_weights(combine):
    """ids in int64 (what torch.topk gives a caller's own gate) and weights in bfloat16 go the way int32 ids
    and float32 weights go; 3 ranks, skewed routing, -1 ids, a rank with no tokens."""
    cfg = MoEConfig(num_experts=6, top_k=3, hidden_size=64, intermediate_size=8, max_tokens_per_rank=4)
    dispatchers = make_world(cfg, 3, combine)
    calls = []
    for i, tokens in enumerate([[4, 0, 3], [1, 4, 2]]):
        inputs = make_inputs(cfg, 3, tokens, seed=60 + i, skew=i == 1, drop=0.25)
        calls.append([(x, ids.long(), w.bfloat16()) for x, ids, w in inputs])
    assert all(ids.dtype == torch.int64 for _, ids, _ in calls[0])
    assert run_calls(dispatchers, cfg, calls) == []


def test_emulated_all_dropped_and_float32():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=8, dtype=torch.float32,
                    max_tokens_per_rank=3)
    dispatchers = make_world(cfg, 2, "source")
    calls = [make_inputs(cfg, 2, [3, 2], seed=7, drop=1.0), make_inputs(cfg, 2, [3, 3], seed=8)]
    assert run_calls(dispatchers, cfg, calls) == []


def test_emulated_base_class_path_and_registry():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=8, max_tokens_per_rank=2)
    groups = EmulatedGroup.world(2)
    assert list_dispatchers(cfg, groups[0])["ll"] == (True, "ok")
    ds = [make_dispatcher("ll", cfg, g, device=EMU_DEVICE) for g in groups]
    # A single rank can run the whole call when R = 1.
    cfg1 = MoEConfig(num_experts=3, top_k=2, hidden_size=128, intermediate_size=8, max_tokens_per_rank=2)
    (g1,) = EmulatedGroup.world(1)
    d1 = make_dispatcher("ll", cfg1, g1, device=EMU_DEVICE)
    inputs = make_inputs(cfg1, 1, [2], seed=3)
    x, ids, w = (t.to(EMU_DEVICE) for t in inputs[0])
    batch = d1.dispatch(x, ids, w)
    assert check_batch(cfg1, 1, inputs, 0, batch) == []
    out = d1.combine(fake_experts(cfg1, batch, 0), batch)
    assert check_out(cfg1, inputs, 0, out, "reduce") == []
    assert ds[0].rows_per_expert == 4


def test_refuses_bad_input():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=8, max_tokens_per_rank=2)
    d = make_world(cfg, 2, "reduce")[0]
    x = torch.randn(3, 128, dtype=torch.bfloat16, device=EMU_DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int32, device=EMU_DEVICE)
    w = torch.ones(3, 2, device=EMU_DEVICE)
    with pytest.raises(ValueError, match="max_tokens_per_rank=2"):
        d.dispatch_send(x, ids, w)
    with pytest.raises(ValueError, match="expert id 4"):
        d.dispatch_send(x[:2], ids[:2] + 4, w[:2])
    with pytest.raises(ValueError, match="combine must be one of"):
        LLDispatcher(cfg, EmulatedGroup.world(2)[0], combine="dest")
    with pytest.raises(ValueError, match="wait_timeout_s"):
        LLDispatcher(cfg, EmulatedGroup.world(2)[0], wait_timeout_s=0)
    assert LLDispatcher.availability(cfg, None)[0] is False
    cfg5 = MoEConfig(num_experts=5, top_k=2, hidden_size=128, intermediate_size=8)
    assert LLDispatcher.availability(cfg5, EmulatedGroup.world(2)[0])[0] is False


def test_emulated_wait_times_out_instead_of_hanging():
    """A rank whose peer never sends: its wait gives up after wait_timeout_s and sets the flag; later
    waits then return at once."""
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=8, max_tokens_per_rank=2)
    d0 = [LLDispatcher(cfg, g, device=EMU_DEVICE, wait_timeout_s=1e-3) for g in EmulatedGroup.world(2)][0]
    x, ids, w = (t.to(EMU_DEVICE) for t in make_inputs(cfg, 2, [2, 2], seed=5)[0])
    assert not d0.timed_out()
    batch = d0.dispatch_recv(d0.dispatch_send(x, ids, w))  # rank 1 never sends
    assert d0.timed_out()
    d0.combine_recv(d0.combine_send(fake_experts(cfg, batch, 0), batch))  # returns, no spinning


# ---- real ranks (gpu_test_ranks() GPUs, default 2) ----------------------------------------------

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
    from epmoe.bench.dispatch import NVLINK_ENV
    for key, val in NVLINK_ENV.items():
        os.environ.setdefault(key, val)
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
