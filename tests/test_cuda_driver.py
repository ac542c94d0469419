"""epmoe.cuda_driver on one GPU: a copy and a fenced flag write queued on a stream behind a kernel of
another stream that writes its source late (2 ms) move what the kernel wrote; a kernel on a third
stream that spins on the flag and then reads the copy's destination finds the copied data (the fence
orders the copy's writes before the flag). The flag is an int64 and its values pass 2^32; the GPU
says it has the 64-bit stream memory operations that write it."""
import pytest
import torch
import triton
import triton.language as tl

from epmoe.kernels.sync import now_ns, spin_until


@triton.jit(do_not_specialize=["value", "delay_ns"])
def _late_fill_kernel(data_ptr, value, delay_ns, N: tl.constexpr):
    """After delay_ns on the GPU's clock: data[:N] = value."""
    start = now_ns(tl.full([], 0, tl.int64), False)
    now = start
    while now - start < delay_ns:
        now = now_ns(now, False)
    tl.store(data_ptr + tl.arange(0, N), tl.full([N], value, tl.int32))


@triton.jit(do_not_specialize=["value"])
def _read_after_flag_kernel(flag_ptr, value, err_ptr, src_ptr, out_ptr, N: tl.constexpr):
    """Spin until flag >= value (acquire, system scope; err = 1 after 10 s without), then out[:N] = src[:N]."""
    spin_until(flag_ptr, value, err_ptr, 10_000_000_000, False)
    tl.store(out_ptr + tl.arange(0, N), tl.load(src_ptr + tl.arange(0, N), volatile=True))


BIG = 1 << 40  # flag values past 32 bits


def test_write_value_refuses_values_outside_an_int64_flag():
    from epmoe import cuda_driver
    for value in (-1, 1 << 63):
        with pytest.raises(ValueError, match="write_value writes values in"):
            cuda_driver.write_value(None, 0, value)


@pytest.mark.gpu
def test_copy_then_write_after_a_late_kernel():
    from epmoe import cuda_driver
    assert cuda_driver.can_write_value(torch.cuda.current_device())
    N = 1024
    src = torch.zeros(N, dtype=torch.int32, device="cuda")
    dst, out = torch.zeros_like(src), torch.zeros_like(src)
    flag, err = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    # three streams of their own (none is the legacy default stream, which would wait for the spinning reader)
    producer, engine, reader = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    filled = torch.cuda.Event()
    # load both kernels first (their int arguments unspecialized: one build whatever the values):
    # loading a kernel's module at its first launch waits for the kernels running on the GPU (the
    # spinning reader: it gave up after 10 s when the late kernel's build was new)
    _read_after_flag_kernel[(1,)](flag, -BIG, err, dst, out, N=N, num_warps=4)  # an int64 value: its build
    _late_fill_kernel[(1,)](src, 0, 0, N=N, num_warps=4)
    torch.cuda.synchronize()
    for value in (7, 8):
        with torch.cuda.stream(reader):  # queued first: it spins until the flag says the copy is done
            _read_after_flag_kernel[(1,)](flag, BIG + value, err, dst, out, N=N, num_warps=4)
        with torch.cuda.stream(producer):
            _late_fill_kernel[(1,)](src, value, 2_000_000, N=N, num_warps=4)
            filled.record(producer)
        engine.wait_event(filled)
        cuda_driver.copy(engine, dst.data_ptr(), src.data_ptr(), N * 4)
        cuda_driver.write_value(engine, flag.data_ptr(), BIG + value)
        torch.cuda.synchronize()
        assert err.item() == 0 and dst.eq(value).all() and out.eq(value).all() and flag.item() == BIG + value
    with pytest.raises(RuntimeError, match="cuMemcpyDtoDAsync failed: CUDA_ERROR_INVALID_VALUE"):
        cuda_driver._check(1, "cuMemcpyDtoDAsync")
