"""Which stream operations can complete while a kernel on another stream of the same GPU spins for
their result? One GPU. Each case: a reader kernel (tests/test_cuda_driver.py) spins up to 10 s for a
flag on its own stream; an engine stream then does the case's steps and a fenced cuStreamWriteValue64
of the flag. Prints whether the reader saw the flag or gave up.

    python3 scripts/fence_probe.py
"""
import sys

import torch

sys.path.insert(0, "tests")
import test_cuda_driver as t  # noqa: E402

from epmoe import cuda_driver  # noqa: E402


def main() -> None:
    N = 1024
    src = torch.full((N,), 5, dtype=torch.int32, device="cuda")
    dst, out = torch.zeros_like(src), torch.zeros_like(src)
    flag, err = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    t._read_after_flag_kernel[(1,)](flag, 0, err, dst, out, N=N, num_warps=4)
    t._late_fill_kernel[(1,)](src, 5, 0, N=N, num_warps=4)
    torch.cuda.synchronize()
    for case in ("write", "copy, write", "event of a late kernel, write", "torch copy_, write"):
        reader, engine, producer = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        flag.zero_()
        err.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(reader):
            t._read_after_flag_kernel[(1,)](flag, 1, err, dst, out, N=N, num_warps=4)
        if case.startswith("copy"):
            cuda_driver.copy(engine, dst.data_ptr(), src.data_ptr(), N * 4)
        if case.startswith("event"):
            with torch.cuda.stream(producer):
                t._late_fill_kernel[(1,)](src, 5, 2_000_000, N=N, num_warps=4)
            ev = torch.cuda.Event()
            ev.record(producer)
            engine.wait_event(ev)
        if case.startswith("torch"):
            with torch.cuda.stream(engine):
                dst.copy_(src)
        cuda_driver.write_value(engine, flag.data_ptr(), 1)
        torch.cuda.synchronize()
        print(f"{case:<32} {'reader gave up' if err.item() else 'reader saw the flag'}", flush=True)


if __name__ == "__main__":
    main()
