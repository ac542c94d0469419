"""`allgather` dispatcher: every rank gathers every token, keeps its experts' pairs, and the partial
weighted sums go back through a reduce-scatter. The simplest multi-rank path; gloo and NCCL.

Shape letters: T tokens on this rank, Tm the largest T over ranks, R ranks, D hidden size, K top-k,
L local experts, N rows for this rank's experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F_

from ..interfaces import Dispatcher, ExpertBatch, Layout
from ._layout import PairOrder, sort_pairs, weighted_sum_to_rows

# torch 2.13 renamed these (same signatures) and warns on the old names; torch 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class AllGatherHandle:
    order: PairOrder
    local_ids_PK: torch.Tensor  # [R*Tm, K] ids local to this rank, -1 elsewhere
    weights_PK: torch.Tensor  # [R*Tm, K] float32
    num_tokens: int  # T of this rank
    max_tokens: int  # Tm


def _all_gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    _all_gather_single(out, t.contiguous(), group=group)
    return out


class AllGatherDispatcher(Dispatcher):
    """All-gather of x/ids/weights padded to the largest T (one host sync for the T exchange, which also
    carries each rank's config fingerprint, and one for the row count), then a float32 reduce-scatter of
    the partial sums in combine."""

    name = "allgather"
    layout = Layout.CONTIGUOUS

    def _dispatch(self, x_TD, ids_TK, weights_TK) -> ExpertBatch:
        R, g, L = self.world_size, self.group, self.num_local_experts
        T = x_TD.shape[0]
        meta_R2 = _all_gather(torch.tensor([[T, self.cfg_fingerprint]], dtype=torch.int64, device=x_TD.device), g, R)
        sizes, fingerprints = meta_R2.t().tolist()  # host sync
        self.check_same_config(fingerprints)  # on every rank alike, before rows of other sizes cross
        Tm = max(1, max(sizes))
        pad = Tm - T
        x_all = _all_gather(F_.pad(x_TD, (0, 0, 0, pad)), g, R)
        ids_all = _all_gather(F_.pad(ids_TK.to(torch.int32), (0, 0, 0, pad), value=-1), g, R)
        w_all = _all_gather(F_.pad(weights_TK, (0, 0, 0, pad)), g, R)
        local = ids_all - self.first_expert
        local_ids = torch.where((ids_all >= 0) & (local >= 0) & (local < L), local, -1)
        order = sort_pairs(local_ids, L)
        n = int(order.offsets_L1[-1])  # host sync: size the batch to the valid rows
        return ExpertBatch(layout=Layout.CONTIGUOUS, x=x_all[order.row_N[:n]], x_scale=None,
                           counts_L=order.counts_L, offsets_L1=order.offsets_L1,
                           handle=AllGatherHandle(order, local_ids, w_all, T, Tm))

    def _combine(self, y, batch) -> torch.Tensor:
        h: AllGatherHandle = batch.handle
        partial = weighted_sum_to_rows(y, h.order, h.weights_PK, h.local_ids_PK, h.local_ids_PK.shape[0])
        mine = partial.new_empty(h.max_tokens, partial.shape[1])
        _reduce_scatter_single(mine, partial, group=self.group)
        return mine[: h.num_tokens].to(self.cfg.dtype)
