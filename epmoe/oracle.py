"""The independent oracle of a whole MoE layer, in float64: what `epmoe check`, `epmoe soak` and the tests
compare every dispatcher and experts implementation with.

It shares no code with the dispatchers, the experts, the layout helpers or `epmoe.quant`: a plain loop
over the experts, each running the tokens that chose it (dense matrix products in float64), summed with
the top-k weights. fp8_block is modelled from the format's definition, written out here again: weights
rounded to float8_e4m3fn per 128x128 block with a float32 scale amax(|block|) / 448, activations (the
layer's input and the expert's intermediate h) per token per 128 columns the same way. The rounding of
bf16 intermediates and of partial sums between ranks is not modelled: the tolerances
(`epmoe.testing.TOLERANCES`) cover it.

Shape letters: T tokens, D hidden size, F intermediate size, E experts, K top-k, n rows of one expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F_

_BLOCK = 128  # fp8_block's group width (activations) and block side (weights)
_E4M3 = torch.float8_e4m3fn
_E4M3_LARGEST = 448.0
_SMALLEST_AMAX = 1e-10  # the format's floor for a group's amax (an all-zero group keeps a finite scale)


def fp8_round_trip_rows(x_nD: torch.Tensor) -> torch.Tensor:
    """x rounded through fp8 e4m3 per row per 128 columns, float64: each group's float32 scale is
    amax(|group|) / 448 (amax at least 1e-10), x / scale is rounded to e4m3 and multiplied back."""
    x = x_nD.float()
    out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    for c0 in range(0, x.shape[-1], _BLOCK):
        group = x[..., c0:c0 + _BLOCK]
        scale = group.abs().amax(dim=-1, keepdim=True).clamp_min(_SMALLEST_AMAX) / _E4M3_LARGEST
        q = (group / scale).clamp(-_E4M3_LARGEST, _E4M3_LARGEST).to(_E4M3)
        out[..., c0:c0 + _BLOCK] = q.double() * scale.double()
    return out


def fp8_round_trip_matrix(w_ND: torch.Tensor) -> torch.Tensor:
    """w [N, D] rounded through fp8 e4m3 per 128x128 block, float64 (float32 scale per block: amax(|block|)
    / 448, amax at least 1e-10)."""
    w = w_ND.float()
    out = torch.empty(w.shape, dtype=torch.float64, device=w.device)
    for r0 in range(0, w.shape[0], _BLOCK):
        for c0 in range(0, w.shape[1], _BLOCK):
            block = w[r0:r0 + _BLOCK, c0:c0 + _BLOCK]
            scale = block.abs().max().clamp_min(_SMALLEST_AMAX) / _E4M3_LARGEST
            q = (block / scale).clamp(-_E4M3_LARGEST, _E4M3_LARGEST).to(_E4M3)
            out[r0:r0 + _BLOCK, c0:c0 + _BLOCK] = q.double() * scale.double()
    return out


def _gated(x_nD: torch.Tensor, w13_ND: torch.Tensor, w2_DF: torch.Tensor, fp8: bool) -> torch.Tensor:
    """(silu(x W1^T) * (x W3^T)) W2^T in float64 for float64 operands; fp8: h rounded through fp8 first."""
    F = w2_DF.shape[1]
    gate_up = x_nD @ w13_ND.t()
    h = F_.silu(gate_up[:, :F]) * gate_up[:, F:]
    return (fp8_round_trip_rows(h) if fp8 else h) @ w2_DF.t()


@dataclass(frozen=True)
class MoERef:
    """A MoE layer's oracle, its weights held in float64 (rounded through fp8 once when `fp8`); build it
    with `MoERef.build`. Calling it gives

        out[t] = routed_scaling_factor * sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) (+ shared(x[t]))

    in float64, expert_e(x) = (silu(x W1^T) * (x W3^T)) W2^T with w13 = [W1; W3]; fp8: x and h rounded
    through fp8 per token per 128 columns first (`fp8_round_trip_rows`).
    """

    w13_END: torch.Tensor
    w2_EDF: torch.Tensor
    fp8: bool
    routed_scaling_factor: float
    shared_w13_ND: torch.Tensor | None
    shared_w2_DF: torch.Tensor | None

    @staticmethod
    def build(w13_END: torch.Tensor, w2_EDF: torch.Tensor, *, fp8: bool = False, routed_scaling_factor: float = 1.0,
              shared: tuple[torch.Tensor, torch.Tensor] | None = None,
              device: torch.device | str | None = None) -> "MoERef":
        """Args:
            w13_END: [E, 2F, D] (F gate rows, then F up rows), w2_EDF: [E, D, F]: the GLOBAL weights in any
                float dtype, unquantized (with fp8 they are rounded here, as the layer rounds them).
            fp8: model cfg.quant == "fp8_block".
            shared: (w13 [2F', D], w2 [D, F']) of one shared expert, never quantized (FusedMoE's GatedMLP).
            device: where the oracle computes (default: the weights' device).
        """
        device = w13_END.device if device is None else torch.device(device)
        if fp8:
            w13 = torch.stack([fp8_round_trip_matrix(w) for w in w13_END]) if len(w13_END) else w13_END.double()
            w2 = torch.stack([fp8_round_trip_matrix(w) for w in w2_EDF]) if len(w2_EDF) else w2_EDF.double()
        else:
            w13, w2 = w13_END.double(), w2_EDF.double()
        s13, s2 = (None, None) if shared is None else (shared[0].double().to(device), shared[1].double().to(device))
        return MoERef(w13_END=w13.to(device), w2_EDF=w2.to(device), fp8=fp8,
                      routed_scaling_factor=float(routed_scaling_factor), shared_w13_ND=s13, shared_w2_DF=s2)

    def __call__(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """float64 [T, D] on the oracle's device.

        Args:
            x_TD: [T, D] any float dtype (T may be 0).
            ids_TK: int [T, K] global expert ids; -1 = no expert (skipped); an id named twice by one token
                counts twice.
            weights_TK: float [T, K], used as given.
        """
        device = self.w13_END.device
        x64 = x_TD.to(device).double()
        x = fp8_round_trip_rows(x64) if self.fp8 else x64
        ids = ids_TK.to(device).long()
        w = weights_TK.to(device).double()
        out = torch.zeros(x.shape, dtype=torch.float64, device=device)
        for e in torch.unique(ids[ids >= 0]).tolist():
            chosen_TK = ids == e
            t = chosen_TK.any(dim=1).nonzero()[:, 0]
            weight_n = torch.where(chosen_TK[t], w[t], 0.0).sum(dim=1)
            out[t] += weight_n[:, None] * _gated(x[t], self.w13_END[e], self.w2_EDF[e], self.fp8)
        out *= self.routed_scaling_factor
        if self.shared_w13_ND is not None:
            out += _gated(x64, self.shared_w13_ND, self.shared_w2_DF, fp8=False)
        return out


def route_ref(logits_TE: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
              num_groups: int | None = None, topk_groups: int | None = None,
              correction_bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing token by token in float64 on the host, from its definition: (weights float64 [T, K],
    ids int64 [T, K]), the K columns in descending order of the choice score.

    scores = softmax(logits) or sigmoid(logits); the choice ranks scores (+ correction_bias_E). With groups
    (num_groups groups of E / num_groups consecutive experts) a token keeps the topk_groups groups of the
    highest group score (softmax: the group's best choice score; sigmoid: the sum of its best two) and
    picks its K experts there. Weights are the chosen experts' scores, divided by their sum if
    renormalize. Meant for small T (a Python loop); equal scores have no defined order, so feed it logits
    without ties.
    """
    logits = logits_TE.detach().double().cpu()
    E = logits.shape[1]
    bias = [0.0] * E if correction_bias_E is None else correction_bias_E.double().cpu().tolist()
    weights, ids = [], []
    for row in logits:
        if scoring == "softmax":
            scores = (row - row.max()).exp()
            scores = (scores / scores.sum()).tolist()
        else:
            scores = (1 / (1 + (-row).exp())).tolist()
        choice = [s + b for s, b in zip(scores, bias)]
        allowed = range(E)
        if num_groups is not None and topk_groups < num_groups:
            size = E // num_groups
            group_score = []
            for g in range(num_groups):
                best = sorted(choice[g * size:(g + 1) * size], reverse=True)
                group_score.append(best[0] if scoring == "softmax" else sum(best[:2]))
            kept = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
            allowed = [e for g in kept for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append(w)
        ids.append(chosen)
    shape = (logits.shape[0], top_k)
    return (torch.tensor(weights, dtype=torch.float64).reshape(shape),
            torch.tensor(ids, dtype=torch.int64).reshape(shape))
