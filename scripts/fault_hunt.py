"""Many calls of one MoE block on one GPU, to catch a kernel that faults or races once in thousands of calls.

    python3 scripts/fault_hunt.py [--points deepseek-v3:512 qwen3-30b-a3b:256] [--quant fp8_block] [--calls 3000]
        [--eager] [--set down:pdl=false] [--put 'KEY@BOUND=CONFIG'] [--wrap 'compute-sanitizer --tool memcheck']
        [--experts triton|grouped_mm] [--only gate_up|down [--ungathered]] [--timeout 300]

Each point runs in a process of its own (a fault ends the CUDA context, and the next point still runs): a
`local` layer (experts `triton`, or --experts) as `epmoe bench moe` builds it (cfg.max_tokens_per_rank = T,
CUDA graphs unless --eager), the launch table of the GPU (or EPMOE_GEMM_TABLE), with --set / --put applied as
`epmoe.bench.table_ab` applies them. SETS input sets of T tokens (random router, as the bench's); the first
pass over them gives each set's output, and every later call's output must equal its set's bit for bit (the
local path is deterministic, so a race that changes a result shows as a mismatch). The host synchronizes every
--sync-every calls. --wrap runs each point's process under a command (compute-sanitizer; few calls then).
--only gate_up (or down) runs that GEMM alone instead, back to back, on the operands the layer's first call of
each set handed it (eager), its output checked the same way: whether a fault needs the kernels around it;
--ungathered hands the gate-up its rows gathered first (no row index: the `gate_up_fp8` buckets that exact
counts and the batched layout take, not `gate_up_fp8_indexed`).
Prints per point: calls done, mismatches (with the largest difference), the error a call raised, seconds; the
exit code is the number of points that faulted or mismatched.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from epmoe.bench.moe import SHAPES, layer_config, make_inputs, make_weights
from epmoe.bench.table_ab import derive
from epmoe.experts import triton as triton_experts
from epmoe.kernels import configs
from epmoe.layer import FusedMoE

SETS = 4


def captured(run: list, op: str, ungathered: bool) -> list:
    """One call per input set of the layer's `op` GEMM alone, on the operands the layer's call of that set
    handed it (with ungathered, a gate-up's rows gathered first)."""
    real, calls = getattr(triton_experts, op), []

    def record(*args, **kwargs):
        if op == "down":
            kwargs["follows_gate_up"] = False  # replayed alone: the kernel before it is the last down
        elif ungathered and kwargs.get("x_rows_R") is not None:
            x_rows = kwargs.pop("x_rows_R").long()
            if kwargs.get("x_scale_RG") is not None:
                kwargs["x_scale_RG"] = kwargs["x_scale_RG"][x_rows]
            args = (args[0][x_rows], *args[1:])
        calls.append(lambda: real(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(triton_experts, op, record)
    try:
        for f in run:
            f()
    finally:
        setattr(triton_experts, op, real)
    return calls


def output(result) -> torch.Tensor:
    """A call's output as one tensor (a gate-up's fp8 h and its scales, bytewise)."""
    if not isinstance(result, tuple):
        return result
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in result if t is not None])


def worker(point: str, quant: str, experts: str, calls: int, eager: bool, sync_every: int, only: str | None,
           ungathered: bool) -> dict:
    """Build the point's layer and inputs, run `calls` calls (of the layer, or of its `only` GEMM), return
    what happened (a fault propagates)."""
    name, T = point.split(":")
    shape, T = SHAPES[name], int(T)
    dev = torch.device("cuda")
    fp8 = quant == "fp8_block"
    weights = make_weights(shape, fp8, 0, dev)
    moe = FusedMoE(layer_config(shape, quant, T), None, dispatcher="local", experts=experts, device=dev,
                   cuda_graphs=not (eager or only))
    if fp8:
        q13, s13, q2, s2 = weights.fp8
        moe.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
    else:
        moe.load_experts(weights.w13_END, weights.w2_EDF)
    del weights
    gen = torch.Generator(dev).manual_seed(1)
    inputs = [make_inputs(shape, T, gen, dev) for _ in range(SETS)]
    run = [lambda inp=inp: moe(inp.x_TD, weights_TK=inp.weights_TK, ids_TK=inp.ids_TK) for inp in inputs]
    if only:
        run = [lambda f=f: output(f()) for f in captured(run, only, ungathered)]
    first = [f().clone() for f in run]
    torch.cuda.synchronize()
    mismatches, worst = 0, 0.0
    outs = []
    t0 = time.perf_counter()
    for c in range(calls):
        outs.append((c % SETS, run[c % SETS]().clone()))
        if len(outs) == sync_every or c == calls - 1:
            torch.cuda.synchronize()
            for k, out in outs:
                if not torch.equal(out, first[k]):
                    mismatches += 1
                    worst = max(worst, (out.float() - first[k].float()).abs().max().item())
            outs.clear()
    return {"calls": calls, "mismatches": mismatches, "max_diff": worst, "seconds": time.perf_counter() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", nargs="+", default=["deepseek-v3:512"], help="shape:T (epmoe.bench.moe.SHAPES)")
    p.add_argument("--quant", default="fp8_block", choices=["bf16", "fp8_block"])
    p.add_argument("--experts", default="triton", choices=["triton", "grouped_mm"])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--set", action="append", default=[], metavar="PREFIX:FIELD=VALUE")
    p.add_argument("--put", action="append", default=[], metavar="KEY@BOUND=CONFIG")
    p.add_argument("--only", choices=["gate_up", "down"], help="run the layer's GEMM alone, back to back")
    p.add_argument("--ungathered", action="store_true", help="--only gate_up: rows gathered first, no row index")
    p.add_argument("--wrap", default="", help="a command to run each point's process under")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a point's process may run")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ungathered and args.only != "gate_up":
        p.error("--ungathered goes with --only gate_up")
    if args.worker:
        result = worker(args.worker, args.quant, args.experts, args.calls, args.eager, args.sync_every, args.only,
                        args.ungathered)
        print("RESULT " + json.dumps(result))
        return 0
    env = dict(os.environ)
    if args.set or args.put:
        table = Path(tempfile.mkdtemp()) / "table.json"
        derive(configs.table_path(), args.set, table, args.put)
        env[configs.TABLE_ENV] = str(table)
    failed = 0
    flags = [*(["--eager"] if args.eager else []), *(["--only", args.only] if args.only else []),
             *(["--ungathered"] if args.ungathered else [])]
    for point in args.points:
        cmd = [*shlex.split(args.wrap), sys.executable, __file__, "--worker", point, "--quant", args.quant,
               "--experts", args.experts, "--calls", str(args.calls), "--sync-every", str(args.sync_every), *flags]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:  # (its output so far comes as bytes)
            out = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                          for part in (exc.stdout, exc.stderr))
            out, rc = f"{out}\ntimed out after {args.timeout:.0f} s", "timeout"
        result = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        bad = rc != 0 or result is None or result["mismatches"] > 0
        failed += bad
        label = " ".join([point, args.quant, args.experts, *(flag.lstrip("-") for flag in flags), *args.set,
                          *args.put])
        print(f"{label}: rc {rc}, {time.perf_counter() - t0:.0f} s, {json.dumps(result)}", flush=True)
        if bad or args.wrap:
            lines = [line for line in out.splitlines() if not line.startswith("RESULT ")]
            print("\n".join("    " + line for line in lines[-40:]), flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
