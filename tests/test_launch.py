"""epmoe.launch.spawn: results by rank (large ones too), a failing rank fails the run without hanging the
others, a run past its timeout is killed, and ranks die with a launcher that is killed."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessRaisedException

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
    """The error raised in a rank comes back with its message: rank 1's own, or rank 0's broken collective
    (whichever the launcher sees first; gloo says the peer closed or reset the connection), not a crash or a
    time-out."""
    t0 = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 1 gives up|Connection (closed|reset) by peer"):
        spawn(_rank1_fails, 2, "cpu", timeout_s=120)
    assert time.monotonic() - t0 < 60


class _GroupUser:
    """Left in a reference cycle by its rank's function; records, when freed, whether the group was still up."""

    def __init__(self, ctx, path):
        self.me, self.group, self.path = self, ctx.group, path

    def __del__(self):
        Path(self.path).write_text(str(dist.is_initialized()))


def _leaves_a_cycle(ctx, folder):
    _GroupUser(ctx, Path(folder) / f"rank{ctx.rank}")
    return ctx.rank


def test_a_rank_frees_what_its_function_left_in_cycles_before_its_group(tmp_path):
    """What a rank's function leaves in reference cycles is freed while its process group is up, not at
    interpreter exit (where a gloo group held by such a cycle aborted the process, now and then)."""
    assert spawn(_leaves_a_cycle, 2, "cpu", (str(tmp_path),), timeout_s=120) == [0, 1]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["True"] * 2


def test_spawn_timeout():
    with pytest.raises(TimeoutError, match="ran past 3"):
        spawn(_sleeps, 1, "cpu", timeout_s=3)


_LAUNCHER = """
import os, signal, sys, time
from epmoe.launch import spawn

def record_pid_and_sleep(ctx, folder):
    # Like a rank blocked in a CUDA call: Python never gets to handle SIGINT (torch's own
    # parent-death signal), so only a signal that cannot be caught ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    path = os.path.join(folder, str(ctx.rank))
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)  # the test never sees a half-written file
    time.sleep(120)

if __name__ == "__main__":
    spawn(record_pid_and_sleep, 2, "cpu", (sys.argv[1],))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_ranks_die_with_a_killed_launcher(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("[01]"))) < 2:
        assert time.monotonic() < deadline and launcher.poll() is None, "ranks did not start"
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("[01]"))]
    launcher.send_signal(signal.SIGKILL)  # no clean-up of its own runs
    launcher.wait()
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and
                 Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
    assert not alive, f"ranks {alive} outlived their killed launcher"


def _threads(ctx):
    return torch.get_num_threads()


def test_cpu_ranks_share_the_cores():
    """CPU ranks run as many torch threads as leave every core one thread in all (at least one each)."""
    from epmoe.launch import cpu_threads_per_rank
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert spawn(_threads, 2, "cpu", timeout_s=120) == [max(1, cores // 2)] * 2
    assert cpu_threads_per_rank(1) == cores and cpu_threads_per_rank(cores + 1) == 1
