"""`epmoe bench dispatch`: the `ht` dispatcher against `alltoall` over NCCL, on 2 GPUs of one host (or
--ranks N).

    python -m epmoe.bench.dispatch --out OUT_DIR [--tokens 512,1024,4096,8192] [--hidden 7168] [--topk 8]
                                   [--num-experts 256] [--iters 20] [--warmup 5]

For each tokens-per-rank T and precision (bf16; fp8 dispatch with bf16 combine; and "bf16 SM", the
rows moved by the send kernel, where the default bf16 dispatcher moves them by copy engine), both ranks
route T random tokens uniformly to top-k distinct experts and time dispatch and combine on each rank
with CUDA events (median after warm-up; two input sets alternate; each call starts from a barrier, a
short device spin and a device barrier, so that the ranks' GPUs begin together; a ~0.2 ms device spin
between dispatch and combine stands in for the experts, so the host queues the combine as it would in
a layer). Reported per rank:
- time of dispatch (split for ht into transfer: numbering, rows' kernel and the wait for every rank's
  rows; ready: also the layout, all the GPU's part; and the rest until the host has read the batch
  size and built the batch, which is when the call returns) and combine (us), and of the `alltoall`
  dispatcher on the same bf16 data, with the end-to-end ratio (alltoall dispatch + combine) / (ht
  dispatch + combine);
- link GB/s: the bytes this rank sends to OTHER ranks per second (dispatch: rows + ids + weights
  [+ fp8 scales] of each (token, other rank) pair; combine: one bf16 row per (token, rank) pair it returns);
  the NVLink limit is 478 GB/s per direction;
- DeepEP's metric: all received rows including the local share (hidden bytes, + scales for fp8) per second;
- host us: the host's time to queue one dispatch (Python and launches; the GPU time above excludes it).
One more bf16 row, "bf16 K=R": top-k = R with token t's k-th expert on rank k, so that the combine
reads and returns one row per (token, rank): the work of DeepEP's combine, whose input is one row per
received token (the sum over a rank's own experts left to the caller), where the K 8 rows' combine
also reads and sums every (token, expert) row (4x the expert rows at K 8, R 2). No alltoall beside it.
The ht dispatchers are built per T with max_tokens_per_rank = T (a layer sizes them to its batch; the
layout's cost follows the rows received either way). Writes OUT_DIR/bench_dispatch.json and prints a
table. Runs well under 90 s.

Shape letters: T tokens per rank, D hidden size, K top-k, E experts, R ranks, G fp8 scale groups.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..launch import RankContext, spawn
from ..quant import num_groups

NVLINK_GBPS = 478.0
# NVLink multicast off: the benchmark machines do not support it (BENCHMARKS.md, machines)
NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def check_nvlink_env() -> None:
    """SystemExit naming what to set unless the environment (inherited by the spawned ranks) turns NVLink
    multicast off as NVLINK_ENV says (scripts/gpu_run.sh exports it)."""
    wrong = [f"{k}={v}" for k, v in NVLINK_ENV.items() if os.environ.get(k) != v]
    if wrong:
        raise SystemExit(f"set {' '.join(wrong)} in the environment first (NVLink multicast must be off)")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="epmoe bench dispatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_dispatch.json")
    p.add_argument("--tokens", default="512,1024,4096,8192", help="tokens per rank, comma-separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", "-E", type=int, default=256, dest="num_experts")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def one_per_rank_inputs(T: int, D: int, E: int, R: int, device, seed: int):
    """x_TD bf16, ids_TR (column r: a uniform random expert of rank r), weights_TR (softmax), from `seed`."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    L = E // R
    ids = torch.randint(0, L, (T, R), device=device, generator=g) + torch.arange(R, device=device) * L
    w = torch.rand(T, R, device=device, generator=g).softmax(dim=1)
    return x, ids, w


def random_inputs(T: int, D: int, E: int, K: int, device, seed: int):
    """x_TD bf16, ids_TK (distinct top-k of uniform random scores), weights_TK (softmax), from `seed`."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, device=device, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device=device, generator=g).softmax(dim=1)
    return x, ids, w


# Between dispatch and combine the stream spins this long, standing in for the experts (milliseconds
# in a layer): the host queues the combine meanwhile, so the combine time is the GPU's, as in a layer,
# not the host's launch latency after dispatch's host sync.
EXPERTS_STAND_IN_CYCLES = 400_000  # ~0.2 ms at H200 clocks
# Before each timed call the stream spins this long while the host queues the dispatch's launches
# (~0.4 ms for an ht dispatch on the H200 machine's host).
ALIGN_CYCLES = 2_000_000  # ~1 ms


class _StartLine:
    """A device barrier of the ranks of a group (epmoe.kernels.sync.device_barrier), so that their timed
    calls start together on the GPUs, not only on the hosts (a host barrier leaves the hosts' wake-ups
    up to ~25 us apart). One per group for the process: its symmetric buffer is never freed."""

    _by_group: dict = {}

    def __init__(self, group, device: torch.device) -> None:
        from ..kernels.sync import DeviceWait
        from ..symm import BufferSpec, torch_workspace
        R = dist.get_world_size(group)
        self.ws = torch_workspace([BufferSpec("flag", (R,), torch.int64), BufferSpec("err", (1,), torch.int32)],
                                  group, device)
        self.rank, self.calls = dist.get_rank(group), 0
        self.wait = DeviceWait(err_1=self.ws.local("err"), timeout_ns=10 ** 10)

    @classmethod
    def of(cls, group, device: torch.device) -> "_StartLine":
        key = (dist.get_world_size(group), dist.get_rank(group), str(device), id(group))
        if key not in cls._by_group:
            cls._by_group[key] = cls(group, device)
        return cls._by_group[key]

    def __call__(self) -> None:
        from ..kernels.sync import device_barrier
        self.calls += 1
        device_barrier(self.ws.peers("flag"), self.ws.local("flag"), self.calls, self.rank, self.wait)


def time_dispatcher(dispatcher, inputs, warmup: int, iters: int, group=None) -> dict[str, float]:
    """Median times (us) over `iters` calls after `warmup`, alternating the input sets: dispatch and
    combine; for a host-synced `ht` dispatcher also `transfer`: until the device has every rank's rows
    (the calling stream's wait; copy engine: the side stream's, queued behind the layout, which
    usually ends first), and `ready`: until the calling stream has the rows and the layout (which
    the side stream makes while the rows travel): the GPU's part (the dispatch also
    includes the host's read of the batch size, which travels ahead of or beside the rows, and
    building the batch: when the host is slow, the stream idles until then).

    Each call starts from a barrier over `group` (host and device idle on every rank), then a device
    spin (ALIGN_CYCLES) while the host queues the dispatch, and a device barrier (`_StartLine`), so
    that all ranks' dispatches start together on the GPUs and the time is the GPU's, not the host's
    launches. Without the spin the ranks can lock into a skewed phase in which one rank's dispatch and another's combine each absorb the other's lag (a
    queued all_reduce before each call did not prevent it: the hosts' launch times differ). Also
    returns `host`: the host's time to queue a dispatch up to its host sync (ht: dispatch_send; the
    others: the whole dispatch call, sync included)."""
    from ..dispatch.ht.schedule import Overlapped
    schedule = getattr(dispatcher, "_schedule", None)
    ht = isinstance(schedule, Overlapped)
    ys = []
    for x, ids, w in inputs:  # one expert output per input set, shaped like its batch
        b = dispatcher._dispatch(x, ids, w)
        ys.append(torch.randn(b.out_shape, device=x.device).to(torch.bfloat16))
        dispatcher._combine(ys[-1], b)
    start_line = _StartLine.of(group if group is not None else dist.group.WORLD, inputs[0][0].device)
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(6)] for _ in range(warmup + iters)]
    host = []
    for i, (e0, e1, e2, e3, e4, e5) in enumerate(ev):
        x, ids, w = inputs[i % len(inputs)]
        torch.cuda.synchronize()
        dist.barrier(group=group)
        torch.cuda._sleep(ALIGN_CYCLES)
        start_line()
        e0.record()
        t0 = time.perf_counter()
        if ht:
            pending = dispatcher._dispatch_send(x, ids, w)
            host.append(time.perf_counter() - t0)
            schedule.wait_for_rows()
            # where the device waits for the rows: the stream, or the side stream (behind the layout)
            e1.record(schedule.rows_stream)
            layout = schedule.layout_ready(pending)
            e5.record()
            b = dispatcher._expert_batch(pending, layout)
        else:
            b = dispatcher._dispatch(x, ids, w)
            host.append(time.perf_counter() - t0)
            e1.record()
            e5.record()
        e2.record()
        torch.cuda._sleep(EXPERTS_STAND_IN_CYCLES)
        e3.record()
        dispatcher._combine(ys[i % len(inputs)], b)
        e4.record()
    torch.cuda.synchronize()
    if start_line.wait.err_1.item():
        raise RuntimeError("bench: the device barrier before a timed call gave up (a rank did not get there)")

    def median(a: int, z: int) -> float:
        return statistics.median(e[a].elapsed_time(e[z]) * 1e3 for e in ev[warmup:])

    return dict(dispatch=median(0, 2), transfer=median(0, 1), ready=median(0, 5), combine=median(3, 4),
                host=statistics.median(host[warmup:]) * 1e6)


def _rank_main(ctx: RankContext, args: argparse.Namespace) -> list[dict]:
    from ..dispatch.alltoall import AllToAllDispatcher
    from ..dispatch.ht import HtDispatcher

    D, K, E, R = args.hidden, args.topk, args.num_experts, ctx.world_size
    L, G = E // R, num_groups(D)
    common = dict(num_experts=E, top_k=K, hidden_size=D, intermediate_size=128, dtype=torch.bfloat16)
    a2a = AllToAllDispatcher(MoEConfig(**common, max_tokens_per_rank=max(args.tokens)), ctx.group)
    kept = []  # every ht workspace stays allocated to the end: no symmetric-memory frees between sizes
    rows = []
    for T in args.tokens:
        # capacity = the T measured, as a layer sized for its batch would be built
        cfg_bf16 = MoEConfig(**common, max_tokens_per_rank=T)
        inputs = [random_inputs(T, D, E, K, ctx.device, seed=1000 * ctx.rank + s) for s in range(2)]
        runs = {"bf16": (HtDispatcher(cfg_bf16, ctx.group), inputs),
                "fp8": (HtDispatcher(MoEConfig(**common, max_tokens_per_rank=T, quant="fp8_block"), ctx.group),
                        inputs)}
        if runs["bf16"][0].copy_engine:  # the default moves bf16 rows by copy engine here: the send kernel beside it
            runs["bf16 SM"] = (HtDispatcher(cfg_bf16, ctx.group, copy_engine=False), inputs)
        runs["bf16 K=R"] = (HtDispatcher(MoEConfig(**dict(common, top_k=R), max_tokens_per_rank=T), ctx.group),
                            [one_per_rank_inputs(T, D, E, R, ctx.device, seed=1000 * ctx.rank + s) for s in range(2)])
        kept.append(runs)
        a2a_t = time_dispatcher(a2a, inputs, args.warmup, args.iters, ctx.group)
        a2a_d, a2a_c = a2a_t["dispatch"], a2a_t["combine"]
        for prec, (ht, run_inputs) in runs.items():
            sent_other, recv_all, recv_other = _traffic(run_inputs[0][1], L, ctx)
            t = time_dispatcher(ht, run_inputs, args.warmup, args.iters, ctx.group)
            d_us, c_us = t["dispatch"], t["combine"]
            row_b = D + 4 * G if prec == "fp8" else D * 2
            same_data = prec != "bf16 K=R"  # alltoall ran on the top-K inputs
            rows.append(dict(
                rank=ctx.rank, tokens=T, precision=prec, rows_by=_rows_by(ht),
                dispatch_us=d_us, combine_us=c_us,
                transfer_us=t["transfer"], ready_us=t["ready"], host_us=t["host"],
                transfer_link_GBps=sent_other * (row_b + 8 * ht.cfg.top_k) / t["transfer"] / 1e3,
                dispatch_link_GBps=sent_other * (row_b + 8 * ht.cfg.top_k) / d_us / 1e3,
                combine_link_GBps=recv_other * D * 2 / c_us / 1e3,
                dispatch_deepep_GBps=recv_all * row_b / d_us / 1e3,
                combine_deepep_GBps=recv_all * D * 2 / c_us / 1e3,
                alltoall_dispatch_us=a2a_d if same_data else None, alltoall_combine_us=a2a_c if same_data else None,
                speedup_vs_alltoall=(a2a_d + a2a_c) / (d_us + c_us) if same_data else None,
                pairs_sent_to_others=sent_other, rows_received=recv_all, capacity=ht.capacity,
                ht_programs=ht.launch.programs, ht_combine_programs=ht.launch.combine_programs,
                sms=torch.cuda.get_device_properties(ctx.device).multi_processor_count))
    return rows


def _rows_by(ht) -> str:
    return "copy engine" if ht.copy_engine else "send kernel, dense" if ht.dense else "send kernel"


def _traffic(ids_TK: torch.Tensor, L: int, ctx: RankContext) -> tuple[int, int, int]:
    """(token, rank) pairs this rank sends to other ranks, and rows it receives in all and from other
    ranks (a token counts once per rank holding any of its experts)."""
    T, R = ids_TK.shape[0], ctx.world_size
    wants_TR = torch.zeros(T, R, dtype=torch.int32, device=ids_TK.device).scatter_(1, ids_TK // L, 1)
    sent_R = wants_TR.sum(0)
    recv_R = torch.empty_like(sent_R)
    dist.all_to_all_single(recv_R, sent_R, group=ctx.group)
    return int(sent_R.sum() - sent_R[ctx.rank]), int(recv_R.sum()), int(recv_R.sum() - recv_R[ctx.rank])


def _table(rows: list[dict]) -> str:
    head = ("rank", "T", "prec", "rows by", "disp us", "(xfer", "ready)", "comb us", "xfer link GB/s", "disp link GB/s",
            "comb link GB/s", "disp DeepEP GB/s", "comb DeepEP GB/s", "a2a disp us", "a2a comb us", "x vs a2a",
            "host us")
    lines = [" | ".join(head)]
    for r in rows:
        lines.append(" | ".join([
            str(r["rank"]), str(r["tokens"]), r["precision"], r["rows_by"], f"{r['dispatch_us']:.0f}",
            f"{r['transfer_us']:.0f}",
            f"{r['ready_us']:.0f}", f"{r['combine_us']:.0f}", f"{r['transfer_link_GBps']:.0f}",
            f"{r['dispatch_link_GBps']:.0f}", f"{r['combine_link_GBps']:.0f}", f"{r['dispatch_deepep_GBps']:.0f}",
            f"{r['combine_deepep_GBps']:.0f}", _num(r["alltoall_dispatch_us"], ".0f"),
            _num(r["alltoall_combine_us"], ".0f"), _num(r["speedup_vs_alltoall"], ".2f"), f"{r['host_us']:.0f}"]))
    return "\n".join(lines)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def main(argv: list[str]) -> None:
    """Entry point of `epmoe bench dispatch` (argv without the subcommand)."""
    args = _parse(argv)
    if torch.cuda.device_count() < args.ranks:
        print(f"epmoe bench dispatch: needs {args.ranks} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        raise SystemExit(2)
    check_nvlink_env()
    per_rank = spawn(_rank_main, args.ranks, "cuda", (args,))
    rows = sorted((r for rank_rows in per_rank for r in rank_rows), key=lambda r: (r["tokens"], r["precision"], r["rank"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(hidden=args.hidden, topk=args.topk, experts=args.num_experts, ranks=args.ranks, iters=args.iters,
                warmup=args.warmup, nvlink_GBps_per_direction=NVLINK_GBPS,
                note="alltoall is bf16 in both precision rows (it has no fp8 dispatch)")
    (out / "bench_dispatch.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"ht: {rows[0]['ht_programs']} programs for the dispatch send kernel and {rows[0]['ht_combine_programs']} "
          f"for the combine kernel ({rows[0]['sms']} SMs); 1 program waits for the rows, 1 (side stream) for "
          f"the sizes and ids; capacity (max_tokens_per_rank) = T of each row")
    print(f"link = bytes to the other rank(s) / time (limit {NVLINK_GBPS:.0f} GB/s); DeepEP = all received rows "
          f"incl. local / time; x vs a2a = alltoall (bf16, NCCL) time / ht time, dispatch + combine; "
          f"xfer = until the device has every rank's rows (by copy engine: the side stream, behind the "
          f"expert-sorted row index, made while the rows travel); ready = until the stream has the rows and the "
          f"index; disp = ready + the host's read of the size and the batch's making, where the host is late; "
          f"host = the host's time to queue a dispatch (ht: up to its host sync; alltoall: the whole call)")
    print(_table(rows))
    print(f"wrote {out / 'bench_dispatch.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
