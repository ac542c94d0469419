"""Timing: wall-clock of layer calls over ranks (`epmoe demo`, `epmoe bench layer`), and the GPU's own time
of a call that the host may queue slower than the GPU runs it (`gpu_us`: back-to-back calls; `flushed_ms`:
each call after an L2 flush, as triton.testing.do_bench times it), and the host's time to queue a call
(`host_us`).

    ms = max_over_ranks(median_ms(lambda: moe(x_TD, logits_TE), repeats, device, group), group, device)
    us = gpu_us(lambda: down(h, w2, rows), iters=20)
    ms = flushed_ms(lambda: down(h, w2, rows), rep_ms=20)
    us = host_us(lambda: down(h, w2, rows), calls=20)
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

SPIN_CLOCK_HZ = 1.98e9  # the H200's top SM clock: torch.cuda._sleep counts cycles
_SPINS = (2, 8, 32)  # spin lengths tried, in multiples of the host's time to queue the calls
_L2_FLUSH_BYTES = 256 * 1024 * 1024  # what triton.testing.do_bench writes to flush L2
# Calls `flushed_ms` queues behind one spin: each is ~6 entries of the GPU's launch queue (~1000 deep); past
# it the host blocks until the GPU drains the queue, which then reaches the calls before all are queued.
_MAX_QUEUED_CALLS = 100


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


def _behind_spin(queue: Callable[[], None], host_s: float) -> None:
    """Run queue() (which queues GPU work on the current stream) behind a spin kernel that outlasts the host's
    queueing, so that the GPU runs the work at its own pace; host_s: the host's time for queue(), estimated.
    Raises RuntimeError when the GPU reached the work before it was all queued, at each spin of _SPINS."""
    torch.cuda.synchronize()
    spun = torch.cuda.Event()
    for spin in _SPINS:  # a longer spin where the host was slower than its estimate
        torch.cuda._sleep(int(spin * host_s * SPIN_CLOCK_HZ))
        spun.record()
        queue()
        spin_over = spun.query()  # the GPU left the spin before the host had queued everything
        torch.cuda.synchronize()
        if not spin_over:
            return
    raise RuntimeError(f"the host queued the work slower than a spin {_SPINS[-1]}x its estimate: no GPU-paced time")


def gpu_us(fn: Callable[[], object], iters: int = 20) -> float:
    """The GPU's µs for one fn() call on the current CUDA stream: the mean of `iters` back-to-back calls, all
    queued behind a spin kernel that outlasts the host's queueing of them, so that a call whose launches take
    the host longer than its kernels take the GPU is timed by the GPU and not at the host's pace. L2 is not
    flushed between the calls (time operands larger than L2). Raises RuntimeError when no spin (up to 32x
    the host's time) outlasted the queueing."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def queue() -> None:
        start.record()
        for _ in range(iters):
            fn()
        end.record()

    _behind_spin(queue, iters * host_s)
    return start.elapsed_time(end) / iters * 1e3


def host_us(fn: Callable[[], object], calls: int = 20) -> float:
    """The host's µs to queue one fn() call: the mean over `calls` calls queued back to back behind a spin
    kernel, so that the GPU never pushes back on the queue (their launches must fit the GPU's launch queue,
    ~1000 entries). Raises RuntimeError when no spin (up to 32x the host's time) outlasted the queueing."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    queued_s = []

    def queue() -> None:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        queued_s.append(time.perf_counter() - t0)

    _behind_spin(queue, calls * host_s)
    return queued_s[-1] / calls * 1e6


def flushed_ms(fn: Callable[[], object], rep_ms: int = 20, warmup_ms: int | None = None,
               flush: str = "write") -> float:
    """The median GPU ms of fn() with L2 flushed before each call, as triton.testing.do_bench(fn, warmup_ms,
    rep_ms, return_mode="median") times it, but with the timed calls queued behind a spin kernel: do_bench
    times each call from an event recorded after the flush, so where queueing the call takes the host longer
    than the flush takes the GPU, it times the host. Calls: as many as fill rep_ms (at least 5, at most
    100), after warm-up calls filling warmup_ms (default rep_ms / 4, at least 5 ms).

    flush: "write" zeroes 256 MiB, as do_bench does, and leaves L2 full of dirty lines, whose write-back
    then falls inside the timed call; "read" sums 256 MiB instead and leaves L2 holding clean lines."""
    if flush not in ("write", "read"):
        raise ValueError(f"flush must be 'write' or 'read', got {flush!r}")
    cache = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    if flush == "read":
        cache.zero_()  # (what the reading flush sums is then defined)
    est_ms = gpu_us(fn, 5) * 1e-3
    for _ in range(max(1, int((warmup_ms or max(rep_ms // 4, 5)) / est_ms))):
        fn()
    n = min(max(5, int(rep_ms / est_ms)), _MAX_QUEUED_CALLS)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]

    def call(i: int) -> None:
        if flush == "write":
            cache.zero_()
        else:
            cache.sum()
        starts[i].record()
        fn()
        ends[i].record()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call(0)
    host_s = time.perf_counter() - t0

    def queue() -> None:
        for i in range(n):
            call(i)

    _behind_spin(queue, n * host_s)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
