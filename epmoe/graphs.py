"""CUDA graphs of a one-GPU layer's routed part (dispatch, experts, combine): one graph per bucket of token
counts, captured on first use and replayed, so that a call costs the host three small operations instead
of the kernels and allocations the eager path queues (about 0.4-0.5 ms of host time on the H200
machine, more than the GPU needs for a few hundred tokens).

Shape letters: T tokens of a call, B the bucket's tokens (T rounded up to a power of two, at most the
graphs' max_tokens: a cap of 3000 tokens makes the buckets 1, 2, 4, ..., 2048 and 3000), D hidden size, K top-k.

A call allocates its output, points the bucket's address table at its x, ids, weights and output
(`epmoe.kernels.graph_io`: a 72-byte row of pinned host memory that the graph reads) and replays. The
graph's first kernels fetch that row and copy the call's T rows into the bucket's static inputs (rows
past T get ids -1: they route nowhere), its last one copies the routed output's T rows into the caller's
output tensor, which the caller owns: the next replay does not touch it. The graphs of a layer share one
`GraphPool` (replays never run at once): a CUDA graph memory pool for their intermediates, and one set of static inputs and address table
per bucket. A pool may be shared by several layers' graphs (e.g. every MoE layer of a model), whose
memory then is that of one layer's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .config import MoEConfig
from .interfaces import ID_DTYPES, check_tokens
from .kernels.graph_io import IOTable, rows_contiguous
from .symm import indexed_device

# The most bytes a bucket's graph may hold in its pool (intermediates of the routed part): 16384 tokens of
# Qwen3-30B-A3B's or DeepSeek-V2-Lite's shapes (1.4 GB), whose eager calls cost the host 0.7-1.6 ms, 45-62%
# of the GPU's work, on the H200 machine (bench moe). Larger buckets run eagerly, where the GPU's work
# outlasts the host's by more (DeepSeek-V3, Mixtral-8x7B at 16384 tokens: host 5-10%).
GRAPH_MAX_BYTES = 2 << 30


def bucket_bytes(cfg: MoEConfig, tokens: int) -> int:
    """Estimated pool bytes of a bucket: per (token, slot) the gate-up output and h and the expert output,
    per token x's quantized copy, the output, and the layout's int32 tables."""
    item = torch.empty((), dtype=cfg.dtype).element_size()
    D, F, K = cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    return tokens * (K * (D + 3 * F + 16) * item + 3 * D * item)


def max_bucket(cfg: MoEConfig, max_bytes: int = GRAPH_MAX_BYTES) -> int:
    """The most tokens a graph takes: cfg.max_tokens_per_rank (one chunk; the top bucket, a power of two
    or not) if its bucket fits within max_bytes, else the largest power of two below it that does; 0 if
    not even one token fits."""
    b = cfg.max_tokens_per_rank
    if bucket_bytes(cfg, b) <= max_bytes:
        return b
    b = 1 << (b.bit_length() - 1)
    while b and bucket_bytes(cfg, b) > max_bytes:
        b //= 2
    return b


@dataclass
class _Static:
    """A bucket's static inputs (outside the graphs' pool) and address table, shared by the graphs reading them."""

    x_BD: torch.Tensor
    ids_BK: torch.Tensor
    weights_BK: torch.Tensor
    io: IOTable


class GraphPool:
    """Memory for the CUDA graphs of layers that never replay at the same time (a model's MoE layers, run
    one after another on one stream): one graph memory pool for the graphs' intermediates, and one set of
    static inputs and address table per bucket, shape and dtypes. Give the same GraphPool to those layers
    (`FusedMoE(graph_pool=...)`): their graphs then hold about one layer's memory, not one per layer.

    Args:
        device: the GPU ("cuda": the current one).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = indexed_device(device)
        self.handle = torch.cuda.graph_pool_handle()
        self._static: dict[tuple, _Static] = {}

    def static(self, B: int, D: int, K: int, dtype: torch.dtype, ids_dtype: torch.dtype,
               weights_dtype: torch.dtype) -> _Static:
        """The static inputs of a bucket of B tokens: x [B, D] in dtype, ids [B, K], weights [B, K], and
        their address table; made on first use."""
        key = (B, D, K, dtype, ids_dtype, weights_dtype)
        if key not in self._static:
            dev = self.device
            self._static[key] = _Static(torch.zeros(B, D, dtype=dtype, device=dev),
                                        torch.full((B, K), -1, dtype=ids_dtype, device=dev),
                                        torch.zeros(B, K, dtype=weights_dtype, device=dev), IOTable(dev))
        return self._static[key]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: _Static


class RoutedGraphs:
    """The CUDA graphs of `routed(x_TD, ids_TK, weights_TK) -> out_TD` (a layer's routed part on one GPU,
    free of host syncs), keyed by bucket and the inputs' dtypes.

    Args:
        routed: the eager function; it must make its output from its inputs alone, queue no host sync
            and keep no state between calls that a replay would miss.
        cfg: the layer's config (sizes the buckets, `max_bucket`).
        device: the GPU.
        pool: a GraphPool to share with other layers whose graphs never replay at the same time (on
            `device`); default one of its own.
        max_tokens: the largest call replayed (default `max_bucket(cfg)`; at most that).
    """

    def __init__(self, routed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], cfg: MoEConfig,
                 device: torch.device, pool: GraphPool | None = None, max_tokens: int | None = None) -> None:
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
            raise ValueError(f"graph max_tokens must be an int >= 0, got {max_tokens!r}")
        self._routed = routed
        self.cfg = cfg
        self.device = device
        self.max_tokens = max_bucket(cfg) if max_tokens is None else min(max_tokens, max_bucket(cfg))
        if pool is not None and pool.device != torch.device(device):
            raise ValueError(f"graph pool on {pool.device}, the layer on {device}")
        self._pool = pool  # made on the first capture when None
        self._graphs: dict[tuple, _Captured] = {}

    def takes(self, x_TD: torch.Tensor) -> bool:
        """Whether a call of x_TD replays a graph: 1 <= T <= max_tokens, on this GPU, and no capture of
        the caller's own is under way (then the eager path is what gets captured)."""
        return (0 < x_TD.shape[0] <= self.max_tokens and self.device.type == "cuda" and x_TD.device == self.device
                and not torch.cuda.is_current_stream_capturing())

    def reads_as_given(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> bool:
        """Whether a replay takes this call with its inputs as they are, so that `replay_checked` needs
        neither `check_tokens` nor a copy first: x_TD [T, D] in cfg.dtype with 1 <= T <= max_tokens, ids_TK
        [T, K] int32 or int64, weights_TK [T, K] float, each with unit column stride, all on this GPU, and
        no capture of the caller's under way. The few comparisons of a framework's every call; False says
        nothing about validity (check_tokens then tells)."""
        dev, cfg = self.device, self.cfg
        TK = (x_TD.shape[0] if x_TD.dim() == 2 else 0, cfg.top_k)
        return (0 < TK[0] <= self.max_tokens and x_TD.is_cuda and x_TD.shape[1] == cfg.hidden_size
                and x_TD.dtype == cfg.dtype and ids_TK.shape == TK and weights_TK.shape == TK
                and ids_TK.dtype in ID_DTYPES and weights_TK.is_floating_point() and x_TD.device == dev
                and ids_TK.device == dev and weights_TK.device == dev and x_TD.stride()[1] == 1
                and ids_TK.stride()[1] == 1 and weights_TK.stride()[1] == 1
                and not torch.cuda.is_current_stream_capturing())

    def bucket(self, T: int) -> int:
        """The tokens B of the bucket whose graph replays a call of 1 <= T <= max_tokens tokens: T rounded
        up to a power of two, at most max_tokens."""
        return min(1 << (T - 1).bit_length(), self.max_tokens)

    def clear(self) -> None:
        """Drop every graph (they hold the weights' addresses: call after the weights change)."""
        self._graphs.clear()

    def move(self, device: torch.device) -> None:
        """Drop every graph and capture the next ones on `device` (a pool on another device is let go)."""
        self.clear()
        self.device = device
        if self._pool is not None and self._pool.device != device:
            self._pool = None

    def __call__(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """out_TD [T, D] of routed(x_TD, ids_TK, weights_TK), by a replay (`takes` must hold): x_TD [T, D] in
        cfg.dtype, ids_TK int [T, K] and weights_TK float [T, K], all on the graphs' device (the graph reads
        them by address, in the dtypes it was captured for: ValueError otherwise)."""
        check_tokens(self.cfg, x_TD, ids_TK, weights_TK, read_ids=False)
        return self.replay_checked(rows_contiguous(x_TD), rows_contiguous(ids_TK), rows_contiguous(weights_TK))

    def replay_checked(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """`self(...)` for inputs that already passed `check_tokens` (FusedMoE's forward checks them, or
        `reads_as_given` held) and have unit column strides (`rows_contiguous`): a replay costs the host
        its dozen or so microseconds of checks less."""
        T = x_TD.shape[0]
        key = (self.bucket(T), ids_TK.dtype, weights_TK.dtype)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(*key)
        out_TD = torch.empty(T, self.cfg.hidden_size, dtype=self.cfg.dtype, device=self.device)
        io = g.static.io
        io.point(x_TD, ids_TK, weights_TK, out_TD)
        try:
            g.graph.replay()
        except BaseException:
            io.abandon()
            raise
        return out_TD

    def _capture(self, B: int, ids_dtype: torch.dtype, weights_dtype: torch.dtype) -> _Captured:
        if self._pool is None:
            self._pool = GraphPool(self.device)
        s = self._pool.static(B, self.cfg.hidden_size, self.cfg.top_k, self.cfg.dtype, ids_dtype, weights_dtype)
        # the capture's table: T = 0 (no rows copied, every id -1)
        s.io.point(s.x_BD[:0], s.ids_BK[:0], s.weights_BK[:0], s.x_BD[:0])

        def run() -> None:
            s.io.stage(s.x_BD, s.ids_BK, s.weights_BK)
            out_BD = self._routed(s.x_BD, s.ids_BK, s.weights_BK)
            assert out_BD.shape == s.x_BD.shape and out_BD.dtype == s.x_BD.dtype and out_BD.is_contiguous()
            s.io.unstage(out_BD)

        try:
            return _Captured(self._record(run), s)
        except BaseException:
            s.io.abandon()  # the eager run may have stopped between stage and unstage
            raise

    def _record(self, run: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """The CUDA graph of run() (after one eager run on a side stream, as torch.cuda.graph's docs ask:
        it compiles and allocates), its intermediates in the pool."""
        dev = self.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool.handle):
            run()
        return graph
