"""Wall-clock timing of layer calls over ranks, for `epmoe demo` and `epmoe bench layer`.

    ms = max_over_ranks(median_ms(lambda: moe(x_TD, logits_TE), repeats, device, group), group, device)
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device,
              group: dist.ProcessGroup | None = None, warmup: int = 1) -> float:
    """Median wall time of fn() in ms over `repeats` runs after `warmup`, ranks lined up by a barrier and
    the device synchronized around each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_over_ranks(value: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """The largest `value` over the ranks of `group` (value itself when group is None)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()
