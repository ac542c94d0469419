"""NVLink ceiling probe on 2 GPUs: how fast can 64 MiB move to the peer, by which mechanism, in one
direction and in both at once (the dispatch / combine case)?

    python3 scripts/link_probe.py [--out OUT_DIR] [--mib 64] [--reps 10] [--match copy]

Mechanisms (each a kernel or call that moves the same bytes from a local tensor to the peer's symmetric
buffer, or reads the peer's buffer into a local tensor):
- push: Triton loads local rows and stores them into the peer's buffer (what `ht` does),
- pull: Triton loads the peer's buffer and stores locally,
- tma_push / tma_pull: the same through tensor descriptors (TMA bulk copies through shared memory),
- copy: `copy_` into the peer's buffer view (copy engine); split over several streams at once;
  and the copy engine and SM stores at once (a share of the rows each, on two streams).
Each repeat starts with a small NCCL all_reduce so both ranks' kernels start together; the time is the
CUDA-event span of the kernel alone, median over repeats, as GB/s per direction (the link's spec is
478 GB/s). Prints a table and writes OUT_DIR/link_probe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from epmoe.bench.dispatch import NVLINK_ENV
from epmoe.launch import spawn
from epmoe.symm import BufferSpec, torch_workspace

COLS = 1024  # bf16 columns per row: 2 KiB rows


@triton.jit
def _move(src, dst, n_rows, COLS: tl.constexpr, ROWS: tl.constexpr):
    """Rows [n_rows, COLS] from src to dst, programs striding over ROWS-row tiles."""
    cols = tl.arange(0, COLS)
    for r in range(tl.program_id(0) * ROWS, n_rows, tl.num_programs(0) * ROWS):
        rows = r + tl.arange(0, ROWS)
        offs = rows[:, None] * COLS + cols[None, :]
        tl.store(dst + offs, tl.load(src + offs))


@triton.jit
def _move_tma(src_desc, dst_desc, n_tiles, TILES_PER_ROW: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
              STAGES: tl.constexpr):
    """[BR, BC] tiles from src_desc to dst_desc through tensor descriptors."""
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        r = (t // TILES_PER_ROW) * BR
        c = (t % TILES_PER_ROW) * BC
        dst_desc.store([r, c], src_desc.load([r, c]))


def _variants(sms: int):
    """(name, kind, settings) of every measurement."""
    out = []
    for per_sm, warps, rows in ((1, 8, 2), (2, 8, 2), (4, 4, 2), (4, 4, 1), (8, 4, 1)):
        for kind in ("push", "pull"):
            out.append((f"{kind} {per_sm}/SM x{warps}w rows{rows}", kind,
                        dict(programs=per_sm * sms, num_warps=warps, ROWS=rows)))
    for per_sm, warps, br, bc, stages in ((1, 4, 16, 256, 3), (2, 4, 16, 256, 2), (1, 4, 32, 256, 2),
                                          (4, 4, 8, 256, 2), (1, 8, 64, 128, 2)):
        for kind in ("tma_push", "tma_pull"):
            out.append((f"{kind} {per_sm}/SM x{warps}w [{br},{bc}] st{stages}", kind,
                        dict(programs=per_sm * sms, num_warps=warps, BR=br, BC=bc, STAGES=stages)))
    for streams in (2, 4):
        out.append((f"copy on {streams} streams", "copy_split", dict(streams=streams, share=1.0)))
    for share in (0.5, 0.7, 0.85):
        out.append((f"copy {share:.0%} + push 1/SM x8w", "copy_split",
                    dict(streams=1, share=share, programs=sms, num_warps=8, ROWS=2)))
    out.append(("copy (copy engine)", "copy", {}))  # last: the data check reads what it left
    return out


_side_streams: list[torch.cuda.Stream] = []


def _copy_split(s: dict, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The first `share` of the rows by `copy_` split over s["streams"] side streams, the rest by the push
    kernel on the current stream; the current stream then waits for the side streams."""
    while len(_side_streams) < s["streams"]:
        _side_streams.append(torch.cuda.Stream())
    main = torch.cuda.current_stream()
    n = src.shape[0]
    copied = int(n * s["share"]) // 2 * 2  # the push kernel takes whole pairs of rows
    bounds = [copied * i // s["streams"] for i in range(s["streams"] + 1)]
    start = torch.cuda.Event()
    start.record(main)
    done = []
    for stream, a, b in zip(_side_streams, bounds, bounds[1:]):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            dst[a:b].copy_(src[a:b])
            done.append(torch.cuda.Event())
            done[-1].record(stream)
    if copied < n:
        _move[(s["programs"],)](src[copied:], dst[copied:], n - copied, COLS=COLS, ROWS=s["ROWS"],
                                num_warps=s["num_warps"])
    for event in done:
        main.wait_event(event)


def _launch(kind: str, s: dict, src: torch.Tensor, dst: torch.Tensor) -> None:
    n = src.shape[0]
    if kind in ("push", "pull"):
        _move[(s["programs"],)](src, dst, n, COLS=COLS, ROWS=s["ROWS"], num_warps=s["num_warps"])
    elif kind in ("tma_push", "tma_pull"):
        from triton.tools.tensor_descriptor import TensorDescriptor

        sd = TensorDescriptor.from_tensor(src, [s["BR"], s["BC"]])
        dd = TensorDescriptor.from_tensor(dst, [s["BR"], s["BC"]])
        tiles = (n // s["BR"]) * (COLS // s["BC"])
        _move_tma[(s["programs"],)](sd, dd, tiles, TILES_PER_ROW=COLS // s["BC"], BR=s["BR"], BC=s["BC"],
                                    STAGES=s["STAGES"], num_warps=s["num_warps"])
    elif kind == "copy_split":
        _copy_split(s, src, dst)
    else:
        dst.copy_(src)


def _rank(ctx, args):
    n = args.mib * 2**20 // (2 * COLS)
    ws = torch_workspace([BufferSpec("x", (n, COLS), torch.bfloat16)], ctx.group, ctx.device)
    peer = 1 - ctx.rank
    peer_x = ws.handle.get_buffer(peer, (n, COLS), torch.bfloat16)
    local_x = ws.local("x")
    base = torch.randn(n, COLS, device=ctx.device, generator=torch.Generator(ctx.device).manual_seed(0))
    src = (base + ctx.rank).to(torch.bfloat16)  # the same base on both ranks: the check below knows the peer's
    sink = torch.empty_like(src)
    tick = torch.zeros(1, device=ctx.device)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    rows = []
    for name, kind, s in [v for v in _variants(sms) if args.match in v[0] or v[1] == "copy"]:
        # push / copy: local src -> peer buffer; pull: peer buffer -> local sink
        a, b = (peer_x, sink) if kind.endswith("pull") else (src, peer_x)
        for direction in ("both", "one"):
            active = direction == "both" or ctx.rank == 0
            times = []
            try:
                for i in range(args.reps + 2):
                    dist.all_reduce(tick, group=ctx.group)  # both ranks' streams start the kernel together
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    if active:
                        _launch(kind, s, a, b)
                    e1.record()
                    times.append((e0, e1))
                torch.cuda.synchronize()
                us = statistics.median(x.elapsed_time(y) * 1e3 for x, y in times[2:])
                gbps = args.mib * 2**20 / us / 1e3 if active else None
                error = None
            except Exception as e:  # noqa: BLE001 - a mechanism Triton cannot build here is a result too
                torch.cuda.synchronize()
                us, gbps, error = None, None, repr(e)[:200]
            if active:
                rows.append(dict(rank=ctx.rank, name=name, direction=direction, us=us, GBps=gbps, error=error))
            dist.barrier(ctx.group)
    # the data really moved: the last variant (copy) left src in the peer's buffer
    torch.cuda.synchronize()
    dist.barrier(ctx.group)
    expect = (base + peer).to(torch.bfloat16)
    rows.append(dict(rank=ctx.rank, name="data check", ok=bool(torch.equal(local_x, expect))))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--match", default="", help="only the mechanisms whose name contains this (and the copy)")
    args = p.parse_args()
    for key, value in NVLINK_ENV.items():
        os.environ.setdefault(key, value)
    per_rank = spawn(_rank, 2, "cuda", (args,), timeout_s=240)
    rows = [r for rank_rows in per_rank for r in rank_rows]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "link_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    by = {}
    for r in rows:
        if "direction" in r:
            by.setdefault((r["name"], r["direction"]), []).append(r)
    print(f"{args.mib} MiB to the peer, GB/s per direction (rank 0 / rank 1; 'one': rank 0 alone)")
    for (name, direction), rs in by.items():
        vals = " / ".join(f"{r['GBps']:.0f}" if r["GBps"] else f"error {r['error']}" for r in rs)
        print(f"{name:<36} {direction:<5} {vals}")
    print([r for r in rows if r["name"] == "data check"])


if __name__ == "__main__":
    main()
