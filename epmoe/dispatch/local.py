"""`local` dispatcher: one rank owns every expert; no communication.

Shape letters: T tokens, D hidden size, K top-k, L = E local experts, N = T*K rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..symm import group_rank_world
from ..interfaces import Dispatcher, ExpertBatch, Layout
from ._layout import PairOrder, sort_pairs, weighted_sum_to_rows


@dataclass(frozen=True)
class LocalHandle:
    order: PairOrder
    ids_TK: torch.Tensor
    weights_TK: torch.Tensor


class LocalDispatcher(Dispatcher):
    """Sorts (token, slot) pairs by expert into a contiguous batch of T*K rows (rows past
    offsets_L1[L] are padding for -1 ids). No host sync; combine is an fp32 weighted index-add."""

    name = "local"
    layout = Layout.CONTIGUOUS
    needs_host_sync = False

    @classmethod
    def availability(cls, cfg: MoEConfig, group: dist.ProcessGroup | None) -> tuple[bool, str]:
        if group_rank_world(group)[1] != 1:
            return False, "needs a single rank (world size 1)"
        return True, "ok"

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup | None = None, **options) -> None:
        available, reason = self.availability(cfg, group)
        if not available:
            raise ValueError(f"dispatcher 'local': {reason}")
        super().__init__(cfg, group, **options)

    def _dispatch(self, x_TD, ids_TK, weights_TK) -> ExpertBatch:
        order = sort_pairs(ids_TK, self.num_local_experts)
        return ExpertBatch(layout=Layout.CONTIGUOUS, x=x_TD[order.row_N], x_scale=None,
                           counts_L=order.counts_L, offsets_L1=order.offsets_L1,
                           handle=LocalHandle(order, ids_TK, weights_TK))

    def _combine(self, y, batch) -> torch.Tensor:
        h: LocalHandle = batch.handle
        out = weighted_sum_to_rows(y, h.order, h.weights_TK, h.ids_TK, h.ids_TK.shape[0])
        return out.to(self.cfg.dtype)
