"""`epmoe soak`: run the parts, print their tables and the figures, write JSON; exit code 1 if a goal is missed.

    epmoe soak [--device cpu|cuda] [--nproc N] [--parts load,graphs,faults,inputs] [--calls N] [--replays N]
               [--precisions fp32,bf16,fp8_block] [--fault-timeout S] [--wait-timeout S] [--quick] [--out DIR]

Goals (each missed one is a line under "missed" and makes the exit code 1): no output off the oracle;
no device memory growth after the warm-up (allocated and reserved), host RSS growth under RSS_SLACK;
every graph path replayed --replays times, every replay checked; every fault ended with a clear error
(or by the fault itself) on every rank, inside the time-out plus FAULT_SLACK_S, and the fresh group's layer
worked; every bad input refused with a ValueError (or a usage error) naming the value.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

import torch

from .. import launch
from ..cli import at_least, positive_float
from .._table import format_table
from .load import CPU_LOAD, GPU_LOAD, PRECISIONS, LoadSpec, Tally, digest_of, soak_emulated, soak_layers

PARTS = ("load", "graphs", "faults", "inputs")
RSS_SLACK = 64 << 20  # host RSS may wander this much after the warm-up (allocator caches, interpreter)
FAULT_SLACK_S = 5.0  # a fault may end this long after its time-out (process start-up of a fresh group)
QUICK = dict(calls=40, interpreted_calls=3, reruns=3, replays=20)  # the CI size


def _names(choices: Sequence[str]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n for n in text.split(",") if n)
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {', '.join(choices)}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epmoe soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--nproc", type=at_least(0), default=None,
                   help="ranks of the process-group paths (default: 2 on cpu; every GPU on cuda if 2 or more, "
                        "else none); 0: none")
    p.add_argument("--parts", type=_names(PARTS), default=PARTS)
    p.add_argument("--precisions", type=_names(tuple(PRECISIONS)), default=tuple(PRECISIONS))
    p.add_argument("--experts", type=_names(("reference", "triton", "grouped_mm")), default=None,
                   help="experts implementations (default: every one available)")
    p.add_argument("--calls", type=at_least(1), default=None, help="layer calls per path")
    p.add_argument("--interpreted-calls", type=at_least(1), default=None,
                   help="calls per path that runs Triton kernels under the interpreter (cpu)")
    p.add_argument("--reruns", type=at_least(0), default=None,
                   help="calls run again on a fresh layer (hashes compared)")
    p.add_argument("--replays", type=at_least(1), default=1000, help="replays per CUDA graph")
    p.add_argument("--emulated-ranks", type=at_least(1), default=None)
    p.add_argument("--fault-timeout", type=positive_float, default=3.0,
                   help="collective time-out of the gloo faults (s)")
    p.add_argument("--wait-timeout", type=positive_float, default=None,
                   help="device-side wait time-out of the emulated faults (s; default 1 on cuda, 0.002 on cpu, "
                        "where the interpreter's stand-in clock counts 1 us a spin)")
    p.add_argument("--quick", action="store_true",
                   help="the CI size: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(1), default=1,
                   help="torch CPU threads of each process (default 1: the soak's tensors are small, and more "
                        "threads only wait on each other on a shared CPU)")
    p.add_argument("--out", default=None, help="folder for soak.json")
    return p


def load_spec(args) -> LoadSpec:
    base = GPU_LOAD if args.device == "cuda" else CPU_LOAD
    quick = QUICK if args.quick else {}
    fields = {"calls": args.calls or quick.get("calls"), "interpreted_calls": args.interpreted_calls or
              quick.get("interpreted_calls"), "reruns": args.reruns if args.reruns is not None else quick.get("reruns"),
              "emulated_ranks": args.emulated_ranks, "seed": args.seed}
    return dataclasses.replace(base, **{k: v for k, v in fields.items() if v is not None})


def _rank_load(ctx, spec: LoadSpec, precisions: tuple[str, ...], experts, threads: int):
    torch.set_num_threads(threads)
    return soak_layers(spec, precisions, ctx.group, ctx.rank, ctx.world_size, ctx.device, experts)


def merge(per_rank: list[list[Tally]]) -> list[Tally]:
    """One tally per path from every rank's: outputs and mismatches summed, errors and growth the largest."""
    merged = []
    for tallies in zip(*per_rank):
        first = tallies[0]
        m = dataclasses.replace(first, outputs=sum(t.outputs for t in tallies),
                                mismatches=sum(t.mismatches for t in tallies),
                                max_error=max(t.max_error for t in tallies),
                                first_mismatch=next((t.first_mismatch for t in tallies if t.first_mismatch), ""),
                                hashes=[digest_of(t.hashes) for t in tallies],
                                rerun_equal=min(t.rerun_equal for t in tallies),
                                memory_growth={k: max(t.memory_growth.get(k, 0) for t in tallies)
                                               for k in first.memory_growth})
        merged.append(m)
    return merged


def not_run(skipped: list[tuple[str, str, str]], tallies: list[Tally]) -> list[tuple[str, str, str]]:
    """The skipped (dispatcher, experts, why) once each, the precisions of a "precision: why" gathered into
    one line, less a dispatcher's "not here" where it ran in another setting (say, allgather without a
    process group, which ran over gloo ranks)."""
    ran = {t.path.split("/")[0] for t in tallies}
    gathered: dict[tuple[str, str, str], list[str]] = {}
    for d, e, why in skipped:
        if e == "*" and d in ran:
            continue
        prec, _, reason = why.partition(": ") if why.split(": ", 1)[0] in PRECISIONS else ("", "", why)
        gathered.setdefault((d, e, reason), [])
        if prec and prec not in gathered[(d, e, reason)]:
            gathered[(d, e, reason)].append(prec)
    return [(d, e, f"{why} ({', '.join(precs)})" if precs else why) for (d, e, why), precs in gathered.items()]


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f}"


def tally_rows(tallies: list[Tally]) -> list[list[str]]:
    return [[t.path, t.calls, t.outputs, t.mismatches, f"{t.max_error:.2e}", f"{t.tolerance:.2g}",
             f"{t.rerun_equal}/{t.reruns}" if t.reruns else "-", _mib(t.memory_growth.get("allocated", 0)),
             _mib(t.memory_growth.get("reserved", 0)), _mib(t.memory_growth.get("rss", 0)), t.first_mismatch[:80]]
            for t in tallies]


TALLY_HEADERS = ["path", "calls", "outputs", "mismatches", "max rel err", "tol", "rerun equal", "alloc MiB",
                 "reserved MiB", "RSS MiB", "first mismatch"]


def missed_goals(tallies: list[Tally], graph_tallies: list[Tally], replays: int, faults: list, timeouts: dict,
                 rows: list) -> list[str]:
    missed = []
    for t in tallies + graph_tallies:
        if t.mismatches:
            missed.append(f"{t.path}: {t.mismatches} mismatches ({t.first_mismatch})")
        g = t.memory_growth
        if g.get("allocated", 0) or g.get("reserved", 0) or g.get("rss", 0) > RSS_SLACK:
            missed.append(f"{t.path}: memory grew after the warm-up: {g}")
    missed += [f"{t.path}: {t.calls} of {replays} replays" for t in graph_tallies if t.calls < replays]
    for o in faults:
        limit = timeouts["gloo" if "gloo" in o.path else "emulated"] + FAULT_SLACK_S
        timed = "gloo" in o.path or timeouts["emulated_on_gpu"]  # the interpreter's waits count spins, not time
        if not o.clear:
            missed.append(f"fault {o.fault} on {o.path}, rank {o.rank}: ended {o.ended} {o.error}")
        elif o.ended == "error" and o.seconds > limit and timed:
            missed.append(f"fault {o.fault} on {o.path}, rank {o.rank}: ended after {o.seconds:.1f} s > {limit:g} s")
        if o.fresh_group_ok is False:
            missed.append(f"fault {o.fault} on {o.path}, rank {o.rank}: the fresh group's layer failed: "
                          f"{o.fresh_error}")
    missed += [f"bad input {r.entry} {r.tried}: {r.error}" for r in rows if not r.ok]
    return missed


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here (--device cpu runs on the CPU)")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    spec = load_spec(args)
    nproc = args.nproc if args.nproc is not None else \
        (2 if args.device == "cpu" else (torch.cuda.device_count() if torch.cuda.device_count() > 1 else 0))
    report: dict = {"device": str(device), "spec": dataclasses.asdict(spec), "nproc": nproc}
    tallies, graph_tallies, faults, rows, skipped = [], [], [], [], []
    wait_timeout = args.wait_timeout if args.wait_timeout is not None else (1.0 if device.type == "cuda" else 2e-3)
    if "load" in args.parts:
        got, skips = soak_layers(spec, args.precisions, None, 0, 1, device, args.experts)
        tallies += got
        skipped += skips
        if nproc:
            results = launch.spawn(_rank_load, nproc, device.type, (spec, args.precisions, args.experts, args.threads),
                                   timeout_s=3600)
            tallies += merge([r[0] for r in results])
            skipped += results[0][1]
        got, skips = soak_emulated(spec, args.precisions, device, args.experts)
        tallies += got
        skipped += skips
        print(format_table(TALLY_HEADERS, tally_rows(tallies)), flush=True)
    if "graphs" in args.parts:
        from .graphs import soak_graphs
        graph_tallies, skips = soak_graphs(spec, args.precisions, args.replays, device)
        skipped += skips
        print(format_table(TALLY_HEADERS, tally_rows(graph_tallies)) if graph_tallies else "graphs: none ran",
              flush=True)
    if "faults" in args.parts:
        from .faults import emulated_faults, group_faults
        faults = group_faults(args.fault_timeout, threads=args.threads)  # gloo ranks, on the CPU wherever it runs
        emulated, why = emulated_faults(device, wait_timeout)
        faults += emulated
        if why:
            skipped.append(("faults: ht, ll", "*", why))
        print(format_table(["fault", "path", "rank", "ended", "s", "fresh group", "error"],
                           [[o.fault, o.path, o.rank, o.ended, f"{o.seconds:.2f}",
                             {True: "ok", False: "FAILED", None: "-"}[o.fresh_group_ok], o.error[:90]]
                            for o in faults]), flush=True)
    if "inputs" in args.parts:
        from .bad_inputs import bad_input_rows
        rows = bad_input_rows()
        print(format_table(["entry point", "input", "ok", "error"],
                           [[r.entry, r.tried, "yes" if r.ok else "NO", r.error[:100]] for r in rows]), flush=True)
    skipped = not_run(skipped, tallies + graph_tallies)
    for d, e, why in skipped:
        print(f"skipped: dispatcher {d}, experts {e}: {why}")
    missed = missed_goals(tallies, graph_tallies, args.replays, faults,
                          {"gloo": args.fault_timeout, "emulated": wait_timeout,
                           "emulated_on_gpu": device.type == "cuda"}, rows)
    summary = {
        "paths": len(tallies), "calls": sum(t.calls for t in tallies),
        "outputs_compared": sum(t.outputs for t in tallies),
        "mismatches": sum(t.mismatches for t in tallies + graph_tallies),
        "deterministic_paths": sum(t.reruns > 0 and t.rerun_equal == t.reruns for t in tallies + graph_tallies),
        "graph_paths": len(graph_tallies), "replays_checked": sum(t.calls for t in graph_tallies),
        "faults": len(faults), "faults_clear": sum(o.clear for o in faults),
        "bad_inputs": len(rows), "bad_inputs_refused": sum(r.ok for r in rows), "missed": missed,
    }
    print("figures: " + ", ".join(f"{k} {v}" for k, v in summary.items() if k != "missed"))
    if not (tallies or graph_tallies or faults or rows):
        missed.append(f"nothing ran: every path of --parts {','.join(args.parts)} was skipped (see above)")
    print("missed:\n  " + "\n  ".join(missed) if missed else "every goal met")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        report.update(summary=summary, load=[t.to_dict() for t in tallies],
                      graphs=[t.to_dict() for t in graph_tallies], faults=[dataclasses.asdict(o) for o in faults],
                      bad_inputs=[dataclasses.asdict(r) for r in rows], skipped=skipped)
        Path(args.out, "soak.json").write_text(json.dumps(report, indent=1, default=str))
    return int(bool(missed))
