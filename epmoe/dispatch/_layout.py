"""The layout engine as the portable dispatchers use it: the kernels of epmoe/kernels/layout.py on a GPU,
their torch references on the CPU (where gloo runs; the kernels themselves are tested on CPU tensors
under the Triton interpreter).

Shape letters: P rows of the id table, K slots per row, L local experts, N = P*K batch rows, D hidden size.
"""
from __future__ import annotations

import torch

from ..kernels import layout
from ..kernels.layout import BAD_POS, PairLayout

__all__ = ["BAD_POS", "PairLayout", "gather_sum", "runs_kernels", "sort_pairs"]


def runs_kernels(t: torch.Tensor) -> bool:
    """Whether the layout of tensors like t runs on the kernels (on a GPU) or on the torch references."""
    return t.is_cuda


def sort_pairs(ids_PK: torch.Tensor, num_local_experts: int, **kwargs) -> PairLayout:
    """`epmoe.kernels.layout.sort_pairs` (its arguments) on a GPU, `sort_pairs_ref` elsewhere. No host sync."""
    fn = layout.sort_pairs if runs_kernels(ids_PK) else layout.sort_pairs_ref
    return fn(ids_PK, num_local_experts, **kwargs)


def gather_sum(y_ND: torch.Tensor, pos_PK: torch.Tensor, out_dtype: torch.dtype,
               weights_PK: torch.Tensor | None = None) -> torch.Tensor:
    """`epmoe.kernels.layout.gather_sum` on a GPU, `gather_sum_ref` elsewhere: out [P, D] in out_dtype,
    the float32 sum of each row's (weighted) y rows. No host sync."""
    fn = layout.gather_sum if runs_kernels(y_ND) else layout.gather_sum_ref
    return fn(y_ND, pos_PK, out_dtype, weights_PK)
