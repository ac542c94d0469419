"""A CUDA graph's inputs and output by address: kernels that read a call's tensors through a small device
table of their addresses, so that a replay costs the host one 72-byte copy instead of a copy per tensor.

A graph captured around `stage` and `unstage` reads whatever tensors the table names at replay time: the
host writes their addresses, row strides and token count into the table (`IOTable.point`: one
host-to-device copy queued on the stream, ahead of the replay) and replays. `stage` copies the call's
T rows of x, ids and weights into the bucket's static inputs and sets the ids of rows [T, B) to -1 (they
route nowhere); `unstage` copies the first T rows of the graph's output into the caller's output tensor.

Shape letters: B the bucket's tokens, T the call's (T <= B), D hidden size, K top-k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..symm import indexed_device
from .layout import GATHER_COLUMNS, GATHER_ELEMENTS, GATHER_WARPS

# The table's int64 slots (`IOTable.point` writes them in this order): each tensor's address and row
# stride (elements), then T.
X, X_STRIDE, IDS, IDS_STRIDE, W, W_STRIDE, OUT, OUT_STRIDE, TOKENS = (tl.constexpr(i) for i in range(9))
SLOTS = 9


@triton.jit
def _stage_kernel(table_ptr, x_ptr, ids_ptr, w_ptr, B, D, K: tl.constexpr, K_BLOCK: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, c): rows [i * ROWS, (i + 1) * ROWS) of the static inputs, x's columns
    [c * BLOCK_D, (c + 1) * BLOCK_D); the programs of column block 0 also take the rows' ids and weights."""
    T = tl.load(table_ptr + TOKENS)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = r < T
    src_x = tl.load(table_ptr + X).to(tl.pointer_type(x_ptr.dtype.element_ty))
    x_stride = tl.load(table_ptr + X_STRIDE)
    m = live[:, None] & (c < D)[None, :]
    rows = tl.load(src_x + r.to(tl.int64)[:, None] * x_stride + c[None, :], mask=m)
    tl.store(x_ptr + r.to(tl.int64)[:, None] * D + c[None, :], rows, mask=m)
    if tl.program_id(1) == 0:
        k = tl.arange(0, K_BLOCK)
        inside = (r < B)[:, None] & (k < K)[None, :]
        mk = live[:, None] & inside
        src_ids = tl.load(table_ptr + IDS).to(tl.pointer_type(ids_ptr.dtype.element_ty))
        src_w = tl.load(table_ptr + W).to(tl.pointer_type(w_ptr.dtype.element_ty))
        ids_stride, w_stride = tl.load(table_ptr + IDS_STRIDE), tl.load(table_ptr + W_STRIDE)
        ids = tl.load(src_ids + r.to(tl.int64)[:, None] * ids_stride + k[None, :], mask=mk, other=-1)
        w = tl.load(src_w + r.to(tl.int64)[:, None] * w_stride + k[None, :], mask=mk, other=0.0)
        tl.store(ids_ptr + r.to(tl.int64)[:, None] * K + k[None, :], ids, mask=inside)
        tl.store(w_ptr + r.to(tl.int64)[:, None] * K + k[None, :], w, mask=inside)


@triton.jit
def _unstage_kernel(table_ptr, out_ptr, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, c): rows [i * ROWS, (i + 1) * ROWS) below T of the static output into the caller's."""
    T = tl.load(table_ptr + TOKENS)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (r < T)[:, None] & (c < D)[None, :]
    dst = tl.load(table_ptr + OUT).to(tl.pointer_type(out_ptr.dtype.element_ty))
    rows = tl.load(out_ptr + r.to(tl.int64)[:, None] * D + c[None, :], mask=m)
    tl.store(dst + r.to(tl.int64)[:, None] * tl.load(table_ptr + OUT_STRIDE) + c[None, :], rows, mask=m)


def _tiles(B: int, D: int) -> tuple[int, int, tuple[int, int]]:
    block_d = min(GATHER_COLUMNS, triton.next_power_of_2(max(D, 1)))
    rows = max(1, min(GATHER_ELEMENTS // block_d, triton.next_power_of_2(max(B, 1))))
    return rows, block_d, (triton.cdiv(B, rows), triton.cdiv(D, block_d))


class IOTable:
    """The device table a graph's `stage` and `unstage` read (int64 [SLOTS]), and its host side.

    On a GPU the host writes each call's values into the next row of a ring of RING_ROWS rows of pinned
    memory and queues that row's copy into the table; a row is written again only once the copies of
    its last round have run: each half of the ring, when the host starts it, records an event, and the
    host waits for the other half's (long run by then, unless the host is RING_ROWS / 2 calls ahead of
    the GPU) before writing into a half again. A call on another stream than the last one's first waits
    for the device (the events order only their own stream).

    Args:
        device: where the graph runs.
    """

    RING_ROWS = 256

    def __init__(self, device: torch.device) -> None:
        self.device = indexed_device(device)
        self.table = torch.zeros(SLOTS, dtype=torch.int64, device=device)
        if self.device.type == "cuda":
            self._ring = torch.zeros(self.RING_ROWS, SLOTS, dtype=torch.int64, pin_memory=True)
            self._ring_rows = list(self._ring)
            self._ring_np = self._ring.numpy()
            self._halves: list[torch.cuda.Event | None] = [None, None]
            self._next = 0
            self._stream: int | None = None

    def point(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, out_TD: torch.Tensor) -> None:
        """Point the table at these tensors (rows with unit column stride, on the table's device): on a GPU
        a copy queued on the current stream from the ring's next row, so the next replay queued reads
        from and writes to them."""
        values = (x_TD.data_ptr(), x_TD.stride(0), ids_TK.data_ptr(), ids_TK.stride(0), weights_TK.data_ptr(),
                  weights_TK.stride(0), out_TD.data_ptr(), out_TD.stride(0), x_TD.shape[0])
        if self.device.type != "cuda":
            self.table.numpy()[:] = values
            return
        row = self._next_row()
        self._ring_np[row] = values
        self.table.copy_(self._ring_rows[row], non_blocking=True)

    def _next_row(self) -> int:
        """The ring row to write, once the copies that last read it have run (see the class docstring)."""
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        if stream != self._stream:
            if self._stream is not None:
                torch.cuda.synchronize(self.device)
            self._stream, self._halves = stream, [None, None]
        row = self._next
        self._next = (row + 1) % self.RING_ROWS
        half = self.RING_ROWS // 2
        if row % half == 0:
            h = row // half
            if self._halves[1 - h] is not None:
                self._halves[1 - h].synchronize()  # recorded after every copy of this half's last round
            self._halves[h] = torch.cuda.Event()
            self._halves[h].record(torch.cuda.current_stream(self.device))  # (the copies' stream)
        return row

    def stage(self, x_BD: torch.Tensor, ids_BK: torch.Tensor, weights_BK: torch.Tensor) -> None:
        """Copy the pointed-to call's T rows into the static inputs (contiguous, B rows); ids of rows
        [T, B) to -1 and their weights to 0."""
        B, D = x_BD.shape
        K = ids_BK.shape[1]
        rows, block_d, grid = _tiles(B, D)
        _stage_kernel[grid](self.table, x_BD, ids_BK, weights_BK, B, D, K=K, K_BLOCK=triton.next_power_of_2(K),
                            ROWS=rows, BLOCK_D=block_d, num_warps=GATHER_WARPS)

    def unstage(self, out_BD: torch.Tensor) -> None:
        """Copy the first T rows of out_BD (contiguous) into the pointed-to output."""
        B, D = out_BD.shape
        rows, block_d, grid = _tiles(B, D)
        _unstage_kernel[grid](self.table, out_BD, D, ROWS=rows, BLOCK_D=block_d, num_warps=GATHER_WARPS)


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t [N, C] with unit column stride (a copy only where it has another)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()

