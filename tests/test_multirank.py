"""allgather and alltoall over 1-7 gloo ranks (and NCCL on gpu_test_ranks() GPUs): every case of moe_cases with both
dispatchers (exact and random data, T=0/1/odd, -1 ids, one hot expert, non-contiguous inputs, chunking with
different chunk counts per rank, bad input refused before communication). One spawn for 1 and for 2 ranks; one of
4 ranks runs the cases on groups of 4 and 3 of them, one of 7 on groups of 7, 6 and 5 (a rank costs seconds of
start-up on a small CI machine)."""
import pytest
import torch
import torch.distributed as dist

from epmoe.launch import spawn
from gpu_ranks import gpu_test_ranks

import moe_cases

SPAWN_TIMEOUT_S = 240


def _report(results: list[list[str]]) -> None:
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [1, 2])
def test_dispatchers_gloo(world_size):
    names = ("local", "allgather", "alltoall") if world_size == 1 else ("allgather", "alltoall")
    _report(spawn(moe_cases.run_cases, world_size, "cpu", (names,), timeout_s=SPAWN_TIMEOUT_S))


def _cases_in_subgroups(ctx, sizes: tuple[int, ...], names: tuple[str, ...]) -> list[str]:
    """moe_cases on a group of the first `size` ranks, for each size (every rank makes every group); one
    thread a rank (7 ranks share the CPU cores)."""
    torch.set_num_threads(1)
    failures = []
    for size in sizes:
        group = dist.new_group(list(range(size)))
        if ctx.rank < size:
            failures += [f"world {size}: {f}" for case in moe_cases.CASES for name in names
                         for f in moe_cases.run_case(case, name, group, ctx.device)]
    return failures


@pytest.mark.parametrize("sizes", [(4, 3), (7, 6, 5)])
def test_dispatchers_gloo_groups(sizes):
    _report(spawn(_cases_in_subgroups, sizes[0], "cpu", (sizes, ("allgather", "alltoall")), timeout_s=SPAWN_TIMEOUT_S))


def _symmetric_config_refusal(ctx) -> list[str]:
    """What ht and ll do before allocating over a process group (TorchSymmetricMemory.gathered, here over
    gloo): rank 1 built from another config, then every rank from the same."""
    import dataclasses

    import epmoe
    from epmoe.symm import TorchSymmetricMemory
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    backend, cpu, failures = TorchSymmetricMemory(ctx.group), torch.device("cpu"), []
    mine = dataclasses.replace(cfg, hidden_size=12) if ctx.rank == 1 else cfg
    d = epmoe.make_dispatcher("allgather", mine, ctx.group)
    try:
        d._check_same_config(backend, cpu)
        failures.append(f"rank {ctx.rank}: another rank's config was not refused")
    except ValueError as e:
        if f"rank(s) [{1 - ctx.rank}]" not in str(e) or "another MoEConfig" not in str(e):
            failures.append(f"rank {ctx.rank}: {e}")
    if backend.gathered(ctx.rank * 10 + 3, cpu) != [3, 13]:
        failures.append(f"rank {ctx.rank}: gathered the wrong values")
    epmoe.make_dispatcher("allgather", cfg, ctx.group)._check_same_config(backend, cpu)  # the same: no error
    return failures


def test_symmetric_dispatchers_refuse_other_configs_before_allocating():
    _report(spawn(_symmetric_config_refusal, 2, "cpu", (), timeout_s=SPAWN_TIMEOUT_S))


@pytest.mark.gpu2
def test_dispatchers_nccl_gpus():
    """On gpu_test_ranks() GPUs (default 2)."""
    _report(spawn(moe_cases.run_cases, gpu_test_ranks(), "cuda", (("allgather", "alltoall"),),
                  timeout_s=SPAWN_TIMEOUT_S))


def test_gpu_test_ranks(monkeypatch):
    monkeypatch.delenv("EPMOE_GPU_RANKS", raising=False)
    assert gpu_test_ranks() == 2
    monkeypatch.setenv("EPMOE_GPU_RANKS", "8")
    assert gpu_test_ranks() == 8
    monkeypatch.setenv("EPMOE_GPU_RANKS", "9")
    with pytest.raises(ValueError, match="2 to 8"):
        gpu_test_ranks()
