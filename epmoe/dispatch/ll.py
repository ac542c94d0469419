"""`ll` dispatcher: low-latency NVLink dispatch/combine for decode, into fixed symmetric-memory buffers.

Rows are stored by Triton kernels straight into peers' buffers; there is no host sync, every call is
capturable in a CUDA graph and replayable with other routing (and other token counts, see below), and
each direction is split into a send and a receive so other work can run while rows are in flight.

Shape letters: T tokens on this rank, D hidden size, K top-k, E global experts, L local experts,
R ranks, Tmax = cfg.max_tokens_per_rank, M = R * Tmax rows per expert slot, G = ceil(D / 128).

Buffers (symmetric: the same offsets on every rank, peers reach them through address tables,
epmoe/kernels/sync.py):
    recv_x [L, M, D]        rows for this rank's experts (float8_e4m3fn when cfg.quant == "fp8_block",
                            else cfg.dtype), with recv_scale [L, M, G] float32 for fp8
    cnt [L] int32           rows claimed per local expert in the current dispatch
    idx [R, Tmax, K] int32  for source rank s, token t, slot k: the row l*M + i of recv_x holding it
                            here, or -1 (slot not routed to this rank)
    wtab [R, Tmax, K] f32   the top-k weights (combine="reduce" only)
    src_tokens [R] int32    T of each source rank in the current call
    comb                    combine results for this rank's tokens: [Tmax, K, D] per slot ("source")
                            or [Tmax, R, D] one pre-summed row per expert rank ("reduce"), cfg.dtype
    signal [2] int64        dispatch / combine arrivals: each rank adds exactly 2^20 per call, spread
                            over its signalling programs (never reset; see epmoe/kernels/ll.py)
Own buffers: error [1] int32 (a wait timed out), counts [L] int32 (the counts_L handed out), route
[Tmax, K] int32 (rank each slot went to, -1 if none), wloc [Tmax, K] float32 (the weights, for
combine="source").

Protocol (per call; every kernel runs on the caller's current stream):
  1. dispatch_send (1 kernel, one program per token): for each slot with a valid id, a remote
     atomic_add on the destination's cnt[l] returns the row i; the row (quantized in registers for
     fp8) and its scales go straight to the destination's recv_x[l, i]; idx (and wtab) entries go to
     every rank. Each program then adds its share to every rank's signal[0] (release, system scope).
  2. dispatch_recv (1 kernel, 1 program): waits until every rank's share of this call has arrived,
     swaps cnt to zero into counts. `dispatch` fuses 1 and 2: the dispatch kernel's last program
     does the wait (one kernel per dispatch). recv_x and counts are fixed tensors: the returned
     ExpertBatch views them, no copy.
  3. combine_send (1 kernel, fixed grid of item programs x column chunks): for each (source rank s,
     token t < src_tokens[s]) the rows this rank holds are stored into s's comb (per slot, or
     weighted and summed here for "reduce"); then every program signals every rank.
  4. combine_recv (1 kernel, one program per (token, column chunk)): waits for the combine signals,
     sums the rows in float32 (weights applied here for "source").
Why the buffers can be reused without a second copy: a peer writes this rank's recv_x, cnt, idx,
wtab and src_tokens for call n+1 only in its dispatch_send n+1, which its stream orders after its
combine_recv n, which waited for this rank's combine_send n — by then this rank has finished reading
all of them for call n (its experts ran before its combine_send) and zeroed cnt (dispatch_recv n).
Likewise comb is rewritten in call n+1 only after this rank's dispatch_send n+1, which follows its
combine_recv n. Signals only grow, so a fast rank never waits on a count that a slow rank still has
to reset, and graph replays continue the count. Rows past counts_L[l] in recv_x[l] are stale
(padding): nothing reads them.

Requirements: on each rank, calls run in the order dispatch_send, dispatch_recv, combine_send,
combine_recv, on one stream, and every rank makes the same calls (T may differ, and may be 0). The
ExpertBatch's rows (x, x_scale) are valid until this rank's combine_send of the same call (after it,
peers may start the next dispatch into them); counts_L until the next dispatch_recv. For two
micro-batches in flight at once use two dispatchers (separate buffers). Token ids must be distinct per token (as `route` gives): a slot
that would overflow an expert's M rows (only possible with repeated ids) is dropped, never written.
Ids outside [0, E) are treated as -1 by the kernels (check_tokens refuses them outside graph capture).

CUDA graphs: capture a fixed T (e.g. Tmax) and vary the routing between replays by copying new
ids/weights/x into the captured tensors; a token whose ids are all -1 sends nothing and gets a zero
row, so marking unused tokens' ids -1 replays a smaller batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import MoEConfig
from ..interfaces import DispatchHandle, Dispatcher, ExpertBatch, Layout, check_tokens
from ..kernels import ll as kernels
from ..kernels.sync import DeviceWait, timeout_ns
from ..quant import FP8_DTYPE, num_groups
from ..symm import BufferSpec, agree_construction, indexed_device, symmetric_world, workspace_backend

COMBINE_MODES = ("source", "reduce")


@dataclass(frozen=True)
class LLHandle(DispatchHandle):
    """Routing state of one call: what dispatch_recv and combine need. num_tokens: T of this rank."""

    num_tokens: int


class LLDispatcher(Dispatcher):
    """Low-latency NVLink dispatcher for decode: batched layout, no host sync, graph-capturable.

    Args:
        cfg: the layer config; buffers are sized from cfg.max_tokens_per_rank (Tmax): recv_x alone is
            E * Tmax * D bytes per rank in fp8 (twice that in bf16; 470 MB for E 256, D 7168, Tmax 256),
            so set Tmax to the decode batch, not the prefill chunk.
        group: an NCCL process group of ranks on one host (torch symmetric memory), or an
            EmulatedGroup (all ranks in one process, for tests).
        combine: "reduce" (default): each expert rank sums the slots it holds per token, weighted,
            and sends one row per (token, rank); "source": each slot's row goes back as is and the
            source applies the weights (no rounding of partial sums, about K / R times the bytes).
        device: where the buffers live (EmulatedGroup only; default CPU). With a process group they
            live on the current CUDA device.
        wait_timeout_s: how long a device-side wait spins for the peers' signal before it gives up
            and sets the error flag (`timed_out()`); later waits then return at once with garbage
            results. Generous by default because a peer's first call may still be compiling its
            kernels; tests set a few seconds so a protocol error fails fast instead of hanging.

    Construction is collective over `group`: first of all the ranks' config fingerprints and combine
    modes are all-gathered, and a rank built otherwise is refused with ValueError on every rank
    (`symm.agree_construction`); then the checks and the symmetric allocation. Output batch: x [L, M, D] in
    float8_e4m3fn with x_scale [L, M, G] when cfg.quant == "fp8_block", else cfg.dtype; counts_L [L].
    """

    name: ClassVar[str] = "ll"
    layout: ClassVar[Layout] = Layout.BATCHED
    supports_fp8_dispatch: ClassVar[bool] = True
    needs_host_sync: ClassVar[bool] = False

    @classmethod
    def availability(cls, cfg: MoEConfig, group) -> tuple[bool, str]:
        world, reason = symmetric_world(cfg, group)
        if not world:
            return False, reason
        Tmax = cfg.max_tokens_per_rank
        if max(cfg.num_experts * Tmax, world * Tmax * cfg.top_k) >= 2 ** 31:
            return False, f"max_tokens_per_rank={Tmax} too large for int32 row indices"
        return True, "ok"

    def __init__(self, cfg: MoEConfig, group, combine: str = "reduce",
                 device: torch.device | str | None = None, wait_timeout_s: float = 60.0) -> None:
        agree_construction("ll", cfg, group, (combine,))  # (what sizes the buffers)
        available, reason = self.availability(cfg, group)
        if not available:
            raise ValueError(f"dispatcher 'll': {reason}")
        if combine not in COMBINE_MODES:
            raise ValueError(f"combine must be one of {COMBINE_MODES}, got {combine!r}")
        wait_ns = timeout_ns(wait_timeout_s)
        backend = workspace_backend(group)
        if device is not None and not backend.runs_in_turn:
            raise ValueError("device is set by the current CUDA device for a process group")
        super().__init__(cfg, group)
        self.device = indexed_device(backend.default_device if device is None else device)
        self.combine_mode = combine
        self.reduce = combine == "reduce"
        self.quant = cfg.quant == "fp8_block"
        R, L, D, K = self.world_size, self.num_local_experts, cfg.hidden_size, cfg.top_k
        Tmax = cfg.max_tokens_per_rank
        M = R * Tmax
        specs = [
            BufferSpec("recv_x", (L, M, D), FP8_DTYPE if self.quant else cfg.dtype),
            *([BufferSpec("recv_scale", (L, M, num_groups(D)), torch.float32)] if self.quant else []),
            BufferSpec("cnt", (L,), torch.int32),
            BufferSpec("idx", (R, Tmax, K), torch.int32),
            *([BufferSpec("wtab", (R, Tmax, K), torch.float32)] if self.reduce else []),
            BufferSpec("src_tokens", (R,), torch.int32),
            BufferSpec("comb", (Tmax, R if self.reduce else K, D), cfg.dtype),
            BufferSpec("signal", (2,), torch.int64),
            BufferSpec("error", (1,), torch.int32),
            BufferSpec("counts", (L,), torch.int32),
            BufferSpec("route", (Tmax, K), torch.int32),
            BufferSpec("wloc", (Tmax, K), torch.float32),
        ]
        # emulated ranks of one config and combine mode share their workspaces (as one dispatcher)
        self._ws = backend.workspace(("ll", cfg, combine), specs, self.device)
        self._buffers = self._ws.views(kernels.LLBuffers, peers=self._ws.tables(kernels.LLPeers))
        self._wait = DeviceWait(err_1=self._buffers.error, timeout_ns=wait_ns)
        self._launch = kernels.ll_launch(D, R, Tmax, self.device)

    @property
    def rows_per_expert(self) -> int:
        """M = R * Tmax, the second dimension of the batched layout."""
        return self.world_size * self.cfg.max_tokens_per_rank

    def timed_out(self) -> bool:
        """Whether any device-side wait of this rank gave up (wait_timeout_s without the peers'
        signal: a peer failed, or the ranks' calls do not match). Reads a device flag: a host sync."""
        return self._wait.timed_out()

    # ---- phases -------------------------------------------------------------------------------

    def dispatch_send(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> LLHandle:
        """Start the dispatch: launch the store kernel and return at once (the rows are in flight).

        Args as for `dispatch`; T <= cfg.max_tokens_per_rank, and x_TD on this dispatcher's device.
        Returns the handle to pass to `dispatch_recv`. No host sync while a CUDA graph is captured
        (outside capture, check_tokens reads the id range on the host).
        """
        check_tokens(self.cfg, x_TD, ids_TK, weights_TK)
        return self._send(x_TD, ids_TK, weights_TK, receive=False)

    def _send(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, receive: bool) -> LLHandle:
        T, Tmax = x_TD.shape[0], self.cfg.max_tokens_per_rank
        if T > Tmax:
            raise ValueError(f"dispatcher 'll' takes at most max_tokens_per_rank={Tmax} tokens, got {T}")
        if x_TD.device != self.device:
            raise ValueError(f"x_TD is on {x_TD.device}, the dispatcher's buffers on {self.device}")
        kernels.dispatch(self._buffers, x_TD.contiguous(), ids_TK.contiguous(), weights_TK.float().contiguous(),
                         rank=self.rank, num_experts=self.cfg.num_experts, quant=self.quant,
                         reduce=self.reduce, receive=receive, wait=self._wait, launch=self._launch)
        return LLHandle(num_tokens=T)

    def dispatch_recv(self, handle: LLHandle) -> ExpertBatch:
        """Finish the dispatch: launch a device-side wait for every rank's rows; return the batch.

        Returns ExpertBatch(BATCHED): x [L, M, D] (and x_scale [L, M, G] for fp8) and counts_L [L] are
        fixed buffers (the same tensors every call, so graph-safe); rows of expert l are
        x[l, :counts_L[l]] in no particular order. x and x_scale hold until this call's combine_send,
        counts_L until the next dispatch_recv.
        """
        kernels.dispatch_recv(self._buffers, wait=self._wait, launch=self._launch)
        return self._batch(handle)

    def _batch(self, handle: LLHandle) -> ExpertBatch:
        b = self._buffers
        return ExpertBatch(layout=Layout.BATCHED, x=b.recv_x, x_scale=b.recv_scale,
                           counts_L=b.counts, offsets_L1=None, handle=handle)

    def combine_send(self, y_LMD: torch.Tensor, batch: ExpertBatch) -> LLHandle:
        """Start the combine: launch the stores of expert outputs y [L, M, D] (cfg.dtype) back to
        their source ranks; return the handle to pass to `combine_recv`."""
        self.check_output(y_LMD, batch)
        if not isinstance(batch.handle, LLHandle):
            raise ValueError("batch was not produced by an 'll' dispatcher")
        kernels.combine_send(self._buffers, y_LMD.contiguous(), rank=self.rank, reduce=self.reduce,
                             launch=self._launch)
        return batch.handle

    def combine_recv(self, handle: LLHandle) -> torch.Tensor:
        """Finish the combine: wait on the device for every rank's rows and sum them per token.

        Returns out_TD [T, D] in cfg.dtype (a new tensor): sum_k w[t, k] * y(t, k), float32
        accumulation; a token with no expert gets zeros.
        """
        out_TD = torch.empty(handle.num_tokens, self.cfg.hidden_size, dtype=self.cfg.dtype, device=self.device)
        kernels.combine_recv(self._buffers, out_TD, reduce=self.reduce, wait=self._wait, launch=self._launch)
        return out_TD

    def _dispatch(self, x_TD, ids_TK, weights_TK) -> ExpertBatch:  # inputs already checked by dispatch
        # One kernel: dispatch_send and dispatch_recv fused (the last program waits).
        return self._batch(self._send(x_TD, ids_TK, weights_TK, receive=True))

    def _combine(self, y, batch) -> torch.Tensor:
        return self.combine_recv(self.combine_send(y, batch))
