"""Top-k routing: from router logits to per-token expert ids and weights.

Shape letters: T tokens, E experts, K top-k, G expert groups.
"""
from __future__ import annotations

import torch

from .config import SCORINGS, MoEConfig
from .kernels.routing import MAX_EXPERTS, route_topk

_UNSET = object()


def check_logits(logits_TE: torch.Tensor, E: int, correction_bias_E: torch.Tensor | None, scoring: str) -> None:
    """ValueError unless logits_TE is a float [T, E] tensor and correction_bias_E, if given, is [E] on
    its device with sigmoid scoring."""
    if logits_TE.dim() != 2 or logits_TE.shape[1] != E:
        raise ValueError(f"logits_TE must be [T, E={E}], got {tuple(logits_TE.shape)}")
    if not logits_TE.is_floating_point():
        raise ValueError(f"logits_TE must be a float tensor, got {logits_TE.dtype}")
    if correction_bias_E is not None:
        if correction_bias_E.shape != (E,):
            raise ValueError(f"correction_bias_E must be [E={E}], got {tuple(correction_bias_E.shape)}")
        if correction_bias_E.device != logits_TE.device:
            raise ValueError(f"correction_bias_E is on {correction_bias_E.device}, logits_TE on {logits_TE.device}")
        if scoring != "sigmoid":
            raise ValueError("correction_bias_E is used only with sigmoid scoring")


def route(
    logits_TE: torch.Tensor,
    cfg: MoEConfig,
    *,
    correction_bias_E: torch.Tensor | None = None,
    scoring: str | None = None,
    renormalize: bool | None = None,
    num_groups: int | None | object = _UNSET,
    topk_groups: int | None | object = _UNSET,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's top-k experts.

    Variants (settings default to `cfg`'s, keyword arguments override them):
      - softmax top-k (Mixtral, Qwen-MoE): scores = softmax(logits); with `renormalize` the K weights
        are rescaled to sum to 1.
      - DeepSeek-V2 grouped softmax: as softmax, but each token first keeps the `topk_groups` groups
        (of E / num_groups consecutive experts) with the highest max score, then picks K among them.
      - DeepSeek-V3: scores = sigmoid(logits); the choice uses scores + correction_bias_E; a group's
        rank is the sum of its two best biased scores; weights are the unbiased scores of the chosen
        experts, renormalized if asked.
    The chosen weights are finally multiplied by `routed_scaling_factor` (default 1; FusedMoE applies
    cfg.routed_scaling_factor itself, to the top-k weights it routes with, whoever chose them).

    Args:
        logits_TE: router logits [T, E], any float dtype, any device.
        cfg: the layer's MoEConfig (E, K and the routing defaults).
        correction_bias_E: float [E] added to the scores for the choice only (sigmoid scoring).

    Returns:
        weights_TK: float32 [T, K], the weight of each chosen expert.
        ids_TK: int32 [T, K], global expert ids in [0, E), distinct per token; the K columns are in
            descending order of the score used for the choice.

    On a GPU (E <= 4096) one Triton kernel does it all (`epmoe.kernels.routing.route_topk`: of equal
    scores it takes the lower expert id, its weights can differ from the torch version's in the last
    bits, and they carry no gradient, so logits that require one take the torch version); elsewhere
    torch operations.
    """
    scoring = cfg.scoring if scoring is None else scoring
    renormalize = cfg.renormalize if renormalize is None else renormalize
    num_groups = cfg.num_groups if num_groups is _UNSET else num_groups
    topk_groups = cfg.topk_groups if topk_groups is _UNSET else topk_groups
    E, K = cfg.num_experts, cfg.top_k
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    check_logits(logits_TE, E, correction_bias_E, scoring)
    if (num_groups is None) != (topk_groups is None):
        raise ValueError("num_groups and topk_groups must be given together")
    if num_groups is not None and (E % num_groups or not 1 <= topk_groups <= num_groups
                                   or topk_groups * (E // num_groups) < K):
        raise ValueError(f"num_groups={num_groups}, topk_groups={topk_groups} do not fit E={E}, K={K}")

    if _use_kernel(logits_TE, E):
        return route_topk(logits_TE, K, sigmoid=scoring == "sigmoid", correction_bias_E=correction_bias_E,
                          num_groups=num_groups, topk_groups=topk_groups, renormalize=renormalize,
                          routed_scaling_factor=routed_scaling_factor)
    return _route_torch(logits_TE, K, scoring, correction_bias_E, num_groups, topk_groups, renormalize,
                        routed_scaling_factor)


def _use_kernel(logits_TE: torch.Tensor, E: int) -> bool:
    """Whether route runs `route_topk` (one launch) rather than its torch version (~16): on a GPU, unless
    the weights must carry gradients to the logits (the kernel's do not)."""
    return logits_TE.is_cuda and E <= MAX_EXPERTS and not (logits_TE.requires_grad and torch.is_grad_enabled())


def _route_torch(logits_TE: torch.Tensor, K: int, scoring: str, correction_bias_E: torch.Tensor | None,
                 num_groups: int | None, topk_groups: int | None, renormalize: bool,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """route's choice in torch operations, for validated inputs (the CPU's, and the kernel's reference)."""
    E = logits_TE.shape[1]
    logits_TE = logits_TE.float()
    if scoring == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
        choice_TE = scores_TE
    else:
        scores_TE = torch.sigmoid(logits_TE)
        choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.float()

    if num_groups is not None and topk_groups < num_groups:
        T = logits_TE.shape[0]
        choice_TGe = choice_TE.view(T, num_groups, E // num_groups)
        if scoring == "sigmoid":
            top2 = min(2, E // num_groups)
            group_score_TG = choice_TGe.topk(top2, dim=-1).values.sum(dim=-1)
        else:
            group_score_TG = choice_TGe.amax(dim=-1)
        keep_groups = group_score_TG.topk(topk_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, keep_groups, True)
        keep_TE = keep_TG.unsqueeze(-1).expand_as(choice_TGe).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))

    ids_TK = choice_TE.topk(K, dim=-1).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if routed_scaling_factor != 1.0:
        weights_TK = weights_TK * routed_scaling_factor
    return weights_TK.float(), ids_TK.to(torch.int32)
