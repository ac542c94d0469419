"""The `epmoe` command: demo, check and bench. Parses arguments and hands over to the modules that work.

    epmoe demo  [--nproc N] [--device cpu|cuda] [--dtype bf16|fp32] [--quant none|fp8_block] [sizes]
    epmoe check [--nproc N] [--device cpu|cuda]
    epmoe bench experts|dispatch|layer ...     (bench dispatch --mode ll -> the low-latency benchmark)
    epmoe soak  [--device cpu|cuda] [--quick] ... (epmoe.soak.run)

Ranks are started here with epmoe.launch.spawn (gloo on CPU, NCCL on GPUs), or, when RANK and
WORLD_SIZE are set, this process is one rank of a torchrun launch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from . import launch
from .testing import add_layer_arguments, layer_spec

_BENCH_MODULES = {"experts": "epmoe.bench.experts", "dispatch": "epmoe.bench.dispatch",
                  "dispatch_ll": "epmoe.bench.dispatch_ll", "layer": "epmoe.bench.layer"}


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to start (default: 2 on cpu, every GPU on cuda; ignored under torchrun)")


def run_ranks(fn: Callable[..., int], device: str, nproc: int | None, args: tuple = ()) -> int:
    """Run fn(ctx, *args) -> exit code on every rank; return the worst exit code (this rank's under torchrun)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        ctx = launch.from_torchrun(device)
        try:
            return fn(ctx, *args)
        finally:
            dist.destroy_process_group()
    if nproc is None:
        nproc = torch.cuda.device_count() if device == "cuda" else 2
    return max(launch.spawn(fn, nproc, device, args))


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo_rank
    return run_ranks(demo_rank, args.device, args.nproc, (layer_spec(args, args.device), args.repeats))


def _check(args: argparse.Namespace) -> int:
    from .check import CASES, check_rank
    names = [c.name for c in CASES] if args.cases is None else args.cases.split(",")
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
        raise SystemExit(f"epmoe check: unknown case(s) {unknown}; cases: {', '.join(c.name for c in CASES)}")
    return run_ranks(check_rank, args.device, args.nproc, (args.seed, tuple(names)))


def _bench(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in ("experts", "dispatch", "layer"):
        print("usage: epmoe bench {experts,dispatch,layer} [options]  (dispatch --mode ll: low latency)",
              file=sys.stderr)
        return 2
    stage, rest = argv[0], list(argv[1:])
    if stage == "dispatch" and _mode(rest) == "ll":
        stage, rest = "dispatch_ll", _without_mode(rest)
    try:
        module = importlib.import_module(_BENCH_MODULES[stage])
    except ModuleNotFoundError as e:
        if e.name != _BENCH_MODULES[stage]:
            raise
        print(f"epmoe bench: the {stage} benchmark ({_BENCH_MODULES[stage]}) is not in this build of epmoe",
              file=sys.stderr)
        return 2
    return module.main(rest) or 0


def _mode(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--mode" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--mode="):
            return arg.split("=", 1)[1]
    return None


def _without_mode(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--mode":
            skip = True
        elif not arg.startswith("--mode="):
            out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epmoe", description="Expert-parallel MoE: demo, check, bench.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a DeepSeek-shaped MoE layer through every dispatcher, "
                                       "check it against one rank and time it")
    add_launch_arguments(demo)
    add_layer_arguments(demo)
    demo.add_argument("--repeats", type=int, default=5, help="timed calls per pair (median)")
    check = sub.add_parser("check", help="every valid dispatcher x experts x precision at several shapes, "
                                         "PASS/FAIL each; exit 1 on any failure")
    add_launch_arguments(check)
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--cases", default=None,
                       help="comma-separated case names to run (default: all; names: epmoe.check.CASES)")
    sub.add_parser("bench", help="benchmarks: bench experts|dispatch|layer ... (options go to the benchmark)",
                   add_help=False)
    sub.add_parser("soak", help="randomized load, memory, CUDA-graph replays, faults and bad inputs, with figures "
                                "(epmoe soak --help)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "soak":
        from .soak.run import main as soak_main
        return soak_main(argv[1:])
    args = build_parser().parse_args(argv)
    return _demo(args) if args.command == "demo" else _check(args)


if __name__ == "__main__":
    sys.exit(main())
