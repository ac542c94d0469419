"""The two interfaces a MoE layer is composed of: a Dispatcher and an Experts implementation.

Shape letters: T tokens on this rank, D hidden size, F expert intermediate size, E global experts,
L local experts, K top-k, N rows of a contiguous batch, M rows per expert slot of a batched batch,
S source rows that a contiguous batch's row index points into,
G = ceil(D / 128) fp8 scale groups per row.

Data flow:  dispatch(x_TD, ids_TK, weights_TK) -> ExpertBatch -> experts(batch) -> y -> combine(y, batch)
"""
from __future__ import annotations

import enum
from contextlib import AbstractContextManager, nullcontext
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from .config import MoEConfig
from .quant import FP8_DTYPE, num_groups
from .symm import WorkspaceBackend, group_rank_world


class Layout(enum.Enum):
    """How an ExpertBatch lays out its rows.

    CONTIGUOUS: the batch has N rows; rows of local expert l are batch rows offsets_L1[l] : offsets_L1[l+1];
        rows at or past offsets_L1[L] are padding that experts may skip and combine ignores. Batch row i
        is x[i] (x [N, D]), or x[row_index_N[i]] when the batch carries a row index (see ExpertBatch).
    BATCHED: x is [L, M, D]; rows of local expert l are x[l, :counts_L[l]]; the rest is padding.
    """

    CONTIGUOUS = "contiguous"
    BATCHED = "batched"


class DispatchHandle:
    """Base of each dispatcher's routing state (its own frozen dataclass), carried by the ExpertBatch that
    its dispatch returns and consumed by its combine."""

    __slots__ = ()


@dataclass(frozen=True)
class ExpertBatch:
    """The rows one rank's experts must process, as produced by `Dispatcher.dispatch`.

    Attributes:
        layout: Layout of `x` (see Layout).
        x: activations, contiguous [N, D] (or [S, D] source rows with row_index_N) or batched [L, M, D];
            dtype cfg.dtype, or float8_e4m3fn when the dispatcher quantized on the way (then `x_scale`
            is set).
        x_scale: None, or float32 [N, G] ([S, G]) / [L, M, G]: per token, per 128 columns,
            x ~= x_fp8 * scale.
        counts_L: int32 [L] on x's device: rows of each local expert. Device-resident; reading it on the
            host is a sync.
        offsets_L1: CONTIGUOUS only (None for BATCHED): int32 [L+1] exclusive prefix sum of counts_L.
        handle: the dispatcher's routing state that its `combine` consumes (never modify it); None for a
            batch made without a dispatcher (experts tests).
        row_index_N: CONTIGUOUS only, optional int32 [N] on x's device: batch row i is x[row_index_N[i]]
            (and x_scale[row_index_N[i]]), so a dispatcher can hand over each received row once (x, S
            source rows, may then view the dispatcher's buffers) instead of one copy per local expert.
            Entries at or past offsets_L1[L] are in [0, S) too. Experts read rows through it (or call
            `materialize()`); their outputs have `out_shape`, one row per batch row.
        weights_N: CONTIGUOUS only, optional float32 [N] on x's device: each valid batch row's top-k weight
            (rows at or past offsets_L1[L] unspecified). A dispatcher that sets it also combines expert
            outputs already multiplied by it (`combine(y, batch, weighted=True)`), which experts with
            `applies_weights` produce in their down projection's epilogue (`experts(batch,
            weighted=True)`).
    """

    layout: Layout
    x: torch.Tensor
    x_scale: torch.Tensor | None
    counts_L: torch.Tensor
    offsets_L1: torch.Tensor | None
    handle: DispatchHandle | None
    row_index_N: torch.Tensor | None = None
    weights_N: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name, dtype in (("row_index_N", "int32"), ("weights_N", "float32")):
            t = getattr(self, name)
            if t is None:
                continue
            if self.layout is not Layout.CONTIGUOUS:
                raise ValueError(f"{name} is only defined for the contiguous layout")
            if t.dim() != 1 or t.dtype != getattr(torch, dtype) or t.device != self.x.device:
                raise ValueError(f"{name} must be {dtype} [N] on {self.x.device}, got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        if self.weights_N is not None and self.weights_N.shape[0] != self.out_shape[0]:
            raise ValueError(f"weights_N has {self.weights_N.shape[0]} rows, the batch {self.out_shape[0]}")

    @property
    def num_local_experts(self) -> int:
        return self.counts_L.shape[0]

    @property
    def out_shape(self) -> torch.Size:
        """Shape of the experts' output y: [N, D] (contiguous) or [L, M, D] (batched)."""
        if self.row_index_N is None:
            return self.x.shape
        return torch.Size((self.row_index_N.shape[0], self.x.shape[-1]))

    def materialize(self) -> "ExpertBatch":
        """This batch with one row of x per batch row (row_index_N applied, a copy); itself if there
        is no row index."""
        if self.row_index_N is None:
            return self
        rows = self.row_index_N.long()
        return replace(self, x=self.x.index_select(0, rows), row_index_N=None,
                       x_scale=None if self.x_scale is None else self.x_scale.index_select(0, rows))


ID_DTYPES = (torch.int32, torch.int64)  # the dtypes caller-given ids_TK may have


def on_device(device: torch.device) -> AbstractContextManager:
    """A context in which `device` is the current CUDA device when it is a GPU other than the current one
    (a model split over GPUs: a layer on cuda:1 while cuda:0 is current), else none. Triton launches,
    CUDA graph captures and the claimed tiles' counters go to the current device, not to their tensors'."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return nullcontext()


def check_x(cfg: MoEConfig, x_TD: torch.Tensor) -> None:
    """ValueError unless x_TD is [T, D] in cfg.dtype."""
    D = cfg.hidden_size
    if x_TD.dim() != 2 or x_TD.shape[1] != D:
        raise ValueError(f"x_TD must be [T, D={D}], got {tuple(x_TD.shape)}")
    if x_TD.dtype != cfg.dtype:
        raise ValueError(f"x_TD dtype {x_TD.dtype} does not match cfg.dtype {cfg.dtype}")


def check_tokens(cfg: MoEConfig, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 read_ids: bool = True) -> None:
    """Refuse malformed dispatch input with ValueError before any communication starts.

    With read_ids, reads ids_TK's min and max on the host (one sync on a GPU) to check the range, unless
    a CUDA graph is being captured (no sync is allowed then; graph-safe dispatchers treat out-of-range
    ids as -1). Without it (dispatchers that catch bad ids on the device, `checks_ids_on_device`), only
    shapes, dtypes and devices are checked. Ids that are in range by construction (epmoe.routing.route's)
    need only `check_x` (FusedMoE).
    """
    K, E = cfg.top_k, cfg.num_experts
    check_x(cfg, x_TD)
    T = x_TD.shape[0]
    if ids_TK.shape != (T, K):
        raise ValueError(f"ids_TK must be [T={T}, K={K}], got {tuple(ids_TK.shape)}")
    if weights_TK.shape != (T, K):
        raise ValueError(f"weights_TK must be [T={T}, K={K}], got {tuple(weights_TK.shape)}")
    if ids_TK.dtype not in ID_DTYPES:
        raise ValueError(f"ids_TK must be int32 or int64, got {ids_TK.dtype}")
    if not weights_TK.is_floating_point():
        raise ValueError(f"weights_TK must be a float tensor, got {weights_TK.dtype}")
    for name, t in (("ids_TK", ids_TK), ("weights_TK", weights_TK)):
        if t.device != x_TD.device:
            raise ValueError(f"{name} is on {t.device} but x_TD is on {x_TD.device}")
    if read_ids and T and ids_TK.numel() and not (ids_TK.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = torch.stack(torch.aminmax(ids_TK)).tolist()  # one host sync
        if lo < -1 or hi >= E:
            bad = lo if lo < -1 else hi
            raise ValueError(f"ids_TK holds expert id {bad}, outside [-1, E={E})")


class Dispatcher(ABC):
    """Moves tokens to the ranks owning their experts and brings the weighted results back.

    Subclasses declare `name`, `layout`, `supports_fp8_dispatch` and implement `_dispatch`/`_combine`;
    the public methods validate first. `needs_host_sync`: whether a dispatch syncs the host (sizing
    its batch); `agrees_chunks`: whether it can also carry its caller's chunk count to every rank
    (`dispatch_checked(..., chunks=n)`, `agreed_chunks`), which FusedMoE then needs no collective for.
    `checks_ids_on_device`: whether ids on a GPU are range-checked on the device rather than read on the
    host (see `check_device_errors`); `reads_any_weight_dtype`: whether weights_TK reach `_dispatch` in
    the caller's float dtype (else as float32). No per-call state is kept on `self`: everything combine
    needs travels in the returned ExpertBatch's handle. All ranks of the group must call dispatch and combine the same number of
    times, in the same order (T may differ, and may be 0).
    """

    name: ClassVar[str]
    layout: ClassVar[Layout]
    supports_fp8_dispatch: ClassVar[bool] = False
    needs_host_sync: ClassVar[bool] = True
    agrees_chunks: ClassVar[bool] = False
    checks_ids_on_device: ClassVar[bool] = False
    reads_any_weight_dtype: ClassVar[bool] = False

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup | WorkspaceBackend | None = None,
                 **options: Any) -> None:
        if options:
            raise ValueError(f"dispatcher {self.name!r} takes no options {sorted(options)}")
        self.cfg = cfg
        self.group = group
        self.rank, self.world_size = group_rank_world(group)
        self.num_local_experts = cfg.local_experts(self.world_size)
        self.first_expert = self.rank * self.num_local_experts
        self._chunks_stream: torch.cuda.Stream | None = None  # the chunk count's all-reduce (start_chunk_count)
        self.cfg_fingerprint = cfg.fingerprint()  # what check_same_config compares

    @classmethod
    def availability(cls, cfg: MoEConfig, group: dist.ProcessGroup | WorkspaceBackend | None) -> tuple[bool, str]:
        """(available, reason) for this config and group, without side effects."""
        if not isinstance(group, dist.ProcessGroup):
            return False, "needs a torch.distributed process group"
        world = dist.get_world_size(group)
        if cfg.num_experts % world:
            return False, f"num_experts={cfg.num_experts} not divisible by world size {world}"
        return True, "ok"

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> ExpertBatch:
        """Send each token to the ranks owning its experts.

        Args:
            x_TD: [T, D] activations in cfg.dtype (T may be 0).
            ids_TK: int32/int64 [T, K] global expert ids in [0, E); -1 means "no expert" and is skipped.
            weights_TK: float [T, K] routing weights, applied in combine (fp32 accumulation).

        Returns:
            ExpertBatch in this dispatcher's layout, holding this rank's local experts' rows.
        """
        check_tokens(self.cfg, x_TD, ids_TK, weights_TK, read_ids=self.reads_ids_on_host(x_TD))
        return self.dispatch_checked(x_TD, ids_TK, weights_TK)

    def reads_ids_on_host(self, x_TD: torch.Tensor) -> bool:
        """Whether validating a dispatch of x_TD reads the ids' range on the host: always, except for
        dispatchers that catch bad ids on the device (`checks_ids_on_device`) with inputs on a GPU."""
        return not (self.checks_ids_on_device and x_TD.is_cuda)

    def check_device_errors(self, wait: bool = True) -> None:
        """Raise ValueError if the device caught bad input in an earlier call (`checks_ids_on_device`:
        an id outside [-1, E)); with `wait`, after the queued work has run (a host sync), else what the
        finished work caught by now. Others: nothing to do."""

    def dispatch_checked(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                         chunks: int | None = None) -> ExpertBatch:
        """`dispatch` for inputs the caller already passed through check_tokens, with T <=
        cfg.max_tokens_per_rank, on the dispatcher's device (FusedMoE checks once per call, for all its
        chunks): no second validation, so no second host sync.

        chunks: with `agrees_chunks` only (ValueError otherwise): how many chunks the caller splits its
        call into on this rank (>= 1), sent along with the dispatch; `agreed_chunks(batch)` is then the
        largest count of any rank, so that every rank runs as many chunks."""
        weights_TK = weights_TK if self.reads_any_weight_dtype else weights_TK.float()
        if chunks is not None and not self.agrees_chunks:
            raise ValueError(f"dispatcher {self.name!r} agrees no chunk count (agrees_chunks is False)")
        if chunks is not None and (type(chunks) is not int or chunks < 1):
            raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
        args = (x_TD.contiguous(), ids_TK.contiguous(), weights_TK.contiguous())
        with on_device(x_TD.device):
            return self._dispatch(*args) if chunks is None else self._dispatch(*args, chunks=chunks)

    @property
    def carries_chunks(self) -> bool:
        """Whether each dispatch carries its caller's chunk count to the other ranks (`agrees_chunks` over
        more than one rank), so that `start_chunk_count` needs no collective."""
        return self.world_size > 1 and self.agrees_chunks

    def start_chunk_count(self, chunks: int, device: torch.device) -> Callable[[ExpertBatch], int]:
        """How many chunks every rank runs for a call this rank cuts into `chunks`: the largest over the
        ranks. Returns its reader, which takes the call's first batch: with one rank, `chunks`; with a
        dispatcher free of host syncs, 1 (its callers make one chunk); with `carries_chunks`, the count
        that came back with the first dispatch (`agreed_chunks`); else an all-reduce queued now (on a GPU
        on a stream of its own, so that its read waits for the other ranks' hosts to get here, not for the
        work queued on the stream), which the reader waits for (a host sync): read after the first chunk
        is queued, it finds the round trip over."""
        if self.world_size == 1:
            return lambda batch: chunks
        if not self.needs_host_sync:
            return lambda batch: 1
        if self.carries_chunks:
            return self.agreed_chunks
        stream = None
        if device.type == "cuda":
            if self._chunks_stream is None:
                self._chunks_stream = torch.cuda.Stream(device)
            stream = self._chunks_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            n = torch.full((1,), chunks, dtype=torch.int64, device=device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)

        def read(batch: ExpertBatch) -> int:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                return int(n.item())
        return read

    def agreed_chunks(self, batch: ExpertBatch) -> int:
        """The largest `chunks` any rank passed to `dispatch_checked` for the dispatch that returned
        batch (dispatchers with `agrees_chunks`; known on the host with the batch, no sync of its own)."""
        if not self.agrees_chunks:
            raise ValueError(f"dispatcher {self.name!r} agrees no chunk count (agrees_chunks is False)")
        return self._agreed_chunks(batch)

    def _agreed_chunks(self, batch: ExpertBatch) -> int:
        raise NotImplementedError(f"dispatcher {self.name!r} sets agrees_chunks but has no _agreed_chunks")

    def combine(self, y: torch.Tensor, batch: ExpertBatch, *, weighted: bool = False) -> torch.Tensor:
        """Return expert outputs to their source ranks and sum them per token with the top-k weights.

        Args:
            y: expert outputs in `batch`'s layout ([N, D] or [L, M, D]) and cfg.dtype.
            batch: the ExpertBatch this dispatcher returned for the same call.
            weighted: y's rows are already multiplied by their top-k weights (batch.weights_N, which
                must be set: `experts(batch, weighted=True)`), so they are only summed.

        Returns:
            out_TD: [T, D] in cfg.dtype, in the order x_TD had; a token with no expert gets zeros.
        """
        self.check_output(y, batch)
        if weighted and batch.weights_N is None:
            raise ValueError(f"combine(weighted=True) needs a batch with weights_N, which {self.name!r} does not set")
        with on_device(y.device):
            return self._combine_weighted(y, batch) if weighted else self._combine(y, batch)

    def _combine_weighted(self, y: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        """The combine of rows already weighted by batch.weights_N (dispatchers that set it)."""
        raise NotImplementedError(f"dispatcher {self.name!r} sets weights_N but has no _combine_weighted")

    def check_same_config(self, fingerprints_R: list[int]) -> None:
        """ValueError unless every rank's cfg.fingerprint() (as exchanged by the dispatcher, the same list on
        every rank) equals this rank's: a rank built from another config would send rows of another size."""
        others = [r for r, f in enumerate(fingerprints_R) if f != self.cfg_fingerprint]
        if others:
            raise ValueError(f"dispatcher {self.name!r}: rank(s) {others} were built from another MoEConfig than "
                             f"rank {self.rank}'s ({self.cfg}); every rank must build the layer from the same config")

    def check_output(self, y: torch.Tensor, batch: ExpertBatch) -> None:
        """Refuse expert outputs that do not match `batch`'s shape or cfg.dtype (ValueError)."""
        if y.shape != batch.out_shape:
            raise ValueError(f"expert output shape {tuple(y.shape)} != batch shape {tuple(batch.out_shape)}")
        if y.dtype != self.cfg.dtype:
            raise ValueError(f"expert output dtype {y.dtype} does not match cfg.dtype {self.cfg.dtype}")

    @abstractmethod
    def _dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> ExpertBatch:
        """The dispatch itself; a dispatcher with `agrees_chunks` also takes `chunks=` (an int >= 1) and
        implements `_agreed_chunks(batch)`."""

    @abstractmethod
    def _combine(self, y: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        ...


class Experts(torch.nn.Module, ABC):
    """Runs the local experts, y = (silu(x W1^T) * (x W3^T)) W2^T per expert, on an ExpertBatch.

    A torch module: the local weights are its buffers once loaded (`w13` [L, 2F, D], `w2` [L, D, F],
    and for fp8_block `w13_scale` float32 [L, ceil(2F/128), ceil(D/128)], `w2_scale` float32
    [L, ceil(D/128), ceil(F/128)]; None before `load`), so `state_dict()` holds them.

    Subclasses declare `name`, the `layouts` they accept, `quants` (cfg.quant values) they support and
    whether they read rows through a batch's row_index_N (`reads_row_index`); batches with a row index
    are materialized (one copy) for those that do not. `applies_weights`: they can multiply each output
    row by its top-k weight (batch.weights_N) in the down projection (`forward(batch, weighted=True)`).
    `syncs_host`: a forward reads device values on the host (so no CUDA graph can capture it).
    """

    name: ClassVar[str]
    layouts: ClassVar[frozenset[Layout]]
    quants: ClassVar[frozenset[str | None]]
    reads_row_index: ClassVar[bool] = False
    applies_weights: ClassVar[bool] = False
    syncs_host: ClassVar[bool] = False

    def __init__(self, cfg: MoEConfig, num_local_experts: int, device: torch.device | str) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_local_experts = num_local_experts
        self._device = torch.device(device)
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            self.register_buffer(name, None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """`load_state_dict` into experts not loaded yet (their buffers None) takes the weights through `load`
        (kept as views where they need no conversion, as `load` keeps them), and counts w13 / w2 as missing
        where the state lacks them; loaded experts copy into their buffers as any module's do."""
        w13, w2 = state_dict.get(prefix + "w13"), state_dict.get(prefix + "w2")
        if self.w13 is None and (w13 is None or w2 is None):
            missing_keys.extend(prefix + name for name, t in (("w13", w13), ("w2", w2)) if t is None)
        elif self.w13 is None:
            scales = {name: state_dict.get(prefix + name) for name in ("w13_scale", "w2_scale")}
            try:
                self.load(w13, w2, **scales)
            except ValueError as exc:
                error_msgs.append(f"{prefix or 'experts'}: {exc}")
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @property
    def device(self) -> torch.device:
        """Where the weights are (where they were built to be, before `load`)."""
        return self._device if self.w13 is None else self.w13.device

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "Experts":
        """`.to(device)`, `.cuda()`, `.cpu()` move the weights; they keep their dtypes (cfg.dtype, or fp8 with
        float32 scales). ValueError, before anything moves, for a cast of cfg.dtype to another dtype or a
        device these experts cannot run on."""
        device = moved_device(fn, self.cfg, self.device, f"experts {self.name!r}")
        ok, reason = self.availability(self.cfg, device)
        if not ok:
            raise ValueError(f"experts {self.name!r} cannot run on {device}: {reason}")
        super()._apply(lambda t: t.to(device), recurse)
        self._device = device
        return self

    @classmethod
    def availability(cls, cfg: MoEConfig, device: torch.device) -> tuple[bool, str]:
        """(available, reason) for this config on `device`, without side effects."""
        if cfg.quant not in cls.quants:
            return False, f"quant={cfg.quant!r} not supported"
        return True, "ok"

    def load(self, w13_LND: torch.Tensor, w2_LDF: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
             w2_scale: torch.Tensor | None = None) -> None:
        """Take this rank's expert weights (N = 2F: F gate rows, then F up rows) and prepare them once.

        Unquantized weights (any float dtype) are cast to cfg.dtype, or quantized when cfg.quant is
        "fp8_block". Weights already in fp8_block form (a checkpoint's float8_e4m3fn weights with
        their block scales, `weight_scale_inv`: w ~= w_fp8 * scale per 128x128 block) are taken as they
        are, never dequantized: w13_LND / w2_LDF float8_e4m3fn and w13_scale float32 [L, ceil(2F/128),
        ceil(D/128)], w2_scale float32 [L, ceil(D/128), ceil(F/128)].
        """
        L, F, D = self.num_local_experts, self.cfg.intermediate_size, self.cfg.hidden_size
        # buffers: no gradient reaches the tensors given (views of them stay views)
        w13_LND, w2_LDF, w13_scale, w2_scale = (None if t is None else t.detach()
                                                for t in (w13_LND, w2_LDF, w13_scale, w2_scale))
        if w13_LND.shape != (L, 2 * F, D):
            raise ValueError(f"w13 must be [L={L}, 2F={2 * F}, D={D}], got {tuple(w13_LND.shape)}")
        if w2_LDF.shape != (L, D, F):
            raise ValueError(f"w2 must be [L={L}, D={D}, F={F}], got {tuple(w2_LDF.shape)}")
        if (w13_scale is None) != (w2_scale is None):
            raise ValueError("give both w13_scale and w2_scale, or neither")
        if w13_scale is None:
            for name, w in (("w13", w13_LND), ("w2", w2_LDF)):
                if not w.is_floating_point() or w.dtype == FP8_DTYPE:
                    raise ValueError(f"{name} must be unquantized floating point weights (or fp8 with its "
                                     f"scales), got {w.dtype}")
            self._load(w13_LND.to(self.device), w2_LDF.to(self.device))
            return
        if self.cfg.quant != "fp8_block":
            raise ValueError(f"fp8 weights with scales need cfg.quant='fp8_block', cfg.quant is {self.cfg.quant!r}")
        for name, w, scale, rows, cols in (("w13", w13_LND, w13_scale, 2 * F, D), ("w2", w2_LDF, w2_scale, D, F)):
            if w.dtype != FP8_DTYPE:
                raise ValueError(f"{name} with a scale must be {FP8_DTYPE}, got {w.dtype}")
            want = (L, num_groups(rows), num_groups(cols))
            if scale.shape != want or scale.dtype != torch.float32:
                raise ValueError(f"{name}_scale must be float32 {list(want)}, got {scale.dtype} {tuple(scale.shape)}")
        self._load_fp8(*(t.to(self.device).contiguous() for t in (w13_LND, w13_scale, w2_LDF, w2_scale)))

    def _load_fp8(self, w13_LND: torch.Tensor, w13_scale: torch.Tensor, w2_LDF: torch.Tensor,
                  w2_scale: torch.Tensor) -> None:
        """Keep pre-quantized fp8_block weights as they are (validated by `load`)."""
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13_LND, w13_scale, w2_LDF, w2_scale

    def forward(self, batch: ExpertBatch, weighted: bool = False) -> torch.Tensor:
        """y [*batch.out_shape] in batch's layout, dtype cfg.dtype; rows past the counts are unspecified.
        weighted: each row multiplied by batch.weights_N (needs `applies_weights` and weights_N), for
        `Dispatcher.combine(y, batch, weighted=True)`."""
        if weighted and not (self.applies_weights and batch.weights_N is not None):
            raise ValueError(f"experts {self.name!r} weight no rows (applies_weights {self.applies_weights}, "
                             f"batch.weights_N {'set' if batch.weights_N is not None else 'None'})")
        if self.w13 is None:
            raise ValueError(f"experts {self.name!r} hold no weights yet: call load() (FusedMoE.load_experts) first")
        if batch.layout not in self.layouts:
            raise ValueError(f"experts {self.name!r} do not accept the {batch.layout.value} layout")
        if batch.num_local_experts != self.num_local_experts:
            raise ValueError(
                f"batch has {batch.num_local_experts} local experts, experts hold {self.num_local_experts}")
        with on_device(self.device):
            batch = batch if self.reads_row_index else batch.materialize()
            return self._forward(batch, weighted) if weighted else self._forward(batch)

    @abstractmethod
    def _load(self, w13_LND: torch.Tensor, w2_LDF: torch.Tensor) -> None:
        """Store unquantized weights (on self.device) as the buffers, quantizing them when cfg.quant asks."""

    @abstractmethod
    def _forward(self, batch: ExpertBatch) -> torch.Tensor:
        """y of the batch; experts with `applies_weights` also take `weighted` (rows times weights_N)."""


def moved_device(fn: Callable[[torch.Tensor], torch.Tensor], cfg: MoEConfig, device: torch.device,
                 owner: str) -> torch.device:
    """The device that torch.nn.Module._apply's `fn` (from `.to()`, `.cuda()`, `.half()`, ...) takes a
    cfg.dtype tensor on `device` to; ValueError, naming `owner`, if it would also change its dtype or
    cannot run (a device torch does not have: its AssertionError or RuntimeError)."""
    try:
        probe = fn(torch.empty(0, dtype=cfg.dtype, device=device))
    except (AssertionError, RuntimeError) as e:
        raise ValueError(f"{owner} cannot move from {device}: {e}") from e
    if probe.dtype != cfg.dtype:
        raise ValueError(f"{owner} computes in cfg.dtype={cfg.dtype} and cannot be cast to {probe.dtype}: build "
                         f"it from a MoEConfig with dtype={probe.dtype} instead")
    return probe.device


def check_pairing(dispatcher: Dispatcher | type[Dispatcher], experts: Experts | type[Experts]) -> None:
    """The one place where a dispatcher's layout is checked against what an experts implementation takes."""
    if dispatcher.layout not in experts.layouts:
        accepted = sorted(layout.value for layout in experts.layouts)
        raise ValueError(f"dispatcher {dispatcher.name!r} produces the {dispatcher.layout.value} layout, "
                         f"experts {experts.name!r} accept only {accepted}")
