"""What the phases of one `ht` call hand on: dispatch_send -> dispatch_recv (HtDispatchPending), the
batch's routing state -> combine (HtHandle), combine_send -> combine_recv (HtCombinePending).

Shape letters: T tokens on this rank, D hidden size, K top-k, R ranks, P = R*C receive rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...interfaces import DispatchHandle
from ...kernels.ht.combine import CombineArgs
from .layout import HtLayout


@dataclass(frozen=True)
class HtEarlySlot:
    """Events of one dispatch's side-stream work (host-synced mode over a process group). A dispatcher
    makes two and uses them in turn: a slot is recorded again two dispatches later, after its
    dispatch's receive has waited for it."""

    numbered: torch.cuda.Event  # recorded on the stream after the numbering kernels (ids and weights sent);
    #   unused in dense mode, whose numbering runs on the side stream
    ready: torch.cuda.Event  # recorded on the side stream after the layout kernels (and, with the copy
    #   engine, the wait for every rank's rows)


@dataclass(frozen=True)
class HtEarly:
    """A dispatch's layout (and, with the copy engine, wait for its rows), queued on the side stream
    while the rows travel."""

    slot: HtEarlySlot
    layout: HtLayout


@dataclass(frozen=True)
class HtDispatchPending:
    """What dispatch_send hands to dispatch_recv (and, through the handle, to combine)."""

    slot_TR: torch.Tensor  # int32 [T, R]: row of token t in rank r's receive region, -1 if not sent
    epoch_1: torch.Tensor  # int64 [1]: the call's epoch
    epoch: int | None  # the same on the host (None in sync_free mode, which does not read the batch size)
    early: HtEarly | None  # host-synced mode over a process group; else dispatch_recv makes the layout
    num_tokens: int


@dataclass(frozen=True)
class HtHandle(DispatchHandle):
    """Routing state of one dispatch, consumed by combine. Holds no view of the workspace."""

    slot_TR: torch.Tensor  # int32 [T, R], as in HtDispatchPending
    pos_PK: torch.Tensor  # int32 [P, K]: batch row of received pair (row p, slot k), -1 if none; rows
    #   p = r * C + s with s >= recv_counts_R[r] are unset (never read)
    weights_PK: torch.Tensor  # float32 [P, K]: top-k weights of the received rows (same validity)
    recv_counts_R: torch.Tensor  # int32 [R]: rows received from each rank
    num_tokens: int
    max_chunks: int | None  # the largest chunk count any rank's caller passed (None: sync_free, not read)


@dataclass(frozen=True)
class HtCombinePending:
    """What combine_send hands to combine_recv: the output, complete unless `local_half` is set (ranks run
    in turn: combine_recv runs the local half of the combine with these arguments)."""

    out_TD: torch.Tensor  # [T, D] cfg.dtype
    local_half: CombineArgs | None
