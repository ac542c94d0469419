"""Probe of the `ht` launch settings on 2 GPUs: programs and warps of the dispatch send and the combine
kernels, the combine's tiles and lag, at one size (default T 4096, D 7168, K 8, E 256), bf16 and fp8 dispatch.

    python3 scripts/ht_probe.py [--tokens 4096] [--iters 20] [--size-timing] [--profile OUT_DIR]

Prints, per setting, the median transfer / dispatch / combine time of each rank (epmoe.bench.dispatch
timing). The winner goes into epmoe/kernels/ht/launch.py `ht_launch`. --size-timing: also when the host
starts polling for the batch size and when it has it, against the layout being ready (is disp - ready
the size arriving late, or the host?). With --profile, instead runs the default
setting under torch.profiler and writes rank 0's kernel table and chrome trace per precision to OUT_DIR
(where the time of a dispatch goes: kernels, host launches, host syncs), and a cProfile of the host's
Python (*.host.txt: where the host's time to queue a call goes).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics

import torch

from epmoe.bench.dispatch import NVLINK_ENV, random_inputs, time_dispatcher
from epmoe.config import MoEConfig
from epmoe.launch import spawn

# (dispatch programs per SM (a fraction: SMs left to the numbering and layout), dispatch warps,
# combine programs per SM, combine warps[, combine columns
# per load, elements per step[, combine lag in waves]]); each new setting of warps or tiles costs a compile.
# The combine's registers are capped so that its programs per SM fit (kernels.registers_per_thread, as
# ht_launch does), unless --uncapped
SETTINGS = [(1, 8, 1, 8), (2, 4, 2, 4), (1, 8, 4, 4), (2, 8, 2, 8)]


class _SizeTiming:
    """Wraps Overlapped.batch_size (the host's poll): per call, GPU-clock events of the layout being ready
    (on the calling stream, which records `ready` just before the host reads the size), of the host
    starting its poll and of the host having the size (both on an idle stream, so each completes when the
    GPU sees the record: the host's moment plus the launch latency, a few µs)."""

    def __init__(self, cls) -> None:
        self.cls, self.original = cls, cls.batch_size
        self.idle = torch.cuda.Stream()
        self.calls = []
        timing = self

        def batch_size(schedule, pending):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record(torch.cuda.current_stream())
            ev[1].record(timing.idle)
            n = timing.original(schedule, pending)
            ev[2].record(timing.idle)
            timing.calls.append(ev)
            return n
        cls.batch_size = batch_size

    def take(self) -> tuple[float, float]:
        """Medians (µs) of the poll's start and of the size's arrival at the host, each minus ready (the
        calls since the last take; negative: before the layout was ready)."""
        torch.cuda.synchronize()
        start = statistics.median(e[0].elapsed_time(e[1]) * 1e3 for e in self.calls)
        seen = statistics.median(e[0].elapsed_time(e[2]) * 1e3 for e in self.calls)
        self.calls = []
        return start, seen


def _rank(ctx, args):
    from epmoe.dispatch.ht import HtDispatcher
    from epmoe.dispatch.ht.schedule import Overlapped
    from epmoe.kernels.ht import registers_per_thread
    timing = _SizeTiming(Overlapped) if args.size_timing else None

    T, D, K, E = args.tokens, 7168, 8, 256
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    inputs = [random_inputs(T, D, E, K, ctx.device, seed=1000 * ctx.rank + s) for s in range(2)]
    out = []
    for quant in args.quants:
        cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=128, max_tokens_per_rank=T,
                        quant=quant)
        default = HtDispatcher(cfg, ctx.group).launch
        kept = []  # every workspace stays allocated to the end: no symmetric-memory frees between settings
        for dp, dw, cp, cw, *tiles in args.settings:
            combine = dict(zip(("combine_chunk", "combine_step", "combine_lag"), tiles))
            # a fresh dispatcher per setting: the flags count one signal per program of its launch
            d = HtDispatcher(cfg, ctx.group, dense=False if args.sparse else None,
                             copy_engine=False if args.send_kernel or args.sparse else None,
                             launch=dataclasses.replace(
                                 default, programs=int(dp * sms), num_warps=dw, combine_programs=cp * sms,
                                 combine_warps=cw, combine_registers=None if args.uncapped else
                                 registers_per_thread(cp, cw), **combine))
            kept.append(d)
            t = time_dispatcher(d, inputs, warmup=3, iters=args.iters)
            if timing is not None:
                poll, seen = timing.take()
                print(f"rank {ctx.rank} {quant or 'bf16':>9} {dp}/SM: the host polls from {poll:+.0f} us and has "
                      f"the size at {seen:+.0f} us of ready (GPU clock; + a launch latency)", flush=True)
            out.append(dict(quant=quant or "bf16", setting=(dp, dw, cp, cw, *tiles), **t))
            print(f"rank {ctx.rank} {quant or 'bf16':>9} dispatch {dp}/SM x {dw} warps, combine {cp}/SM x {cw} "
                  f"warps {tiles}: xfer {t['transfer']:.0f} us, ready {t['ready']:.0f} us, "
                  f"dispatch {t['dispatch']:.0f} us, "
                  f"combine {t['combine']:.0f} us", flush=True)
    return out


def _profile(ctx, args):
    from torch.profiler import ProfilerActivity, profile

    from epmoe.dispatch.ht import HtDispatcher

    T, D, K, E = args.tokens, 7168, 8, 256
    inputs = [random_inputs(T, D, E, K, ctx.device, seed=1000 * ctx.rank + s) for s in range(2)]
    kept = []  # workspaces stay allocated to the end: no symmetric-memory frees between precisions
    for quant in args.quants:
        cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=128, max_tokens_per_rank=T,
                        quant=quant)
        d = HtDispatcher(cfg, ctx.group, copy_engine=False if args.send_kernel else None)
        kept.append(d)
        time_dispatcher(d, inputs, warmup=3, iters=5)  # compile and warm up outside the profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time_dispatcher(d, inputs, warmup=0, iters=args.iters)
        host = cProfile.Profile()  # the host's side: where the Python and launch time of a call goes
        with host:
            time_dispatcher(d, inputs, warmup=0, iters=args.iters)
        name = quant or "bf16"
        if ctx.rank == 0:
            out = os.path.join(args.profile, f"ht_profile_{name}")
            prof.export_chrome_trace(out + ".trace.json")
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            with open(out + ".txt", "w") as f:
                f.write(table)
            with open(out + ".host.txt", "w") as f:
                pstats.Stats(host, stream=f).sort_stats("tottime").print_stats(40)
                pstats.Stats(host, stream=f).sort_stats("cumulative").print_stats(60)
            print(f"{name}: {t}\n{table}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timeout", type=float, default=150, help="seconds before the ranks are killed")
    p.add_argument("--settings", default=";".join(",".join(map(str, s)) for s in SETTINGS),
                   help="';'-separated settings 'dispatch programs/SM,warps,combine programs/SM,warps[,chunk,step[,lag]]'")
    p.add_argument("--fp8-only", action="store_true")
    p.add_argument("--uncapped", action="store_true", help="leave the combine's registers to ptxas")
    p.add_argument("--bf16-only", action="store_true")
    p.add_argument("--send-kernel", action="store_true", help="bf16 rows by the send kernel, not the copy engine")
    p.add_argument("--sparse", action="store_true", help="rows only where they have an expert, after the numbering "
                   "(no dense mode)")
    p.add_argument("--size-timing", action="store_true", help="also time when the host gets the batch size, "
                   "against the layout being ready")
    p.add_argument("--profile", metavar="OUT_DIR", help="profile the default setting instead")
    args = p.parse_args()
    args.settings = [tuple(float(v) if "." in v else int(v) for v in item.split(",")) for item in args.settings.split(";")]
    args.quants = [q for q, skip in ((None, args.fp8_only), ("fp8_block", args.bf16_only)) if not skip]
    for key, value in NVLINK_ENV.items():
        os.environ.setdefault(key, value)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        spawn(_profile, 2, "cuda", (args,), timeout_s=args.timeout)
        return
    per_rank = spawn(_rank, 2, "cuda", (args,), timeout_s=args.timeout)
    print(f"{'prec':>5} {'disp prog/SM,warps':>18} {'comb prog/SM,warps[,chunk,step,lag]':>36}   xfer us  ready us"
          f"   disp us   comb us  (rank 0 / 1)")
    for a, b in zip(*per_rank):
        dp, dw, *comb = a["setting"]
        print(f"{a['quant']:>5} {f'{dp},{dw}':>18} {','.join(map(str, comb)):>36}   "
              f"{a['transfer']:4.0f}/{b['transfer']:<4.0f} {a['ready']:4.0f}/{b['ready']:<4.0f} "
              f"{a['dispatch']:4.0f}/{b['dispatch']:<4.0f} "
              f"{a['combine']:4.0f}/{b['combine']:<4.0f}", flush=True)


if __name__ == "__main__":
    main()
