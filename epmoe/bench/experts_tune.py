"""`epmoe bench experts --tune`: the launch-config sweep that writes the grouped GEMMs' table.

Shape letters: L experts, t rows per expert, R = L*t rows, D hidden size, F intermediate size,
N output columns of one GEMM (gate-up: both halves, 2F), K its reduction size, S source rows.

For every (GEMM, precision) and every table bucket from 128 rows per expert up, each candidate launch
config (`candidates`: the warp-specialized Gluon kernel on its schedules and the pointer kernel,
the committed entry first) is
1. checked: run on the GPU at the bucket's model shapes with 16 experts (8 for Mixtral) and skewed row
   counts (empty experts, partial tiles) against the float32 torch reference (`gate_up_ref` /
   `down_ref`; fp8 h against the reference re-quantized as the kernel does); these runs, which also
   compile every kernel, go to --workers processes at once, within --check-s seconds in all: a
   candidate that fails, errs, faults or hangs there is recorded and never timed;
2. timed at each of the bucket's points (`POINTS`: shape and t, exactly t rows per expert, x already
   quantized for fp8), median over calls with L2 flushed before each (`epmoe.timing.flushed_ms`: GPU-paced,
   so that no candidate's host launch time counts against it), beside torch._grouped_mm and a dense
   cuBLAS matmul of the same total size (bf16), or a dense torch._scaled_mm (fp8, one scale per tensor).
The winner of a bucket has the smallest sum over its points of time / the point's best time. Gate-ups
through a row index (`_indexed` entries: the warp-specialized kernel loading A by cp.async, and the
pointer kernel) are swept the same way over `INDEXED_CANDIDATES`. Buckets up to 64 rows (decode,
weight-bandwidth bound; `scripts/decode_sweep.py` sweeps them on routed rows) keep the entries of the table in
use on the GPU. Writes OUT/configs.json, listing the GPU it was tuned on (copy it over the committed table
that lists that GPU, epmoe/kernels/configs*.json, or to a new file there for a new GPU, and commit) and
OUT/experts_tune.json (every check and time, after each point), and prints a table per point last.
A stalled point (a kernel that never returns) ends the run after --stall-s seconds (exit code 3), with
the JSON and a configs.json from the points timed so far.

`--table-from OUT/experts_tune.json` writes configs.json from an earlier run's times without a GPU.
"""
from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import torch
import triton

from ..kernels import configs as configs_mod
from ..kernels.configs import GemmConfig
from ..kernels.grouped_gemm import ExpertRows, down, down_ref, gate_up, gate_up_ref
from ..kernels.quant import quantize_act
from ..quant import dequantize_act_ref, quantize_act_ref, quantize_weights_ref
from ..timing import flushed_ms
from .ceilings import device_name

BUCKETS = (128, 256, 1_000_000_000)  # the table's bounds tuned here (rows per expert)
# (shape, t) points each bucket is tuned on; shapes as in epmoe.bench.experts.SHAPES.
POINTS = {
    128: (("dsv3-128", 128), ("qwen3-30b", 128), ("dsv2-lite", 128)),
    256: (("dsv3-128", 256), ("qwen3-30b", 256), ("dsv2-lite", 256)),
    1_000_000_000: (("dsv3-128", 1024), ("qwen3-30b", 1024), ("mixtral-8x7b", 4096), ("dsv2-lite", 1024)),
}
INDEXED_POINTS = {128: (("dsv3-128", 128),), 256: (("qwen3-30b", 256),),
                  1_000_000_000: (("dsv3-128", 1024), ("qwen3-30b", 1024), ("mixtral-8x7b", 4096))}
TOP_K = 8  # an indexed gate-up reads R rows from S = R / TOP_K source rows
CHECK_EXPERTS = 16


def ws_config(schedule: str, m: int, n: int, k: int, stages: int, pipe: bool = False,
              claim: bool = False, swap: bool = False) -> GemmConfig:
    """A warp-specialized launch config: an m x n x k tile on `schedule` with `stages` ring stages (8 consumer
    warps cooperative, else 4; GROUP_M 8); pipe: pipe_mma (fp8); claim: claim_tiles (cooperative); swap:
    swap_ab."""
    return GemmConfig(block_m=m, block_n=n, block_k=k, group_m=8, num_warps=8 if schedule == "cooperative" else 4,
                      num_stages=stages, warp_specialize=schedule, pipe_mma=pipe, claim_tiles=claim, swap_ab=swap)


# Warp-specialized candidates per (op, fp8), the same for every bucket. Shared memory: stages of
# (block_m + block_n (x2 gate-up)) * block_k elements within 227 KB, with the 16-bit outputs' TMA store
# buffer where it fits beside them (`grouped_gemm_ws.uses_tma_store`: the 3-stage 128x256 down is there for
# it); registers: the fp32 tiles a consumer thread holds (accumulators, and for fp8 the one or two block
# results) within 224 (tests/compile_hopper.py checks both with triton 3.6 and the newest, and that ptxas
# keeps the wgmma pipelined). Two interleaved 4-warp consumers
# hold too few registers (triton 3.6's ptxas spills) for the fp8 gate-up's 128-column h tiles (h
# quantized in the epilogue; 64-column tiles leave h to `quantize_act`) and for PIPE_MMA's two block results;
# split consumers (each half of a 128-row tile) hold the fp8 gate-up's with 232 registers, but not
# PIPE_MMA's gate-up (two block results of the gate and the up).
# The interleaved bf16 gate-up (64x128x64, 5 stages) is left out: it twice misbehaved in the tuner's checks
# on the H200 (an unspecified launch failure at Mixtral-8x7B's shape, a wrong result at V2-Lite's: rel.
# error 0.032), as the schedule's ring does with an odd count of stages, which GemmConfig now refuses
# (grouped_gemm_ws._ring_slot); it won no bucket. The cooperative gate-ups run also with
# claim_tiles (the programs take tiles from a counter: 1.01-1.07x at 128 rows per expert, 0.98-0.99x at 256 in
# `bench experts`, BENCHMARKS.md "what we tried"), so that the tuner decides it per bucket.
WS_CANDIDATES = {
    ("gate_up", False): (ws_config("cooperative", 128, 128, 64, 4), ws_config("split", 128, 128, 64, 4),
                         ws_config("cooperative", 128, 128, 64, 4, claim=True)),
    ("down", False): (ws_config("cooperative", 128, 256, 64, 4), ws_config("cooperative", 128, 256, 64, 3),
                      ws_config("cooperative", 128, 128, 64, 6),
                      ws_config("interleaved", 128, 128, 64, 6), ws_config("split", 128, 256, 64, 3),
                      ws_config("split", 128, 128, 64, 6)),
    ("gate_up", True): (ws_config("cooperative", 64, 128, 128, 5, pipe=True), ws_config("cooperative", 128, 128, 128, 4),
                        ws_config("interleaved", 64, 64, 128, 8), ws_config("split", 128, 128, 128, 4),
                        ws_config("cooperative", 128, 128, 128, 4, claim=True)),
    ("down", True): (ws_config("cooperative", 128, 128, 128, 6, pipe=True), ws_config("cooperative", 128, 128, 128, 6),
                     ws_config("interleaved", 64, 128, 128, 8), ws_config("split", 128, 128, 128, 6),
                     ws_config("split", 128, 128, 128, 6, pipe=True)),
}
# Pointer-kernel candidates beside the committed entry: one 128-row tile per expert at 128 rows (each
# weight tile read once).
POINTER_CANDIDATES = {
    ("gate_up", False): (GemmConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4,
                                    tma=True),),
    ("down", False): (), ("gate_up", True): (), ("down", True): (),
}
INDEXED_CANDIDATES = {
    False: (ws_config("cooperative", 128, 128, 64, 4), ws_config("split", 128, 128, 64, 4),
            ws_config("cooperative", 128, 128, 64, 4, claim=True),
            GemmConfig(block_m=64, block_n=128, block_k=64, group_m=4, num_warps=4, num_stages=4),
            GemmConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, tma=True),
            GemmConfig(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=3, tma=True)),
    True: (ws_config("cooperative", 64, 128, 128, 5, pipe=True),
           GemmConfig(block_m=64, block_n=128, block_k=128, group_m=4, num_warps=8, num_stages=4),
           GemmConfig(block_m=128, block_n=128, block_k=128, group_m=16, num_warps=8, num_stages=3)),
}


SWAP_ROWS = (16, 32, 64)  # an expert's rows per swapped tile (the wgmma's N side)


def swap_candidates(op: str, fp8: bool) -> list[GemmConfig]:
    """Tiles with swapped products (`GemmConfig.swap_ab`) for the hand-set decode buckets, timed on routed rows
    by scripts/decode_sweep.py --pool swap (not by the tuner): SWAP_ROWS of an expert's rows against 128
    weight rows (64 too for the bf16 pointer kernel). Spills below are of the sm_90 compile
    (tests/compile_hopper.py).
    - The pointer kernel: 128-deep K blocks, pointer or TMA loads, 3 or 4 stages, 4 warps (8 with 64 rows:
      an fp8 gate-up's two 128x64 float32 sums spill 112-512 B on 4, triton 3.9).
    - The warp-specialized kernel: the cooperative schedule as the fp8 decode buckets run it (5 stages,
      claim_tiles for the gate-up, pipe_mma but on a 64-row gate-up, whose four block results spill 216 B),
      the fp8 ones also without pipe_mma; the interleaved schedule for the downs of up to 32 rows (at 64 its
      4-warp fp8 consumers spill 16 B, triton 3.6). As many of those stages as fit beside each consumer's
      transposition of its sums (`configs.swap_scratch_bytes`) and a 16-bit output's TMA store buffer."""
    gate = op == "gate_up"
    size = 1 if fp8 else 2
    out = []
    for bm, bn, stages, tma in itertools.product(SWAP_ROWS, (128,) if fp8 else (64, 128), (3, 4), (False, True)):
        if (bm + (2 if gate else 1) * bn) * 128 * size * stages <= configs_mod.POINTER_STAGE_BYTES:
            out.append(GemmConfig(block_m=bm, block_n=bn, block_k=128, group_m=1, num_warps=8 if bm == 64 else 4,
                                  num_stages=stages, tma=tma, swap_ab=True))
    bk = 128 if fp8 else 64
    for bm in SWAP_ROWS:
        stage = (bm + (2 if gate else 1) * 128) * bk * size
        for schedule in ("cooperative",) if gate or bm == 64 else ("cooperative", "interleaved"):
            consumers = 2 if schedule == "interleaved" else 1
            scratch = configs_mod.swap_scratch_bytes(ws_config(schedule, bm, 128, bk, 4, swap=True))
            fixed = 1024 + consumers * scratch + (0 if (gate and fp8) or consumers == 2 else bm * 128 * 2)
            stages = min(5 if gate else 6, (configs_mod.SHARED_BYTES - fixed) // stage)
            stages -= stages % consumers  # (interleaved consumers: an even count)
            pipes = (True, False) if fp8 and schedule == "cooperative" and not (gate and bm == 64) else (False,)
            out += [ws_config(schedule, bm, 128, bk, stages, pipe=pipe, claim=gate, swap=True) for pipe in pipes]
    return out


def candidates(op: str, fp8: bool, bound: int, indexed: bool = False) -> list[GemmConfig]:
    """The committed table's entry for rows-per-expert bound `bound` first, then the others."""
    pool = INDEXED_CANDIDATES[fp8] if indexed else WS_CANDIDATES[(op, fp8)] + POINTER_CANDIDATES[(op, fp8)]
    out = [configs_mod.gemm_config(op, fp8=fp8, rows_hint=bound, on_gpu=True, indexed=indexed)]
    return out + [c for c in pool if c not in out]


_SHORT = {"cooperative": "coop", "interleaved": "intl", "split": "split"}


def describe(cfg: GemmConfig) -> str:
    if cfg.warp_specialize:
        kind = f"ws-{_SHORT[cfg.warp_specialize]}{'+pipe' if cfg.pipe_mma else ''}{'+claim' if cfg.claim_tiles else ''}"
    else:
        kind = f"ptr w{cfg.num_warps}{' tma' if cfg.tma else ''}"
    pdl = " pdl" if cfg.pdl else ""
    swap = " swap" if cfg.swap_ab else ""
    return f"{kind} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} g{cfg.group_m}{pdl}{swap}"


# ---------------------------------------------------------------------------------------------------
# Operands


def _shape(name: str) -> tuple[int, int, int]:
    from .experts import SHAPES
    return SHAPES[name]


def _weights(L: int, D: int, F: int, fp8: bool, device, seed: int = 0):
    from .experts import random_weights
    torch.manual_seed(seed)
    w13, w2 = random_weights(L, D, F, device)
    if not fp8:
        return w13, None, w2, None
    q13, s13 = quantize_weights_ref(w13)
    q2, s2 = quantize_weights_ref(w2)
    return q13, s13, q2, s2


def _activations(op: str, fp8: bool, R: int, K: int, device):
    a = torch.randn(R, K, dtype=torch.bfloat16, device=device)
    return quantize_act(a) if fp8 else (a, None)


def _run(op: str, a, a_s, w, w_s, rows: ExpertRows, cfg: GemmConfig, x_rows=None):
    """(out, out_scale) of the library launcher with launch config cfg."""
    if op == "gate_up":
        return gate_up(a, w, rows, x_scale_RG=a_s, w13_scale=w_s, x_rows_R=x_rows, config=cfg)
    return down(a, w, rows, h_scale_RG=a_s, w2_scale=w_s, out_dtype=torch.bfloat16, config=cfg), None


# ---------------------------------------------------------------------------------------------------
# Checks (worker processes)


def _check_task(task: dict) -> list[dict]:
    """Every candidate of one (shape, op, precision[, indexed]) against the reference, at 16 experts.

    task: op, fp8, indexed, dims (D, F, L), configs (GemmConfig dicts), device (default cuda)."""
    op, fp8, indexed = task["op"], task["fp8"], task["indexed"]
    D, F, L = task["dims"]
    dev = torch.device(task.get("device", "cuda"))
    Lc = min(L, CHECK_EXPERTS)
    counts = [(0, 1, 17, 64, 130, 5, 128, 255, 33, 0, 7, 96, 200, 3, 64, 100)[i] for i in range(Lc)]
    R = -(-(sum(counts) + 5) // 16) * 16  # padding rows past the experts, a multiple of 16 in all
    offsets = torch.tensor([0] + counts, dtype=torch.int32, device=dev).cumsum(0).to(torch.int32)
    rows = ExpertRows.contiguous(offsets)
    w13, s13, w2, s2 = _weights(Lc, D, F, fp8, dev)
    w, w_s = (w13, s13) if op == "gate_up" else (w2, s2)
    K = D if op == "gate_up" else F
    x_rows = None
    if indexed:
        a, a_s = _activations(op, fp8, R // TOP_K + 1, K, dev)
        x_rows = torch.randint(0, a.shape[0], (R,), dtype=torch.int32, device=dev)
    else:
        a, a_s = _activations(op, fp8, R, K, dev)
    if op == "gate_up":
        ref = gate_up_ref(a, w, rows, x_scale_RG=a_s, w13_scale=w_s, x_rows_R=x_rows)
        if fp8:  # the kernel's h is quantized: compare with the reference quantized the same way
            ref = dequantize_act_ref(*quantize_act_ref(ref))
    else:
        ref = down_ref(a, w, rows, h_scale_RG=a_s, w2_scale=w_s)
    mask = torch.zeros(R, dtype=torch.bool, device=dev)
    mask[:sum(counts)] = True
    out = []
    for cfg in (GemmConfig(**c) for c in task["configs"]):
        t0 = time.perf_counter()
        entry = {"config": cfg.to_dict()}
        try:
            got, got_s = _run(op, a, a_s, w, w_s, rows, cfg, x_rows)
            got = dequantize_act_ref(got, got_s) if got_s is not None else got.float()
            entry["rel_err"] = ((got[mask] - ref[mask]).norm() / ref[mask].norm().clamp_min(1e-30)).item()
            entry["ok"] = entry["rel_err"] < 1e-2
        except Exception as exc:  # a compile or launch failure is recorded, the sweep goes on
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
        entry["seconds"] = time.perf_counter() - t0
        out.append(entry)
    return out


def run_checks(waves: list[list[dict]], workers: int, budget_s: float) -> list[list[list[dict]]]:
    """_check_task over worker processes, wave after wave (the first wave compiles every kernel once,
    one config a task, so that the later waves find them compiled), each task in a fresh process (a
    kernel that faults takes no other task's CUDA context with it). A wave ends when the waves up to it
    have had their share of budget_s (by task count, so that time a wave leaves goes to the next); its
    tasks not done by then are reported as not finished (a hang, or too slow), and the next wave starts
    on the processes that are free."""
    results = [[None] * len(wave) for wave in waves]
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(processes=max(1, workers), maxtasksperchild=1)
    total = max(1, sum(len(wave) for wave in waves))
    start, done = time.monotonic(), 0
    try:
        for w, wave in enumerate(waves):
            done += len(wave)
            deadline = start + budget_s * done / total
            pending = {i: pool.apply_async(_check_task, (task, )) for i, task in enumerate(wave)}
            while pending and time.monotonic() < deadline:
                for i in [i for i, r in pending.items() if r.ready()]:
                    try:
                        results[w][i] = pending.pop(i).get()
                    except Exception as exc:  # the worker itself failed (e.g. out of memory)
                        results[w][i] = [{"config": c, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
                                         for c in wave[i]["configs"]]
                time.sleep(0.2)
            for i in pending:
                results[w][i] = [{"config": c, "ok": False, "error": "no result in its wave's time (hang?)"}
                                 for c in wave[i]["configs"]]
    finally:
        pool.terminate()
        pool.join()
    return results


# ---------------------------------------------------------------------------------------------------
# Timing (this process)


class _Watchdog:
    """Ends the process (exit code 3) when `beat` has not been called for stall_s seconds, after
    `on_stall` (which writes what was measured)."""

    def __init__(self, stall_s: float, on_stall) -> None:
        self.stall_s, self.on_stall, self.last = stall_s, on_stall, time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, what: str) -> None:
        self.what, self.last = what, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if time.monotonic() - self.last > self.stall_s:
                print(f"# stalled for {self.stall_s:.0f} s at {getattr(self, 'what', '?')}: stopping", flush=True)
                self.on_stall()
                os._exit(3)


def _baselines(op: str, fp8: bool, a, a_s, w, w_s, rows: ExpertRows, rep_ms: int) -> dict:
    """torch._grouped_mm and a dense matmul of the same size (bf16), or dense torch._scaled_mm (fp8)."""
    R, K = a.shape
    N = w.shape[1]
    out = {}
    fns = {}
    if not fp8:
        if hasattr(torch, "_grouped_mm"):
            w_t, offs = w.transpose(1, 2), rows.index_L[1:].clone()
            fns["gmm"] = lambda: torch._grouped_mm(a, w_t, offs=offs, out_dtype=torch.bfloat16)
        dense_b = w.reshape(-1, K)[:N].t()
        fns["dense"] = lambda: torch.mm(a, dense_b)
    elif hasattr(torch, "_scaled_mm"):
        dense_b = w.reshape(-1, K)[:N].t()
        one = torch.ones((), dtype=torch.float32, device=a.device)
        fns["dense_fp8"] = lambda: torch._scaled_mm(a, dense_b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    for name, fn in fns.items():
        try:
            out[name] = flushed_ms(fn, rep_ms)
        except Exception as exc:  # a torch build without the op for these operands
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def time_point(op: str, fp8: bool, shape: str, t: int, configs: list[GemmConfig], weights, rep_ms: int,
               indexed: bool, watchdog: _Watchdog) -> dict:
    D, F, L = weights["shape"]
    w13, s13, w2, s2 = weights["fp8" if fp8 else "bf16"]
    w, w_s = (w13, s13) if op == "gate_up" else (w2, s2)
    dev = w.device
    R = L * t
    K, N = w.shape[2], w.shape[1]
    rows = ExpertRows.contiguous(torch.arange(0, (L + 1) * t, t, dtype=torch.int32, device=dev))
    x_rows = None
    if indexed:
        a, a_s = _activations(op, fp8, R // TOP_K, K, dev)
        x_rows = torch.randint(0, a.shape[0], (R,), dtype=torch.int32, device=dev)
    else:
        a, a_s = _activations(op, fp8, R, K, dev)
    flops = 2.0 * R * N * K
    res = {"op": op, "prec": "fp8" if fp8 else "bf16", "indexed": indexed, "shape": shape, "t": t, "L": L,
           "R": R, "N": N, "K": K, "flops": flops, "entries": []}
    if not indexed:
        watchdog.beat(f"{shape} t={t} {op} baselines")
        res["baselines_ms"] = _baselines(op, fp8, a, a_s, w, w_s, rows, rep_ms)
    for cfg in configs:
        watchdog.beat(f"{shape} t={t} {op} {describe(cfg)}")
        entry = {"config": cfg.to_dict(), "name": describe(cfg)}
        try:
            entry["ms"] = flushed_ms(lambda: _run(op, a, a_s, w, w_s, rows, cfg, x_rows), rep_ms)
            entry["tflops"] = flops / entry["ms"] / 1e9
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        res["entries"].append(entry)
    return res


# ---------------------------------------------------------------------------------------------------
# The table


def choose(points: list[dict]) -> dict:
    """{(table key, bound): (winning config dict, score)} from timed points (each point's `bucket`)."""
    by_key: dict = {}
    for p in points:
        key = configs_mod.table_key(p["op"], p["prec"] == "fp8", p["indexed"])
        times = {json.dumps(e["config"], sort_keys=True): e["ms"] for e in p["entries"] if "ms" in e}
        if not times:
            continue
        best = min(times.values())
        scores = by_key.setdefault((key, p["bucket"]), {})
        names = set(scores) | set(times)
        for name in names:  # slowdown against the point's best, summed; a config missing at a point loses
            scores[name] = scores.get(name, 0.0) + times.get(name, math.inf) / best
    return {k: min(((GemmConfig(**json.loads(c)).to_dict(), s) for c, s in scores.items()), key=lambda cs: cs[1])
            for k, scores in by_key.items()}


def build_table(points: list[dict], comment: str, device: str) -> dict:
    """The table in use on the GPU named `device` with the buckets >= 128 replaced by the winners (and _indexed
    entries; their hand-set buckets below 128 stay), listing that GPU (`configs.device_tables`). A winner
    keeps the committed bucket's `pdl`: the tuner times a down alone, where a dependent launch changes
    nothing."""
    base = configs_mod._table(gpu=device)
    winners = choose(points)
    tables = {}
    for key, buckets in base.items():
        kept = [[bound, cfg.to_dict()] for bound, cfg in buckets if bound < BUCKETS[0]]
        pdl = {bound for bound, cfg in buckets if cfg.pdl}
        tuned = [[bound, {**winners[(key, bound)][0], **({"pdl": True} if bound in pdl else {})}]
                 for bound in BUCKETS if (key, bound) in winners]
        fallback = [[bound, cfg.to_dict()] for bound, cfg in buckets if bound >= BUCKETS[0]]
        tables[key] = kept + (tuned if len(tuned) == len(BUCKETS) else fallback)
    for op in configs_mod.OPS:
        for fp8 in (False, True):
            key = configs_mod.table_key(op, fp8, indexed=True)
            tuned = [[bound, winners[(key, bound)][0]] for bound in BUCKETS if (key, bound) in winners]
            if len(tuned) == len(BUCKETS):  # (an entry's hand-set buckets below the tuned ones stay)
                hand_set = [[bound, cfg.to_dict()] for bound, cfg in base.get(key, []) if bound < BUCKETS[0]]
                tables[key] = hand_set + tuned
            elif key in base:
                tables[key] = [[bound, cfg.to_dict()] for bound, cfg in base[key]]
    return {"comment": comment, "devices": [device], "tables": tables}


def format_configs_json(table: dict) -> str:
    """configs.json text: one bucket per line, like the committed table."""
    keys = [f'    "{key}": [\n' + ",\n".join(f"      {json.dumps(bucket)}" for bucket in buckets) + "\n    ]"
            for key, buckets in table["tables"].items()]
    devices = f',\n  "devices": {json.dumps(table["devices"])}' if "devices" in table else ""
    return ('{\n  "comment": ' + json.dumps(table["comment"]) + devices + ',\n  "tables": {\n' + ",\n".join(keys)
            + "\n  }\n}\n")


def print_points(points: list[dict]) -> None:
    """One line per (point, GEMM, precision): TFLOP/s of the committed entry, of the best candidate and of
    the baselines (dense: cuBLAS bf16, or _scaled_mm for fp8), the best's ratios to them, its config."""
    print(f"{'shape':>12} {'t':>5} {'op':>7} {'prec':>7} {'table TF':>8} {'best TF':>8} {'gmm TF':>7} "
          f"{'dense TF':>8} {'best/gmm':>8} {'best/dense':>10}  best")
    for p in points:
        ok = [e for e in p["entries"] if "ms" in e]
        if not ok:
            continue
        best = min(ok, key=lambda e: e["ms"])
        table = next((e["tflops"] for e in ok if e["config"] == p.get("committed")), None)
        base = p.get("baselines_ms", {})
        tf = {k: p["flops"] / v / 1e9 for k, v in base.items() if isinstance(v, float)}
        dense = tf.get("dense", tf.get("dense_fp8"))
        gmm = tf.get("gmm")
        prec = p["prec"] + ("/ix" if p["indexed"] else "")
        print(f"{p['shape']:>12} {p['t']:>5} {p['op']:>7} {prec:>7} {_f(table):>8} {_f(best['tflops']):>8} "
              f"{_f(gmm):>7} {_f(dense):>8} {_f(gmm and best['tflops'] / gmm, '.2f'):>8} "
              f"{_f(dense and best['tflops'] / dense, '.2f'):>10}  {best['name']}")


def _f(v, spec=".0f") -> str:
    return "-" if v is None else format(v, spec)


# ---------------------------------------------------------------------------------------------------


def _sweeps() -> list[tuple[str, bool, bool, int, str, int]]:
    """(op, fp8, indexed, bound, shape, t) of every timed point."""
    out = []
    for fp8 in (False, True):
        for op in configs_mod.OPS:
            for bound in BUCKETS:
                out += [(op, fp8, False, bound, s, t) for s, t in POINTS[bound]]
        for bound in BUCKETS:
            out += [("gate_up", fp8, True, bound, s, t) for s, t in INDEXED_POINTS[bound]]
    return out


def run_tune(args, dev: torch.device) -> dict:
    t_start = time.perf_counter()
    out_dir = Path(args.out or ".")
    sweeps = _sweeps()
    result = {"device": device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "checks": [], "points": []}

    def save(table: bool = False) -> None:
        result["seconds"] = time.perf_counter() - t_start
        if table:
            result["table"] = build_table(result["points"], _comment(result), result["device"])
            if args.out:
                (out_dir / "configs.json").write_text(format_configs_json(result["table"]))
        (out_dir / "experts_tune.json").write_text(json.dumps(result, indent=1) + "\n")

    # 1. Check (and compile) every candidate at every shape, in worker processes: first each candidate at
    # one shape on its own (every kernel compiled once, in parallel), then the other shapes.
    tasks = {}
    for op, fp8, indexed, bound, shape, _ in sweeps:
        task = tasks.setdefault((shape, op, fp8, indexed), {"shape": shape, "dims": _shape(shape), "op": op,
                                                            "fp8": fp8, "indexed": indexed, "configs": [],
                                                            "device": str(dev)})
        for cfg in candidates(op, fp8, bound, indexed):
            if cfg.to_dict() not in task["configs"]:
                task["configs"].append(cfg.to_dict())
    first, rest, compiled = [], [], set()
    for task in tasks.values():
        kind = (task["op"], task["fp8"], task["indexed"])
        fresh = [c for c in task["configs"] if (kind, json.dumps(c, sort_keys=True)) not in compiled]
        compiled.update((kind, json.dumps(c, sort_keys=True)) for c in fresh)
        first += [{**task, "configs": [c]} for c in fresh]
        if len(fresh) < len(task["configs"]):
            rest.append({**task, "configs": [c for c in task["configs"] if c not in fresh]})
    rest.sort(key=lambda task: -task["dims"][1] * task["dims"][0])  # the largest shapes (and compiles) first
    checked = run_checks([first, rest], args.workers, args.check_s)
    passed = set()
    for wave, wave_results in zip((first, rest), checked):
        for task, entries in zip(wave, wave_results):
            for entry in entries:
                entry.update(shape=task["shape"], op=task["op"], prec="fp8" if task["fp8"] else "bf16",
                             indexed=task["indexed"], name=describe(GemmConfig(**entry["config"])))
                result["checks"].append(entry)
                if entry["ok"]:
                    passed.add((task["shape"], task["op"], task["fp8"], task["indexed"],
                                json.dumps(entry["config"], sort_keys=True)))
                else:
                    print(f"# check failed: {task['shape']} {task['op']} {entry['prec']} {entry['name']}: "
                          f"{entry.get('error', entry.get('rel_err'))}", flush=True)
    print(f"# checks: {len(passed)} of {len(result['checks'])} passed in {time.perf_counter() - t_start:.0f} s",
          flush=True)
    save()

    # 2. Time the candidates that passed, shape by shape (the weights made once per shape).
    watchdog = _Watchdog(args.stall_s, lambda: save(table=True))  # the table from the points so far
    for shape in dict.fromkeys(s for *_, s, _ in sweeps):
        D, F, L = _shape(shape)
        L_run = min(L, args.max_rows // min(t for *_, s, t in sweeps if s == shape))
        watchdog.beat(f"{shape} weights")
        weights = {"shape": (D, F, L_run), "bf16": _weights(L_run, D, F, False, dev)}
        weights["fp8"] = _weights(L_run, D, F, True, dev)
        for op, fp8, indexed, bound, s, t in sweeps:
            if s != shape:
                continue
            L_t = min(L_run, args.max_rows // t)
            w_t = {"shape": (D, F, L_t), **{k: tuple(x if x is None else x[:L_t] for x in v)
                                             for k, v in weights.items() if k != "shape"}}
            configs = [c for c in candidates(op, fp8, bound, indexed)
                       if (shape, op, fp8, indexed, json.dumps(c.to_dict(), sort_keys=True)) in passed]
            point = time_point(op, fp8, shape, t, configs, w_t, args.rep_ms, indexed, watchdog)
            point.update(bucket=bound, committed=candidates(op, fp8, bound, indexed)[0].to_dict())
            result["points"].append(point)
            save()
        del weights, w_t
        torch.cuda.empty_cache()
        print(f"# {shape} timed at {time.perf_counter() - t_start:.0f} s", flush=True)
    watchdog.beat("done")
    save(table=True)
    print_points(result["points"])
    return result


def _comment(result: dict) -> str:
    return (f"Grouped expert GEMM launch configs for Hopper, by op and rows per expert. Buckets up to 64 rows: "
            f"hand-set (decode sizes, weight-bound; the bf16 16- and 32-row buckets the fastest of "
            f"`python3 scripts/decode_sweep.py` on routed rows, the fp8 16- and 64-row downs the fastest over their "
            f"buckets' points of `python3 scripts/decode_sweep.py --quant fp8_block`). From 128 rows: the fastest "
            f"candidate of "
            f"`python -m epmoe.bench.experts --tune` on {result['device']}, torch {result['torch']}, triton "
            f"{result['triton']} (summed slowdown over the bucket's model shapes; see epmoe/bench/experts_tune.py). "
            f"Regenerate with `python -m epmoe.bench.experts --tune --out DIR` on that GPU and copy DIR/configs.json "
            f"over the committed table that lists it (epmoe/kernels/configs*.json; a new file for a new GPU). "
            f"Downs keep the committed pdl (a programmatic dependent launch behind the gate-up), which the tuner, "
            f"timing a down alone, cannot weigh.")


def table_from(path: str, out: str | None) -> dict:
    """configs.json from an earlier run's experts_tune.json (no GPU needed)."""
    result = json.loads(Path(path).read_text())
    table = build_table(result["points"], _comment(result), result["device"])
    text = format_configs_json(table)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "configs.json").write_text(text)
    else:
        sys.stdout.write(text)
    print_points(result["points"])
    return table
