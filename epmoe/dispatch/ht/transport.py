"""How the `ht` dispatch's rows travel, chosen once at construction (`RowTransport`).

- `SentRows`: the send kernel, after the numbering: each row once per destination rank, at its slot
  there, only where it has an expert (fp8-quantized on the way with fp8 dispatch).
- `DenseRows`: dense mode by the send kernel: every row to row t of every rank's receive region, needing
  no numbering (a token with no expert on a rank gets there too, its ids -1; its partial row comes back
  as zeros), so it can go first, the numbering beside it.
- `CopyEngineRows` (copy_engine.py): dense mode by the GPU's copy engine.

Each transport also knows how the receiver waits for its rows (what the rows' flags count).

Shape letters: T tokens on this rank, D hidden size, R ranks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ...kernels.ht import send as kernels
from .workspace import HtSetup


class RowTransport(ABC):
    """The rows' way to every rank, and the wait for them.

    dense: rows go to row t of every rank, before (or beside) the numbering.
    waits_on_side_stream: over a process group in host-synced mode, the side stream (behind the layout)
        rather than the calling stream waits for the rows (see CopyEngineRows)."""

    dense: ClassVar[bool]
    waits_on_side_stream: ClassVar[bool] = False

    def __init__(self, setup: HtSetup) -> None:
        self.setup = setup

    @abstractmethod
    def send(self, x_TD: torch.Tensor, slot_TR: torch.Tensor, epoch: int | None) -> None:
        """Every rank's rows of x_TD [T, D], after the numbering (slot_TR int32 [T, R] its slots; epoch: this
        call's on the host, None in sync_free mode), on the current stream."""

    def wait(self) -> None:
        """Block the current stream until every rank's rows of the latest epoch are here (or the wait
        gives up): each rank's send programs signal once a call."""
        b, s = self.setup.buffers, self.setup
        kernels.wait_flags(b.dispatch_flag, b.dispatch_seq, s.launch.programs, s.wait)


class SentRows(RowTransport):
    """The send kernel, at the numbering's slots."""

    dense = False

    def send(self, x_TD: torch.Tensor, slot_TR: torch.Tensor, epoch: int | None) -> None:
        kernels.dispatch_send(self.setup.buffers, x_TD, slot_TR, self.setup.launch)


class DenseRows(RowTransport):
    """Dense mode by the send kernel (every rank's region of parity epoch % 2, row t)."""

    dense = True

    def send(self, x_TD: torch.Tensor, slot_TR: torch.Tensor, epoch: int | None) -> None:
        self.send_first(x_TD, epoch, None)
        self.copy_own(x_TD, epoch)

    def send_first(self, x_TD: torch.Tensor, epoch: int, stream: torch.cuda.Stream | None) -> None:
        """Every row to row t of the ranks' receive regions of parity epoch % 2, and the flags, on the
        current stream (which is `stream` where one is given), before the numbering."""
        kernels.dispatch_send_dense(self.setup.buffers, x_TD, epoch, self.setup.launch)

    def copy_own(self, x_TD: torch.Tensor, epoch: int) -> None:
        """The rows to this rank's own region, where send_first leaves them out (nothing here: the send
        kernel stores to every rank)."""
