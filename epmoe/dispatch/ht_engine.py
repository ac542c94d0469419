"""The copy-engine rows of the `ht` dispatcher (its copy_engine mode, see HtDispatcher).

Every token's row goes to row t of each peer's receive region, by the GPU's copy engine, and then the
call's epoch into the peer's dispatch flag: a fenced 64-bit write (cuStreamWriteValue64,
epmoe.cuda_driver), so the rows are visible on the peer before the flag. The rows need no numbering,
so they are queued first, and the epoch is the host's count of calls (equal to the device's: the mode
refuses CUDA graph capture). Emulated ranks (CPU, run in turn) copy at once with torch.

(The combine's partial rows stay with the combine kernel's SM stores: copying them by the copy engine
in chunks, each behind a cuStreamWaitValue32 on the kernel's stamp of it, took 259-463 µs at 4096
tokens on 2 H200s against 225 µs: the engine stream started its first chunk 50-60 µs after the kernel
had stamped it, and lost ~8 µs between chunks; notes/gpu-findings.md, 2026-11-30, eighth session.)
"""
from __future__ import annotations

import torch

from .. import cuda_driver
from ..symm import Workspace


class HtCopyEngine:
    """Copy-engine state of one rank's `ht` dispatcher: views of its rows and flags at every rank."""

    def __init__(self, ws: Workspace, emulated: bool) -> None:
        R, rank = ws.world_size, ws.rank
        self.rank, self.emulated = rank, emulated
        self._peers = [r for r in range(R) if r != rank]
        # [parity][r]: this rank's rows at rank r, [C, D]
        self._rows_at = [[ws.peer("recv_x", r)[parity, rank] for r in range(R)] for parity in range(2)]
        # [r]: dispatch_flag[this rank] at rank r (only this rank writes it)
        self._flag_at = [ws.peer("dispatch_flag", r)[rank:][:1] for r in range(R)]

    def send_rows(self, x_TD: torch.Tensor, epoch: int, stream: torch.cuda.Stream | None) -> None:
        """x_TD's rows into every peer's receive region (parity epoch % 2, this rank, row t), then epoch
        into the peer's dispatch flag of this rank. GPU: queued on `stream`. Emulated: now."""
        rows_at = self._rows_at[epoch % 2]
        if self.emulated:
            for r in self._peers:
                rows_at[r][:x_TD.shape[0]].copy_(x_TD)
                self._flag_at[r].fill_(epoch)
            return
        nbytes = x_TD.numel() * x_TD.element_size()
        for r in self._peers:
            if nbytes:
                cuda_driver.copy(stream, rows_at[r].data_ptr(), x_TD.data_ptr(), nbytes)
            cuda_driver.write_value(stream, self._flag_at[r].data_ptr(), epoch)

    def own_rows(self, epoch: int) -> torch.Tensor:
        """[C, D]: this rank's own receive region of parity epoch % 2 (its rows from itself)."""
        return self._rows_at[epoch % 2][self.rank]
