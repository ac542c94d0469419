"""`triton` experts: grouped GEMMs in Triton for both layouts, bf16/fp16/fp32 or fp8 block-128.

Shape letters: L local experts, N rows of a contiguous batch, M rows per expert slot (batched),
R rows seen by the kernels (N, or L*M), D hidden size, F intermediate size, G = ceil(D / 128).

Pipeline per call, with no host sync: [quantize x per token per 128 columns, when cfg.quant is
"fp8_block" and the dispatcher did not: in the gate-up kernel for the batched layout, a separate pass
for the contiguous one] -> gate-up GEMM with SiLU-and-mul in its epilogue (fp8: h
re-quantized there, or by `quantize_act` when the tile does not cover a whole scale group) -> down GEMM.
Rows past the counts (and past offsets_L1[L]) are never computed; their outputs are unspecified. A
contiguous batch's row index is applied inside the gate-up kernel (rows are read through it), and its
top-k weights (weights_N, `weighted=True`) in the down kernel's epilogue.
"""
from __future__ import annotations

import os

import torch

from ..interfaces import ExpertBatch, Experts, Layout
from ..kernels.grouped_gemm import ExpertRows, down, gate_up
from ..quant import FP8_DTYPE, quantize_weights_ref


class TritonExperts(Experts):
    name = "triton"
    layouts = frozenset({Layout.CONTIGUOUS, Layout.BATCHED})
    quants = frozenset({None, "fp8_block"})
    reads_row_index = True
    applies_weights = True

    @classmethod
    def availability(cls, cfg, device) -> tuple[bool, str]:
        """Available on CUDA devices; on the CPU only under the Triton interpreter.

        Triton itself is switched to its interpreter by the TRITON_INTERPRET=1 environment variable, so
        that variable is read here, only to report availability; it changes no behaviour.
        """
        ok, reason = super().availability(cfg, device)
        if not ok:
            return ok, reason
        device = torch.device(device)
        if device.type == "cuda":
            return (True, "ok") if torch.cuda.is_available() else (False, "CUDA is not available")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return True, "ok (Triton interpreter)"
        return False, "needs CUDA or TRITON_INTERPRET=1"

    def _load(self, w13_LND: torch.Tensor, w2_LDF: torch.Tensor) -> None:
        if self.cfg.quant == "fp8_block":
            self.w13, self.w13_scale = quantize_weights_ref(w13_LND)
            self.w2, self.w2_scale = quantize_weights_ref(w2_LDF)
        else:
            self.w13 = w13_LND.to(self.cfg.dtype).contiguous()
            self.w2 = w2_LDF.to(self.cfg.dtype).contiguous()

    def _batched_rows_hint(self, slot_rows: int) -> int:
        """Expected rows per expert of a batched batch, for the launch config: the M slots are sized for
        the worst case, the counts are on the device; with uniform routing at full batch each local
        expert gets max_tokens_per_rank * R * K / E = max_tokens_per_rank * K / L rows (R = E / L)."""
        full = -(-self.cfg.max_tokens_per_rank * self.cfg.top_k // self.num_local_experts)
        return max(1, min(slot_rows, full))

    def _forward(self, batch: ExpertBatch, weighted: bool = False) -> torch.Tensor:
        x, D = batch.x, self.cfg.hidden_size
        if x.shape[-1] != D:
            raise ValueError(f"batch rows have {x.shape[-1]} columns, expected D={D}")
        if batch.layout is Layout.CONTIGUOUS:
            rows = ExpertRows.contiguous(batch.offsets_L1)
            hint = None  # the mean N / L
        else:
            rows = ExpertRows.batched_slots(batch.counts_L, x.shape[1])
            hint = self._batched_rows_hint(x.shape[1])
        x_RD = x.reshape(-1, D)
        x_scale = None if batch.x_scale is None else batch.x_scale.reshape(x_RD.shape[0], -1)
        if self.cfg.quant == "fp8_block":
            if x.dtype == FP8_DTYPE and x_scale is None:
                raise ValueError("fp8 batch.x needs batch.x_scale")
            if x.dtype != FP8_DTYPE and x.dtype != self.cfg.dtype:
                raise ValueError(f"batch.x dtype {x.dtype} is neither fp8 nor cfg.dtype {self.cfg.dtype}")
        elif x.dtype != self.cfg.dtype:
            raise ValueError(f"batch.x dtype {x.dtype} does not match cfg.dtype {self.cfg.dtype} (quant=None)")
        h, h_scale = gate_up(x_RD, self.w13, rows, x_scale_RG=x_scale, w13_scale=self.w13_scale,
                             x_rows_R=batch.row_index_N, rows_hint=hint)
        y = down(h, self.w2, rows, h_scale_RG=h_scale, w2_scale=self.w2_scale, out_dtype=self.cfg.dtype,
                 rows_hint=hint, row_scale_R=batch.weights_N if weighted else None, follows_gate_up=True)
        return y.view(batch.out_shape)
