"""epmoe.cuda_driver on one GPU: a copy and a fenced flag write queued on a stream behind a kernel of
another stream that writes its source late (2 ms) move what the kernel wrote, in that order."""
import pytest
import torch
import triton
import triton.language as tl

from epmoe.kernels.sync import now_ns


@triton.jit
def _late_fill_kernel(data_ptr, value, delay_ns, N: tl.constexpr):
    """After delay_ns on the GPU's clock: data[:N] = value."""
    start = now_ns(tl.full([], 0, tl.int64), False)
    now = start
    while now - start < delay_ns:
        now = now_ns(now, False)
    tl.store(data_ptr + tl.arange(0, N), tl.full([N], value, tl.int32))


@pytest.mark.gpu
def test_copy_then_write_after_a_late_kernel():
    from epmoe import cuda_driver
    N = 1024
    src = torch.zeros(N, dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(src)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    engine, filled = torch.cuda.Stream(), torch.cuda.Event()
    for value in (7, 8):
        _late_fill_kernel[(1,)](src, value, 2_000_000, N=N, num_warps=4)
        filled.record()
        engine.wait_event(filled)
        cuda_driver.copy(engine, dst.data_ptr(), src.data_ptr(), N * 4)
        cuda_driver.write_value(engine, flag.data_ptr(), 100 + value)
        engine.synchronize()
        assert dst.eq(value).all() and flag.item() == 100 + value
    with pytest.raises(RuntimeError, match="cuMemcpyDtoDAsync failed: CUDA_ERROR_INVALID_VALUE"):
        cuda_driver._check(1, "cuMemcpyDtoDAsync")
