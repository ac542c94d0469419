"""Shared layout helpers: sort (row, slot) pairs by local expert, and the weighted sum back to rows.

Shape letters: P source rows, K slots per row, L local experts, N = P*K pairs, D hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairOrder:
    """Pairs (p, k) of a [P, K] table of local expert ids, sorted by expert (stable); -1 pairs last.

    pair_N: int64 [P*K], flat pair index p*K + k of each sorted position.
    counts_L: int32 [L] valid pairs per local expert; offsets_L1: int32 [L+1] their prefix sum.
    No host sync.
    """

    pair_N: torch.Tensor
    counts_L: torch.Tensor
    offsets_L1: torch.Tensor
    slots: int

    @property
    def row_N(self) -> torch.Tensor:
        return self.pair_N // self.slots


def sort_pairs(local_ids_PK: torch.Tensor, num_local_experts: int) -> PairOrder:
    """Order the pairs of `local_ids_PK` (ids in [0, L) or -1) by expert. No host sync."""
    L = num_local_experts
    flat = local_ids_PK.reshape(-1).long()
    key = torch.where(flat < 0, torch.full_like(flat, L), flat)
    pair_N = torch.argsort(key, stable=True)
    # not torch.bincount, which reads the largest key on the host on a GPU
    counts_L = torch.zeros(L + 1, dtype=torch.int32, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key, dtype=torch.int32))[:L]
    offsets_L1 = torch.zeros(L + 1, dtype=torch.int32, device=flat.device)
    torch.cumsum(counts_L, 0, out=offsets_L1[1:])
    return PairOrder(pair_N=pair_N, counts_L=counts_L, offsets_L1=offsets_L1, slots=local_ids_PK.shape[1])


def weighted_sum_to_rows(y_ND: torch.Tensor, order: PairOrder, weights_PK: torch.Tensor,
                         local_ids_PK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """sum over k of weights_PK[p, k] * y[pair (p, k)] for each row p, float32 [P, D].

    Pairs whose id is -1 (padding rows of y, which may hold anything) contribute nothing.
    """
    D = y_ND.shape[-1]
    out = torch.zeros(num_rows, D, dtype=torch.float32, device=y_ND.device)
    n = y_ND.shape[0]
    pair = order.pair_N[:n]
    valid = local_ids_PK.reshape(-1)[pair] >= 0
    w = torch.where(valid, weights_PK.reshape(-1)[pair].float(), 0.0)
    contrib = torch.where(valid.unsqueeze(1), y_ND.float() * w.unsqueeze(1), 0.0)
    out.index_add_(0, pair // order.slots, contrib)
    return out
