"""When and on which stream the parts of an `ht` dispatch run, chosen once at construction (`Schedule`).

- `SyncFree`: no host sync anywhere (CUDA-graph capturable): the numbering, then the rows, on the calling
  stream; the receive waits for the rows and lays the batch out there, sized for the worst case.
- `InTurn`: ranks emulated in one process, host-synced: as SyncFree, and the host reads the batch size
  once the layout has run.
- `Overlapped`: a process group, host-synced: the numbering and the rows on the calling stream, and
  while the rows travel a side stream lays the batch out (its first kernel spins until every rank has
  numbered its pairs and writes the batch size to pinned host memory, where the host polls for it); the
  receive makes the calling stream wait for the rows and the side stream.
- `RowsFirst`: Overlapped in dense mode: the rows go first, on the calling stream; the numbering (and,
  with the copy engine, this rank's own rows) run on the side stream beside them.

Shape letters: T tokens on this rank, K top-k, R ranks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ...kernels.ht import send as kernels
from .handles import HtDispatchPending, HtEarly, HtEarlySlot
from .layout import HtLayout, SizeWords, lay_out
from .transport import DenseRows, RowTransport
from .workspace import HtSetup


class Schedule(ABC):
    """A dispatch's order of work over the streams, and how the host learns the batch size.

    calls: dispatches whose numbering was queued (the device epoch counts them too: dense mode takes the
        receive buffers' parity from it, and the host reads the batch size of that epoch).
    sizes: the batch size words the layout writes."""

    def __init__(self, setup: HtSetup, transport: RowTransport) -> None:
        self.setup, self.transport = setup, transport
        self.calls = 0
        self.sizes = SizeWords(setup.device, setup.buffers.rank, setup.wait)

    @abstractmethod
    def send(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, chunks: int
             ) -> HtDispatchPending:
        """Number the pairs and send the rows (inputs checked, contiguous, weights float32)."""

    @abstractmethod
    def wait_for_rows(self) -> None:
        """The calling stream's part of the wait for every rank's rows."""

    @abstractmethod
    def layout_ready(self, pending: HtDispatchPending) -> HtLayout:
        """The batch's layout, the calling stream waiting for it."""

    @abstractmethod
    def batch_size(self, pending: HtDispatchPending) -> tuple[int, int | None]:
        """(the batch's rows, the largest chunk count of any rank's caller, or None where none is read)."""

    def _number(self, ids_TK: torch.Tensor, weights_TK: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """number_pairs on the current stream: (slot_TR, epoch_1); this call's epoch on the device is the
        previous one + 1 (graph-replayable)."""
        s = self.setup
        return kernels.number_pairs(s.buffers, ids_TK, weights_TK, s.num_local_experts, dense=self.transport.dense,
                                    chunks=chunks)


class _InStream(Schedule):
    """Everything on the calling stream: the numbering, then the rows; the wait for them, then the layout."""

    def send(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, chunks: int
             ) -> HtDispatchPending:
        calls = self.calls + 1
        slot_TR, epoch_1 = self._number(ids_TK, weights_TK, chunks)
        self.calls = calls
        epoch = self._host_epoch(epoch_1)
        self.transport.send(x_TD, slot_TR, epoch)
        return HtDispatchPending(slot_TR=slot_TR, epoch_1=epoch_1, epoch=epoch, early=None, num_tokens=x_TD.shape[0])

    def wait_for_rows(self) -> None:
        self.transport.wait()

    def layout_ready(self, pending: HtDispatchPending) -> HtLayout:
        return lay_out(self.setup, pending.epoch_1, self.sizes.word(pending.epoch))

    @abstractmethod
    def _host_epoch(self, epoch_1: torch.Tensor) -> int | None:
        """This call's epoch on the host."""


class SyncFree(_InStream):
    """No host sync: the batch has max_recv_rows rows (valid ones end at offsets_L1[L]); no chunk count."""

    def _host_epoch(self, epoch_1: torch.Tensor) -> None:
        return None

    def batch_size(self, pending: HtDispatchPending) -> tuple[int, None]:
        return self.setup.max_recv_rows, None


class InTurn(_InStream):
    """Emulated ranks: the host reads the device epoch (CPU tensors: no sync) and, once the layout has run,
    the batch size."""

    def _host_epoch(self, epoch_1: torch.Tensor) -> int:
        return int(epoch_1)

    def batch_size(self, pending: HtDispatchPending) -> tuple[int, int]:
        return self.sizes.read(pending.epoch)


class Overlapped(Schedule):
    """A process group, host-synced: the layout on a side stream while the rows travel.

    The side stream's work is queued after the rows' kernel, so that its launches do not hold that back.
    The layout's tensors are allocated on the side stream and read on the calling stream (after the
    slot's `ready`): when they are freed, the side stream may reuse their memory at once, which is safe
    because all its later work starts after an event a later dispatch records on the calling stream after
    everything queued there before (`numbered`; dense mode: `_inputs_ready`, which the side stream waits
    for)."""

    def __init__(self, setup: HtSetup, transport: RowTransport) -> None:
        super().__init__(setup, transport)
        self.side = torch.cuda.Stream(setup.device)
        self.slots = [HtEarlySlot(numbered=torch.cuda.Event(), ready=torch.cuda.Event()) for _ in range(2)]

    @property
    def rows_stream(self) -> torch.cuda.Stream | None:
        """The stream that waits for the rows: the side stream (transport.waits_on_side_stream), else
        None (the calling stream)."""
        return self.side if self.transport.waits_on_side_stream else None

    def send(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, chunks: int
             ) -> HtDispatchPending:
        calls = self.calls + 1
        slot_TR, epoch_1 = self._number(ids_TK, weights_TK, chunks)
        self.calls = calls
        slot = self.slots[calls % 2]
        slot.numbered.record(torch.cuda.current_stream(self.setup.device))
        self.transport.send(x_TD, slot_TR, calls)
        self.side.wait_event(slot.numbered)
        return HtDispatchPending(slot_TR=slot_TR, epoch_1=epoch_1, epoch=calls,
                                 early=self._start_early(slot, epoch_1, calls), num_tokens=x_TD.shape[0])

    def _start_early(self, slot: HtEarlySlot, epoch_1: torch.Tensor, epoch: int) -> HtEarly:
        """On the side stream, after the numbering (queued there or waited for), while the rows travel:
        the batch's layout (and size, to the host), once every rank's numbering has signalled (its counts,
        ids and weights are here); where the side stream waits for the rows, then that wait; then
        `slot.ready`."""
        with torch.cuda.stream(self.side):
            layout = lay_out(self.setup, epoch_1, self.sizes.word(epoch))
            if self.transport.waits_on_side_stream:
                self.transport.wait()
            slot.ready.record(self.side)
        epoch_1.record_stream(self.side)
        return HtEarly(slot=slot, layout=layout)

    def wait_for_rows(self) -> None:
        if not self.transport.waits_on_side_stream:
            self.transport.wait()

    def layout_ready(self, pending: HtDispatchPending) -> HtLayout:
        torch.cuda.current_stream(self.setup.device).wait_event(pending.early.slot.ready)
        return pending.early.layout

    def batch_size(self, pending: HtDispatchPending) -> tuple[int, int]:
        return self.sizes.poll(pending.epoch, pending.early.slot.ready)


class RowsFirst(Overlapped):
    """Overlapped in dense mode: the rows go first, on the calling stream (row t to row t at every rank,
    then the flags): queued behind an event on a stream of its own, the copy engine's copy started ~10 µs
    after the event's work on H200. The side stream meanwhile numbers the pairs (the epoch: `calls`, the
    host's count, is the device's), copies this rank's own rows on the SMs (copy engine) and makes the
    layout; the calling stream waits for the numbering and own rows (so that x_TD is the caller's again
    after dispatch_send, in stream order, and the wait for the rows reads this call's epoch).

    The peers have this call's rows and flags before the numbering is queued: if queueing it fails, the
    dispatcher is marked failed (the error flag of a wait that gave up) before the exception goes on, so
    that no later call mistakes those for a complete dispatch."""

    transport: DenseRows

    def __init__(self, setup: HtSetup, transport: DenseRows) -> None:
        super().__init__(setup, transport)
        self._inputs_ready, self._side_done = torch.cuda.Event(), torch.cuda.Event()

    def send(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, chunks: int
             ) -> HtDispatchPending:
        calls = self.calls + 1
        stream = torch.cuda.current_stream(self.setup.device)
        self._inputs_ready.record(stream)
        self.transport.send_first(x_TD, calls, stream)
        self.side.wait_event(self._inputs_ready)
        slot = self.slots[calls % 2]
        try:
            with torch.cuda.stream(self.side):
                slot_TR, epoch_1 = self._number(ids_TK, weights_TK, chunks)
                self.calls = calls
                self.transport.copy_own(x_TD, calls)
                self._side_done.record(self.side)
        except BaseException:
            self.setup.wait.err_1.fill_(1)  # (on the stream: after the flags it poisons)
            raise
        for t in (x_TD, ids_TK, weights_TK):  # the caller's, read on the side stream
            t.record_stream(self.side)
        for t in (slot_TR, epoch_1):  # made on the side stream, read on the stream (combine, the wait)
            t.record_stream(stream)
        stream.wait_event(self._side_done)
        return HtDispatchPending(slot_TR=slot_TR, epoch_1=epoch_1, epoch=calls,
                                 early=self._start_early(slot, epoch_1, calls), num_tokens=x_TD.shape[0])
