"""Peer addressing, signals, device-side waits and their time-outs: the one convention of the `ht` and `ll`
kernels (and of the benchmarks' device barrier).

- Addressing: a buffer that peers write is reached through its address table, int64 [R] on the device
  (`Workspace.peers(name)`, epmoe/symm.py): `peer_ptr(table, r, dtype)` is rank r's buffer as a pointer
  (`peer_base`: hinted 16-byte aligned). A vector of ranks gives a vector of pointers.
- Signalling: after every store it orders (`tl.debug_barrier()`, so that all threads' stores are issued),
  a program adds to a flag of the receiver with release semantics at system scope (`signal_peers`: one add
  per rank into the receiver's flag of this rank). What a flag counts is the protocol of its dispatcher
  (ht: one add per signalling program and call, epmoe/kernels/ht/; ll: a fixed unit per rank and call,
  epmoe/kernels/ll.py).
- Waiting: `spin_until` spins on a flag with acquire semantics at system scope, so the signaller's stores
  before its release are visible after it.
- Time-outs: a wait gives up after `DeviceWait.timeout_ns` without its signal and sets the rank's error
  flag (`DeviceWait.err_1`); every later wait then returns at once (results are garbage from then on:
  a peer is gone, or the ranks' calls do not match). The host reads the flag with `DeviceWait.timed_out()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def peer_ptr(table_ptr, r, dtype: tl.constexpr):
    """Rank r's buffer (r a scalar or a vector of ranks) as a pointer to `dtype`, from its address table."""
    return tl.load(table_ptr + r).to(tl.pointer_type(dtype))


@triton.jit
def peer_base(table_ptr, r, dtype: tl.constexpr):
    """peer_ptr of a buffer's start, hinted 16-byte aligned (workspace buffers start at multiples of 256
    bytes), so that stores of rows at multiples of 16 bytes from it vectorize. (The hint is given here, on
    the cast: one given to the value a jit function returns is lost on some Triton versions.)"""
    return tl.multiple_of(tl.load(table_ptr + r).to(tl.pointer_type(dtype)), 16)


@triton.jit
def signal_peers(flag_peers, rank, R: tl.constexpr):
    """flag[rank] += 1 on every rank r (release, system scope), after all stores of this program are
    issued (flag_peers: the flag's address table)."""
    tl.debug_barrier()
    for r in tl.static_range(R):
        tl.atomic_add(peer_ptr(flag_peers, r, tl.int64) + rank, 1, sem="release", scope="sys")


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


def timeout_ns(wait_timeout_s: float) -> int:
    """A dispatcher's `wait_timeout_s` option in nanoseconds (ValueError unless finite and > 0)."""
    if not 0 < wait_timeout_s < float("inf"):
        raise ValueError(f"wait_timeout_s must be finite and > 0, got {wait_timeout_s!r}")
    return int(wait_timeout_s * 1e9)


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

    def timed_out(self) -> bool:
        """Whether any wait on err_1 gave up. Reads a device flag: a host sync."""
        return bool(self.err_1.item())


@triton.jit(do_not_specialize=["target"])
def _barrier_kernel(flag_peers, flag_ptr, err_ptr, timeout_ns, target, rank, R: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """flag[rank] += 1 on every rank r (release, system scope), then spin until every flag here is >= target."""
    for r in tl.static_range(R):
        tl.atomic_add(peer_ptr(flag_peers, r, tl.int64) + rank, 1, sem="release", scope="sys")
    for r in tl.static_range(R):
        spin_until(flag_ptr + r, target, err_ptr, timeout_ns, INTERPRET)


def device_barrier(flag_peers_R: torch.Tensor, flag_R: torch.Tensor, calls: int, rank: int, wait: DeviceWait) -> None:
    """Block the stream until every rank's stream has reached its `calls`-th device_barrier on these flags
    (flag_R: int64 [R] of a symmetric workspace, zero at first; flag_peers_R: its address on each rank).
    The ranks' streams leave it within the link's latency of each other, whenever their hosts queued it."""
    _barrier_kernel[(1,)](flag_peers_R, flag_R, wait.err_1, wait.timeout_ns, calls, rank, R=flag_R.shape[0],
                          INTERPRET=wait.interpret, num_warps=1)
