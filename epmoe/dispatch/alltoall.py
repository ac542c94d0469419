"""`alltoall` dispatcher: a count exchange, then `all_to_all_single` moving one copy per
(token, destination rank); the received rows are laid out by the layout engine (a row index into them,
epmoe/kernels/layout.py on a GPU); combine reduces per (token, rank) at the destination (one kernel,
float32 sums) and sends one row back per pair in cfg.dtype (half the bytes of float32, as `ht` and
DeepEP send theirs: a token's result is rounded once per rank that holds its experts, then once more),
summed at the source (the same kernel). Portable: gloo, NCCL, one host or many.

Shape letters: T tokens on this rank, D hidden size, K top-k, R ranks, L local experts,
S (token, rank) pairs sent, P rows received, N (row, slot) pairs for this rank's experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..interfaces import DispatchHandle, Dispatcher, ExpertBatch, Layout
from ._layout import gather_sum, sort_pairs


@dataclass(frozen=True)
class AllToAllHandle(DispatchHandle):
    slot_TR: torch.Tensor  # int32 [T, R], row of token t among the rows sent to (and back from) all ranks, -1 none
    send_counts: list[int]  # [R] rows sent to each rank
    recv_counts: list[int]  # [R] rows received from each rank
    pos_PK: torch.Tensor  # int32 [P, K], batch row of each received (row, slot), -1 for other ranks' experts
    recv_weights_PK: torch.Tensor  # float32 [P, K]


def _as_bytes(t_SX: torch.Tensor) -> torch.Tensor:
    """uint8 [S, X * itemsize] of a [S, X] tensor; any strides (an empty or one-column tensor may carry a
    stride that a dtype view refuses)."""
    S, X = t_SX.shape
    return t_SX.contiguous().reshape(-1).view(torch.uint8).reshape(S, X * t_SX.element_size())


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    return recv


class AllToAllDispatcher(Dispatcher):
    """Two host syncs per dispatch (the pair list and the count exchange, which also carries each rank's
    config fingerprint) and one for the row count; the batch is a row index into the received rows, with
    their top-k weights (weights_N).

    Rows travel packed as bytes: [x row | K local ids (int32) | K weights (float32)], one collective.
    """

    name = "alltoall"
    layout = Layout.CONTIGUOUS

    def _dispatch(self, x_TD, ids_TK, weights_TK) -> ExpertBatch:
        R, L, g = self.world_size, self.num_local_experts, self.group
        T, D = x_TD.shape
        K = ids_TK.shape[1]
        dev = x_TD.device
        ids_TK = ids_TK.to(torch.int32)
        dest_TK = torch.where(ids_TK >= 0, ids_TK // L, R).long()
        wants_TR = torch.zeros(T, R + 1, dtype=torch.bool, device=dev).scatter_(1, dest_TK, True)[:, :R]
        pairs = wants_TR.t().nonzero()  # host sync; (rank, token) sorted by rank, then token
        send_rank_S, send_token_S = pairs[:, 0], pairs[:, 1]
        send_R2 = torch.stack([wants_TR.sum(0), torch.full((R,), self.cfg_fingerprint, device=dev)], dim=1)
        recv_R2 = torch.empty_like(send_R2)
        dist.all_to_all_single(recv_R2, send_R2, group=g)  # counts, and each rank's config fingerprint
        send_counts, (recv_counts, fingerprints) = send_R2[:, 0].tolist(), recv_R2.t().tolist()  # host sync
        self.check_same_config(fingerprints)  # on every rank alike, before rows of other sizes cross

        local_SK = ids_TK[send_token_S] - (send_rank_S * L).unsqueeze(1).to(torch.int32)
        local_SK = torch.where((ids_TK[send_token_S] >= 0) & (local_SK >= 0) & (local_SK < L), local_SK, -1)
        packed = torch.cat([_as_bytes(x_TD[send_token_S]), _as_bytes(local_SK), _as_bytes(weights_TK[send_token_S])],
                           dim=1)
        recv = _exchange(packed, send_counts, recv_counts, g)
        xb = x_TD.element_size() * D
        recv_x = recv[:, :xb].contiguous().view(x_TD.dtype)
        recv_ids = recv[:, xb:xb + 4 * K].contiguous().view(torch.int32)
        recv_w = recv[:, xb + 4 * K:].contiguous().view(torch.float32)

        lay = sort_pairs(recv_ids, L, weights_PK=recv_w)
        n = int(lay.offsets_L1[-1])  # host sync: size the batch to the valid rows
        slot_TR = torch.full((T, R), -1, dtype=torch.int32, device=dev)
        slot_TR[send_token_S, send_rank_S] = torch.arange(send_token_S.shape[0], dtype=torch.int32, device=dev)
        return ExpertBatch(layout=Layout.CONTIGUOUS, x=recv_x, x_scale=None, counts_L=lay.counts_L,
                           offsets_L1=lay.offsets_L1, row_index_N=lay.rows_N[:n], weights_N=lay.weights_N[:n],
                           handle=AllToAllHandle(slot_TR, send_counts, recv_counts, lay.pos_PK, recv_w))

    def _combine(self, y, batch) -> torch.Tensor:
        return self._send_back(y, batch, batch.handle.recv_weights_PK)

    def _combine_weighted(self, y, batch) -> torch.Tensor:
        return self._send_back(y, batch, None)

    def _send_back(self, y, batch, weights_PK: torch.Tensor | None) -> torch.Tensor:
        """One row per received (token, rank): the sum of its (weighted) expert rows, back to its source,
        where each token sums its rows from every rank (float32, then cfg.dtype)."""
        h: AllToAllHandle = batch.handle
        rows = gather_sum(y, h.pos_PK, self.cfg.dtype, weights_PK)
        back = _exchange(rows, h.recv_counts, h.send_counts, self.group)
        return gather_sum(back, h.slot_TR, self.cfg.dtype)
