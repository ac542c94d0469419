"""`local` dispatcher: one rank owns every expert; no communication, no host sync.

Shape letters: T tokens, D hidden size, K top-k, L = E local experts, N = T*K batch rows.

Dispatch is the layout engine (epmoe/kernels/layout.py: count, scan and place kernels on a GPU): the batch
is a row index into x_TD itself (no copy of x per pair), with each row's top-k weight, so the `triton`
experts read x through the index and weight their outputs in the down projection; combine is one kernel
that sums each token's K rows in float32 and stores its row once in cfg.dtype.

Caller-given ids on a GPU are checked on the device, not read on the host: an id outside [-1, E) indexes
nothing, its token's output row is NaN, and the id is written to pinned host memory, so the next dispatch
(or `check_device_errors`, which syncs) raises ValueError naming it. On the CPU the ids are read before any
work (no sync to save there).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..interfaces import DispatchHandle, Dispatcher, ExpertBatch, Layout
from ..symm import group_rank_world
from . import _layout
from ._layout import gather_sum, sort_pairs


@dataclass(frozen=True)
class LocalHandle(DispatchHandle):
    """pos_TK: int32 [T, K] batch row of each (token, slot), -1 none, BAD_POS for a bad id;
    weights_TK: [T, K] the caller's weights (any float dtype)."""

    pos_TK: torch.Tensor
    weights_TK: torch.Tensor


class _CaughtIds:
    """The last id outside [-1, E) the layout kernels caught on each GPU: an int64 word of pinned host
    memory per device (0: none; no bad id is 0), which the kernels write through to and the host reads
    without a sync."""

    def __init__(self) -> None:
        self._words: dict[torch.device, tuple[torch.Tensor, ctypes.c_int64]] = {}

    def __deepcopy__(self, memo: dict) -> "_CaughtIds":
        """Words of its own (a copied word's host view would read the original's address), none caught yet."""
        return _CaughtIds()

    def word(self, device: torch.device) -> torch.Tensor:
        if device not in self._words:
            t = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
            self._words[device] = (t, ctypes.c_int64.from_address(t.data_ptr()))
        return self._words[device][0]

    def devices(self) -> list[torch.device]:
        return list(self._words)

    def take(self) -> int | None:
        """A caught id (clearing it), or None."""
        for _, value in self._words.values():
            if value.value:
                caught, value.value = value.value, 0
                return caught
        return None


class LocalDispatcher(Dispatcher):
    """Sorts (token, slot) pairs by expert into a contiguous batch of T*K rows given as a row index into
    x_TD (rows past offsets_L1[L] are padding: -1 ids), with weights_N. No host sync on a GPU."""

    name = "local"
    layout = Layout.CONTIGUOUS
    needs_host_sync = False
    checks_ids_on_device = True
    reads_any_weight_dtype = True

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
        self._caught = _CaughtIds()

    def check_device_errors(self, wait: bool = True) -> None:
        """Raise ValueError if an earlier dispatch on a GPU held an id outside [-1, E) (its tokens' outputs
        were NaN). With `wait`, after the GPU's queued work has run (a host sync); else what the finished
        work caught by now (no sync)."""
        for device in self._caught.devices():
            if wait and device.type == "cuda":
                torch.cuda.synchronize(device)
        self._raise_caught()

    def _raise_caught(self) -> None:
        caught = self._caught.take()
        if caught is not None:
            raise ValueError(f"ids_TK held expert id {caught}, outside [-1, E={self.cfg.num_experts}), in an earlier "
                             "call on the GPU (caught on the device: those tokens' outputs were NaN)")

    def _dispatch(self, x_TD, ids_TK, weights_TK) -> ExpertBatch:
        self._raise_caught()  # what earlier calls' kernels caught by now (no sync)
        E = self.cfg.num_experts
        # the kernels check the ids (on the CPU, check_tokens has read them)
        checked = dict(num_experts=E, bad_id_1=self._caught.word(x_TD.device)) if _layout.runs_kernels(x_TD) else {}
        lay = sort_pairs(ids_TK, E, weights_PK=weights_TK, **checked)
        return ExpertBatch(layout=Layout.CONTIGUOUS, x=x_TD, x_scale=None, counts_L=lay.counts_L,
                           offsets_L1=lay.offsets_L1, handle=LocalHandle(lay.pos_PK, weights_TK),
                           row_index_N=lay.rows_N, weights_N=lay.weights_N)

    def _combine(self, y, batch) -> torch.Tensor:
        h: LocalHandle = batch.handle
        return gather_sum(y, h.pos_TK, self.cfg.dtype, h.weights_TK)

    def _combine_weighted(self, y, batch) -> torch.Tensor:
        return gather_sum(y, batch.handle.pos_TK, self.cfg.dtype)
