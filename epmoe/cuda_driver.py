"""Stream operations of the CUDA driver that torch does not expose, through ctypes (libcuda.so.1, loaded
on first use: importing this module needs no GPU).

- `write_value`: a stream writes a 64-bit word (cuStreamWriteValue64, after a system-scope memory
  fence: everything the stream did before is visible first), e.g. into a peer's flag over NVLink.
- `can_write_value`: whether a GPU supports `write_value` (its 64-bit stream memory operations).
- `copy`: an asynchronous device-to-device copy of raw bytes (cuMemcpyDtoDAsync; peer memory mapped
  into this process counts as device memory): the copy engine, without torch's per-call overhead.

Addresses are ints (`tensor.data_ptr()`); streams are torch.cuda.Stream. The calls only enqueue work;
they cost a few microseconds of host time each (a torch `copy_` of a view costs ~10). They need the
stream's device to be the current CUDA context (true once torch has used that device in this thread).
"""
from __future__ import annotations

import ctypes
import functools

import torch

_WRITE_FENCED = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write
_CAN_USE_64_BIT_STREAM_MEM_OPS = 122  # CUdevice_attribute of the v2 stream memory operations (93: v1's)


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64, ptr = ctypes.c_uint64, ctypes.c_void_p
    for name, args in (("cuStreamWriteValue64_v2", (ptr, u64, u64, ctypes.c_uint)),
                       ("cuMemcpyDtoDAsync_v2", (u64, u64, ctypes.c_size_t, ptr)),
                       ("cuDeviceGet", (ctypes.POINTER(ctypes.c_int), ctypes.c_int)),
                       ("cuDeviceGetAttribute", (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int))):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.cuGetErrorName.argtypes, lib.cuGetErrorName.restype = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)), ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else result}")


@functools.cache
def can_write_value(device_index: int) -> bool:
    """Whether CUDA device `device_index` runs `write_value`: CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    (a driver older than CUDA 12, which does not know it, counts as no)."""
    torch.cuda.init()  # the driver calls below need cuInit
    device, supported = ctypes.c_int(), ctypes.c_int()
    _check(_driver().cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    known = _driver().cuDeviceGetAttribute(ctypes.byref(supported), _CAN_USE_64_BIT_STREAM_MEM_OPS, device) == 0
    return known and bool(supported.value)


def write_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Once the work queued on `stream` before it is done and visible system-wide, the int64 at
    `address` (local or peer memory, 8-byte aligned) becomes value (in [0, 2^63): the flags it writes
    are int64)."""
    if not 0 <= value < 1 << 63:
        raise ValueError(f"write_value writes values in [0, 2^63), got {value}")
    _check(_driver().cuStreamWriteValue64_v2(stream.cuda_stream, address, value, _WRITE_FENCED),
           "cuStreamWriteValue64")


def copy(stream: torch.cuda.Stream, dst: int, src: int, nbytes: int) -> None:
    """Copy nbytes from device address src to dst (either may be a peer's mapped memory) on `stream`."""
    _check(_driver().cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream.cuda_stream), "cuMemcpyDtoDAsync")
