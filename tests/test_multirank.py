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
        else:
            failures += [f"world {size}: rank {ctx.rank} outside the group: {f}" for f in _refused_outside(group)]
    return failures


def _refused_outside(group) -> list[str]:
    """A layer built on a process outside `group` is refused, naming it (torch gives that process rank -1)."""
    import epmoe
    cfg = epmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    try:
        epmoe.FusedMoE(cfg, group=group, device="cpu")
    except ValueError as e:
        return [] if "not a member of the process group" in str(e) else [f"refused with {e}"]
    return ["built"]


@pytest.mark.parametrize("sizes", [(4, 3), (7, 6, 5)])
def test_dispatchers_gloo_groups(sizes):
    _report(spawn(_cases_in_subgroups, sizes[0], "cpu", (sizes, ("allgather", "alltoall")), timeout_s=SPAWN_TIMEOUT_S))


def _symmetric_build_refusal(ctx) -> list[str]:
    """What ht and ll agree on before any check or allocation over a process group (symm.agree_construction,
    here its gather over gloo): rank 1 built from another config, then with other options, then alike."""
    import dataclasses

    import epmoe
    from epmoe.config import repr_hash
    from epmoe.symm import all_gather_ints, refuse_other_builds
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    other = dataclasses.replace(cfg, hidden_size=12)
    failures = []
    for mine, opts, words in ((other, ("reduce",), "another MoEConfig"), (cfg, ("source",), "other options"),
                              (cfg, ("reduce",), None)):
        built = (mine, opts) if ctx.rank == 1 else (cfg, ("reduce",))
        every = all_gather_ints(ctx.group, [built[0].fingerprint(), repr_hash(built[1])], torch.device("cpu"))
        try:
            refuse_other_builds("ll", ctx.rank, every)
            if words:
                failures.append(f"rank {ctx.rank}: a rank built otherwise ({words}) was not refused")
        except ValueError as e:
            if not words or words not in str(e) or f"rank(s) [{1 - ctx.rank}]" not in str(e):
                failures.append(f"rank {ctx.rank}: {e}")
    return failures


def test_symmetric_dispatchers_refuse_ranks_built_otherwise():
    _report(spawn(_symmetric_build_refusal, 2, "cpu", (), timeout_s=SPAWN_TIMEOUT_S))


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
