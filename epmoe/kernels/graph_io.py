"""A CUDA graph's inputs and output by address: kernels that read a call's tensors through a small table
of their addresses, so that a replay costs the host a 72-byte write into its own memory instead of a copy
per tensor (or any CUDA call beside the replay).

A graph captured around `stage` and `unstage` reads whatever tensors the table names at replay time: the
host writes their addresses, row strides and token count into the next row of a ring in pinned host
memory (`IOTable.point`) and replays. `stage` first reads the row of its call from host memory into a
device table (one program: the ring row a device counter of the calls run so far names; every program
reading host memory itself made the copy kernel ~4x slower on the H200), then copies the call's T rows
of x, ids and weights into the bucket's static inputs and sets the ids of rows [T, B) to -1 (they route
nowhere); `unstage` copies the first T rows of the graph's output into the caller's output tensor and
counts the call. Host and device thus walk the ring in step: every
`point` must be followed by one `stage` and one `unstage` (a replay that fails to queue is undone by
`IOTable.abandon`).

Shape letters: B the bucket's tokens, T the call's (T <= B), D hidden size, K top-k.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ..symm import indexed_device
from .layout import GATHER_COLUMNS, GATHER_ELEMENTS, GATHER_WARPS

# A row's int64 slots (`IOTable.point` writes them in this order): each tensor's address and row stride
# (elements), then T; SLOT_BLOCK: the power of two the kernels read a row as.
X, X_STRIDE, IDS, IDS_STRIDE, W, W_STRIDE, OUT, OUT_STRIDE, TOKENS = (tl.constexpr(i) for i in range(9))
SLOTS = 9
_SLOTS_C = tl.constexpr(SLOTS)
SLOT_BLOCK = tl.constexpr(16)
_ROW = struct.Struct(f"={SLOTS}q")  # a row as the host writes it: native int64s, no padding


@triton.jit
def _fetch_kernel(ring_addr, counter_ptr, table_ptr, RING: tl.constexpr):
    """One program: the call's ring row (ring_addr: the ring's address, in host memory on a GPU; the row
    the counter names) into the device table."""
    offs = tl.arange(0, SLOT_BLOCK)
    src = ring_addr.to(tl.pointer_type(tl.int64)) + (tl.load(counter_ptr) % RING) * _SLOTS_C
    row = tl.load(src + offs, mask=offs < _SLOTS_C, other=0, volatile=True)  # written by the host since the last call
    tl.store(table_ptr + offs, row, mask=offs < _SLOTS_C)


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
def _unstage_kernel(counter_ptr, table_ptr, out_ptr, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, c): rows [i * ROWS, (i + 1) * ROWS) below T of the static output into the caller's;
    program (0, 0) also counts the call (the next `_stage_kernel` reads the next ring row)."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(counter_ptr, tl.load(counter_ptr) + 1)
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
    """The ring of call rows a graph's `stage` reads, the device counter and table beside it, and the
    host side.

    The host writes each call's values into the next of RING_ROWS rows (int64 [SLOTS]) of the ring,
    pinned host memory on a GPU that the kernels read in place; a row is written again only once the
    call that last read it has run: each half of the ring, when the host starts it, records an event,
    and the host waits for the other half's (long run by then, unless the host is RING_ROWS / 2 calls
    ahead of the GPU) before writing into a half again. A call on another stream than the last one's
    first waits for the device (the events order only their own stream, and the calls must run in the
    order the host wrote their rows).

    Args:
        device: where the graph runs.
    """

    RING_ROWS = 256

    def __init__(self, device: torch.device) -> None:
        self.device = indexed_device(device)
        self._index = self.device.index
        on_gpu = self.device.type == "cuda"
        self.table = torch.zeros(SLOTS, dtype=torch.int64, device=self.device)  # the running call's row
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)  # calls unstaged so far
        self._ring = torch.zeros(self.RING_ROWS, SLOTS, dtype=torch.int64, pin_memory=on_gpu)
        self._ring_bytes = memoryview(self._ring.numpy()).cast("B")  # (written through, as one row's bytes)
        self._written = 0  # rows the host has written (calls pointed)
        self._halves: list[torch.cuda.Event | None] = [None, None]
        self._stream: int | None = None

    def point(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, out_TD: torch.Tensor) -> None:
        """Point the next call's row at these tensors (rows with unit column stride, on the table's
        device): the next `stage` queued reads from them and the next `unstage` writes to out_TD."""
        values = (x_TD.data_ptr(), x_TD.stride()[0], ids_TK.data_ptr(), ids_TK.stride()[0], weights_TK.data_ptr(),
                  weights_TK.stride()[0], out_TD.data_ptr(), out_TD.stride()[0], x_TD.shape[0])
        _ROW.pack_into(self._ring_bytes, self._next_row() * _ROW.size, *values)  # (the row taken once all are read)

    def abandon(self) -> None:
        """Forget the last pointed call, which will never run (its replay failed to queue): waits for
        the device, then sets the counter to the rows written, so that the next call reads its own."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with torch.inference_mode():  # (a counter made in inference mode takes writes only there)
            self.counter.fill_(self._written)

    def _next_row(self) -> int:
        """The ring row to write, once the call that last read it has run (see the class docstring)."""
        row = self._written % self.RING_ROWS
        self._written += 1
        if self.device.type != "cuda":
            return row  # (the interpreter runs each kernel as it is launched)
        stream = torch._C._cuda_getCurrentRawStream(self._index)
        if stream != self._stream:
            if self._stream is not None:
                torch.cuda.synchronize(self.device)
            self._stream, self._halves = stream, [None, None]
        half = self.RING_ROWS // 2
        if row % half == 0:
            h = row // half
            if self._halves[1 - h] is not None:
                self._halves[1 - h].synchronize()  # recorded after every call of this half's last round
            self._halves[h] = torch.cuda.Event()
            self._halves[h].record(torch.cuda.current_stream(self.device))
        return row

    def stage(self, x_BD: torch.Tensor, ids_BK: torch.Tensor, weights_BK: torch.Tensor) -> None:
        """Copy the pointed-to call's T rows into the static inputs (contiguous, B rows); ids of rows
        [T, B) to -1 and their weights to 0."""
        B, D = x_BD.shape
        K = ids_BK.shape[1]
        rows, block_d, grid = _tiles(B, D)
        _fetch_kernel[(1, )](self._ring.data_ptr(), self.counter, self.table, RING=self.RING_ROWS, num_warps=1)
        _stage_kernel[grid](self.table, x_BD, ids_BK, weights_BK, B, D, K=K, K_BLOCK=triton.next_power_of_2(K),
                            ROWS=rows, BLOCK_D=block_d, num_warps=GATHER_WARPS)

    def unstage(self, out_BD: torch.Tensor) -> None:
        """Copy the first T rows of out_BD (contiguous) into the pointed-to output."""
        B, D = out_BD.shape
        rows, block_d, grid = _tiles(B, D)
        _unstage_kernel[grid](self.counter, self.table, out_BD, D, ROWS=rows, BLOCK_D=block_d,
                              num_warps=GATHER_WARPS)


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t [N, C] with unit column stride (a copy only where it has another)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()

