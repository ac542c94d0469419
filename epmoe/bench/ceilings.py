"""The GPU ceilings a benchmark's floor is computed from: dense bf16 and fp8 matmul throughput and device
copy bandwidth, per GPU.

A floor is max(flops / peak, bytes / bandwidth) (`epmoe.bench.experts.Floor`). The ceilings are measured,
not taken from a datasheet: a dense bf16 torch.mm of 8192 x 8192 x 8192, a tensorwise-scaled fp8
torch._scaled_mm of the same size (NaN on a GPU without fp8 matmuls, whose fp8 floors are then NaN too),
and a copy of 1 GiB into another (read + write bytes), each timed back to back (`measure`). `KNOWN` holds
the measured values of the GPUs the project's tables were made on, so that every run on one GPU kind is
held to the same floor; another GPU is measured at the first call of `device_ceilings` in the process.

    python -m epmoe.bench.ceilings   # measure this GPU's, beside the known ones (needs one CUDA GPU)
"""
from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import asdict, dataclass

import torch

from ..timing import gpu_us

MATMUL_SIZE = 8192  # M = N = K of the dense matmuls
COPY_BYTES = 1 << 30  # bytes copied by the bandwidth probe (each way)


@dataclass(frozen=True, kw_only=True)
class Ceilings:
    """One GPU's ceilings: TFLOP/s of dense bf16 and fp8 (tensorwise) matmul, TB/s of a device copy counting
    the bytes read and written, and where the numbers come from."""

    bf16_tflops: float
    fp8_tflops: float
    copy_tbps: float
    source: str
    by_measure: bool = True  # measured by `measure` (False: by an earlier probe, whose timing differs)

    def tflops(self, fp8: bool) -> float:
        return self.fp8_tflops if fp8 else self.bf16_tflops


KNOWN = {  # GPU name (torch.cuda.get_device_name): its measured ceilings
    # The H200's: an earlier probe's, its calls timed with an L2 flush before each, as triton's do_bench or
    # `epmoe.timing.flushed_ms` time them; on one H100 those read 727 and 687 bf16 TFLOP/s against
    # `measure`'s 797, the copy 3.003 TB/s against 3.013. Kept, so that the H200's floors stay those of
    # BENCHMARKS.md's tables.
    "NVIDIA H200": Ceilings(bf16_tflops=686.0, fp8_tflops=1276.0, copy_tbps=4.16, by_measure=False,
                            source="one H200, 2026-11-29 (BENCHMARKS.md, machines)"),
    "NVIDIA H100 80GB HBM3": Ceilings(bf16_tflops=796.7, fp8_tflops=1458.9, copy_tbps=3.013,
                                      source="one H100, 2026-12-05, the median of three runs of `measure`"),
}
H200 = KNOWN["NVIDIA H200"]


def measure(device: torch.device, iters: int = 20) -> Ceilings:
    """This GPU's ceilings, measured now (a few seconds): the mean of `iters` back-to-back calls of each
    probe (`epmoe.timing.gpu_us`), the best of three such means."""
    n = MATMUL_SIZE
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # (column-major B, as _scaled_mm takes it)
    one = torch.ones((), device=device, dtype=torch.float32)
    src = torch.empty(COPY_BYTES, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def best_us(fn) -> float:
        return min(gpu_us(fn, iters) for _ in range(3))

    flops = 2.0 * n ** 3
    bf16 = flops / best_us(lambda: torch.mm(a, b)) / 1e6
    if torch.cuda.get_device_capability(device) >= (8, 9):  # fp8 tensor cores: Ada, Hopper and later
        fp8 = flops / best_us(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                       out_dtype=torch.bfloat16)) / 1e6
    else:
        fp8 = math.nan
    copy = 2 * COPY_BYTES / best_us(lambda: dst.copy_(src)) / 1e6
    name = torch.cuda.get_device_name(device)
    return Ceilings(bf16_tflops=round(bf16, 1), fp8_tflops=round(fp8, 1), copy_tbps=round(copy, 3),
                    source=f"measured on this {name} by epmoe.bench.ceilings")


@functools.cache
def _measured(index: int) -> Ceilings:
    return measure(torch.device("cuda", index))


def device_name(device: torch.device) -> str:
    """The name a benchmark's record gives its device: the CUDA GPU's (torch.cuda.get_device_name), else the
    device type ("cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_ceilings(device: torch.device) -> Ceilings:
    """The ceilings of the CUDA GPU `device`: `KNOWN`'s for its name, else measured (once per process)."""
    known = KNOWN.get(torch.cuda.get_device_name(device))
    if known is not None:
        return known
    return _measured(device.index if device.index is not None else torch.cuda.current_device())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.ceilings", description=__doc__.split("\n\n")[0])
    p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it times GPU kernels), and none is visible here")
    dev = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(dev)
    print(json.dumps({"device": name, "measured": asdict(measure(dev)),
                      "known": asdict(KNOWN[name]) if name in KNOWN else None}, indent=1))


if __name__ == "__main__":
    main()
