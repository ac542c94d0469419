"""The frozen arguments of the `ht` launchers: one rank's workspace buffers and the address tables of
those that peers write (epmoe/kernels/sync.py, `peer_ptr`).

Buffers that change per call exist twice (parity = epoch % 2, the epoch being a device counter in the
workspace); flags are monotonic (see epmoe/kernels/ht/__init__.py). Shape letters: R ranks, C capacity
(max tokens per rank), D hidden size, K top-k, G = ceil(D / 128) fp8 scale groups, NI combine items per
source rank (`combine_items`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HtPeers:
    """int64 [R] address tables (each rank's address of the buffer of the same name in HtBuffers)."""

    recv_x: torch.Tensor
    recv_scale: torch.Tensor | None  # fp8 dispatch only
    recv_ids: torch.Tensor
    recv_w: torch.Tensor
    recv_count: torch.Tensor
    pairs: torch.Tensor
    chunks: torch.Tensor
    comb: torch.Tensor
    comb_ready: torch.Tensor
    dispatch_flag: torch.Tensor
    meta_flag: torch.Tensor


@dataclass(frozen=True)
class HtBuffers:
    """One rank's `ht` workspace, as the launchers take it (views made once).

    Written by the senders: recv_x [2, R, C, D] (cfg.dtype, or float8_e4m3fn) and recv_scale [2, R, C, G]
    float32 (fp8 dispatch only, else None): the rows from each rank; recv_ids int32 / recv_w float32
    [2, R, C, K]: their destination-local ids (-1 none) and top-k weights; recv_count / pairs / chunks
    int32 [2, R]: the rows and (row, slot) pairs each rank sends here, and its caller's chunk count;
    meta_flag / dispatch_flag int64 [R]: each rank's signals of its numbering and of its rows. Written
    by the peers' combines: comb [2, R, C, D] cfg.dtype (row (r, s): rank r's partial row of this rank's
    token in slot s there) and comb_ready int64 [R, NI] (the epoch of the latest item i rank r stored
    here). This rank's own: control int32 [3] (the combine's tickets and finished programs, back to 0
    after each call; control[2]: the error flag of every device-side wait), number_done int32 [1] (the
    numbering's finished programs, back to 0), dispatch_seq / combine_seq int64 [1] (the epochs,
    advanced on the device; 64 bits like every flag compared with them).
    """

    rank: int
    recv_x: torch.Tensor
    recv_scale: torch.Tensor | None
    recv_ids: torch.Tensor
    recv_w: torch.Tensor
    recv_count: torch.Tensor
    pairs: torch.Tensor
    chunks: torch.Tensor
    comb: torch.Tensor
    comb_ready: torch.Tensor
    control: torch.Tensor
    dispatch_flag: torch.Tensor
    meta_flag: torch.Tensor
    number_done: torch.Tensor
    dispatch_seq: torch.Tensor
    combine_seq: torch.Tensor
    peers: HtPeers

    @property
    def world_size(self) -> int:
        return self.recv_count.shape[1]

    @property
    def capacity(self) -> int:
        return self.recv_x.shape[2]

    @property
    def fp8(self) -> bool:
        return self.recv_scale is not None
