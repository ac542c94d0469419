"""epmoe.timing's GPU-paced timers against a spin kernel of known length and against triton's do_bench on a
call whose host part outlasts its GPU part (which do_bench times at the host's pace)."""
import time

import pytest
import torch

from epmoe.timing import SPIN_CLOCK_HZ, flushed_ms, gpu_us, host_us

SPIN_CYCLES = 200_000  # ~101 µs at the H200's top clock, longer at a lower one


@pytest.mark.gpu
def test_gpu_us_times_a_spin_kernel_by_its_cycles():
    us = gpu_us(lambda: torch.cuda._sleep(SPIN_CYCLES), iters=20)
    assert SPIN_CYCLES / SPIN_CLOCK_HZ * 1e6 * 0.95 <= us <= SPIN_CYCLES / 0.8e9 * 1e6


@pytest.mark.gpu
def test_flushed_ms_times_the_gpu_where_the_host_is_slower():
    import triton.testing

    def host_bound():  # 2 ms of host, ~10 µs of GPU
        time.sleep(0.002)
        torch.cuda._sleep(20_000)

    paced_by_host = triton.testing.do_bench(host_bound, warmup=5, rep=40, return_mode="median")
    by_gpu = flushed_ms(host_bound, rep_ms=1, warmup_ms=1)
    assert paced_by_host >= 1.5  # the control: do_bench's time includes the host's 2 ms
    assert by_gpu < 0.2
    assert flushed_ms(lambda: torch.cuda._sleep(SPIN_CYCLES), rep_ms=10) == pytest.approx(
        gpu_us(lambda: torch.cuda._sleep(SPIN_CYCLES)) * 1e-3, rel=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("flush", ["write", "read"])
def test_flushed_ms_flushes_by_writing_or_reading(flush):
    # a spin touches no memory: either flush leaves it its own length
    assert flushed_ms(lambda: torch.cuda._sleep(SPIN_CYCLES), rep_ms=10, flush=flush) == pytest.approx(
        gpu_us(lambda: torch.cuda._sleep(SPIN_CYCLES)) * 1e-3, rel=0.1)


def test_flushed_ms_rejects_an_unknown_flush():
    with pytest.raises(ValueError, match="flush must be"):
        flushed_ms(lambda: None, flush="evict")


@pytest.mark.gpu
def test_flushed_ms_times_a_call_far_shorter_than_its_budget():
    # 20 ms of ~1 µs calls: do_bench would queue ~20000; more than the GPU's launch queue holds behind a spin
    assert 0 < flushed_ms(lambda: torch.cuda._sleep(2_000), rep_ms=20) < 0.05


@pytest.mark.gpu
def test_host_us_times_the_queueing_not_the_gpu():
    def host_bound():  # 2 ms of host, ~10 µs of GPU
        time.sleep(0.002)
        torch.cuda._sleep(20_000)

    assert 1900 <= host_us(host_bound, calls=10) <= 4000
    gpu_bound = lambda: torch.cuda._sleep(SPIN_CYCLES)  # noqa: E731  (~101 µs of GPU a call)
    assert host_us(gpu_bound, calls=20) < 0.5 * gpu_us(gpu_bound, iters=20)
