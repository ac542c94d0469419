"""FusedMoE: route -> dispatch -> experts -> combine (+ shared experts), composed in one place.

Shape letters: T tokens on this rank, D hidden size, F intermediate size, E global experts,
L local experts, K top-k.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F_

from .config import MoEConfig
from .graphs import GraphPool, RoutedGraphs
from .interfaces import Dispatcher, ExpertBatch, check_pairing, check_tokens, check_x, moved_device, on_device
from .kernels.graph_io import rows_contiguous
from .registry import default_device, make_dispatcher, make_experts
from .routing import check_logits, route
from .symm import group_rank_world


class GatedMLP(torch.nn.Module):
    """A dense SiLU-gated MLP, out = (silu(x W1^T) * (x W3^T)) W2^T; usable as FusedMoE's shared experts.

    Weights: w13 [2F, D] (F gate rows, then F up rows), w2 [D, F].
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, dtype=dtype, device=device),
                                      requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.empty(hidden_size, intermediate_size, dtype=dtype, device=device),
                                     requires_grad=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate, up = (x_TD @ self.w13.t()).chunk(2, dim=-1)
        return (F_.silu(gate) * up) @ self.w2.t()


class FusedMoE(torch.nn.Module):
    """An expert-parallel MoE layer.

    Args:
        cfg: shapes, precision and routing settings (the same on every rank).
        group: process group of the expert-parallel ranks; None = single rank. Rank r of the group
            owns global experts [r*L, (r+1)*L), L = E / R.
        dispatcher: a dispatcher name (see `epmoe.list_dispatchers`), "auto", or a Dispatcher built for
            this cfg and group, for options a name cannot carry: e.g. `HtDispatcher(cfg, group,
            sync_free=True)` makes a layer with no host sync, which a CUDA graph can capture (with `ll`
            by name too).
        experts: an experts name (see `epmoe.list_experts`) or "auto".
        shared_experts: optional module mapping x_TD -> [T, D], added to the routed output (which is
            scaled by cfg.routed_scaling_factor first); it sees the whole local batch, as [T, D].
        device: where activations and local weights live (default: current CUDA device, else CPU);
            ValueError for a CUDA device that is not there.
        cuda_graphs: on one GPU with a dispatcher and experts free of host syncs (`local`, `triton`
            or `grouped_mm`), replay the routed part
            (dispatch, experts, combine) as a CUDA graph per bucket of token counts (epmoe.graphs) for
            calls of up to `graphs.max_tokens` tokens, where queueing the eager kernels would take the
            host longer than the GPU takes to run them; calls inside a CUDA graph capture of the caller's
            run eagerly (and are captured with it). A call with caller-given ids whose inputs the replay
            reads as given (`RoutedGraphs.reads_as_given`: [T, D] x, [T, K] ids and weights, unit column
            strides; no shared experts, no strict_ids) goes straight to the replay, its few comparisons
            the only checks (the same results; anything else is checked first). graph_pool: an
            `epmoe.graphs.GraphPool` on the layer's device to share with other layers that never run at
            the same time (a model's MoE
            layers: their graphs then share one pool of intermediates and one set of static inputs per
            bucket); graph_max_tokens: the largest call replayed (default: what fits in
            epmoe.graphs.GRAPH_MAX_BYTES, at most max_tokens_per_rank).
        strict_ids: read caller-given ids' range on the host before any work (one host sync a call),
            refusing ids outside [-1, E) with ValueError before anything runs. By default a dispatcher
            that checks ids on the device (`local` on a GPU) syncs nothing: a bad id's token gets a NaN
            row and the next call (or `check_errors()`) raises ValueError naming the id; other
            dispatchers read the ids on the host anyway.

    Construction is collective for dispatchers that set up shared buffers: call it on every rank.

    Module state: after `load_experts`, this rank's expert weights are buffers of the `experts`
    submodule, so `state_dict()` holds `experts.w13` [L, 2F, D] and `experts.w2` [L, D, F] (and for
    fp8_block `experts.w13_scale`, `experts.w2_scale`, float32 block scales), plus the shared experts'
    own state (`shared_experts.w13`, `shared_experts.w2` for a GatedMLP); `load_state_dict` of such a state
    into a layer built with the same config (its experts not loaded yet) loads them as `load_experts` does.
    Weights that need no conversion (cfg.dtype on the layer's device; contiguous, for the `triton` and
    `grouped_mm` experts) are kept as views of the tensors given, not copies: change those tensors, and the
    layer computes with the change. No gradient reaches them (they are buffers, detached). `.to(device)` moves a
    single-rank layer (whose experts can run there); a layer over several ranks, or whose dispatcher
    keeps buffers of its own (`ht`, `ll`), stays where it was built (ValueError). The dtype is cfg.dtype:
    `.to(dtype)`, `.half()`, ... to another dtype raise ValueError; fp8 weights and their scales keep
    theirs.
    """

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup | None = None, dispatcher: str | Dispatcher = "auto",
                 experts: str = "auto", shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device: torch.device | str | None = None, strict_ids: bool = False, cuda_graphs: bool = True,
                 graph_pool: GraphPool | None = None, graph_max_tokens: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.strict_ids = strict_ids
        self.group = group
        self.device = default_device() if device is None else torch.device(device)
        if self.device.type == "cpu":
            self.device = torch.device("cpu")  # "cpu:0" too: CPU tensors report "cpu"
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {str(device)!r}: no CUDA device is visible here "
                                 "(torch.cuda.is_available() is False)")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            elif self.device.index >= torch.cuda.device_count():
                raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA devices are visible")
        self.rank, self.world_size = group_rank_world(group)
        self.num_local_experts = cfg.local_experts(self.world_size)
        if isinstance(dispatcher, Dispatcher):
            if dispatcher.cfg != cfg or dispatcher.group is not group:
                raise ValueError(f"dispatcher {dispatcher.name!r} was built for another "
                                 f"{'config' if dispatcher.cfg != cfg else 'group'} than the layer's")
            self.dispatcher = dispatcher
        else:
            self.dispatcher = make_dispatcher(dispatcher, cfg, group)
        buffers = getattr(self.dispatcher, "device", None)  # dispatchers with their own buffers (ht, ll)
        if buffers is not None and torch.device(buffers) != self.device:
            raise ValueError(f"dispatcher {self.dispatcher.name!r} keeps its buffers on {buffers}, the layer is on "
                             f"{self.device}: make the layer's device the current one (torch.cuda.set_device)")
        self.experts = make_experts(experts, cfg, self.num_local_experts, self.device, self.dispatcher.layout)
        check_pairing(self.dispatcher, self.experts)
        self.shared_experts = shared_experts
        if graph_pool is not None and not isinstance(graph_pool, GraphPool):
            raise ValueError(f"graph_pool must be an epmoe.graphs.GraphPool, got {type(graph_pool).__name__}")
        self.graphs: RoutedGraphs | None = None
        if (cuda_graphs and self.device.type == "cuda" and self.world_size == 1 and not self.dispatcher.needs_host_sync
                and not self.experts.syncs_host):
            self.graphs = RoutedGraphs(self._routed, cfg, self.device, pool=graph_pool, max_tokens=graph_max_tokens)

    def load_experts(self, w13_END: torch.Tensor, w2_EDF: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None) -> None:
        """Load GLOBAL expert weights and keep this rank's slice (as `self.experts`' buffers).

        Args:
            w13_END: [E, 2F, D], per expert F gate rows then F up rows, in any float dtype; or, with
                cfg.quant "fp8_block", float8_e4m3fn checkpoint weights with
            w13_scale: float32 [E, ceil(2F/128), ceil(D/128)], their 128x128 block scales
                (`weight_scale_inv`: w ~= w_fp8 * scale), taken as they are (never dequantized).
            w2_EDF: [E, D, F] (fp8 with w2_scale float32 [E, ceil(D/128), ceil(F/128)]).
        """
        E, F, D = self.cfg.num_experts, self.cfg.intermediate_size, self.cfg.hidden_size
        if w13_END.shape != (E, 2 * F, D):
            raise ValueError(f"w13 must be [E={E}, 2F={2 * F}, D={D}], got {tuple(w13_END.shape)}")
        if w2_EDF.shape != (E, D, F):
            raise ValueError(f"w2 must be [E={E}, D={D}, F={F}], got {tuple(w2_EDF.shape)}")
        mine = slice(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)
        scales = {name: None if t is None else t[mine] for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale))}
        self.experts.load(w13_END[mine], w2_EDF[mine], **scales)
        if self.graphs is not None:
            self.graphs.clear()

    def check_errors(self) -> None:
        """Raise ValueError if the device caught bad input in an earlier call (an id outside [-1, E) with
        a dispatcher that checks ids on the device; see `strict_ids`). A host sync."""
        self.dispatcher.check_device_errors()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "FusedMoE":
        """`.to()`, `.cuda()`, `.cpu()`, `.half()`, ...: see the class docstring; refused (ValueError)
        before anything moves."""
        device = moved_device(fn, self.cfg, self.device, "FusedMoE")
        if device != self.device:
            if self.world_size > 1 or getattr(self.dispatcher, "device", None) is not None:
                raise ValueError(f"FusedMoE with dispatcher {self.dispatcher.name!r} over {self.world_size} rank(s) "
                                 f"stays on {self.device}, where it was built: build it on {device} instead")
            ok, reason = self.experts.availability(self.cfg, device)
            if not ok:
                raise ValueError(f"experts {self.experts.name!r} cannot run on {device}: {reason}")
        super()._apply(fn, recurse)
        self.device = device
        if self.graphs is not None:
            self.graphs.move(device)
        return self

    def _chunks_of(self, x_TD: torch.Tensor) -> int:
        """This rank's chunks of cfg.max_tokens_per_rank tokens (every rank runs at least one)."""
        return max(1, -(-x_TD.shape[0] // self.cfg.max_tokens_per_rank))

    def _routed(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                chunks: Callable[[ExpertBatch], int] | None = None) -> torch.Tensor:
        """routed_scaling_factor * the routed experts' weighted sum [T, D]: dispatch, experts and combine,
        in chunks of cfg.max_tokens_per_rank (as many on every rank; `chunks`: the agreed count's reader,
        `Dispatcher.start_chunk_count`, started by the caller or here). No host sync of its own with a
        dispatcher free of them (what `graphs` captures)."""
        T, step = x_TD.shape[0], self.cfg.max_tokens_per_rank
        if self.cfg.routed_scaling_factor != 1.0:
            # in the top-k weights, in float32, so that the combine's float32 sum holds it before its one
            # rounding to cfg.dtype (scaled after, a float16 sum could overflow on the way to a finite
            # result; scaled in a caller's bfloat16 weights, each weight would be rounded once more)
            weights_TK = weights_TK.float() * self.cfg.routed_scaling_factor
        mine = self._chunks_of(x_TD)
        chunks = chunks or self.dispatcher.start_chunk_count(mine, x_TD.device)
        sent = mine if self.dispatcher.carries_chunks else None  # the count that goes with each dispatch
        outs = []
        chunk, num_chunks = 0, None
        while chunk != num_chunks:
            lo, hi = min(chunk * step, T), min((chunk + 1) * step, T)
            batch = self.dispatcher.dispatch_checked(x_TD[lo:hi], ids_TK[lo:hi], weights_TK[lo:hi], chunks=sent)
            # the top-k weights in the experts' down projection where both sides can (no pass of their own)
            weighted = self.experts.applies_weights and batch.weights_N is not None
            outs.append(self.dispatcher.combine(self.experts(batch, weighted=weighted), batch, weighted=weighted))
            # the agreed count is read once the first chunk is queued: with the batch's size (agreeing
            # dispatchers), or a host sync on the all-reduce, over by then
            num_chunks = num_chunks or chunks(batch)
            chunk += 1
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _as_tokens(self, x_TD: torch.Tensor, *rest: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """x_TD [..., D] and the other inputs given ([..., E] or [..., K], with x_TD's leading dims) as
        [T, D] / [T, E] / [T, K], T the product of the leading dims (views where the strides allow)."""
        D = self.cfg.hidden_size
        if x_TD.dim() == 2 and x_TD.shape[1] == D:  # [T, D] and [T, .]: as given (a call's host time counts)
            T = x_TD.shape[0]
            for t in rest:
                if t is not None and (t.dim() != 2 or t.shape[0] != T):
                    break
            else:
                return (x_TD, *rest)
        if x_TD.dim() == 0 or x_TD.shape[-1] != D:
            raise ValueError(f"x_TD must be [..., D={D}], got {tuple(x_TD.shape)}")
        lead = x_TD.shape[:-1]
        for name, t in zip(("logits_TE", "weights_TK", "ids_TK"), rest):
            if t is not None and (t.dim() == 0 or t.shape[:-1] != lead):
                last = "E" if name == "logits_TE" else "K"
                raise ValueError(f"{name} must be [..., {last}] with x_TD's leading dims {tuple(lead)}, got "
                                 f"{tuple(t.shape)}")
        return tuple(t if t is None or t.dim() == 2 else t.reshape(-1, t.shape[-1]) for t in (x_TD, *rest))

    def _check_inputs(self, x_TD: torch.Tensor, logits_TE: torch.Tensor | None, weights_TK: torch.Tensor | None,
                      ids_TK: torch.Tensor | None, correction_bias_E: torch.Tensor | None) -> None:
        """Every check of forward's arguments, before anything is queued or sent: a rank that raised after
        the chunk count's all-reduce would be a collective ahead of its peers. Caller-given ids: their
        range is read on the host (a sync, here before the shared experts' work is queued); the
        router's are in range by construction."""
        if logits_TE is not None and (weights_TK is not None or ids_TK is not None):
            raise ValueError("give either logits_TE or (weights_TK, ids_TK), not both")
        if logits_TE is None and (weights_TK is None or ids_TK is None):
            raise ValueError("give logits_TE, or both weights_TK and ids_TK")
        if logits_TE is None and correction_bias_E is not None:
            raise ValueError("correction_bias_E corrects the routing of logits_TE: with weights_TK and ids_TK "
                             "given there is none to correct")
        if x_TD.device != self.device:
            raise ValueError(f"x_TD is on {x_TD.device}, the layer on {self.device}")
        if logits_TE is None:
            read_ids = self.strict_ids or self.dispatcher.reads_ids_on_host(x_TD)
            check_tokens(self.cfg, x_TD, ids_TK, weights_TK, read_ids=read_ids)
        else:
            check_x(self.cfg, x_TD)
            if logits_TE.device != x_TD.device:
                raise ValueError(f"logits_TE is on {logits_TE.device}, x_TD on {x_TD.device}")
            check_logits(logits_TE, self.cfg.num_experts, correction_bias_E, self.cfg.scoring)
            if logits_TE.shape[0] != x_TD.shape[0]:
                raise ValueError(f"logits_TE has {logits_TE.shape[0]} rows, x_TD {x_TD.shape[0]}")
        T = x_TD.shape[0]
        if self.world_size > 1 and not self.dispatcher.needs_host_sync and T > self.cfg.max_tokens_per_rank:
            raise ValueError(f"dispatcher {self.dispatcher.name!r} takes at most max_tokens_per_rank="
                             f"{self.cfg.max_tokens_per_rank} tokens per call, got {T} (it has no host sync to "
                             "agree on a chunk count with the other ranks)")

    def forward(self, x_TD: torch.Tensor, logits_TE: torch.Tensor | None = None, *,
                weights_TK: torch.Tensor | None = None, ids_TK: torch.Tensor | None = None,
                correction_bias_E: torch.Tensor | None = None) -> torch.Tensor:
        """out_TD = routed_scaling_factor * sum_k w[t,k] * expert_{ids[t,k]}(x[t]) (+ shared_experts(x)).

        Args:
            x_TD: [T, D] in cfg.dtype, on this layer's device; T may be 0 (the rank still takes part). Or
                any [..., D], e.g. a model's [B, S, D]: the leading dims are the tokens, and the other
                token inputs have them too ([..., E], [..., K]).
            logits_TE: router logits [T, E], on x_TD's device, routed with cfg's settings; or else give both
            weights_TK: float [T, K] and ids_TK: int [T, K] (-1 = no expert) from the caller's own gate.
            correction_bias_E: float [E], DeepSeek-V3's score correction bias (sigmoid scoring).

        Returns:
            out_TD: [T, D] (x_TD's shape) in cfg.dtype.

        Raises ValueError where autograd would need gradients (grad mode on and x_TD, logits_TE or weights_TK
        requiring them) through a path with no backward (the Triton kernels, the CUDA graphs and the
        collectives record none), after the call: run inference under torch.no_grad() or
        torch.inference_mode().

        A layer on a GPU other than the current one (a model split over GPUs) makes its own device the
        current one for the call, where its kernels are launched and its CUDA graphs captured.
        """
        with on_device(self.device):
            return self._forward(x_TD, logits_TE, weights_TK, ids_TK, correction_bias_E)

    def _forward(self, x_TD: torch.Tensor, logits_TE: torch.Tensor | None, weights_TK: torch.Tensor | None,
                 ids_TK: torch.Tensor | None, correction_bias_E: torch.Tensor | None) -> torch.Tensor:
        """`forward` on the layer's device."""
        graphs = self.graphs
        if (graphs is not None and logits_TE is None and weights_TK is not None and ids_TK is not None
                and correction_bias_E is None and not self.strict_ids and self.shared_experts is None
                and not (torch.is_grad_enabled() and (x_TD.requires_grad or weights_TK.requires_grad))
                and graphs.reads_as_given(x_TD, ids_TK, weights_TK) and not self.dispatcher.reads_ids_on_host(x_TD)):
            # a framework's every call (its router's ids and weights, as the graph reads them): none of the
            # general path's reshaping, checks or copies apply (a call's host time counts at a few hundred
            # tokens, where the GPU's work takes a few hundred microseconds)
            self.dispatcher.check_device_errors(wait=False)  # what earlier replays caught
            return graphs.replay_checked(x_TD, ids_TK, weights_TK)
        shape = x_TD.shape
        wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                     for t in (x_TD, logits_TE, weights_TK))
        x_TD, logits_TE, weights_TK, ids_TK = self._as_tokens(x_TD, logits_TE, weights_TK, ids_TK)
        self._check_inputs(x_TD, logits_TE, weights_TK, ids_TK, correction_bias_E)
        # The shared experts first: their GPU work runs while the host routes and queues the dispatch (~1 ms
        # of host time at 4096 tokens on 2 H200s, during which an idle GPU would wait; with a dispatcher
        # that agrees no chunk count, also the all-reduce that agrees it, ~150-250 µs)
        shared_TD = None if self.shared_experts is None else self.shared_experts(x_TD)
        if shared_TD is not None and shared_TD.shape != x_TD.shape:
            raise ValueError(f"shared_experts must map x_TD {tuple(x_TD.shape)} to the same shape, gave "
                             f"{tuple(shared_TD.shape)}")
        graphed = graphs is not None and graphs.takes(x_TD)
        chunks = None if graphed else self.dispatcher.start_chunk_count(self._chunks_of(x_TD), x_TD.device)
        if logits_TE is not None:
            weights_TK, ids_TK = route(logits_TE, self.cfg, correction_bias_E=correction_bias_E)
        if graphed:
            self.dispatcher.check_device_errors(wait=False)  # what earlier replays caught (the graph's host
            #   code, where the dispatcher would look, does not run again)
            out_TD = graphs.replay_checked(rows_contiguous(x_TD), rows_contiguous(ids_TK), rows_contiguous(weights_TK))
        else:
            out_TD = self._routed(x_TD, ids_TK, weights_TK, chunks)
        if wants_grad and not out_TD.requires_grad:
            raise ValueError(f"FusedMoE (dispatcher {self.dispatcher.name!r}, experts {self.experts.name!r}) has no "
                             "backward on this path, and its inputs require gradients: call it under "
                             "torch.no_grad() or torch.inference_mode()")
        if shared_TD is not None:
            out_TD += shared_TD
        return out_TD if len(shape) == 2 else out_TD.view(shape)
