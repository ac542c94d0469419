"""`epmoe check`: every valid (dispatcher x experts x precision) combination at several shapes against
the float64 oracle (`epmoe.oracle.MoERef`, which shares no code with the dispatchers or the experts),
one PASS/FAIL row each; exit code 1 if any row fails or none could run.

The combinations are the cross-product filtered by the library's own validity checks
(`list_dispatchers`, `list_experts`, `check_pairing`, via `testing.plan`). Tolerances: relative L2 norm
error per precision, `testing.TOLERANCES`.

Shape letters: T tokens of this rank, D hidden size, E experts, K top-k.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import MoEConfig
from .launch import RankContext
from .registry import dispatcher_class
from .routing import route
from .testing import (Plan, build_layer, layer_oracle, make_tokens, make_weights, plan, precision, rank_rows,
                      rel_error, tolerance)
from .timing import max_over_ranks


@dataclass(frozen=True)
class Case:
    """One shape. Rank r gets tokens[r % len(tokens)] tokens; `cfg` holds shapes and routing."""

    name: str
    cfg: MoEConfig
    tokens: tuple[int, ...]
    no_expert_fraction: float = 0.0  # this share of the top-k ids is set to -1 (and all of token 0's)
    one_expert: bool = False  # every token's first choice is the last expert, the rest -1
    shared: bool = False

    def tokens_per_rank(self, world_size: int) -> list[int]:
        return [self.tokens[r % len(self.tokens)] for r in range(world_size)]


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
    return MoEConfig(**{**base, **kw})


CASES = (
    Case("deepseek_v3", _cfg(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, scoring="sigmoid",
                             num_groups=4, topk_groups=2, routed_scaling_factor=2.5), (24, 17), shared=True),
    Case("t0_on_rank0", _cfg(), (0, 9, 5)),
    Case("t1_grouped_softmax", _cfg(renormalize=False, num_groups=4, topk_groups=2), (1,)),
    Case("odd_D97_F45", _cfg(top_k=3, hidden_size=97, intermediate_size=45), (13, 6)),
    Case("no_expert_ids", _cfg(top_k=3), (16, 11), no_expert_fraction=0.3),
    Case("one_expert", _cfg(), (12, 7), one_expert=True),
    Case("chunked", _cfg(max_tokens_per_rank=8), (20, 3, 9)),
)
PRECISIONS = ({"dtype": torch.float32}, {"dtype": torch.bfloat16}, {"dtype": torch.bfloat16, "quant": "fp8_block"})


def case_inputs(case: Case, cfg: MoEConfig, rank: int, world_size: int, seed: int, device: torch.device):
    """This rank's x_TD, weights_TK, ids_TK for `case` (the same on every rank for the same rank id)."""
    tokens = case.tokens_per_rank(world_size)
    x_all, logits_all = make_tokens(cfg, seed, tokens, device)
    rows = rank_rows(tokens, rank)
    weights_TK, ids_TK = route(logits_all, cfg)
    g = torch.Generator(device=device).manual_seed(seed + 2)
    if case.no_expert_fraction:
        drop = torch.rand(ids_TK.shape, generator=g, device=device) < case.no_expert_fraction
        drop[0] = True
        ids_TK = ids_TK.masked_fill(drop, -1)
    if case.one_expert:
        ids_TK = torch.full_like(ids_TK, -1)
        ids_TK[:, 0] = cfg.num_experts - 1
    return x_all[rows].contiguous(), weights_TK[rows].contiguous(), ids_TK[rows].contiguous()


def without_chunkless(todo: Plan, cfg: MoEConfig, tokens_per_rank: list[int]) -> Plan:
    """`todo` less the dispatchers that cannot take a batch the layer must chunk (more tokens on some rank
    than cfg.max_tokens_per_rank): those without a host sync have no way to agree on a chunk count, and
    refuse such a batch (FusedMoE raises ValueError); they move to `skipped` with that reason."""
    if max(tokens_per_rank) <= cfg.max_tokens_per_rank:
        return todo
    chunkless = sorted({d for d, _ in todo.runs if not dispatcher_class(d).needs_host_sync})
    reason = "takes at most max_tokens_per_rank tokens per call (no host sync to agree on a chunk count)"
    return Plan(runs=[run for run in todo.runs if run[0] not in chunkless],
                skipped=todo.skipped + [(d, "*", reason) for d in chunkless])


def check_rank(ctx: RankContext, seed: int, case_names: tuple[str, ...] | None = None) -> int:
    """Run the cases named (default: every case) on this rank; rank 0 prints each row as it finishes, then
    the skipped combinations, the failures' errors and the counts. Returns 1 if any row failed."""
    dev, group = ctx.device, ctx.group
    work = []  # (case, cfg, plan) in the order they run
    for case in CASES:
        if case_names is None or case.name in case_names:
            for prec in PRECISIONS:
                cfg = dataclasses.replace(case.cfg, **prec)
                work.append((case, cfg, without_chunkless(plan(cfg, group, dev), cfg,
                                                          case.tokens_per_rank(ctx.world_size))))
    headers = ["case", "precision", "dispatcher", "experts", "rel err", "tol", "result"]
    widths = [max([len(headers[0])] + [len(case.name) for case, _, _ in work]), len("fp8_block"),
              max([len(headers[2])] + [len(d) for _, _, todo in work for d, _ in todo.runs]),
              max([len(headers[3])] + [len(e) for _, _, todo in work for _, e in todo.runs]), 8, 5, 6]

    def line(cells) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    if ctx.rank == 0:
        print(f"epmoe check: {ctx.world_size} ranks on {dev.type}; relative L2 error vs the float64 oracle "
              "(epmoe.oracle); rows as they finish:", flush=True)
        print(line(headers) + "\n" + "  ".join("-" * w for w in widths), flush=True)
    rows, failures, skipped = 0, [], {}
    for case, cfg, todo in work:
        for d_name, e_name, reason in todo.skipped:
            skipped.setdefault((d_name, e_name, reason), []).append(f"{case.name}/{precision(cfg)}")
        weights = make_weights(cfg, seed, dev)
        x_TD, w_TK, ids_TK = case_inputs(case, cfg, ctx.rank, ctx.world_size, seed, dev)
        ref_TD = layer_oracle(cfg, weights, case.shared)(x_TD, ids_TK, w_TK)
        for d_name, e_name in todo.runs:
            err, note = float("inf"), ""
            try:
                moe = build_layer(cfg, weights, group, d_name, e_name, dev, case.shared)
                err = rel_error(moe(x_TD, weights_TK=w_TK, ids_TK=ids_TK), ref_TD)
            except Exception as e:  # a failing combination is a FAIL row, not the end of the check
                note = f"{type(e).__name__}: {e}"
            err = max_over_ranks(err, group, dev)
            ok = err <= tolerance(cfg)
            cells = [case.name, precision(cfg), d_name, e_name, f"{err:.2e}" if err < float("inf") else "-",
                     f"{tolerance(cfg):.2g}", "PASS" if ok else "FAIL"]
            rows += 1
            if not ok:
                failures.append(f"FAIL {'/'.join(cells[:4])}: {note or 'error over tolerance'}")
            if ctx.rank == 0:
                print(line(cells), flush=True)
    if ctx.rank == 0:
        for (d_name, e_name, reason), where in skipped.items():
            print(f"skipped: dispatcher {d_name}, experts {e_name}: {reason} ({len(where)} case/precision pairs)")
        for failure in failures:
            print(failure)
        if not rows:
            print("nothing could run: every combination was skipped (see above)")
        print(f"{rows - len(failures)} passed, {len(failures)} failed")
    return int(not rows or bool(failures))
