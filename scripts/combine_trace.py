"""Timeline of the `ht` combine kernel's items on 2 GPUs: when each ticket's remote or local item ran,
and how long local items spun for the peers' partial rows.

    python3 scripts/combine_trace.py [--tokens 4096] [--lags 1.0] [--out DIR]

Loads a copy of epmoe/kernels/ht/combine.py whose combine kernel also stores, per ticket, (kind, program,
start, end of the wait, end) in global-timer ns, swaps it into the dispatcher, and runs the combine of
one 4096-token DeepSeek-V3-shaped dispatch (D 7168, K 8, E 256) from a device barrier. Variant
"no wait": local items skip their wait for the peers' partial rows (wrong sums: how long the
kernel would take if they never waited). Prints, per rank: the kernel's span, when the remote items
(the link's share) end, the local items' spin, and 10 us buckets of items finished.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from epmoe.bench.dispatch import ALIGN_CYCLES, NVLINK_ENV, _StartLine, random_inputs
from epmoe.config import MoEConfig
from epmoe.launch import spawn

PATCHES = [  # (old, new): each old must occur exactly once
    ("from ..sync import DeviceWait, peer_ptr, spin_until",
     "from epmoe.kernels.sync import DeviceWait, now_ns, peer_ptr, spin_until"),
    ("from .buffers import HtBuffers", "from epmoe.kernels.ht.buffers import HtBuffers"),
    ("from .launch import HtLaunch", "from epmoe.kernels.ht.launch import HtLaunch"),
    ("LOCAL: tl.constexpr, TIMEOUT_NS: tl.constexpr, INTERPRET: tl.constexpr):",
     "LOCAL: tl.constexpr, TIMEOUT_NS: tl.constexpr, INTERPRET: tl.constexpr, trace_ptr, NO_WAIT: tl.constexpr):"),
    ("    while ticket < total:\n        i = ticket // R\n",
     "    while ticket < total:\n        t_0 = now_ns(tl.full([], 0, tl.int64), INTERPRET)\n        t_w = t_0\n"
     "        kind = 0\n        i = ticket // R\n"),
    ("                                         rank, R, C, NI, D, K, BLOCK_K, CHUNK, ROWS)\n",
     "                                         rank, R, C, NI, D, K, BLOCK_K, CHUNK, ROWS)\n                    kind = 1\n"),
    ("                _wait_partials(slot_ptr, ready_ptr, j, T, epoch, rank, control_ptr + 2, TIMEOUT_NS, R, NI, ROWS,\n"
     "                               INTERPRET)\n",
     "                if not NO_WAIT:\n"
     "                    _wait_partials(slot_ptr, ready_ptr, j, T, epoch, rank, control_ptr + 2, TIMEOUT_NS, R, NI,\n"
     "                                   ROWS, INTERPRET)\n"
     "                t_w = now_ns(t_0, INTERPRET)\n                kind = 2\n"),
    ("        ticket = tl.atomic_add(control_ptr, 1, sem=\"relaxed\")\n    if tl.atomic_add(control_ptr + 1, 1)",
     "        if kind > 0:\n            at = trace_ptr + ticket.to(tl.int64) * 5\n"
     "            tl.store(at, kind.to(tl.int64))\n            tl.store(at + 1, tl.program_id(0).to(tl.int64))\n"
     "            tl.store(at + 2, t_0)\n            tl.store(at + 3, t_w)\n"
     "            tl.store(at + 4, now_ns(t_w, INTERPRET))\n"
     "        ticket = tl.atomic_add(control_ptr, 1, sem=\"relaxed\")\n    if tl.atomic_add(control_ptr + 1, 1)"),
    ("TIMEOUT_NS=wait.timeout_ns, INTERPRET=wait.interpret,",
     "TIMEOUT_NS=wait.timeout_ns, INTERPRET=wait.interpret, trace_ptr=TRACE[0], NO_WAIT=NO_WAIT[0],"),
]


def traced_kernels(tmp: str):
    """A copy of epmoe.kernels.ht.combine with the traced combine kernel (TRACE[0]: int64 [tickets, 5])."""
    import epmoe.kernels.ht.combine as original
    src = open(original.__file__).read()
    for old, new in PATCHES:
        if src.count(old) != 1:
            raise RuntimeError(f"patch target found {src.count(old)} times: {old!r}")
        src = src.replace(old, new)
    src += "\nTRACE = [None]\nNO_WAIT = [False]\n"
    path = os.path.join(tmp, "ht_traced.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("ht_traced", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ht_traced"] = mod
    spec.loader.exec_module(mod)
    return mod


def _summary(trace: torch.Tensor) -> dict:
    rows = trace[trace[:, 0] > 0].tolist()
    t0 = min(r[2] for r in rows)
    rel = [(k, p, (a - t0) / 1e3, (w - t0) / 1e3, (e - t0) / 1e3) for k, p, a, w, e in rows]
    remote = [r for r in rel if r[0] == 1]
    local = [r for r in rel if r[0] == 2]
    span = max(r[4] for r in rel)
    spins = sorted(r[3] - r[2] for r in local)
    buckets = {}
    for k, _, _, _, e in rel:
        b = int(e // 10) * 10
        buckets.setdefault(b, [0, 0])[k - 1] += 1
    return dict(
        span_us=round(span, 1), remote_items=len(remote), local_items=len(local),
        remote_first_end_us=round(min(r[4] for r in remote), 1) if remote else None,
        remote_last_end_us=round(max(r[4] for r in remote), 1) if remote else None,
        remote_item_us_median=round(sorted(r[4] - r[2] for r in remote)[len(remote) // 2], 1) if remote else None,
        local_first_start_us=round(min(r[2] for r in local), 1) if local else None,
        local_item_us_median=round(sorted(r[4] - r[3] for r in local)[len(local) // 2], 1) if local else None,
        local_spin_us_total=round(sum(spins), 1), local_spin_us_max=round(max(spins, default=0), 1),
        local_spinning_over_1us=sum(s > 1 for s in spins),
        local_after_last_remote=sum(r[2] >= max(x[4] for x in remote) for r in local) if remote else None,
        buckets_remote_local=[(b, *buckets[b]) for b in sorted(buckets)],
    )


def _rank(ctx, args):
    import epmoe.dispatch.ht.combine as combine_module
    from epmoe.dispatch.ht import HtDispatcher
    from epmoe.kernels.ht import ht_launch
    combine_module.kernels = mod = traced_kernels(tempfile.mkdtemp())  # the combine strategies' kernels
    T, D, K, E = args.tokens, 7168, 8, 256
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=128, max_tokens_per_rank=T)
    x, ids, w = random_inputs(T, D, E, K, ctx.device, seed=1000 * ctx.rank)
    start = _StartLine.of(dist.group.WORLD, ctx.device)
    mod.TRACE[0] = trace = torch.zeros(16 * T, 5, dtype=torch.int64, device=ctx.device)
    out = []
    kept = []
    for lag in args.lags:
        launch = dataclasses.replace(ht_launch(cfg.row_bytes, ctx.device), combine_lag=lag)
        d = HtDispatcher(cfg, ctx.group, launch=launch)
        kept.append(d)
        b = d._dispatch(x, ids, w)
        y = torch.randn(b.out_shape, device=ctx.device).to(torch.bfloat16)
        for no_wait in (False, True):
            mod.NO_WAIT[0] = no_wait
            times = []
            for _ in range(args.iters):
                trace.zero_()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda._sleep(ALIGN_CYCLES)
                start()
                e0.record()
                d._combine(y, b)
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1) * 1e3)
            s = dict(rank=ctx.rank, lag=lag, no_wait=no_wait, combine_us=sorted(times)[len(times) // 2],
                     **_summary(trace.cpu()))
            out.append(s)
            print(json.dumps({k: v for k, v in s.items() if k != "buckets_remote_local"}), flush=True)
            print(f"rank {ctx.rank} lag {lag} no_wait {no_wait} buckets (end us, remote, local): "
                  f"{s['buckets_remote_local']}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--lags", default="1.0")
    p.add_argument("--out", help="directory for combine_trace.json")
    args = p.parse_args()
    args.lags = [float(v) for v in args.lags.split(",")]
    for key, value in NVLINK_ENV.items():
        os.environ.setdefault(key, value)
    per_rank = spawn(_rank, 2, "cuda", (args,), timeout_s=240)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "combine_trace.json"), "w") as f:
            json.dump(per_rank, f)


if __name__ == "__main__":
    main()
