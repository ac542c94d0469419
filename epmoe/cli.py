"""The `epmoe` command: demo, check, bench, generate and soak. Parses arguments and hands over to the modules that work.

    epmoe demo  [--nproc N] [--device cpu|cuda] [--dtype bf16|fp16|fp32] [--quant none|fp8_block] [sizes]
    epmoe check [--nproc N] [--device cpu|cuda]
    epmoe bench experts|dispatch|layer|moe ...     (bench dispatch --mode ll -> the low-latency benchmark)
    epmoe generate --model DIR | --preset NAME [--nproc N] [--check] [--bench] ...   (transformers models)
    epmoe soak  [--device cpu|cuda] [--quick] ... (epmoe.soak.run)

Every argument and the whole configuration (the layer's MoEConfig, the ranks against the devices) is
checked here, in the launching process, before any rank starts: a mistake exits with code 2 and one
line on stderr (argparse's usage and error for options it cannot parse). Ranks are then started with
epmoe.launch.spawn (gloo on CPU, NCCL on GPUs), or, when RANK and WORLD_SIZE are set, this process is one
rank of a torchrun launch.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
from typing import Callable, NoReturn, Sequence

import torch

from . import launch
from .demo import CPU_SPEC, GPU_SPEC, LayerSpec
from .registry import DISPATCHER_NAMES, EXPERTS_NAMES

_BENCH_MODULES = {"experts": "epmoe.bench.experts", "dispatch": "epmoe.bench.dispatch",
                  "dispatch_ll": "epmoe.bench.dispatch_ll", "layer": "epmoe.bench.layer", "moe": "epmoe.bench.moe"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit with code 2 and one line on stderr: `<prog>: error: <message>`."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nproc", type=at_least(1), default=None, metavar="N",
                        help="ranks to start (default: 2 on cpu, every GPU on cuda; ignored under torchrun)")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_world_size(parser: argparse.ArgumentParser, device: str, nproc: int | None) -> int:
    """The number of ranks the launch will have (torchrun's WORLD_SIZE under torchrun); exits 2 (`fail`)
    where they cannot start on `device` here."""
    if _under_torchrun():
        nproc, local = int(os.environ["WORLD_SIZE"]), 1  # each process of the launch needs one device
    else:
        if nproc is None:
            nproc = torch.cuda.device_count() if device == "cuda" and torch.cuda.is_available() else 2
        local = nproc
    try:
        launch.check_launch(device, local)
    except ValueError as e:
        hint = ""
        if device == "cuda":
            hint = " (--nproc for fewer)" if torch.cuda.is_available() else " (--device cpu runs the ranks over gloo)"
        fail(parser, f"{e}{hint}")
    return nproc


def run_ranks(fn: Callable[..., int], device: str, world_size: int, args: tuple = ()) -> int:
    """Run fn(ctx, *args) -> exit code on `world_size` new ranks (launch_world_size's, checked) and return the
    worst exit code; under torchrun, run it on this rank and return its exit code."""
    if _under_torchrun():
        ctx = launch.from_torchrun(device)
        try:
            return fn(ctx, *args)
        finally:
            launch.close_rank()
    return max(launch.spawn(fn, world_size, device, args))


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of a LayerSpec (defaults: demo.CPU_SPEC on cpu, demo.GPU_SPEC on cuda)."""
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quant", choices=["none", "fp8_block"], default="none")
    parser.add_argument("--num-experts", "-E", type=at_least(1), dest="num_experts", metavar="E",
                        help="E, routed experts in the layer (divisible by the number of ranks)")
    parser.add_argument("--topk", "-K", type=at_least(1), dest="top_k", metavar="K", help="K experts per token")
    parser.add_argument("--hidden", "-D", type=at_least(1), dest="hidden_size", metavar="D", help="D hidden size")
    parser.add_argument("--intermediate", "-F", type=at_least(1), dest="intermediate_size", metavar="F",
                        help="F expert width")
    parser.add_argument("--tokens", "-T", type=at_least(0), dest="tokens_per_rank", metavar="T",
                        help="T tokens per rank")
    parser.add_argument("--groups", type=at_least(1), dest="num_groups", metavar="G",
                        help="expert groups for grouped top-k (default: DeepSeek-V3's, for the default E and K "
                             "only: none where -E or -K is given)")
    parser.add_argument("--topk-groups", type=at_least(1), dest="topk_groups", metavar="G",
                        help="groups each token picks from")
    parser.add_argument("--scaling", type=float, dest="routed_scaling_factor", metavar="S",
                        help="routed scaling factor")
    parser.add_argument("--seed", type=int, default=0)


def layer_spec(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> LayerSpec:
    """The LayerSpec that add_layer_arguments' options ask for on args.device, checked for `world_size`
    ranks (its MoEConfig, E divisible by the ranks); exits 2 (`fail`) naming the value it refuses."""
    base = GPU_SPEC if args.device == "cuda" else CPU_SPEC
    if (args.num_experts is not None or args.top_k is not None) and args.num_groups is None \
            and args.topk_groups is None:
        base = dataclasses.replace(base, num_groups=None, topk_groups=None)  # the default groups fit the default E, K
    fields = {name: getattr(args, name) for name in (
        "num_experts", "top_k", "hidden_size", "intermediate_size", "tokens_per_rank", "num_groups",
        "topk_groups", "routed_scaling_factor") if getattr(args, name) is not None}
    spec = dataclasses.replace(base, dtype=DTYPES[args.dtype], quant=None if args.quant == "none" else args.quant,
                               seed=args.seed, **fields)
    try:
        spec.config().local_experts(world_size)
    except ValueError as e:
        fail(parser, f"{e} (the layer: -E {spec.num_experts} -K {spec.top_k} --groups {spec.num_groups} "
                     f"--topk-groups {spec.topk_groups} --scaling {spec.routed_scaling_factor}, on {world_size} "
                     "ranks)")
    return spec


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .demo import demo_rank
    world_size = launch_world_size(parser, args.device, args.nproc)
    spec = layer_spec(parser, args, world_size)
    return run_ranks(demo_rank, args.device, world_size, (spec, args.repeats, args.warmup))


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .check import CASES, check_rank
    names = [c.name for c in CASES] if args.cases is None else args.cases.split(",")
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
        fail(parser, f"unknown case(s) {unknown}; cases: {', '.join(c.name for c in CASES)}")
    world_size = launch_world_size(parser, args.device, args.nproc)
    counts = sorted({c.cfg.num_experts for c in CASES if c.name in names})
    if all(e % world_size for e in counts):
        every = math.gcd(*counts)
        fail(parser, f"no case can run on {world_size} ranks: the cases' expert counts {counts} do not divide over "
                     f"them (--nproc {', '.join(str(n) for n in range(1, every + 1) if every % n == 0)} runs every "
                     "case chosen)")
    return run_ranks(check_rank, args.device, world_size, (args.seed, tuple(names)))


def _generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        from .hf.run import generate_rank, spec_from_args
    except ModuleNotFoundError as e:
        fail(parser, f"needs transformers and safetensors (pip install 'epmoe[hf]'): {e}")
    one_rank = not _under_torchrun() and args.nproc in (None, 1)  # in this process
    world_size = 1 if one_rank else launch_world_size(parser, args.device, args.nproc)
    try:
        spec = spec_from_args(args, world_size)
    except ValueError as e:
        fail(parser, str(e))
    if not any(spec.batch[r % len(spec.batch)] for r in range(world_size)):
        fail(parser, f"--batch {args.batch}: no prompts on any of the {world_size} rank(s)")
    if one_rank:
        if args.device == "cuda" and not torch.cuda.is_available():
            fail(parser, "--device cuda: no CUDA device is visible here (--device cpu runs on the CPU)")
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        return generate_rank(launch.RankContext(0, 1, device, None), spec)
    return run_ranks(generate_rank, args.device, world_size, (spec,))


def _bench(argv: Sequence[str]) -> int:
    usage = "usage: epmoe bench {experts,dispatch,layer,moe} [options]  (dispatch --mode ll: low latency; " \
            "epmoe bench NAME --help: its options)"
    if argv and argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if not argv or argv[0] not in ("experts", "dispatch", "layer", "moe"):
        unknown = f"epmoe bench: unknown benchmark {argv[0]!r}; " if argv else ""
        print(f"{unknown}{usage}", file=sys.stderr)
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
    """The parser of `epmoe demo|check|generate`, with entries for `bench` and `soak` (whose options their
    modules parse); each subcommand's parser is its namespace's `command_parser`."""
    parser = argparse.ArgumentParser(prog="epmoe", description="Expert-parallel MoE: demo, check, bench, generate, "
                                                               "soak.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a DeepSeek-shaped MoE layer through every dispatcher, "
                                       "check it against one rank and time it")
    add_launch_arguments(demo)
    add_layer_arguments(demo)
    demo.add_argument("--repeats", type=at_least(1), default=5, metavar="N", help="timed calls per pair (median)")
    demo.add_argument("--warmup", type=at_least(0), default=2, metavar="N", help="untimed calls before them")
    check = sub.add_parser("check", help="every valid dispatcher x experts x precision at several shapes, "
                                         "PASS/FAIL each; exit 1 on any failure")
    add_launch_arguments(check)
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--cases", default=None,
                       help="comma-separated case names to run (default: all; names: epmoe.check.CASES)")
    sub.add_parser("bench", help="benchmarks: bench experts|dispatch|layer|moe ... (options go to the benchmark)",
                   add_help=False)
    generate = sub.add_parser("generate", help="a transformers model (folder or preset) through epmoe: greedy "
                                               "decoding, tokens/s; --check against transformers; --bench")
    add_launch_arguments(generate)
    _add_generate_arguments(generate)
    for command_parser in (demo, check, generate):
        command_parser.set_defaults(command_parser=command_parser)
    sub.add_parser("soak", help="randomized load, memory, CUDA-graph replays, faults and bad inputs, with figures "
                                "(epmoe soak --help)", add_help=False)
    return parser


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """`epmoe generate`'s options (checked by epmoe.hf.run.spec_from_args, which needs transformers)."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint folder (safetensors, config.json)")
    src.add_argument("--preset", help="random weights at real shapes: qwen3-30b-a3b, deepseek-v2-lite, deepseek-v3, "
                                      "mixtral-8x7b (epmoe.hf.presets; comma-separated for --bench)")
    parser.add_argument("--layers", type=at_least(1), default=None, help="decoder layers of a preset (default: all)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--quant", default=None, help="none, fp8 or both (none,fp8): fp8 quantizes a preset's "
                                                      "experts per 128x128 block (default: none; --bench: both)")
    parser.add_argument("--batch", default="2", help="prompts per rank, or a comma-separated count per rank")
    parser.add_argument("--prompt-len", type=at_least(1), default=16)
    parser.add_argument("--new-tokens", type=at_least(1), default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dispatcher", choices=("auto", *DISPATCHER_NAMES), default="auto",
                        help="dispatcher of prefill calls")
    parser.add_argument("--decode-dispatcher", choices=("auto", *DISPATCHER_NAMES), default=None,
                        help="dispatcher of decode calls (default: the same)")
    parser.add_argument("--experts", choices=("auto", *EXPERTS_NAMES), default="auto")
    parser.add_argument("--max-tokens", type=at_least(1), default=4096, help="tokens per rank per prefill dispatch")
    parser.add_argument("--decode-max-tokens", type=at_least(1), default=None,
                        help="tokens per rank per decode dispatch")
    parser.add_argument("--check", action="store_true", help="compare with the unmodified transformers model")
    parser.add_argument("--bench", action="store_true", help="time prefill and decode-sized steps against "
                                                             "transformers' grouped_mm experts")
    parser.add_argument("--bench-prefill", type=at_least(1), default=4096, help="--bench: tokens of the prefill step")
    parser.add_argument("--bench-decode", type=at_least(1), default=256, help="--bench: batch of the decode step")
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--out", default=None, help="folder for the JSON results")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "soak":
        from .soak.run import main as soak_main
        return soak_main(argv[1:])
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return {"demo": _demo, "check": _check, "generate": _generate}[args.command](args.command_parser, args)


if __name__ == "__main__":
    sys.exit(main())
