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

from ..interfaces import DispatchHandle, Dispatcher, ExpertBatch, Layout
from ._layout import gather_sum, sort_pairs

# torch 2.13 renamed these (same signatures) and warns on the old names; torch 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class AllGatherHandle(DispatchHandle):
    pos_PK: torch.Tensor  # int32 [R*Tm, K] batch row of each gathered (token, slot), -1 for other ranks' experts
    weights_PK: torch.Tensor  # [R*Tm, K] float32
    num_tokens: int  # T of this rank
    max_tokens: int  # Tm


def _all_gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    _all_gather_single(out, t.contiguous(), group=group)
    return out


class AllGatherDispatcher(Dispatcher):
    """All-gather of x/ids/weights padded to the largest T (one host sync for the T exchange, which also
    carries each rank's config fingerprint, and one for the row count), laid out as a row index into the
    gathered rows; then a float32 reduce-scatter of the partial sums (one kernel) in combine."""

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
        lay = sort_pairs(ids_all, L, first_expert=self.first_expert, weights_PK=w_all)
        n = int(lay.offsets_L1[-1])  # host sync: size the batch to the valid rows
        return ExpertBatch(layout=Layout.CONTIGUOUS, x=x_all, x_scale=None, counts_L=lay.counts_L,
                           offsets_L1=lay.offsets_L1, row_index_N=lay.rows_N[:n], weights_N=lay.weights_N[:n],
                           handle=AllGatherHandle(lay.pos_PK, w_all, T, Tm))

    def _combine(self, y, batch) -> torch.Tensor:
        return self._reduce(y, batch, batch.handle.weights_PK)

    def _combine_weighted(self, y, batch) -> torch.Tensor:
        return self._reduce(y, batch, None)

    def _reduce(self, y, batch, weights_PK: torch.Tensor | None) -> torch.Tensor:
        h: AllGatherHandle = batch.handle
        partial = gather_sum(y, h.pos_PK, torch.float32, weights_PK)
        mine = partial.new_empty(h.max_tokens, partial.shape[1])
        _reduce_scatter_single(mine, partial, group=self.group)
        return mine[: h.num_tokens].to(self.cfg.dtype)
