"""The copy-engine transfers of the `ht` dispatcher (its copy_engine mode, see HtDispatcher).

Dispatch: every token's row goes to row t of each peer's receive region, by the GPU's copy engine on
a stream of its own, and then the call's epoch into the peer's dispatch flag (a fenced 32-bit write:
the rows are visible first). The rows need no numbering, so they are queued before it.

Combine: the combine kernel reduces each peer's tokens into a local stage and stamps each chunk of
rows once all of it is there; the copy-engine stream waits on the GPU for each stamp
(cuStreamWaitValue32), copies the chunk into the peer's combine region and writes the epoch into the
peer's ready flag of that chunk, which the peer's combine kernel waits for. So the link carries each
partial row by the copy engine (faster than SM stores on H200) while the SMs go on reducing.

The host gives the epochs (its count of calls, equal to the device's: the mode refuses CUDA graph
capture) and the rows to copy (T of every rank: the dispatch's host sync brings the peers' counts).
Emulated ranks (CPU, run in turn) copy at once with torch and check the kernel's stamps instead.

Shape letters: R ranks, C capacity, D hidden size, Q = max(R - 1, 1) peers, N chunks of a region.
"""
from __future__ import annotations

import torch

from .. import cuda_driver
from ..kernels import ht as kernels
from ..symm import Workspace


class HtCopyEngine:
    """Copy-engine state of one rank's `ht` dispatcher: peer views, the stage and chunk stamps of the
    combine (kernels.CombineCopy), and, on a GPU, the engine stream and its events."""

    def __init__(self, ws: Workspace, hidden: int, dtype: torch.dtype, launch: kernels.HtLaunch,
                 emulated: bool) -> None:
        R, rank = ws.world_size, ws.rank
        self.rank, self.world_size, self.emulated = rank, R, emulated
        self._peers = [(rank + 1 + q) % R for q in range(R - 1)]  # stage row q holds peer (rank + 1 + q) % R
        # [parity][r]: this rank's rows at rank r ([C, D]) and its partial rows there ([C, D])
        self._rows_at = [[ws.peer("recv_x", r)[parity, rank] for r in range(R)] for parity in range(2)]
        self._comb_at = [[ws.peer("comb", r)[parity, rank] for r in range(R)] for parity in range(2)]
        # [r]: the int32 low word of dispatch_flag[this rank] at rank r (an int64 that only this rank writes,
        # with epochs < 2^31; little-endian), and this rank's row of comb_ready at r (one flag per chunk)
        self._flag_at = [ws.peer("dispatch_flag", r).view(torch.int32)[2 * rank:][:1] for r in range(R)]
        self._ready_at = [ws.peer("comb_ready", r)[rank] for r in range(R)]
        C = ws.local("comb").shape[2]
        rows = launch.combine_copy_chunk(hidden)
        device = ws.local("comb").device
        self._stage_QCD = torch.empty(max(R - 1, 1), C, hidden, dtype=dtype, device=device)
        self._chunks_2RN = torch.zeros(2, R, -(-C // rows), dtype=torch.int32, device=device)
        self._chunk_rows = rows
        if not emulated:
            self._stream = torch.cuda.Stream(device)
            self._start, self._done = torch.cuda.Event(), torch.cuda.Event()

    def send_rows(self, x_TD: torch.Tensor, epoch: int, stream: torch.cuda.Stream | None) -> None:
        """x_TD's rows into every peer's receive region (parity epoch % 2, this rank, row t), then epoch
        into the peer's dispatch flag of this rank. GPU: on the engine stream, after the work queued so
        far on `stream` (x_TD's producer); `join` makes a stream wait for it. Emulated: now."""
        T = x_TD.shape[0]
        rows_at = self._rows_at[epoch % 2]
        if self.emulated:
            for r in self._peers:
                rows_at[r][:T].copy_(x_TD)
                self._flag_at[r].fill_(epoch)
            return
        self._start.record(stream)
        self._stream.wait_event(self._start)
        nbytes = x_TD.numel() * x_TD.element_size()
        for r in self._peers:
            if nbytes:
                cuda_driver.copy(self._stream, rows_at[r].data_ptr(), x_TD.data_ptr(), nbytes)
            cuda_driver.write_value(self._stream, self._flag_at[r].data_ptr(), epoch)
        x_TD.record_stream(self._stream)
        self._done.record(self._stream)

    def own_rows(self, epoch: int) -> torch.Tensor:
        """[C, D]: this rank's own receive region of parity epoch % 2 (rows from itself)."""
        return self._rows_at[epoch % 2][self.rank]

    def combine(self, recv_rows_R: tuple[int, ...]) -> kernels.CombineCopy:
        """What the combine kernel of a dispatch that received recv_rows_R[r] rows from rank r needs."""
        return kernels.CombineCopy(stage_QCD=self._stage_QCD, chunks_2RN=self._chunks_2RN, rows=self._chunk_rows,
                                   recv_rows_R=recv_rows_R)

    def send_partials(self, copy: kernels.CombineCopy, epoch: int) -> None:
        """After the combine kernel (launched with `copy`) is queued: each peer r's chunks of partial
        rows (copy.recv_rows_R[r] rows: the tokens r sent here), chunk k once the kernel has stamped it
        with epoch, into r's combine region (parity epoch % 2, this rank), then epoch into r's ready
        flag of chunk k; the chunks of all peers in turn, first ones first. GPU: on the engine stream
        (`join` waits for it). Emulated: now, RuntimeError if the kernel left a chunk unstamped."""
        S, stage, stamps, recv_rows_R = copy.rows, copy.stage_QCD, copy.chunks_2RN[0], copy.recv_rows_R
        C, row_bytes = stage.shape[1], stage.shape[2] * stage.element_size()
        comb_at = self._comb_at[epoch % 2]
        for k in range(-(-max((recv_rows_R[r] for r in self._peers), default=0) // S)):
            for q, r in enumerate(self._peers):
                lo = k * S
                n = min(S, recv_rows_R[r] - lo)
                if n <= 0:
                    continue
                if self.emulated:
                    if int(stamps[r, k]) != epoch:
                        raise RuntimeError(f"combine kernel left chunk {k} of rank {r} unstamped "
                                           f"({int(stamps[r, k])}, epoch {epoch})")
                    comb_at[r][lo:lo + n].copy_(stage[q, lo:lo + n])
                    self._ready_at[r][k].fill_(epoch)
                    continue
                # addresses computed here: a view per call costs more host time than the copy's enqueue
                cuda_driver.wait_value(self._stream, stamps.data_ptr() + 4 * (r * stamps.shape[1] + k), epoch)
                cuda_driver.copy(self._stream, comb_at[r].data_ptr() + lo * row_bytes,
                                 stage.data_ptr() + (q * C + lo) * row_bytes, n * row_bytes)
                cuda_driver.write_value(self._stream, self._ready_at[r].data_ptr() + 4 * k, epoch)
        if not self.emulated:
            self._done.record(self._stream)

    def join(self, stream: torch.cuda.Stream | None) -> None:
        """Make `stream` wait for the engine stream's work queued so far (GPU; emulated: nothing)."""
        if not self.emulated:
            stream.wait_event(self._done)
