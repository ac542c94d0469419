"""Device-side waits shared by the `ht` and `ll` kernels: spin on a flag another rank raises, with a
timeout and an error flag, so that a lost peer or mismatched calls fail instead of hanging."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def now_ns(prev, INTERPRET: tl.constexpr):
    """Nanoseconds on the GPU's global timer; under the interpreter a stand-in: prev + 1000."""
    if INTERPRET:
        return prev + 1000
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def spin_until(flag_ptr, target, err_ptr, timeout_ns, INTERPRET: tl.constexpr):
    """Spin until flag_ptr[0] >= target, reading with acquire semantics at system scope (what the
    signaller stored before its release is visible after).

    After timeout_ns without that it gives up and sets err_ptr[0] = 1 (a peer is gone, or the ranks'
    calls do not match); once the flag is set, waits return at once (results are garbage from then on).
    """
    healthy = tl.load(err_ptr, volatile=True) == 0
    cur = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    start = now_ns(tl.full([], 0, tl.int64), INTERPRET)
    now = start
    while (cur < target) & healthy & (now - start < timeout_ns):
        cur = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        now = now_ns(now, INTERPRET)
    if cur < target:
        tl.atomic_xchg(err_ptr, 1, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class DeviceWait:
    """How a launcher's device-side waits give up: after timeout_ns without their signal, setting
    err_1 (int32 [1], this rank's) to 1."""

    err_1: torch.Tensor
    timeout_ns: int

    @property
    def interpret(self) -> bool:
        """Whether the kernels run under the Triton interpreter (CPU tensors): no GPU timer there."""
        return self.err_1.device.type != "cuda"


@triton.jit(do_not_specialize=["target"])
def _barrier_kernel(flag_peers, flag_ptr, err_ptr, timeout_ns, target, rank, R: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """flag[rank] += 1 on every rank r (release, system scope), then spin until every flag here is >= target."""
    for r in tl.static_range(R):
        tl.atomic_add(tl.load(flag_peers + r).to(tl.pointer_type(tl.int64)) + rank, 1, sem="release", scope="sys")
    for r in tl.static_range(R):
        spin_until(flag_ptr + r, target, err_ptr, timeout_ns, INTERPRET)


def device_barrier(flag_peers_R: torch.Tensor, flag_R: torch.Tensor, calls: int, rank: int, wait: DeviceWait) -> None:
    """Block the stream until every rank's stream has reached its `calls`-th device_barrier on these flags
    (flag_R: int64 [R] of a symmetric workspace, zero at first; flag_peers_R: its address on each rank).
    The ranks' streams leave it within the link's latency of each other, whenever their hosts queued it."""
    _barrier_kernel[(1,)](flag_peers_R, flag_R, wait.err_1, wait.timeout_ns, calls, rank, R=flag_R.shape[0],
                          INTERPRET=wait.interpret, num_warps=1)
