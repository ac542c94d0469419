"""Top-k routing in one Triton kernel: scores, bias, group choice, top-k, weights, renormalization and
scaling of a block of tokens per program, in registers (epmoe.routing.route's torch version takes ~16
launches, which pace a layer timed from an idle GPU: ~350-700 µs of host time per call at 4096 tokens
on the 2 x H200 machines, against ~210 µs of GPU work; scripts/route_probe.py).

Shape letters: T tokens, E experts, K top-k, G expert groups.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Experts of one row, at most: a program holds its rows' E scores in registers.
MAX_EXPERTS = 4096
_ELEMENTS_PER_PROGRAM = 4096  # BLOCK_T * BLOCK_E


@dataclass(frozen=True)
class RouteLaunch:
    """Launch configuration of `_route_kernel`: BLOCK_T tokens of BLOCK_E (>= E) scores per program."""

    block_t: int
    block_e: int
    num_warps: int = 4


def route_launch(num_tokens: int, num_experts: int, top_k: int) -> RouteLaunch:
    """_ELEMENTS_PER_PROGRAM scores per program (fewer tokens than that take one program), counting a
    token's [BLOCK_K] ids and weights as 2 BLOCK_K columns where that is more than its BLOCK_E scores
    (E 64, K 64: 64 tokens a program spilled 16 B under triton 3.6's ptxas, 32 none); 8 warps where
    BLOCK_E alone fills a program (4096 experts, one token a program: with 64 groups 4 warps spilled
    32 B, 8 none).
    tests/compile_routing.py checks both."""
    block_e, block_k = triton.next_power_of_2(num_experts), triton.next_power_of_2(top_k)
    block_t = min(max(1, _ELEMENTS_PER_PROGRAM // max(block_e, 2 * block_k)), triton.next_power_of_2(num_tokens))
    return RouteLaunch(block_t=block_t, block_e=block_e, num_warps=8 if block_e >= _ELEMENTS_PER_PROGRAM else 4)


@triton.jit
def _argmax_rows(v, avail, cols):
    """Per row, the column of v's largest value among the `avail` ones (of equals, the first), as
    [BLOCK_T]; the first available column where none compares (NaN), so that the choice stays one of
    them."""
    none: tl.constexpr = 1 << 30
    best = tl.max(tl.where(avail, v, float("-inf")), 1)
    first = tl.min(tl.where(avail & (v == best[:, None]), cols[None, :], none), 1)
    return tl.where(first == none, tl.min(tl.where(avail, cols[None, :], none), 1), first)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, E, stride_t, scale,
                  K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr,
                  GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    """weights [T, K] float32 and ids [T, K] int32 of BLOCK_T tokens; see `route_topk`. GROUPS > 0: a token
    keeps the TOPK_GROUPS groups (of GROUP_SIZE consecutive experts) ranked highest (sigmoid: the sum of a
    group's two best choice scores; softmax: its best), then takes its K experts among them."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))
        choice = score
        if HAS_BIAS:
            choice = score + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    else:
        x = tl.where(col_ok[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, 1)[:, None])
        score = p / tl.sum(p, 1)[:, None]
        choice = score
    choice = tl.where(choice != choice, float("inf"), choice)  # NaN ranks first, as in torch.topk
    avail = tl.broadcast_to(col_ok[None, :], (BLOCK_T, BLOCK_E))

    if GROUPS > 0:
        group_of = cols // GROUP_SIZE
        gcols = tl.arange(0, BLOCK_G)
        group_score = tl.zeros((BLOCK_T, BLOCK_G), tl.float32)
        for g in tl.static_range(GROUPS):
            in_g = avail & (group_of == g)[None, :]
            best = tl.max(tl.where(in_g, choice, float("-inf")), 1)
            if SIGMOID and GROUP_SIZE > 1:  # plus the second best (a twin of the best counts)
                in_g = in_g & (cols[None, :] != _argmax_rows(choice, in_g, cols)[:, None])
                best += tl.max(tl.where(in_g, choice, float("-inf")), 1)
            group_score = tl.where(gcols[None, :] == g, best[:, None], group_score)
        groups_left = tl.broadcast_to((gcols < GROUPS)[None, :], (BLOCK_T, BLOCK_G))
        keep = tl.zeros((BLOCK_T, BLOCK_E), tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            g_best = _argmax_rows(group_score, groups_left, gcols)
            keep = keep | (group_of[None, :] == g_best[:, None])
            groups_left = groups_left & (gcols[None, :] != g_best[:, None])
        avail = avail & keep

    kcols = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    weights = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    for k in range(K):
        pick = _argmax_rows(choice, avail, cols)
        hit = cols[None, :] == pick[:, None]
        ids = tl.where(kcols[None, :] == k, pick[:, None], ids)
        weights = tl.where(kcols[None, :] == k, tl.sum(tl.where(hit, score, 0.0), 1)[:, None], weights)
        avail = avail & (~hit)
    if RENORMALIZE:  # a NaN weight makes the row's sum and so every weight NaN, as in the torch version
        total = tl.sum(weights, 1)
        weights = weights / tl.where(total != total, total, tl.maximum(total, 1e-20))[:, None]
    out = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    out_ok = row_ok[:, None] & (kcols < K)[None, :]
    tl.store(w_ptr + out, weights * scale, mask=out_ok)
    tl.store(ids_ptr + out, ids, mask=out_ok)


def route_topk(logits_TE: torch.Tensor, top_k: int, *, sigmoid: bool, correction_bias_E: torch.Tensor | None,
               num_groups: int | None, topk_groups: int | None, renormalize: bool,
               routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`epmoe.routing.route`'s choice in one kernel launch, for inputs route has validated.

    Args:
        logits_TE: float [T, E] (any float dtype, unit stride along E), E <= MAX_EXPERTS.
        top_k: K.
        sigmoid: sigmoid scores (else softmax).
        correction_bias_E: float [E] added to the sigmoid scores for the choice only, or None.
        num_groups, topk_groups: grouped choice (both None, or topk_groups groups of num_groups kept).
        renormalize, routed_scaling_factor: as for route.

    Returns:
        weights_TK float32 [T, K] and ids_TK int32 [T, K] on logits_TE's device, the K columns in
        descending order of the choice score (of two equal scores, the lower expert id first; NaN
        scores first, as torch.topk ranks them, with NaN weights).
    """
    T, E = logits_TE.shape
    if E > MAX_EXPERTS:
        raise ValueError(f"route_topk takes at most {MAX_EXPERTS} experts, got {E}")
    if logits_TE.stride(1) != 1:
        logits_TE = logits_TE.contiguous()
    weights_TK = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    ids_TK = torch.empty(T, top_k, dtype=torch.int32, device=logits_TE.device)
    if T == 0:
        return weights_TK, ids_TK
    grouped = num_groups is not None and topk_groups < num_groups
    launch = route_launch(T, E, top_k)
    bias = correction_bias_E.contiguous() if correction_bias_E is not None else logits_TE  # placeholder if unused
    with torch.cuda.device(logits_TE.device) if logits_TE.is_cuda else nullcontext():  # Triton's launch device
        _route_kernel[(triton.cdiv(T, launch.block_t),)](
            logits_TE, bias, weights_TK, ids_TK, T, E, logits_TE.stride(0), float(routed_scaling_factor),
            K=top_k, SIGMOID=sigmoid, HAS_BIAS=correction_bias_E is not None, GROUPS=num_groups if grouped else 0,
            GROUP_SIZE=E // num_groups if grouped else 1, TOPK_GROUPS=topk_groups if grouped else 0,
            RENORMALIZE=renormalize, BLOCK_T=launch.block_t, BLOCK_E=launch.block_e,
            BLOCK_G=triton.next_power_of_2(num_groups) if grouped else 1, BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=launch.num_warps)
    return weights_TK, ids_TK
