"""`reference` experts: plain torch, any device, both layouts; the oracle the kernels are checked against.

Shape letters: L local experts, D hidden size, F intermediate size, n rows of one expert, G = ceil(D/128).
Numerics: float32 matmuls; the intermediate h = silu(gate) * up is rounded to cfg.dtype (or, for
fp8_block, re-quantized per 128 columns) before the down projection, as the kernels store it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F_

from ..interfaces import ExpertBatch, Experts, Layout
from ..quant import dequantize_act_ref, dequantize_weight_ref, quantize_act_ref, quantize_weight_ref


def expert_mlp_ref(x_nD: torch.Tensor, w13_ND: torch.Tensor, w2_DF: torch.Tensor, h_dtype: torch.dtype,
                   fp8: bool) -> torch.Tensor:
    """One expert on float32 inputs: (silu(x W1^T) * (x W3^T)) W2^T, float32 [n, D]."""
    F = w2_DF.shape[1]
    gate_up = x_nD @ w13_ND.t()
    h = F_.silu(gate_up[:, :F]) * gate_up[:, F:]
    h = dequantize_act_ref(*quantize_act_ref(h)) if fp8 else h.to(h_dtype).float()
    return h @ w2_DF.t()


class ReferenceExperts(Experts):
    name = "reference"
    layouts = frozenset({Layout.CONTIGUOUS, Layout.BATCHED})
    quants = frozenset({None, "fp8_block"})
    syncs_host = True  # the loop over experts reads their row counts on the host

    def _load(self, w13_LND, w2_LDF) -> None:
        if self.cfg.quant == "fp8_block":
            self.w13, self.w13_scale = quantize_weight_ref(w13_LND)
            self.w2, self.w2_scale = quantize_weight_ref(w2_LDF)
        else:
            self.w13, self.w2 = w13_LND.to(self.cfg.dtype), w2_LDF.to(self.cfg.dtype)

    def _weights(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.quant == "fp8_block":
            return (dequantize_weight_ref(self.w13[l], self.w13_scale[l]),
                    dequantize_weight_ref(self.w2[l], self.w2_scale[l]))
        return self.w13[l].float(), self.w2[l].float()

    def _activations(self, batch: ExpertBatch) -> torch.Tensor:
        """float32 activations as the kernels see them (dequantized fp8 when quant is fp8_block)."""
        if batch.x_scale is not None:
            return dequantize_act_ref(batch.x, batch.x_scale)
        if self.cfg.quant == "fp8_block":
            return dequantize_act_ref(*quantize_act_ref(batch.x))
        return batch.x.float()

    def _forward(self, batch: ExpertBatch) -> torch.Tensor:
        x = self._activations(batch)
        y = torch.zeros(batch.x.shape, dtype=self.cfg.dtype, device=batch.x.device)
        counts = batch.counts_L.tolist()  # host sync: the reference loops over experts on the host
        fp8 = self.cfg.quant == "fp8_block"
        if batch.layout is Layout.CONTIGUOUS:
            offsets = batch.offsets_L1.tolist()
            for l, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
                if hi > lo:
                    y[lo:hi] = expert_mlp_ref(x[lo:hi], *self._weights(l), self.cfg.dtype, fp8).to(y.dtype)
        else:
            for l, n in enumerate(counts):
                if n:
                    y[l, :n] = expert_mlp_ref(x[l, :n], *self._weights(l), self.cfg.dtype, fp8).to(y.dtype)
        return y
