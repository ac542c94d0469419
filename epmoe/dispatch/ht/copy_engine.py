"""The copy-engine rows of the `ht` dispatcher (its copy_engine mode, see HtDispatcher).

Every token's row goes to row t of each peer's receive region, by the GPU's copy engine, and then the
call's epoch into the peer's dispatch flag: a fenced 64-bit write (cuStreamWriteValue64,
epmoe.cuda_driver), so the rows are visible on the peer before the flag. The rows need no numbering,
so they are queued first, and the epoch is the host's count of calls (equal to the device's: the mode
refuses CUDA graph capture). This rank's own rows are copied on the SMs (`copy_rows`), beside the copy
engine's. Ranks emulated in one process (CPU, run in turn) copy at once with torch.

The combine's partial rows stay with the combine kernel's SM stores: copying them by the copy engine in
chunks, each behind a stream wait on the kernel's stamp of it, was slower (259-463 µs at 4096 tokens on
2 H200s against 225; BENCHMARKS.md, "What we tried: ht combine").
"""
from __future__ import annotations

import torch

from ... import cuda_driver
from ...kernels.ht import send as kernels
from ...symm import Workspace
from .transport import DenseRows
from .workspace import HtSetup


class CopyEngine:
    """Copy-engine state of one rank's `ht` dispatcher: views of its rows and flags at every rank."""

    def __init__(self, ws: Workspace) -> None:
        R, rank = ws.world_size, ws.rank
        self.rank = rank
        self._peers = [r for r in range(R) if r != rank]
        # [parity][r]: this rank's rows at rank r, [C, D]
        self._rows_at = [[ws.peer("recv_x", r)[parity, rank] for r in range(R)] for parity in range(2)]
        # [r]: dispatch_flag[this rank] at rank r (only this rank writes it)
        self._flag_at = [ws.peer("dispatch_flag", r)[rank:][:1] for r in range(R)]

    def send_rows(self, x_TD: torch.Tensor, epoch: int, stream: torch.cuda.Stream | None) -> None:
        """x_TD's rows into every peer's receive region (parity epoch % 2, this rank, row t), then epoch
        into the peer's dispatch flag of this rank, queued on `stream`."""
        rows_at = self._rows_at[epoch % 2]
        nbytes = x_TD.numel() * x_TD.element_size()
        for r in self._peers:
            if nbytes:
                cuda_driver.copy(stream, rows_at[r].data_ptr(), x_TD.data_ptr(), nbytes)
            cuda_driver.write_value(stream, self._flag_at[r].data_ptr(), epoch)

    def own_rows(self, epoch: int) -> torch.Tensor:
        """[C, D]: this rank's own receive region of parity epoch % 2 (its rows from itself)."""
        return self._rows_at[epoch % 2][self.rank]


class EmulatedCopyEngine(CopyEngine):
    """The copy engine of ranks emulated in one process: the rows and flags are copied at once."""

    def send_rows(self, x_TD: torch.Tensor, epoch: int, stream: torch.cuda.Stream | None) -> None:
        rows_at = self._rows_at[epoch % 2]
        for r in self._peers:
            rows_at[r][:x_TD.shape[0]].copy_(x_TD)
            self._flag_at[r].fill_(epoch)


class CopyEngineRows(DenseRows):
    """Dense mode by the copy engine: one epoch stamp per peer, this rank's own rows on the SMs.

    Over a process group the side stream waits for the rows, behind the layout: a wait kernel queued on
    the calling stream behind the copies started a few µs after them on H200, while one on the side stream
    is spinning when the flags land (BENCHMARKS.md, "What we tried: ht dispatch")."""

    waits_on_side_stream = True

    def __init__(self, setup: HtSetup, engine: CopyEngine) -> None:
        super().__init__(setup)
        self.engine = engine

    def send_first(self, x_TD: torch.Tensor, epoch: int, stream: torch.cuda.Stream | None) -> None:
        self.engine.send_rows(x_TD, epoch, stream)

    def copy_own(self, x_TD: torch.Tensor, epoch: int) -> None:
        kernels.copy_rows(x_TD, self.engine.own_rows(epoch), self.setup.launch)

    def wait(self) -> None:
        """As RowTransport.wait, for one epoch stamp per peer (this rank's own rows were copied on the SMs
        before the wait, in stream order)."""
        b, s = self.setup.buffers, self.setup
        kernels.wait_flags(b.dispatch_flag, b.dispatch_seq, 1, s.wait, b.rank)
