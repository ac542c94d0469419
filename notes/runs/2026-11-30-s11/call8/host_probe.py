import os, sys, time
sys.path.insert(0, ".")
import torch
import torch.distributed as dist
from epmoe.launch import spawn


def _rank(ctx):
    aff = sorted(os.sched_getaffinity(0))
    dev = ctx.device
    t = torch.zeros(1, device=dev)
    def bench():
        for _ in range(200):
            t.add_(0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            t.add_(0)
        us = (time.perf_counter() - t0) / 2000 * 1e6
        torch.cuda.synchronize()
        return us
    dist.barrier(group=ctx.group)
    both = bench()
    dist.barrier(group=ctx.group)
    alone = bench() if ctx.rank == 0 else None
    dist.barrier(group=ctx.group)
    return (ctx.rank, len(aff), aff[:8], os.cpu_count(), round(both, 1), alone and round(alone, 1), torch.get_num_threads())


if __name__ == "__main__":
    for r in spawn(_rank, 2, "cuda", (), timeout_s=120):
        print("rank, n_affinity, first cpus, cpu_count, add_ us both ranks, rank0 alone, torch threads:", r)
