"""The receiver's layout step of the `ht` dispatch, and the host's read of the batch size.

The layout sorts the received (row, local expert) pairs by expert with the layout engine's count / scan /
place (epmoe/kernels/ht/layout.py), once every rank's numbering has signalled: work proportional to the
pairs received (not to the capacity C), no row read or moved. Its first kernel writes the batch size
(and the largest of the ranks' chunk counts) into a word of host memory, pinned on a GPU, where the host
polls for it without a copy or a stream sync (`SizeWords`).

Shape letters: R ranks, C capacity, K top-k, L local experts, P = R*C receive rows, N = R*C*K batch rows.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

from ...kernels.ht import layout as kernels
from ...kernels.sync import DeviceWait
from .workspace import HtSetup


@dataclass(frozen=True)
class HtLayout:
    """The expert-sorted layout of one dispatch's batch (device tensors)."""

    counts_L: torch.Tensor  # int32 [L]: rows of each local expert
    offsets_L1: torch.Tensor  # int32 [L+1]: their exclusive prefix sum
    pos_PK: torch.Tensor  # int32 [P, K]: batch row of each received (row, slot) pair, -1 none
    weights_PK: torch.Tensor  # float32 [P, K]: their top-k weights
    rows_N: torch.Tensor  # int32 [R*C*K]: each batch row's row in recv_x viewed as [2 * R * C, D]
    recv_counts_R: torch.Tensor  # int32 [R]: rows received from each rank


def lay_out(setup: HtSetup, epoch_1: torch.Tensor, size_1: torch.Tensor) -> HtLayout:
    """The batch's expert-sorted layout, once every rank's counts and ids of epoch epoch_1 are here (its
    first kernel waits on the device, and writes the batch size into size_1). A count and a place kernel
    over blocks of received rows, with a scan of the [B, L] table of per-block counts between them (one
    program per few experts). No host sync."""
    b, L = setup.buffers, setup.num_local_experts
    table_BL = kernels.layout_count(b, epoch_1, setup.blocks, L, size_1, setup.wait)
    counts_L, offsets_L1, start_BL, recv_counts_R = kernels.layout_scan(table_BL, b.recv_count, epoch_1)
    pos_PK, weights_PK, rows_N = kernels.layout_place(b, epoch_1, start_BL, setup.blocks, setup.max_recv_rows)
    return HtLayout(counts_L=counts_L, offsets_L1=offsets_L1, pos_PK=pos_PK, weights_PK=weights_PK,
                    rows_N=rows_N, recv_counts_R=recv_counts_R)


# how often (seconds) the host's poll for the batch size checks that the layout is still to run (and lets
# other Python threads run)
SIZE_POLL_CHECK_S = 1e-3


def poll_size(word: ctypes.c_int64, epoch: int, ready: torch.cuda.Event) -> tuple[int, int] | None:
    """Spin until the host word holds epoch's batch size and chunk count (`kernels.batch_size`); every
    SIZE_POLL_CHECK_S let other Python threads run and check `ready` (an event after the layout
    kernels): once it has completed, the word is final (None: the layout ended without writing it)."""
    checked = time.perf_counter()
    while (n := kernels.batch_size(word.value, epoch)) is None:
        if time.perf_counter() - checked > SIZE_POLL_CHECK_S:
            if ready.query():
                return kernels.batch_size(word.value, epoch)
            time.sleep(0)
            checked = time.perf_counter()
    return n


class SizeWords:
    """The batch size words of the dispatches of even and odd epochs: the layout's first kernel writes
    them (`kernels.layout_count`; sync_free mode: word 0, never read), the host reads them. Pinned on a
    GPU, where the host polls them. 16 bytes apart: Triton specializes pointers on 16-byte alignment (one
    build for both)."""

    def __init__(self, device: torch.device, rank: int, wait: DeviceWait) -> None:
        self.device, self.rank, self._wait = device, rank, wait
        self.sizes = torch.zeros(2, 2, dtype=torch.int64, pin_memory=device.type == "cuda")
        # each parity's word as the layout kernel's output and as the host reads it (made once: a torch
        # view costs the host several µs per call, and the host paces a layer's dispatch)
        self._words = [self.sizes[p, :1] for p in range(2)]
        self._values = [ctypes.c_int64.from_address(w.data_ptr()) for w in self._words]

    def word(self, epoch: int | None) -> torch.Tensor:
        """int64 [1]: the word the layout of `epoch` writes (None: sync_free, word 0)."""
        return self._words[(epoch or 0) % 2]

    def read(self, epoch: int) -> tuple[int, int]:
        """(valid rows, largest chunk count) of the layout of `epoch`, queued on the current stream: it
        has run once the stream has (on a GPU a stream sync)."""
        word = self._values[epoch % 2]
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self._checked(kernels.batch_size(word.value, epoch), epoch)

    def poll(self, epoch: int, ready: torch.cuda.Event) -> tuple[int, int]:
        """(valid rows, largest chunk count) of the layout of `epoch`, polled for while it runs (`ready`:
        an event after it)."""
        return self._checked(poll_size(self._values[epoch % 2], epoch, ready), epoch)

    def _checked(self, size: tuple[int, int] | None, epoch: int) -> tuple[int, int]:
        """RuntimeError if a device-side wait of this rank gave up (in this call's layout or any call
        before), or if the layout ran without writing the word."""
        if size is None:
            raise RuntimeError(f"dispatcher 'ht' (rank {self.rank}): the layout of epoch {epoch} ended "
                               f"without writing the batch size")
        if size[0] < 0:
            raise RuntimeError(f"dispatcher 'ht' (rank {self.rank}): a device-side wait gave up after "
                               f"{self._wait.timeout_ns / 1e9:g} s (a peer failed, or the ranks' calls do "
                               "not match); its results are garbage from then on: rebuild the dispatcher")
        return size
