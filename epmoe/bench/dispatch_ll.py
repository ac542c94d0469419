"""Benchmark of the `ll` dispatcher on 2 GPUs (or --ranks N), with the NCCL `alltoall` path (and `ht` when
present) in the same run.

    python -m epmoe.bench.dispatch_ll --out results/ [--ranks 2]   # or: epmoe bench dispatch --mode ll
    (env: NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1)

What is timed (CUDA events, median over iterations, microseconds, the slowest rank):
  ll: one CUDA graph for dispatch (the fused kernel) and one for combine (send + receive), replayed
      alternately after a sleep kernel that lets the host queue ahead; each time includes one graph
      launch on the GPU side. "split" times dispatch_send + dispatch_recv (two kernels) the same way. "pair/graph" is a graph of 16 (dispatch, combine) pairs divided by 16,
      the cost a layer pays inside a whole-model decode graph. fp8 dispatch, bf16 combine, both
      combine modes ("reduce", "source").
  alltoall / ht: eager calls (they sync with the host), ranks aligned by a barrier before each call;
      bf16 rows for alltoall. ht is skipped when epmoe.dispatch.ht is not importable.
Ratios are baseline time / ll time.

Shape letters: T tokens per rank, D hidden size, E experts, K top-k, L local experts, M rows per expert.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..launch import spawn
from ..quant import dequantize_act_ref
from ..registry import dispatcher_class, make_dispatcher
from ..routing import route
from .dispatch import check_nvlink_env

MODELS = {
    "deepseek-v3": dict(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048),
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),
}
TOKENS = (1, 32, 128, 256)
_GRAPH_PAIRS = 16
_GOAL_DISPATCH_US, _GOAL_COMBINE_US, _GOAL_RATIO = 12.0, 15.0, 5.0  # issue 5's targets
_SLEEP_CYCLES = 20_000_000  # ~10 ms on an H200: lets the host queue a whole timing batch


def _inputs(cfg: MoEConfig, T: int, rank: int, device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(1000 * T + rank)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(cfg.dtype).to(device)
    logits = torch.randn(T, cfg.num_experts, generator=g).to(device)
    weights, ids = route(logits, cfg)
    return x, ids, weights


def _median_us(pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    return statistics.median(a.elapsed_time(b) for a, b in pairs) * 1000.0


def _time_ll(d, cfg: MoEConfig, T: int, rank: int, iters: int) -> dict[str, float]:
    dev = d.device
    x, ids, w = _inputs(cfg, T, rank, dev)
    y = torch.randn(d.num_local_experts, d.rows_per_expert, cfg.hidden_size, device=dev).to(cfg.dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside capture
        for _ in range(3):
            d.combine(y, d.dispatch(x, ids, w))
            d.combine(y, d.dispatch_recv(d.dispatch_send(x, ids, w)))  # compiles the split path too
    torch.cuda.current_stream().wait_stream(side)
    g_dispatch, g_combine, g_pairs = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    g_split = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_dispatch):
        batch = d.dispatch(x, ids, w)
    with torch.cuda.graph(g_split):
        d.dispatch_recv(d.dispatch_send(x, ids, w))
    with torch.cuda.graph(g_combine):
        d.combine(y, batch)
    with torch.cuda.graph(g_pairs):
        for _ in range(_GRAPH_PAIRS):
            d.combine(y, d.dispatch(x, ids, w))
    for _ in range(5):
        g_dispatch.replay()
        g_combine.replay()
    torch.cuda.synchronize()
    dist.barrier()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    torch.cuda._sleep(_SLEEP_CYCLES)
    for e0, e1, e2 in ev:
        e0.record()
        g_dispatch.replay()
        e1.record()
        g_combine.replay()
        e2.record()
    torch.cuda.synchronize()
    dist.barrier()
    ev_split = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(iters)]
    torch.cuda._sleep(_SLEEP_CYCLES)
    for e0, e1 in ev_split:
        e0.record()
        g_split.replay()
        e1.record()
        g_combine.replay()  # the same call sequence on every rank: dispatch, combine
    torch.cuda.synchronize()
    dist.barrier()
    p0, p1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(_SLEEP_CYCLES)
    p0.record()
    for _ in range(4):
        g_pairs.replay()
    p1.record()
    torch.cuda.synchronize()
    return {"dispatch_us": _median_us([(a, b) for a, b, _ in ev]),
            "combine_us": _median_us([(b, c) for _, b, c in ev]),
            "dispatch_split_us": _median_us([(a, b) for a, b in ev_split]),
            "pair_in_graph_us": p0.elapsed_time(p1) * 1000.0 / (4 * _GRAPH_PAIRS)}


def _time_eager(d, cfg: MoEConfig, T: int, rank: int, iters: int) -> dict[str, float]:
    x, ids, w = _inputs(cfg, T, rank, torch.device("cuda", torch.cuda.current_device()))
    dispatch_t, combine_t = [], []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        batch = d.dispatch(x, ids, w)
        e1.record()
        y = batch.x if batch.x_scale is None else dequantize_act_ref(batch.x, batch.x_scale).to(cfg.dtype)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        e1b = torch.cuda.Event(enable_timing=True)
        e1b.record()
        d.combine(y, batch)
        e2.record()
        torch.cuda.synchronize()
        if i >= 3:
            dispatch_t.append(e0.elapsed_time(e1) * 1000.0)
            combine_t.append(e1b.elapsed_time(e2) * 1000.0)
    return {"dispatch_us": statistics.median(dispatch_t), "combine_us": statistics.median(combine_t)}


def _ht_available() -> str | None:
    """None if the `ht` dispatcher is registered and importable, else why not."""
    try:
        dispatcher_class("ht")
    except (ValueError, ImportError, AttributeError) as exc:
        return f"ht dispatcher not available ({exc})"
    return None


def _rank_main(ctx, tokens: tuple[int, ...], iters: int, models: tuple[str, ...]) -> list[dict]:
    rows = []
    ht_reason = _ht_available()
    for model in models:
        cfg = MoEConfig(**MODELS[model], quant="fp8_block", max_tokens_per_rank=max(tokens))
        cfg_bf16 = MoEConfig(**MODELS[model], max_tokens_per_rank=max(tokens))
        ll = {mode: make_dispatcher("ll", cfg, ctx.group, combine=mode) for mode in ("reduce", "source")}
        a2a = make_dispatcher("alltoall", cfg_bf16, ctx.group)
        ht = None
        if ht_reason is None:
            try:  # another branch's work in progress: any failure skips it, with the reason
                ht = make_dispatcher("ht", cfg, ctx.group)
            except Exception as exc:  # noqa: BLE001
                ht_reason = f"ht construction failed: {exc!r}"
        for T in tokens:
            row = {"model": model, "tokens": T, "D": cfg.hidden_size, "E": cfg.num_experts, "K": cfg.top_k}
            for mode, d in ll.items():
                row[f"ll_{mode}"] = _time_ll(d, cfg, T, ctx.rank, iters)
                if d.timed_out():
                    raise RuntimeError(f"ll ({mode}) device-side wait timed out at T={T}")
            row["alltoall"] = _time_eager(a2a, cfg_bf16, T, ctx.rank, max(10, iters // 5))
            if ht is not None:
                try:
                    row["ht"] = _time_eager(ht, cfg, T, ctx.rank, max(10, iters // 5))
                except Exception as exc:  # noqa: BLE001
                    ht, ht_reason = None, f"ht failed at T={T}: {exc!r}"
            rows.append(row)
        del ll, a2a, ht
        torch.cuda.empty_cache()
    if ht_reason is not None:
        rows.append({"ht_skipped": ht_reason})
    return rows


def _slowest(per_rank: list[list[dict]]) -> list[dict]:
    """Merge the ranks' rows: each time is the slower rank's."""
    merged = []
    for rows in zip(*per_rank):
        out = dict(rows[0])
        for key, val in rows[0].items():
            if isinstance(val, dict):
                out[key] = {k: max(r[key][k] for r in rows) for k in val}
        merged.append(out)
    return merged


def _table(rows: list[dict]) -> str:
    head = (f"{'model':<15}{'T':>5} | {'ll disp':>8}{'split':>7}{'comb red':>9}{'comb src':>9}{'pair/gr':>8} | "
            f"{'a2a disp':>9}{'a2a comb':>9}{'x disp':>7}{'x comb':>7} | {'ht disp':>8}{'ht comb':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "model" not in r:
            lines.append(f"(ht skipped: {r['ht_skipped']})")
            continue
        ll, src, a2a = r["ll_reduce"], r["ll_source"], r["alltoall"]
        best_comb = min(ll["combine_us"], src["combine_us"])
        ht = r.get("ht")
        ht_cols = f"{ht['dispatch_us']:>8.1f}{ht['combine_us']:>8.1f}" if ht else f"{'-':>8}{'-':>8}"
        lines.append(
            f"{r['model']:<15}{r['tokens']:>5} | {ll['dispatch_us']:>8.1f}{ll['dispatch_split_us']:>7.1f}"
            f"{ll['combine_us']:>9.1f}"
            f"{src['combine_us']:>9.1f}{ll['pair_in_graph_us']:>8.1f} | {a2a['dispatch_us']:>9.1f}"
            f"{a2a['combine_us']:>9.1f}{a2a['dispatch_us'] / ll['dispatch_us']:>7.1f}"
            f"{a2a['combine_us'] / best_comb:>7.1f} | {ht_cols}")
    lines.append("times in us (median, slower rank); x = alltoall / ll (combine: the faster ll mode)")
    for r in rows:
        if r.get("model") == "deepseek-v3" and r["tokens"] == 128:
            ll, a2a = r["ll_reduce"], r["alltoall"]
            comb = min(ll["combine_us"], r["ll_source"]["combine_us"])
            ok = (ll["dispatch_us"] <= _GOAL_DISPATCH_US and comb <= _GOAL_COMBINE_US
                  and a2a["dispatch_us"] / ll["dispatch_us"] >= _GOAL_RATIO
                  and a2a["combine_us"] / comb >= _GOAL_RATIO)
            lines.append(f"goal at 128 tokens, D 7168 (dispatch <= {_GOAL_DISPATCH_US} us, combine <= "
                         f"{_GOAL_COMBINE_US} us, >= {_GOAL_RATIO}x alltoall): {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="epmoe bench dispatch --mode ll", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for dispatch_ll.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens per rank")
    parser.add_argument("--iters", type=int, default=100, help="timed iterations per point")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--ranks", type=int, default=2, help="ranks, one GPU each (2 to 8)")
    args = parser.parse_args(argv)
    if not 2 <= args.ranks <= 8:
        parser.error(f"--ranks must be 2 to 8, got {args.ranks}")
    if torch.cuda.device_count() < args.ranks:
        parser.error(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
    check_nvlink_env()
    per_rank = spawn(_rank_main, nprocs=args.ranks, device="cuda",
                     args=(tuple(args.tokens), args.iters, tuple(args.models)))
    rows = _slowest(per_rank)
    print(_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "dispatch_ll.json"
        path.write_text(json.dumps({"bench": "dispatch_ll", "device": torch.cuda.get_device_name(0),
                                    "world_size": args.ranks, "rows": rows}, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
