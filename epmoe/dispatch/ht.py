"""`ht` dispatcher: high-throughput NVLink dispatch/combine over symmetric memory, no NCCL in the data path.

Dispatch, on the sender: two kernels number its (token, destination rank) pairs with a device prefix
sum and store into every destination, ahead of the rows, the tokens and (token, slot) pairs it will
get, each token's destination-local ids and weights, and its caller's chunk count (FusedMoE's: the
largest comes back to the host with the batch size, so the layer needs no collective to agree on
it), with one signal; then one Triton kernel stores each row once per destination rank
(fp8-quantized on the way when cfg.quant == "fp8_block") straight into that rank's receive region,
and signals. Dense mode (when nearly every token goes to
every rank, see `HtDispatcher`): slot = t, and all T rows go to every rank first (they need no
numbering), the numbering beside them; by the copy engine (bf16: no SM busy with them, then the epoch
into the peer's flag; ht_engine.py) or by the send kernel. On the receiver (host-synced mode, process
group), a side stream waits for the first signal and, while the rows still travel, sorts the received
(row, local expert) pairs by expert, with work proportional to the pairs received (not to the
capacity C); the layout's first kernel writes the batch size through to pinned host memory, where the
host polls for it (no copy or stream sync); the batch is a row index into the
receive buffer (ExpertBatch.row_index_N), so no row is copied again: the `triton` experts read rows
through the index (experts that do not get a materialized copy, see Experts.reads_row_index). The
stream waits (on the device) for every rank's rows (copy engine: the side stream does, after the
layout) and for the side stream.
(Emulated ranks and sync_free mode: no side stream, the receive phase waits for the rows and then
makes the layout.)
Combine: one kernel whose programs take items by ticket. A remote item reduces rows received from a
peer (their local results, fp32, top-k weights) into one row per (token, rank), stored into that peer's
combine region, and stamps the item's ready flag there with the epoch. A local item, handed out about a
wave of tickets later, waits for the ready flags of its tokens' partial rows and writes out[t] = its own
local results (reduced the same way) + the peers' partial rows: the final sum overlaps the transfer, and
this rank's own partial rows never go through memory. (Emulated ranks run the remote items of every rank,
then the local ones.)

Workspace (symmetric, set up once; per-call regions twice, chosen by the parity of a device epoch):
    recv_x [2, R, C, D] (cfg.dtype, or float8_e4m3fn), recv_scale [2, R, C, G] (fp8 only),
    recv_ids int32 [2, R, C, K], recv_w float32 [2, R, C, K], recv_count / pairs / chunks int32 [2, R]
    (tokens and pairs from each rank, and its caller's chunk count), comb [2, R, C, D] cfg.dtype (row
    (r, s): rank r's partial row of this rank's token in slot s there), comb_ready int64 [R, NI]
    (epoch of the latest combine item i that rank r stored here; NI = kernels.combine_items), meta_flag
    / dispatch_flag int64 [R] (monotonic: one add per call from the numbering, per sending program and
    call from the send kernel; copy-engine mode: the epoch, written after the rows), dispatch_seq /
    combine_seq int64 [1] (epochs, incremented on the device; 64 bits, as every flag compared with
    them: an int32 went negative after 2^31 calls, 8 months of a layer called 100 times a second),
    number_done int32 [1] and control int32 [3] (the numbering kernel's finished programs, the
    combine's tickets and finished programs: used locally, back to 0 after each call; control[2]: a
    device-side wait of this rank gave up).
Why two copies suffice: with at most two dispatches not yet combined on every rank, source A's
dispatch n+2 writes only A's own regions ([parity, A, ...]) at each peer B. B reads rows of that region
of call n only for tokens with pairs on B; A's combine n then waited for B's remote combine items of
those tokens (`_wait_partials`), which B ran after its experts on call n (the last reads of those rows,
through the row index), and A's dispatch n+2 follows A's combine n. The region's counts, ids and
weights are read only by B's layout n, which ends before B's dispatch n+1, which A's dispatch n+1
waited for. So a receive region
is never overwritten while a rank still reads it. Likewise a peer's combine n+2 writes this rank's
comb region of parity n only after its dispatch n+2 received this rank's rows of call n+2, sent after
this rank's combine n had read that region; and a ready stamp of a later epoch is released after the
same item of the earlier one, so it also means that item is here. This needs the experts to run on the
stream that later issues the combine (so that the combine follows their reads), and it is not
enforced: a third dispatch before the first one's combine overwrites rows that may still be read. Calls
must alternate send/receive per phase on every rank, and the batch's rows are valid until its combine.

Shape letters: T tokens on this rank, D hidden size, K top-k, L local experts, R ranks, C capacity
(cfg.max_tokens_per_rank), P = R*C receive rows, N rows of the expert batch, G = ceil(D / 128).
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

from .. import cuda_driver
from ..config import MoEConfig
from ..interfaces import Dispatcher, ExpertBatch, Layout, check_tokens
from ..kernels import ht as kernels
from ..kernels.sync import DeviceWait
from ..quant import FP8_DTYPE, num_groups
from .ht_engine import HtCopyEngine
from ..symm import BufferSpec, EmulatedGroup, Workspace, indexed_device, symmetric_world, torch_workspace


@dataclass(frozen=True)
class HtLayout:
    """The expert-sorted layout of one dispatch's batch (device tensors)."""

    counts_L: torch.Tensor  # int32 [L]: rows of each local expert
    offsets_L1: torch.Tensor  # int32 [L+1]: their exclusive prefix sum
    pos_PK: torch.Tensor  # int32 [P, K]: batch row of each received (row, slot) pair, -1 none
    weights_PK: torch.Tensor  # float32 [P, K]: their top-k weights
    rows_N: torch.Tensor  # int32 [R*C*K]: each batch row's row in recv_x viewed as [2 * R * C, D]
    recv_counts_R: torch.Tensor  # int32 [R]: rows received from each rank


@dataclass(frozen=True)
class HtEarlySlot:
    """Events of one dispatch's side-stream work (host-synced mode over a process group). A dispatcher
    makes two and uses them in turn: a slot is recorded again two dispatches later, after its
    dispatch's receive has waited for it."""

    numbered: torch.cuda.Event  # recorded on the stream after the numbering kernels (ids and weights sent);
    #   unused in dense mode, whose numbering runs on the side stream
    ready: torch.cuda.Event  # recorded on the side stream after the layout kernels and the wait for every
    #   rank's rows


@dataclass(frozen=True)
class HtEarly:
    """A dispatch's layout and wait for its rows, queued on the side stream while the rows travel."""

    slot: HtEarlySlot
    layout: HtLayout


@dataclass(frozen=True)
class HtDispatchPending:
    """What dispatch_send hands to dispatch_recv (and, through the handle, to combine)."""

    slot_TR: torch.Tensor  # int32 [T, R]: row of token t in rank r's receive region, -1 if not sent
    epoch_1: torch.Tensor  # int64 [1]: the call's epoch
    epoch: int | None  # the same on the host (None in sync_free mode, which does not read the batch size)
    early: HtEarly | None  # host-synced mode over a process group; else the receive makes the layout
    num_tokens: int


@dataclass(frozen=True)
class HtHandle:
    """Routing state of one dispatch, consumed by combine. Holds no view of the workspace."""

    slot_TR: torch.Tensor  # int32 [T, R], as in HtDispatchPending
    pos_PK: torch.Tensor  # int32 [P, K]: batch row of received pair (row p, slot k), -1 if none; rows
    #   p = r * C + s with s >= recv_counts_R[r] are unset (never read)
    weights_PK: torch.Tensor  # float32 [P, K]: top-k weights of the received rows (same validity)
    recv_counts_R: torch.Tensor  # int32 [R]: rows received from each rank
    num_tokens: int
    max_chunks: int | None  # the largest chunk count any rank's caller passed (None: sync_free, not read)


@dataclass(frozen=True)
class HtCombinePending:
    """What combine_send hands to combine_recv: the output, complete unless `local_args` (emulated
    ranks: combine_recv runs the local half of the combine with them)."""

    out_TD: torch.Tensor
    local_args: tuple | None


# dense=None turns dense mode on when a uniform routing sends at least this share of a rank's tokens to
# each rank (the rest of its rows cross the link in vain)
DENSE_MIN_SHARE = 0.95


def dense_pays(world_size: int, top_k: int) -> bool:
    """Whether a uniform routing of top_k distinct experts sends at least DENSE_MIN_SHARE of a rank's
    tokens to each other rank (1 - (1 - 1/R)^K), so that sending every row to every rank (dense mode)
    wastes little of the link."""
    return world_size > 1 and 1 - (1 - 1 / world_size) ** top_k >= DENSE_MIN_SHARE


# how often (seconds) the host's poll for the batch size checks that the layout is still to run (and lets
# other Python threads run)
SIZE_POLL_CHECK_S = 1e-3


def _poll_size(word: ctypes.c_int64, epoch: int, ready: torch.cuda.Event) -> tuple[int, int] | None:
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


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class HtDispatcher(Dispatcher):
    """NVLink dispatcher over symmetric memory; contiguous expert-sorted output.

    Options:
        sync_free: False (default): one host sync per dispatch, to size the batch to its valid rows.
            True: no host sync anywhere (CUDA-graph capturable when driven through the phase methods or
            dispatch/combine): the batch has R*C*K rows (max_recv_rows), valid ones end at offsets_L1[L].
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
            the send kernel's SM stores: faster on the link (370 vs 350 GB/s per direction on 2
            H200s) and no SM busy with the rows. None (default): on in dense mode for a process group
            and bf16 rows where the GPU has 64-bit stream memory operations (cuda_driver.can_write_value).
            True needs dense mode, cfg.quant None and those operations.
        wait_timeout_s: how long a device-side wait spins for the peers' signal before it gives up and
            sets the error flag (`timed_out()`); later waits then return at once with garbage results
            until the dispatcher is rebuilt, and the next host-synced dispatch raises RuntimeError
            (sync_free mode: check `timed_out()`). A hang guard only: no healthy call waits that long.

    Host-synced mode (sync_free False) cannot be captured in a CUDA graph: the host reads each batch's
    size, and tracks the epoch. It also agrees chunk counts (`agrees_chunks`, see
    Dispatcher.dispatch_checked): each rank's count, below kernels.MAX_CHUNKS (2**24), travels with its
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
    """

    name = "ht"
    layout = Layout.CONTIGUOUS
    supports_fp8_dispatch = True
    needs_host_sync = True
    agrees_chunks = True

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

    def __init__(self, cfg: MoEConfig, group=None, *, sync_free: bool = False,
                 device: torch.device | str | None = None, launch: kernels.HtLaunch | None = None,
                 dense: bool | None = None, copy_engine: bool | None = None, wait_timeout_s: float = 60.0) -> None:
        available, reason = self.availability(cfg, group)
        if not available:
            raise ValueError(f"dispatcher 'ht': {reason}")
        if not 0 < wait_timeout_s < float("inf"):
            raise ValueError(f"wait_timeout_s must be finite and > 0, got {wait_timeout_s!r}")
        super().__init__(cfg, group)
        if device is None:
            device = "cpu" if isinstance(group, EmulatedGroup) else "cuda"
        self.device = indexed_device(device)
        self.sync_free = bool(sync_free)
        self.needs_host_sync = not self.sync_free  # FusedMoE then agrees no chunk count at all
        self.agrees_chunks = not self.sync_free  # the chunk counts travel with the numbering, the largest
        #   comes back with the batch size (`agreed_chunks`)
        self.fp8 = cfg.quant == "fp8_block"
        self.capacity = cfg.max_tokens_per_rank
        # Fixed for the dispatcher's lifetime: the flags count one signal per sending program and call.
        self.launch = kernels.ht_launch(cfg.row_bytes, self.device) if launch is None else launch
        self.blocks = kernels.layout_blocks(self.capacity, cfg.top_k)
        self._emulated = isinstance(group, EmulatedGroup)
        # host-synced mode over a process group: the batch size and layout are made on a side stream
        # while the rows travel (HtEarly)
        self._early = not self.sync_free and not self._emulated
        # (checked before the collective allocation)
        self.dense = self._wants_dense(dense, copy_engine)
        self.copy_engine = self._wants_copy_engine(copy_engine)
        specs = self._specs()
        if self._emulated:
            # Dispatchers of equal config, launch (which sizes the flags and counts the signals) and mode
            # (which sets what the flags hold) share one workspace, epochs and flags included, so they act as
            # one dispatcher; the first emulated rank to get here allocates every rank's buffers.
            key = ("ht", cfg, str(self.device), self.launch, self.copy_engine)
            self.ws: Workspace = group.workspace(key, specs, self.device)
        else:
            self.ws = torch_workspace(specs, group, self.device)
        self._peers = {name: self.ws.peers(name) for name in self.ws.specs}  # address tables, per buffer
        self._wait = DeviceWait(err_1=self.ws.local("control")[2:], timeout_ns=int(wait_timeout_s * 1e9))
        # dispatches whose numbering was queued: the device epoch counts them too (dense mode takes the
        # receive buffers' parity from it, and the host polls for the batch size of that epoch); picks the
        # early slot
        self._dispatch_calls = 0
        if self._early:
            self._side = torch.cuda.Stream(self.device)
            self._early_slots = [HtEarlySlot(numbered=torch.cuda.Event(), ready=torch.cuda.Event())
                                 for _ in range(2)]
        # the batch size of the dispatches of even and odd epochs, written by the layout's first kernel
        # (`kernels.layout_count`; sync_free mode: word 0, never read); pinned on a GPU: the host polls it.
        # 16 bytes apart: Triton specializes pointers on 16-byte alignment (one build for both)
        self._sizes = torch.zeros(2, 2, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        # each parity's word as the layout kernel's output and as the host reads it (made once: a torch
        # view costs the host several µs per call, and the host paces a layer's dispatch)
        self._size_words = [self._sizes[p, :1] for p in range(2)]
        self._size_values = [ctypes.c_int64.from_address(w.data_ptr()) for w in self._size_words]
        self._engine = HtCopyEngine(self.ws, self._emulated) if self.copy_engine else None
        if self.dense and self._early:  # (_dispatch_send_rows_first)
            self._inputs_ready, self._side_done = torch.cuda.Event(), torch.cuda.Event()
        # what a batch's row index points into: the receive rows of both parities, [2 * R * C, D] (and G)
        self._recv_rows = self.ws.local("recv_x").view(-1, cfg.hidden_size)
        self._recv_row_scales = self.ws.local("recv_scale").view(-1, num_groups(cfg.hidden_size)) if self.fp8 else None

    def _wants_dense(self, dense: bool | None, copy_engine: bool | None) -> bool:
        if dense is None:
            return not self.sync_free and (bool(copy_engine) or dense_pays(self.world_size, self.cfg.top_k))
        if dense and self.sync_free:
            raise ValueError("dense=True needs sync_free=False: the host tracks the receive buffers' parity, which "
                             "a replayed CUDA graph would not advance")
        return bool(dense)

    def _wants_copy_engine(self, copy_engine: bool | None) -> bool:
        # the copy engine's flag is a 64-bit stream write, which a GPU may lack (H100 / H200 have it)
        if copy_engine is None:
            return self.dense and not (self.fp8 or self._emulated) and cuda_driver.can_write_value(self.device.index)
        if copy_engine and not (self._emulated or cuda_driver.can_write_value(self.device.index)):
            raise ValueError(f"copy_engine=True needs 64-bit stream memory operations, which {self.device} lacks "
                             "(use copy_engine=False or None)")
        if copy_engine and self.fp8:
            raise ValueError("copy_engine=True moves the rows as they are: fp8 dispatch quantizes them in the send "
                             "kernel (use copy_engine=False or None)")
        if copy_engine and not self.dense:
            raise ValueError("copy_engine=True needs dense mode (all T rows to every rank), which dense=False or "
                             "sync_free=True turns off")
        return bool(copy_engine)

    def _specs(self) -> list[BufferSpec]:
        R, C, D, K = self.world_size, self.capacity, self.cfg.hidden_size, self.cfg.top_k
        specs = [BufferSpec("recv_x", (2, R, C, D), FP8_DTYPE if self.fp8 else self.cfg.dtype)]
        if self.fp8:
            specs.append(BufferSpec("recv_scale", (2, R, C, num_groups(D)), torch.float32))
        return specs + [
            BufferSpec("recv_ids", (2, R, C, K), torch.int32),
            BufferSpec("recv_w", (2, R, C, K), torch.float32),
            BufferSpec("recv_count", (2, R), torch.int32),
            BufferSpec("pairs", (2, R), torch.int32),  # (token, slot) pairs each rank sends here, per parity
            BufferSpec("chunks", (2, R), torch.int32),  # each rank's caller's chunk count, per parity
            BufferSpec("comb", (2, R, C, D), self.cfg.dtype),
            BufferSpec("comb_ready", (R, kernels.combine_items(C, D, self.launch)), torch.int64),
            # the combine's tickets and finished programs, and the error flag of every wait (local)
            BufferSpec("control", (3,), torch.int32),
            BufferSpec("dispatch_flag", (R,), torch.int64),
            BufferSpec("meta_flag", (R,), torch.int64),
            BufferSpec("number_done", (1,), torch.int32),  # programs of the numbering kernel done (local)
            BufferSpec("dispatch_seq", (1,), torch.int64),
            BufferSpec("combine_seq", (1,), torch.int64),
        ]

    @property
    def max_recv_rows(self) -> int:
        """Rows of the batch in sync_free mode, and of its row index buffer: every received (row, slot)
        pair could be valid (R * C * K; a token may repeat an expert id)."""
        return self.world_size * self.capacity * self.cfg.top_k

    # -- public API -------------------------------------------------------------------------------

    def timed_out(self) -> bool:
        """Whether any device-side wait of this rank gave up (wait_timeout_s without the peers' signal:
        a peer failed, or the ranks' calls do not match). Reads a device flag: a host sync."""
        return bool(self._wait.err_1.item())

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> ExpertBatch:
        """See Dispatcher.dispatch. Validation reads the id range on the host unless a CUDA graph is
        being captured; then one more host sync sizes the batch unless sync_free."""
        return self.dispatch_recv(self.dispatch_send(x_TD, ids_TK, weights_TK))

    def combine(self, y: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        """See Dispatcher.combine. No host sync."""
        return self.combine_recv(self.combine_send(y, batch))

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
        return self._dispatch_recv(pending)

    def combine_send(self, y: torch.Tensor, batch: ExpertBatch) -> HtCombinePending:
        """Process group: the whole combine (one kernel: each received row's weighted local results go
        back to its source rank; this rank's tokens are summed as their partial rows arrive). Emulated
        ranks: the first half (rows back to their sources). y: [N, D] expert outputs, cfg.dtype."""
        self.check_output(y, batch)
        if not isinstance(batch.handle, HtHandle):
            raise ValueError("batch was not produced by an 'ht' dispatcher")
        return self._combine_send(y.contiguous(), batch)

    def combine_recv(self, pending: HtCombinePending) -> torch.Tensor:
        """out_TD [T, D] cfg.dtype: fp32 sums of each token's partial rows (emulated ranks: the second half
        of the combine runs now, once every rank's first half has)."""
        return self._combine_recv(pending)

    # -- phases -----------------------------------------------------------------------------------

    def _check_shapes(self, x_TD, ids_TK, weights_TK) -> None:
        D, K = self.cfg.hidden_size, self.cfg.top_k
        if x_TD.dim() != 2 or x_TD.shape[1] != D or x_TD.dtype != self.cfg.dtype:
            raise ValueError(f"x_TD must be [T, D={D}] {self.cfg.dtype}, got {tuple(x_TD.shape)} {x_TD.dtype}")
        for name, t in (("ids_TK", ids_TK), ("weights_TK", weights_TK)):
            if t.shape != (x_TD.shape[0], K):
                raise ValueError(f"{name} must be [T={x_TD.shape[0]}, K={K}], got {tuple(t.shape)}")

    def _check_chunks(self, chunks: int) -> None:
        if type(chunks) is not int or not 1 <= chunks < kernels.MAX_CHUNKS.value:
            raise ValueError(f"chunks must be an int in [1, {kernels.MAX_CHUNKS.value}), got {chunks!r}")
        if chunks != 1 and not self.agrees_chunks:
            raise ValueError("a sync_free 'ht' dispatcher agrees no chunk count (its callers make one chunk)")

    def _dispatch_send(self, x_TD, ids_TK, weights_TK, chunks: int = 1) -> HtDispatchPending:
        calls = self._dispatch_calls + 1  # counted once the numbering (which advances the epoch) is queued
        if self.dense and self._early:
            return self._dispatch_send_rows_first(x_TD, ids_TK, weights_TK, calls, chunks)
        R, L = self.world_size, self.num_local_experts
        T = x_TD.shape[0]
        seq = self.ws.local("dispatch_seq")
        # slots and this call's epoch (seq + 1, on the device: graph-replayable); stored into every
        # destination: its token and pair counts and the tokens' ids and weights. Then the rows.
        slot_TR, epoch_1 = kernels.number_pairs(ids_TK, weights_TK, seq, self.ws.local("number_done"), R,
                                                self.capacity, L, self._peers, self.rank, dense=self.dense,
                                                chunks=chunks)
        self._dispatch_calls = calls
        # the host's epoch: emulated ranks read the device's (CPU tensors: no sync), a process group counts
        epoch = None if self.sync_free else int(epoch_1) if self._emulated else calls
        if self.dense:  # emulated ranks: the rows as a process group's rows-first dispatch sends them
            self._send_dense_rows(x_TD, epoch, None)
            if self._engine is not None:
                kernels.copy_rows(x_TD, self._engine.own_rows(epoch), self.launch)
            return HtDispatchPending(slot_TR=slot_TR, epoch_1=epoch_1, epoch=epoch, early=None, num_tokens=T)
        slot = None
        if self._early:
            slot = self._early_slots[calls % 2]
            slot.numbered.record(torch.cuda.current_stream(self.device))
        kernels.dispatch_send(x_TD, slot_TR, seq, self._peers, self.rank, self.capacity, self.fp8, self.launch)
        # the side stream's work is queued after the rows' kernel, so that its launches do not hold that back
        early = None
        if slot is not None:
            self._side.wait_event(slot.numbered)
            early = self._start_early(slot, epoch_1, calls)
        return HtDispatchPending(slot_TR=slot_TR, epoch_1=epoch_1, epoch=epoch, early=early, num_tokens=T)

    def _send_dense_rows(self, x_TD, epoch: int, stream: torch.cuda.Stream | None) -> None:
        """Dense mode: every row to row t of every rank's receive region of parity epoch % 2, and the
        flags: by the copy engine (peers only: this rank's own rows are then copied apart) or by the
        send kernel (every rank), on the current stream."""
        if self._engine is not None:
            self._engine.send_rows(x_TD, epoch, stream)
        else:
            kernels.dispatch_send_dense(x_TD, epoch, self._peers, self.rank, self.world_size, self.capacity, self.fp8,
                                        self.launch)

    def _dispatch_send_rows_first(self, x_TD, ids_TK, weights_TK, calls: int, chunks: int) -> HtDispatchPending:
        """Dense mode over a process group. The rows go first, on the stream itself (row t to row t at
        every rank, then the flags; `_send_dense_rows`): queued behind an event on a stream of its own,
        the copy engine's copy started ~10 µs after the event's work on H200. The side stream meanwhile
        numbers the pairs (the epoch: `calls`, the host's count, is the device's), copies this rank's own rows on the SMs
        (copy engine) and makes the layout; the stream waits for the numbering and own rows (so that
        x_TD is the caller's again after dispatch_send, in stream order, and the wait for the rows reads
        this call's epoch).

        The peers have this call's rows and flags before the numbering is queued: if queueing it fails,
        the dispatcher is marked failed (the error flag of a wait that gave up) before the exception
        goes on, so that no later call mistakes those for a complete dispatch."""
        stream = torch.cuda.current_stream(self.device)
        self._inputs_ready.record(stream)
        self._send_dense_rows(x_TD, calls, stream)
        self._side.wait_event(self._inputs_ready)
        slot = self._early_slots[calls % 2]
        try:
            with torch.cuda.stream(self._side):
                slot_TR, epoch_1 = kernels.number_pairs(ids_TK, weights_TK, self.ws.local("dispatch_seq"),
                                                        self.ws.local("number_done"), self.world_size,
                                                        self.capacity, self.num_local_experts, self._peers,
                                                        self.rank, dense=True, chunks=chunks)
                self._dispatch_calls = calls
                if self._engine is not None:
                    kernels.copy_rows(x_TD, self._engine.own_rows(calls), self.launch)
                self._side_done.record(self._side)
        except BaseException:
            self._wait.err_1.fill_(1)  # (on the stream: after the flags it poisons)
            raise
        for t in (x_TD, ids_TK, weights_TK):  # the caller's, read on the side stream
            t.record_stream(self._side)
        for t in (slot_TR, epoch_1):  # made on the side stream, read on the stream (combine, the wait)
            t.record_stream(stream)
        stream.wait_event(self._side_done)
        return HtDispatchPending(slot_TR=slot_TR, epoch_1=epoch_1, epoch=calls,
                                 early=self._start_early(slot, epoch_1, calls), num_tokens=x_TD.shape[0])

    def _start_early(self, slot: HtEarlySlot, epoch_1: torch.Tensor, epoch: int) -> HtEarly:
        """On the side stream, after the numbering (queued there or waited for by the caller), while the
        rows travel: the batch's layout (and size, to the host), once every rank's numbering has
        signalled (its counts, ids and weights are here); with the copy engine then also the
        device-side wait for the rows (`_side_waits_for_rows`); then `slot.ready`.
        The layout's tensors are allocated on the side stream and read on the stream (after
        `ready`): when they are freed, the side stream may reuse their memory at once, which is safe
        because all its later work starts after an event a later dispatch records on the stream after
        everything queued there before (`numbered`; dense mode: `_inputs_ready`, which the side
        stream waits for)."""
        with torch.cuda.stream(self._side):
            layout = self._layout(epoch_1, epoch)
            if self._side_waits_for_rows:
                self._wait_for_rows()
            slot.ready.record(self._side)
        epoch_1.record_stream(self._side)
        return HtEarly(slot=slot, layout=layout)

    @property
    def _side_waits_for_rows(self) -> bool:
        """Whether the side stream, not the calling stream, waits for the rows: with the copy engine
        (host-synced, process group), where a wait kernel queued on the stream behind the rows' copy
        started a few µs after the copy on H200, while one on the side stream is spinning when the
        flags land (2 H200s, 4096 tokens: ready 166-168 µs against 174). Behind the send kernel the
        stream's wait starts as the kernel ends; a side-stream wait spinning beside it was later
        there (fp8 ready 116 against 111-113, scripts/ht_probe.py, 2026-11-30)."""
        return self._early and self.copy_engine

    def _layout(self, epoch_1: torch.Tensor, epoch: int | None) -> HtLayout:
        """The batch's expert-sorted layout, once every rank's counts and ids of epoch epoch_1 are here
        (its first kernel waits on the device, and writes the batch size into the host word of `epoch`,
        `_batch_size`). Work proportional to the pairs received: a count and a place kernel over blocks
        of received rows, with a scan of the [B, L] table of per-block counts between them (one program
        per few experts); no row is read."""
        L = self.num_local_experts
        recv_count = self.ws.local("recv_count")
        recv_ids, recv_w = self.ws.local("recv_ids"), self.ws.local("recv_w")
        table_BL = kernels.layout_count(recv_ids, recv_count, epoch_1, self.blocks, L, self.ws.local("meta_flag"),
                                        self.ws.local("pairs"), self.ws.local("chunks"), self._size_word(epoch),
                                        self._wait)
        counts_L, offsets_L1, start_BL, recv_counts_R = kernels.layout_scan(table_BL, recv_count, epoch_1)
        pos_PK, weights_PK, rows_N = kernels.layout_place(recv_ids, recv_w, recv_count, epoch_1, start_BL,
                                                          self.blocks, self.max_recv_rows)
        return HtLayout(counts_L=counts_L, offsets_L1=offsets_L1, pos_PK=pos_PK, weights_PK=weights_PK,
                        rows_N=rows_N, recv_counts_R=recv_counts_R)

    def _size_word(self, epoch: int | None) -> torch.Tensor:
        return self._size_words[(epoch or 0) % 2]

    def _batch_size(self, pending: HtDispatchPending) -> tuple[int, int]:
        """(the batch's valid rows, the largest chunk count of any rank's caller): the layout's first
        kernel writes them to pinned host memory, where the host polls for the word of this dispatch's
        epoch. RuntimeError if a device-side wait of this rank gave up (in this call's layout or any call
        before), or if the layout ran without writing it."""
        word = self._size_values[(pending.epoch or 0) % 2]
        if pending.early is None:  # emulated ranks: the layout has run (on a GPU, once the stream has)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            size = kernels.batch_size(word.value, pending.epoch)
        else:
            size = _poll_size(word, pending.epoch, pending.early.slot.ready)
        if size is None:
            raise RuntimeError(f"dispatcher 'ht' (rank {self.rank}): the layout of epoch {pending.epoch} ended "
                               f"without writing the batch size")
        if size[0] < 0:
            raise RuntimeError(f"dispatcher 'ht' (rank {self.rank}): a device-side wait gave up after "
                               f"{self._wait.timeout_ns / 1e9:g} s (a peer failed, or the ranks' calls do "
                               "not match); its results are garbage from then on: rebuild the dispatcher")
        return size

    def _dispatch_recv(self, pending: HtDispatchPending) -> ExpertBatch:
        self._stream_waits_for_rows()
        return self._expert_batch(pending, self._layout_ready(pending))

    def _wait_for_rows(self) -> None:
        """Block the current stream until every rank's rows of the latest epoch are here."""
        # copy engine: one epoch stamp per peer (this rank's own rows were copied on the SMs before this
        # wait, in stream order)
        programs, skip = (1, self.rank) if self.copy_engine else (self.launch.programs, -1)
        kernels.wait_flags(self.ws.local("dispatch_flag"), self.ws.local("dispatch_seq"), programs, self._wait, skip)

    def _stream_waits_for_rows(self) -> None:
        """The calling stream's device-side wait for the rows, unless the side stream has it (then the
        stream waits for the side stream, `_layout_ready`)."""
        if not self._side_waits_for_rows:
            self._wait_for_rows()

    def _layout_ready(self, pending: HtDispatchPending) -> HtLayout:
        """The batch's layout, the stream waiting for it: started early on the side stream (process
        groups, host-synced mode), else made now, on the stream."""
        if pending.early is None:
            return self._layout(pending.epoch_1, pending.epoch)
        torch.cuda.current_stream(self.device).wait_event(pending.early.slot.ready)
        return pending.early.layout

    def _expert_batch(self, pending: HtDispatchPending, lay: HtLayout) -> ExpertBatch:
        """The received rows, sorted by local expert (source rank, slot, k within an expert), as a row
        index into the receive buffer (x views recv_x of both parities as [2 * R * C, D]); no row is
        copied. The host reads the batch size (unless sync_free, `_batch_size`): it travels ahead of the
        rows (dense mode: beside them), so the host usually has it before the stream has the rows."""
        n, max_chunks = (self.max_recv_rows, None) if self.sync_free else self._batch_size(pending)
        handle = HtHandle(slot_TR=pending.slot_TR, pos_PK=lay.pos_PK, weights_PK=lay.weights_PK,
                          recv_counts_R=lay.recv_counts_R, num_tokens=pending.num_tokens, max_chunks=max_chunks)
        return ExpertBatch(layout=Layout.CONTIGUOUS, x=self._recv_rows, x_scale=self._recv_row_scales,
                           counts_L=lay.counts_L, offsets_L1=lay.offsets_L1, handle=handle,
                           row_index_N=lay.rows_N[:n])

    def _combine_send(self, y_ND, batch: ExpertBatch) -> HtCombinePending:
        """Real ranks: the whole combine, one kernel (it spins until the peers' partial rows of each of
        its items are here). Emulated ranks, which run in turn: the remote half only."""
        h: HtHandle = batch.handle
        seq = self.ws.local("combine_seq")  # the kernel advances it (its remote half: this call's epoch)
        out_TD = torch.empty(h.num_tokens, self.cfg.hidden_size, dtype=self.cfg.dtype, device=self.device)
        args = [y_ND, h.pos_PK, h.weights_PK, h.recv_counts_R, h.slot_TR, seq, self.ws.local("comb"),
                self.ws.local("comb_ready"), self.ws.local("control"), self._peers, out_TD, self.rank, self.launch,
                self._wait]
        kernels.combine(*args, remote=True, local=not self._emulated)
        if not self._emulated:
            return HtCombinePending(out_TD=out_TD, local_args=None)
        args[5] = seq.clone()  # the local half runs later (emulated ranks may share seq): this call's epoch
        return HtCombinePending(out_TD=out_TD, local_args=tuple(args))

    def _combine_recv(self, pending: HtCombinePending) -> torch.Tensor:
        if pending.local_args is not None:
            kernels.combine(*pending.local_args, remote=False, local=True)
        return pending.out_TD

    def _dispatch(self, x_TD, ids_TK, weights_TK, chunks: int = 1) -> ExpertBatch:
        self._check_chunks(chunks)
        return self._dispatch_recv(self._dispatch_send(x_TD, ids_TK, weights_TK, chunks))

    def _agreed_chunks(self, batch: ExpertBatch) -> int:
        if batch.handle.max_chunks is None:  # a batch of another, sync_free, dispatcher
            raise ValueError("batch comes from a sync_free 'ht' dispatcher, which agrees no chunk count")
        return batch.handle.max_chunks

    def _combine(self, y, batch) -> torch.Tensor:
        return self._combine_recv(self._combine_send(y, batch))
