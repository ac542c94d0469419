"""`grouped_mm` experts: torch's grouped GEMM (torch._grouped_mm) for the contiguous layout, bf16.

Shape letters: L local experts, N rows of the batch, D hidden size, F intermediate size.

Two grouped GEMMs with SiLU-and-mul in torch (float32) between them. torch._grouped_mm takes
int32 cumulative row ends `offs` = offsets_L1[1:] (no host sync) and the weights as [L, K, N] views
with K contiguous (w.transpose(1, 2) of our [L, N, K] weights, no copy). Since torch 2.8 only the
strides and base pointers must be 16-byte aligned (D and F multiples of 8 in bf16); group sizes
need no padding. Rows past offsets_L1[L] are outside every group; their outputs are unspecified.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F_

from ..interfaces import ExpertBatch, Experts, Layout

_ALIGN = 8  # 16 bytes of bf16


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


class GroupedMMExperts(Experts):
    name = "grouped_mm"
    layouts = frozenset({Layout.CONTIGUOUS})
    quants = frozenset({None})

    @classmethod
    def availability(cls, cfg, device) -> tuple[bool, str]:
        """Needs torch._grouped_mm (CUDA builds since torch 2.8; CPU kernel since 2.9), bf16, D and F
        multiples of 8."""
        ok, reason = super().availability(cfg, device)
        if not ok:
            return ok, reason
        device = torch.device(device)
        if not hasattr(torch, "_grouped_mm"):
            return False, f"torch {torch.__version__} has no torch._grouped_mm"
        if device.type == "cuda" and not torch.cuda.is_available():
            return False, "CUDA is not available"
        if device.type == "cpu" and _torch_version() < (2, 9):
            return False, f"torch {torch.__version__} has no CPU kernel for torch._grouped_mm"
        if device.type not in ("cuda", "cpu"):
            return False, f"no torch._grouped_mm on {device.type}"
        if cfg.dtype != torch.bfloat16:
            return False, f"torch._grouped_mm takes bfloat16, cfg.dtype is {cfg.dtype}"
        if cfg.hidden_size % _ALIGN or cfg.intermediate_size % _ALIGN:
            return False, (f"hidden_size={cfg.hidden_size} and intermediate_size={cfg.intermediate_size} "
                           f"must be multiples of {_ALIGN} (16-byte strides)")
        return True, "ok"

    def _load(self, w13_LND: torch.Tensor, w2_LDF: torch.Tensor) -> None:
        self.w13 = w13_LND.to(self.cfg.dtype).contiguous()
        self.w2 = w2_LDF.to(self.cfg.dtype).contiguous()

    def _forward(self, batch: ExpertBatch) -> torch.Tensor:
        x = batch.x
        if x.dtype != self.cfg.dtype:
            raise ValueError(f"batch.x dtype {x.dtype} does not match cfg.dtype {self.cfg.dtype}")
        if x.shape[0] == 0:
            return torch.empty_like(x)
        F = self.cfg.intermediate_size
        offs = batch.offsets_L1[1:].to(torch.int32, copy=True)  # own buffer: 16-byte aligned
        gate_up = torch._grouped_mm(x.contiguous(), self.w13.transpose(1, 2), offs=offs, out_dtype=x.dtype)
        h = (F_.silu(gate_up[:, :F].float()) * gate_up[:, F:].float()).to(x.dtype)
        return torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offs, out_dtype=x.dtype)
