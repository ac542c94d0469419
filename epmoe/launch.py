"""Start N ranks on this machine (gloo on CPU, NCCL on GPUs), or join a torchrun launch.

    results = epmoe.launch.spawn(fn, nprocs=2, device="cpu", args=(...))  # fn(ctx, *args) on each rank
"""
from __future__ import annotations

import ctypes
import datetime
import gc
import os
import pickle
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class RankContext:
    """What a rank's function is given: its rank, the world size, its device and the process group."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_rank(rank: int, world_size: int, device_type: str, init_method: str,
              timeout_s: float | None = None) -> RankContext:
    """Initialize the default process group for one rank and return its context.

    timeout_s bounds each collective (None: the backend's default).
    """
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    kwargs = {"device_id": device} if device_type == "cuda" else {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(_backend(device_type), init_method=init_method, rank=rank,
                            world_size=world_size, **kwargs)
    return RankContext(rank, world_size, device, dist.group.WORLD)


def _die_with_parent(launcher_pid: int) -> None:
    """On Linux, have the kernel kill this rank when the launching process dies (say, killed by a time
    limit before its own clean-up ran), so that no rank is left running, or spinning on a GPU."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher_pid:  # the launcher died before the signal was armed
            os._exit(1)


def cpu_threads_per_rank(world_size: int) -> int:
    """torch's intra-op threads for each of `world_size` CPU ranks on this machine: its cores shared out
    (at least 1). With more threads than cores in all, each op's threads wait for the other ranks' to
    be scheduled, and a small layer's calls take tens of times longer, by chance."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world_size)


def _worker(rank: int, fn: Callable, world_size: int, device_type: str, init_method: str, args: tuple,
            queue, timeout_s: float | None, launcher_pid: int) -> None:
    _die_with_parent(launcher_pid)
    if device_type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size))
    ctx = init_rank(rank, world_size, device_type, init_method, timeout_s)
    try:
        result = fn(ctx, *args)
        # plain pickle: torch's queue reductions would share tensors through file descriptors that
        # vanish when this process exits, before the parent has read them
        queue.put((rank, pickle.dumps(result)))
        dist.barrier()  # only on success: a failed rank must not enter a collective the others are not in
    finally:
        close_rank()


def close_rank() -> None:
    """End this rank's process groups. What the rank's function left in reference cycles (a model whose
    layers hold the group) is freed first, while the interpreter is whole: a gloo group freed later, by the
    collection at interpreter exit, aborted the process now and then (SIGABRT, 'terminate called without an
    active exception'): 4 of 40 two-rank runs whose function left its group in a cycle, none of 40 after."""
    gc.collect()
    dist.destroy_process_group()


def check_launch(device: str, nprocs: int) -> None:
    """ValueError unless `nprocs` ranks can start on `device` ("cpu" or "cuda", one GPU per rank) here."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if nprocs < 1:
        raise ValueError(f"the number of ranks must be >= 1, got {nprocs}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda': no CUDA device is visible here (torch.cuda.is_available() is False)")
        if torch.cuda.device_count() < nprocs:
            raise ValueError(f"{nprocs} ranks on cuda need {nprocs} GPUs, found {torch.cuda.device_count()}")


def spawn(fn: Callable[..., Any], nprocs: int, device: str = "cpu", args: tuple = (),
          timeout_s: float | None = None) -> list[Any]:
    """Run fn(ctx, *args) on `nprocs` new processes, one per rank; return their results by rank. CPU
    ranks share the machine's cores (`cpu_threads_per_rank` torch threads each).

    fn must be importable (defined at module level) and its results picklable. Raises ValueError before
    any rank starts where `check_launch` refuses; raises if any rank fails (the other ranks are then
    terminated). With timeout_s, every collective is bounded by it and the whole run too: past it all
    ranks are killed and TimeoutError is raised.
    """
    check_launch(device, nprocs)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_worker, args=(fn, nprocs, device, init_method, args, queue, timeout_s, os.getpid()),
                               nprocs=nprocs, join=False, start_method="spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results: dict[int, Any] = {}

    def collect() -> None:  # read results as they come: a large one would block its writer
        while not queue.empty():
            rank, result = queue.get()
            results[rank] = pickle.loads(result)

    try:
        while not procs.join(timeout=0.05):
            collect()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"spawn: {nprocs} ranks of {getattr(fn, '__name__', fn)} ran past {timeout_s} s")
    finally:  # on a timeout, a failed rank or an interrupt, leave no rank behind
        for p in procs.processes:
            if p.is_alive():
                p.kill()
                p.join()
    collect()
    return [results[r] for r in range(nprocs)]


def from_torchrun(device_type: str) -> RankContext:
    """Join a torchrun launch (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from torchrun)."""
    return init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device_type, "env://")
