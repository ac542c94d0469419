"""The `ht` combine, as the ranks run it, chosen once at construction (`Combine`).

- `FusedCombine`: ranks in processes of their own: the whole combine is one kernel (epmoe/kernels/ht/
  combine.py) whose local items spin until the peers' partial rows of their tokens are here.
- `SplitCombine`: ranks emulated in one process, which run in turn: combine_send runs the remote half
  (partial rows to their sources) and combine_recv, once every rank's remote half has run, the local
  half (the sums), so that no wait is for a later phase.

Shape letters: T tokens on this rank, D hidden size, N batch rows.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import torch

from ...kernels.ht import combine as kernels
from .handles import HtCombinePending, HtHandle
from .workspace import HtSetup


class Combine(ABC):
    """combine_send / combine_recv of one rank."""

    def __init__(self, setup: HtSetup, dtype: torch.dtype) -> None:
        self.setup, self.dtype = setup, dtype

    def _args(self, y_ND: torch.Tensor, h: HtHandle) -> kernels.CombineArgs:
        """The call's arguments, with a new out_TD [T, D]; the epoch: the combine's own counter, which its
        remote half advances."""
        b = self.setup.buffers
        out_TD = torch.empty(h.num_tokens, b.comb.shape[3], dtype=self.dtype, device=self.setup.device)
        return kernels.CombineArgs(y_ND=y_ND, pos_PK=h.pos_PK, weights_PK=h.weights_PK, counts_R=h.recv_counts_R,
                                   slot_TR=h.slot_TR, seq_1=b.combine_seq, out_TD=out_TD)

    @abstractmethod
    def send(self, y_ND: torch.Tensor, h: HtHandle) -> HtCombinePending:
        """Start the combine of expert outputs y_ND [N, D] (checked, contiguous)."""

    def recv(self, pending: HtCombinePending) -> torch.Tensor:
        """out_TD [T, D]: the sums, once the combine has run."""
        return pending.out_TD

    def _launch(self, args: kernels.CombineArgs, *, remote: bool, local: bool) -> None:
        s = self.setup
        kernels.combine(s.buffers, args, s.launch, s.wait, remote=remote, local=local)


class FusedCombine(Combine):
    """The whole combine in one kernel (the local items trailing the remote ones)."""

    def send(self, y_ND: torch.Tensor, h: HtHandle) -> HtCombinePending:
        args = self._args(y_ND, h)
        self._launch(args, remote=True, local=True)
        return HtCombinePending(out_TD=args.out_TD, local_half=None)


class SplitCombine(Combine):
    """The remote half in send, the local half in recv."""

    def send(self, y_ND: torch.Tensor, h: HtHandle) -> HtCombinePending:
        args = self._args(y_ND, h)
        self._launch(args, remote=True, local=False)
        # the local half runs later (emulated ranks may share the counter): this call's epoch, as the remote
        # half left it
        return HtCombinePending(out_TD=args.out_TD, local_half=dataclasses.replace(args, seq_1=args.seq_1.clone()))

    def recv(self, pending: HtCombinePending) -> torch.Tensor:
        self._launch(pending.local_half, remote=False, local=True)
        return pending.out_TD
