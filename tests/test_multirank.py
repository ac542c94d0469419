"""allgather and alltoall over 1-4 gloo ranks (and NCCL on gpu_test_ranks() GPUs): one spawn per world size runs every
case of moe_cases with both dispatchers; exact and random data, T=0/1/odd, -1 ids, one hot expert,
chunking with different chunk counts per rank, bad input refused before communication."""
import pytest

from epmoe.launch import spawn
from gpu_ranks import gpu_test_ranks

import moe_cases

SPAWN_TIMEOUT_S = 240


def _report(results: list[list[str]]) -> None:
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_dispatchers_gloo(world_size):
    names = ("local", "allgather", "alltoall") if world_size == 1 else ("allgather", "alltoall")
    _report(spawn(moe_cases.run_cases, world_size, "cpu", (names,), timeout_s=SPAWN_TIMEOUT_S))


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
