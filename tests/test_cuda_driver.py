"""epmoe.cuda_driver on one GPU: a stream's wait on a word that a running kernel stamps late holds back
the copy queued behind it, and the fenced write that follows lands after the copy."""
import pytest
import torch
import triton
import triton.language as tl

from epmoe.kernels.sync import now_ns


@triton.jit
def _late_stamp_kernel(data_ptr, flag_ptr, value, delay_ns, N: tl.constexpr):
    """After delay_ns on the GPU's clock: data[:N] = value, then flag = value (release, system scope)."""
    start = now_ns(tl.full([], 0, tl.int64), False)
    now = start
    while now - start < delay_ns:
        now = now_ns(now, False)
    tl.store(data_ptr + tl.arange(0, N), tl.full([N], value, tl.int32))
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@pytest.mark.gpu
def test_wait_copy_write_in_order():
    from epmoe import cuda_driver
    N = 1024
    src = torch.zeros(N, dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(src)
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")  # the kernel's stamp, the engine stream's write
    engine = torch.cuda.Stream()
    for value in (7, 8):  # a second round: the wait is for >= the new value, not any change
        _late_stamp_kernel[(1,)](src, flags, value, 2_000_000, N=N, num_warps=4)  # 2 ms late
        cuda_driver.wait_value(engine, flags.data_ptr(), value)
        cuda_driver.copy(engine, dst.data_ptr(), src.data_ptr(), N * 4)
        cuda_driver.write_value(engine, flags.data_ptr() + 4, 100 + value)
        engine.synchronize()
        torch.cuda.synchronize()
        assert dst.eq(value).all() and flags.tolist() == [value, 100 + value]
