"""epmoe.launch.spawn: results by rank (large ones too), a failing rank fails the run without hanging the
others, and a run past its timeout is killed."""
import time

import pytest
import torch
import torch.distributed as dist

from epmoe.launch import spawn


def _big_result(ctx):
    t = torch.full((4,), float(ctx.rank))
    dist.all_reduce(t, group=ctx.group)
    return ctx.rank, ctx.world_size, t.tolist(), torch.arange(300_000)  # far beyond a pipe's buffer


def _rank1_fails(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.ones(1), group=ctx.group)  # rank 0 waits in a collective rank 1 never joins


def _sleeps(ctx):
    time.sleep(120)


def test_spawn_returns_results_by_rank():
    results = spawn(_big_result, 2, "cpu", timeout_s=120)
    assert [r[:3] for r in results] == [(0, 2, [1.0] * 4), (1, 2, [1.0] * 4)]
    assert all(torch.equal(r[3], torch.arange(300_000)) for r in results)


def test_spawn_failing_rank_raises_without_hang():
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:  # rank 1's error, or rank 0's broken collective, whichever is seen first
        spawn(_rank1_fails, 2, "cpu", timeout_s=120)
    assert not isinstance(e.value, TimeoutError)
    assert time.monotonic() - t0 < 60


def test_spawn_timeout():
    with pytest.raises(TimeoutError, match="ran past 3"):
        spawn(_sleeps, 1, "cpu", timeout_s=3)
