"""What the L2 flush before each timed call costs the call: the whole expert MLP of `epmoe bench experts` and a
plain read of its weight bytes, each timed after a flush that writes (do_bench's, the bench's) and after one
that reads.

    python3 scripts/flush_probe.py [--points qwen3-30b:16 dsv2-lite:16 mixtral-8x7b:16 dsv3-256:16]
        [--quant fp8_block bf16] [--rep-ms 20]

do_bench flushes L2 by zeroing 256 MiB, which leaves L2 full of dirty lines: the next kernel's reads evict them,
and their write-back (up to L2's size) runs inside its timed interval. A flush that sums 256 MiB leaves clean
lines. Per point (mlp_parts' inputs, exactly t rows per expert): µs by `epmoe.timing.flushed_ms` with
flush="write" and flush="read", by `gpu_us` (back to back, no flush), and each as % of the weight floor
(the weights' bytes at the GPU's copy bandwidth, `epmoe.bench.ceilings`; scales not counted); the same for
a plain read of the gate-up's and the down's weights (one Triton read kernel each, the MLP's two launches).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from epmoe.bench.ceilings import device_ceilings
from epmoe.timing import flushed_ms, gpu_us
from mlp_parts import mlp_calls  # scripts/, on sys.path as the running script's folder


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Reads src[0:n) (int32 words) grid-stride, BLOCK words a step; one xor-sum per program (kept live)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def plain_read(tensors: list[torch.Tensor]):
    """A call reading each tensor's bytes once, one launch per tensor (each tensor's bytes a multiple of 4)."""
    words = [t.view(torch.int32).reshape(-1) for t in tensors]
    programs = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(programs, dtype=torch.int32, device="cuda")

    def read() -> None:
        for w in words:
            _read_kernel[(programs,)](w, out, w.numel(), BLOCK=2048, num_warps=8)
    return read


def run_point(name: str, t: int, fp8: bool, rep_ms: int, max_rows: int, experts: int | None) -> None:
    parts, (L, D, F, weights) = mlp_calls(name, t, fp8, max_rows, experts)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    copy_tbps = device_ceilings(torch.device("cuda", torch.cuda.current_device())).copy_tbps
    floor_us = weight_bytes / (copy_tbps * 1e12) * 1e6
    print(f"## {name} t={t} L={L} {'fp8' if fp8 else 'bf16'}: weights {weight_bytes / 1e6:.0f} MB, "
          f"floor {floor_us:.1f} us")
    for label, fn in (("mlp", parts["mlp"]), ("plain read", plain_read(weights))):
        us = {"write flush": flushed_ms(fn, rep_ms, flush="write") * 1e3,
              "read flush": flushed_ms(fn, rep_ms, flush="read") * 1e3,
              "back to back": gpu_us(fn, 20)}
        print(f"{label:10s} " + "  ".join(f"{k} {v:7.1f} us ({floor_us / v * 100:5.1f}%)" for k, v in us.items()),
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", nargs="+", default=["qwen3-30b:16", "dsv2-lite:16", "mixtral-8x7b:16",
                                                   "dsv3-256:16"], help="shape:t or shape:t:L (L experts)")
    p.add_argument("--quant", nargs="+", default=["fp8_block", "bf16"], choices=["bf16", "fp8_block"])
    p.add_argument("--rep-ms", type=int, default=20)
    p.add_argument("--max-rows", type=int, default=131072)
    args = p.parse_args()
    for quant in args.quant:
        for point in args.points:
            name, t, *experts = point.split(":")
            run_point(name, int(t), quant == "fp8_block", args.rep_ms, args.max_rows,
                      int(experts[0]) if experts else None)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
