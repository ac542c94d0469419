"""The front of the `ht` dispatcher: options, validation, the public phases; the work is done by the
strategy objects it picks at construction (see epmoe/dispatch/ht/__init__.py).

Shape letters: T tokens on this rank, D hidden size, K top-k, L local experts, R ranks, C capacity
(cfg.max_tokens_per_rank), N rows of the expert batch, G = ceil(D / 128).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ... import cuda_driver
from ...config import MoEConfig
from ...interfaces import Dispatcher, ExpertBatch, Layout, check_tokens
from ...kernels.ht.launch import HtLaunch, ht_launch
from ...kernels.ht.layout import MAX_CHUNKS
from ...kernels.layout import layout_blocks
from ...kernels.sync import DeviceWait, timeout_ns
from ...quant import num_groups
from ...symm import WorkspaceBackend, agree_construction, indexed_device, symmetric_world, workspace_backend
from .combine import Combine, FusedCombine, SplitCombine
from .copy_engine import CopyEngine, CopyEngineRows, EmulatedCopyEngine
from .handles import HtCombinePending, HtDispatchPending, HtHandle
from .layout import HtLayout
from .schedule import InTurn, Overlapped, RowsFirst, Schedule, SyncFree
from .transport import DenseRows, RowTransport, SentRows
from .workspace import HtSetup, ht_buffers, ht_specs

# dense=None turns dense mode on when a uniform routing sends at least this share of a rank's tokens to
# each rank (the rest of its rows cross the link in vain)
DENSE_MIN_SHARE = 0.95


def dense_pays(world_size: int, top_k: int) -> bool:
    """Whether a uniform routing of top_k distinct experts sends at least DENSE_MIN_SHARE of a rank's
    tokens to each other rank (1 - (1 - 1/R)^K), so that sending every row to every rank (dense mode)
    wastes little of the link."""
    return world_size > 1 and 1 - (1 - 1 / world_size) ** top_k >= DENSE_MIN_SHARE


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class HtDispatcher(Dispatcher):
    """NVLink dispatcher over symmetric memory; contiguous expert-sorted output.

    Options:
        sync_free: False (default): one host sync per dispatch, to size the batch to its valid rows.
            True makes a SyncFreeHtDispatcher: no host sync anywhere (CUDA-graph capturable when driven
            through the phase methods or dispatch/combine): the batch has R*C*K rows (max_recv_rows),
            valid ones end at offsets_L1[L].
        device: where buffers live; default the current CUDA device for a process group, the CPU for
            an EmulatedGroup.
        launch: the kernels' launch settings (epmoe.kernels.ht.HtLaunch), the same on every rank;
            default `ht_launch` for the row size and device. Fixed for the dispatcher's lifetime.
        dense: every token's row goes to row t of every rank's receive region, before the numbering
            (which then runs beside the rows' transfer), also where the token has no expert (its
            partial row comes back too: zeros); False: the rows follow the numbering and go only where
            they have an expert. None (default): on when that costs little: not sync_free, and a
            uniform routing sends at least DENSE_MIN_SHARE of the tokens to each rank (`dense_pays`,
            1 - (1 - 1/R)^K: R 2 with K >= 5, R 3 with K >= 8). Needs sync_free False (the send takes
            the receive buffers' parity from the host's count of calls). The attribute `dense` says
            which mode a dispatcher is in.
        copy_engine: in dense mode, move the rows with the GPU's copy engine (a copy into each peer's
            receive region, all T rows in token order, then the epoch into the peer's flag) instead of
            the send kernel's SM stores: faster on the link (measured 370 vs 350 GB/s per direction on
            2 H200s) and no SM busy with the rows. None (default): on in dense mode for a process group
            and bf16 rows where the GPU has 64-bit stream memory operations (cuda_driver.can_write_value).
            True needs dense mode, cfg.quant None and those operations.
        wait_timeout_s: how long a device-side wait spins for the peers' signal before it gives up and
            sets the error flag (`timed_out()`); later waits then return at once with garbage results
            until the dispatcher is rebuilt, and the next host-synced dispatch raises RuntimeError
            (sync_free mode: check `timed_out()`). A hang guard only: no healthy call waits that long.

    Construction is collective over a process group: first of all the ranks' config fingerprints and
    options (sync_free, launch, dense, copy_engine: what sizes the buffers) are all-gathered, and a rank
    built otherwise is refused with ValueError on every rank (`symm.agree_construction`); then the
    checks and the symmetric allocation.

    Host-synced mode (sync_free False) cannot be captured in a CUDA graph: the host reads each batch's
    size, and tracks the epoch. It also agrees chunk counts (`agrees_chunks`, see
    Dispatcher.dispatch_checked): each rank's count, below MAX_CHUNKS (2**24), travels with its
    dispatch, and `agreed_chunks(batch)` is the largest, read with the batch size (a rank that passed
    none, e.g. through `dispatch`, counts as 1).

    Needs rows of a multiple of 16 bytes (D * itemsize; with fp8 dispatch also D itself), E divisible
    by R, 1 <= R <= 8 ranks on one host (or an EmulatedGroup).

    Phases (public so that emulated ranks can run them in turn, and for overlap of the dispatch):
        dispatch_send -> dispatch_recv -> (experts) -> combine_send -> combine_recv.
    Over a process group combine_send runs the whole combine (one kernel) and combine_recv returns its
    output; emulated ranks run its remote half in combine_send and its local half in combine_recv.
    T may differ per rank and be 0; T <= cfg.max_tokens_per_rank. The batch's x views the receive
    buffer through its row_index_N: its rows are valid until the batch is combined, the experts must
    run on the stream that then calls combine, and at most two dispatches may be in flight (not yet
    combined) per dispatcher (not checked: a third overwrites the first one's rows).

    Streams (host-synced mode over a process group): dispatch_send also queues, on an internal side
    stream, the layout kernels (the first spins until every rank has numbered its pairs and writes the
    batch size to pinned host memory) and, with the copy engine, then the wait for every rank's rows
    (one program spinning); dispatch_recv polls for the size there and makes the calling stream wait
    for the rows and the side stream. In dense mode the calling stream
    carries the rows (copies or the send kernel) and the numbering (and this rank's own rows, copied
    on the SMs beside the copy engine's) go to the side stream too. Call the phases from one stream. The
    combine kernel's programs can all wait (spinning) for peers' partial rows: do not run the combines
    of two ht dispatchers at once on different streams of a GPU (each could hold every SM while
    waiting for the other's peers). The layout's count kernel also spins, one program per block of
    received rows, until the peers have numbered their pairs: a late peer keeps those programs on the
    SMs meanwhile. A kernel's first launch in a new build (Triton specializes int arguments such as T
    on == 1 and divisibility by 16) loads its module, which waits for the kernels running on the GPU:
    such a call's host can stall until a spinning kernel of an earlier call ends (it ends: it waits
    for work the peers queued before); calls at shapes seen before do not.

    Modes, each a strategy object picked once here: the schedule (epmoe/dispatch/ht/schedule.py:
    SyncFree, InTurn for emulated ranks, Overlapped / RowsFirst for a process group), the rows'
    transport (transport.py, copy_engine.py) and the combine (combine.py: FusedCombine, SplitCombine for
    emulated ranks, which run in turn).
    """

    name = "ht"
    layout = Layout.CONTIGUOUS
    supports_fp8_dispatch = True
    needs_host_sync: ClassVar[bool] = True
    agrees_chunks: ClassVar[bool] = True
    sync_free: ClassVar[bool] = False

    def __new__(cls, cfg: MoEConfig, group=None, *, sync_free: bool | None = None, **options) -> "HtDispatcher":
        if sync_free and cls is HtDispatcher:
            cls = SyncFreeHtDispatcher
        return super().__new__(cls)

    @classmethod
    def availability(cls, cfg: MoEConfig, group) -> tuple[bool, str]:
        world, reason = symmetric_world(cfg, group)
        if not world:
            return False, reason
        if cfg.row_bytes % 16:
            return False, f"rows of hidden_size={cfg.hidden_size} x {cfg.dtype} are {cfg.row_bytes} bytes, " \
                          f"not a multiple of 16"
        if cfg.quant == "fp8_block" and cfg.hidden_size % 16:
            return False, f"fp8 rows of hidden_size={cfg.hidden_size} are {cfg.hidden_size} bytes, not a multiple of 16"
        return True, "ok"

    def __init__(self, cfg: MoEConfig, group=None, *, sync_free: bool | None = None,
                 device: torch.device | str | None = None, launch: HtLaunch | None = None,
                 dense: bool | None = None, copy_engine: bool | None = None, wait_timeout_s: float = 60.0) -> None:
        agree_construction("ht", cfg, group, (self.sync_free, launch, dense, copy_engine))  # (what sizes the buffers)
        available, reason = self.availability(cfg, group)
        if not available:
            raise ValueError(f"dispatcher 'ht': {reason}")
        if sync_free is not None and bool(sync_free) != self.sync_free:
            raise ValueError(f"{type(self).__name__} takes no sync_free={sync_free!r}")
        wait_ns = timeout_ns(wait_timeout_s)
        super().__init__(cfg, group)
        backend = workspace_backend(group)
        self.device = indexed_device(backend.default_device if device is None else device)
        self.fp8 = cfg.quant == "fp8_block"
        self.capacity = cfg.max_tokens_per_rank
        # Fixed for the dispatcher's lifetime: the flags count one signal per sending program and call.
        self.launch = ht_launch(cfg.row_bytes, self.device) if launch is None else launch
        # (checked before the collective allocation)
        self.dense = self._wants_dense(dense, copy_engine)
        self.copy_engine = self._wants_copy_engine(copy_engine, backend)
        # Emulated ranks: dispatchers of equal config, launch (which sizes the flags and counts the signals)
        # and copy_engine mode (which sets what the flags hold) share one workspace, epochs and flags
        # included, so they act as one dispatcher; the first emulated rank to get here allocates every
        # rank's buffers.
        key = ("ht", cfg, str(self.device), self.launch, self.copy_engine)
        self.ws = backend.workspace(key, ht_specs(cfg, self.world_size, self.launch), self.device)
        buffers = ht_buffers(self.ws)
        self._wait = DeviceWait(err_1=buffers.control[2:], timeout_ns=wait_ns)
        self._setup = HtSetup(buffers=buffers, launch=self.launch, wait=self._wait,
                              num_local_experts=self.num_local_experts,
                              blocks=layout_blocks(self.capacity, cfg.top_k), device=self.device)
        self._schedule = self._pick_schedule(backend, self._pick_transport(backend))
        self._combine_mode: Combine = (SplitCombine if backend.runs_in_turn else FusedCombine)(self._setup, cfg.dtype)
        # what a batch's row index points into: the receive rows of both parities, [2 * R * C, D] (and G)
        self._recv_rows = buffers.recv_x.view(-1, cfg.hidden_size)
        self._recv_row_scales = buffers.recv_scale.view(-1, num_groups(cfg.hidden_size)) if self.fp8 else None

    def _wants_dense(self, dense: bool | None, copy_engine: bool | None) -> bool:
        if dense is None:
            return not self.sync_free and (bool(copy_engine) or dense_pays(self.world_size, self.cfg.top_k))
        if dense and self.sync_free:
            raise ValueError("dense=True needs sync_free=False: the host tracks the receive buffers' parity, which "
                             "a replayed CUDA graph would not advance")
        return bool(dense)

    def _wants_copy_engine(self, copy_engine: bool | None, backend: WorkspaceBackend) -> bool:
        # the copy engine's flag is a 64-bit stream write, which a GPU may lack (H100 / H200 have it)
        emulated = backend.runs_in_turn
        if copy_engine is None:
            return self.dense and not (self.fp8 or emulated) and cuda_driver.can_write_value(self.device.index)
        if copy_engine and not (emulated or cuda_driver.can_write_value(self.device.index)):
            raise ValueError(f"copy_engine=True needs 64-bit stream memory operations, which {self.device} lacks "
                             "(use copy_engine=False or None)")
        if copy_engine and self.fp8:
            raise ValueError("copy_engine=True moves the rows as they are: fp8 dispatch quantizes them in the send "
                             "kernel (use copy_engine=False or None)")
        if copy_engine and not self.dense:
            raise ValueError("copy_engine=True needs dense mode (all T rows to every rank), which dense=False or "
                             "sync_free=True turns off")
        return bool(copy_engine)

    def _pick_transport(self, backend: WorkspaceBackend) -> RowTransport:
        if self.copy_engine:
            engine = (EmulatedCopyEngine if backend.runs_in_turn else CopyEngine)(self.ws)
            return CopyEngineRows(self._setup, engine)
        return (DenseRows if self.dense else SentRows)(self._setup)

    def _pick_schedule(self, backend: WorkspaceBackend, transport: RowTransport) -> Schedule:
        if self.sync_free:
            return SyncFree(self._setup, transport)
        if backend.runs_in_turn:
            return InTurn(self._setup, transport)
        return RowsFirst(self._setup, transport) if self.dense else Overlapped(self._setup, transport)

    @property
    def max_recv_rows(self) -> int:
        """Rows of the batch in sync_free mode, and of its row index buffer: every received (row, slot)
        pair could be valid (R * C * K; a token may repeat an expert id)."""
        return self._setup.max_recv_rows

    # -- public API -------------------------------------------------------------------------------

    def timed_out(self) -> bool:
        """Whether any device-side wait of this rank gave up (wait_timeout_s without the peers' signal:
        a peer failed, or the ranks' calls do not match). Reads a device flag: a host sync."""
        return self._wait.timed_out()

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> ExpertBatch:
        """See Dispatcher.dispatch. Validation reads the id range on the host unless a CUDA graph is
        being captured; then one more host sync sizes the batch unless sync_free."""
        return self.dispatch_recv(self.dispatch_send(x_TD, ids_TK, weights_TK))

    def dispatch_send(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                      chunks: int = 1) -> HtDispatchPending:
        """Validate, then store this rank's rows into every destination's receive region and signal.

        Inputs as in Dispatcher.dispatch, T <= cfg.max_tokens_per_rank; chunks as in
        Dispatcher.dispatch_checked. Returns without waiting; the side stream's work (see Streams in the
        class docstring) may spin until every rank has sent.
        """
        if _capturing():
            if not self.sync_free:
                raise ValueError("a host-synced 'ht' dispatch cannot be captured in a CUDA graph: the host reads the "
                                 "batch size and tracks the epoch, which a replay would not advance (use "
                                 "sync_free=True)")
            self._check_shapes(x_TD, ids_TK, weights_TK)
        else:
            check_tokens(self.cfg, x_TD, ids_TK, weights_TK)  # host sync: id range
        if x_TD.device != self.device:
            raise ValueError(f"x_TD is on {x_TD.device}, the dispatcher's buffers on {self.device}")
        if x_TD.shape[0] > self.capacity:
            raise ValueError(f"{x_TD.shape[0]} tokens exceed cfg.max_tokens_per_rank={self.capacity}")
        self._check_chunks(chunks)
        return self._dispatch_send(x_TD.contiguous(), ids_TK.contiguous(), weights_TK.float().contiguous(), chunks)

    def dispatch_recv(self, pending: HtDispatchPending) -> ExpertBatch:
        """Wait (on the device) for every rank's rows and the batch's layout (made on the side stream
        during the transfer in host-synced mode over a process group, else now); the expert-sorted batch.

        One host sync (the number of valid rows, known before the rows arrive) unless sync_free.
        """
        self._schedule.wait_for_rows()
        return self._expert_batch(pending, self._schedule.layout_ready(pending))

    def combine_send(self, y: torch.Tensor, batch: ExpertBatch) -> HtCombinePending:
        """Process group: the whole combine (one kernel: each received row's weighted local results go
        back to its source rank; this rank's tokens are summed as their partial rows arrive). Emulated
        ranks: the first half (rows back to their sources). y: [N, D] expert outputs, cfg.dtype."""
        self.check_output(y, batch)
        return self._combine_send(y, batch)

    def combine_recv(self, pending: HtCombinePending) -> torch.Tensor:
        """out_TD [T, D] cfg.dtype: fp32 sums of each token's partial rows (emulated ranks: the second half
        of the combine runs now, once every rank's first half has)."""
        return self._combine_mode.recv(pending)

    # -- phases -----------------------------------------------------------------------------------

    def _check_shapes(self, x_TD, ids_TK, weights_TK) -> None:
        D, K = self.cfg.hidden_size, self.cfg.top_k
        if x_TD.dim() != 2 or x_TD.shape[1] != D or x_TD.dtype != self.cfg.dtype:
            raise ValueError(f"x_TD must be [T, D={D}] {self.cfg.dtype}, got {tuple(x_TD.shape)} {x_TD.dtype}")
        for name, t in (("ids_TK", ids_TK), ("weights_TK", weights_TK)):
            if t.shape != (x_TD.shape[0], K):
                raise ValueError(f"{name} must be [T={x_TD.shape[0]}, K={K}], got {tuple(t.shape)}")

    def _check_chunks(self, chunks: int) -> None:
        if type(chunks) is not int or not 1 <= chunks < MAX_CHUNKS.value:
            raise ValueError(f"chunks must be an int in [1, {MAX_CHUNKS.value}), got {chunks!r}")
        if chunks != 1 and not self.agrees_chunks:
            raise ValueError("a sync_free 'ht' dispatcher agrees no chunk count (its callers make one chunk)")

    def _dispatch_send(self, x_TD, ids_TK, weights_TK, chunks: int = 1) -> HtDispatchPending:
        """dispatch_send of checked inputs (contiguous, weights float32)."""
        return self._schedule.send(x_TD, ids_TK, weights_TK, chunks)

    def _expert_batch(self, pending: HtDispatchPending, lay: HtLayout) -> ExpertBatch:
        """The received rows, sorted by local expert (source rank, slot, k within an expert), as a row
        index into the receive buffer (x views recv_x of both parities as [2 * R * C, D]); no row is
        copied. The host reads the batch size (unless sync_free, `Schedule.batch_size`): it travels ahead
        of the rows (dense mode: beside them), so the host usually has it before the stream has the rows."""
        n, max_chunks = self._schedule.batch_size(pending)
        handle = HtHandle(slot_TR=pending.slot_TR, pos_PK=lay.pos_PK, weights_PK=lay.weights_PK,
                          recv_counts_R=lay.recv_counts_R, num_tokens=pending.num_tokens, max_chunks=max_chunks)
        return ExpertBatch(layout=Layout.CONTIGUOUS, x=self._recv_rows, x_scale=self._recv_row_scales,
                           counts_L=lay.counts_L, offsets_L1=lay.offsets_L1, handle=handle,
                           row_index_N=lay.rows_N[:n])

    def _dispatch(self, x_TD, ids_TK, weights_TK, chunks: int = 1) -> ExpertBatch:
        self._check_chunks(chunks)
        return self.dispatch_recv(self._dispatch_send(x_TD, ids_TK, weights_TK, chunks))

    def _agreed_chunks(self, batch: ExpertBatch) -> int:
        if batch.handle.max_chunks is None:  # a batch of another, sync_free, dispatcher
            raise ValueError("batch comes from a sync_free 'ht' dispatcher, which agrees no chunk count")
        return batch.handle.max_chunks

    def _combine_send(self, y: torch.Tensor, batch: ExpertBatch) -> HtCombinePending:
        if not isinstance(batch.handle, HtHandle):
            raise ValueError("batch was not produced by an 'ht' dispatcher")
        return self._combine_mode.send(y.contiguous(), batch.handle)

    def _combine(self, y: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        """Dispatcher.combine (outputs checked there): combine_send and combine_recv."""
        return self.combine_recv(self._combine_send(y, batch))


class SyncFreeHtDispatcher(HtDispatcher):
    """`HtDispatcher(cfg, group, sync_free=True)`: the ht dispatcher with no host sync anywhere, CUDA-graph
    capturable; its batch has max_recv_rows rows (valid ones end at offsets_L1[L]); it agrees no chunk
    count (FusedMoE then runs one chunk, T <= cfg.max_tokens_per_rank); no dense mode."""

    needs_host_sync = False
    agrees_chunks = False
    sync_free = True
