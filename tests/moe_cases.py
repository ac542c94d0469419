"""Test cases shared by the single-rank tests and the multi-rank workers (run in spawned ranks).

Every `case_*` function takes (dispatcher name, group, device) and records wrong results with `expect`
instead of raising, so every rank goes through the same collectives even when one rank's check fails;
`run_cases` runs them all on a rank and returns the failures as text, so one spawn checks many cases and
reports every failure.

Shape letters: T tokens of this rank, D hidden size, F intermediate size, E experts, K top-k, L local
experts.
"""
from __future__ import annotations

import dataclasses
import traceback

import torch
import torch.distributed as dist

import epmoe
from epmoe.interfaces import ExpertBatch, Layout
from epmoe.oracle import route_ref
from epmoe.testing import TOLERANCES, build_layer, layer_oracle, make_weights, precision, rel_error

_failures: list[str] = []


def expect(ok, message: str) -> None:
    """A check that records a failure (with its caller's case) instead of raising."""
    if not ok:
        _failures.append(f"{traceback.extract_stack(limit=2)[0].name}: {message}")


def experts_for(R: int) -> int:
    """Experts of the cases at world size R: 24 where R divides it (1 to 4, 6, 8), else 4 R (5: 20, 7: 28);
    below 32, so the exact cases' products stay exact in float32, and a multiple of 4 (the groups of
    case_fused_vs_dense)."""
    return 24 if 24 % R == 0 else 4 * R


TOKEN_PATTERN = (7, 0, 5, 1)  # rank r has TOKEN_PATTERN[r % 4] tokens: odd T, T=0 and T=1 across ranks


def world(group) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def scale_by_expert(batch: ExpertBatch, first_expert: int) -> torch.Tensor:
    """Stand-in experts for exact checks: expert e maps x to x * (e + 1); padding rows give zeros."""
    L = batch.num_local_experts
    batch = batch.materialize()
    mult_L = torch.arange(first_expert + 1, first_expert + 1 + L, dtype=batch.x.dtype, device=batch.x.device)
    y = torch.zeros_like(batch.x)
    if batch.layout is Layout.BATCHED:
        for l, n in enumerate(batch.counts_L.tolist()):
            y[l, :n] = batch.x[l, :n] * mult_L[l]
        return y
    per_row = torch.repeat_interleave(mult_L, batch.counts_L.long())
    n = per_row.shape[0]
    y[:n] = batch.x[:n] * per_row[:, None]
    return y


def exact_tokens(T: int, D: int, rank: int) -> torch.Tensor:
    """x[t, c] = rank*1000 + t + (c % 8)/8 in fp32: exact through x*(e+1) (e < 32), power-of-two weights
    in {1/2, 1, 2} and a sum of at most 4 such terms (at most 24 significant bits)."""
    t = torch.arange(T, dtype=torch.float32)[:, None]
    c = torch.arange(D, dtype=torch.float32)[None, :]
    return rank * 1000 + t + torch.remainder(c, 8) / 8


def random_ids(T: int, E: int, K: int, g: torch.Generator, drop: float = 0.25) -> torch.Tensor:
    """int32 [T, K], distinct ids per token, a `drop` share of them -1."""
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    ids = ids.to(torch.int32)
    return ids.masked_fill(torch.rand(ids.shape, generator=g) < drop, -1)


def expected_exact(x_TD, ids_TK, w_TK) -> torch.Tensor:
    """float64 sum_k w[t,k] * (ids[t,k] + 1) * x[t] over ids != -1."""
    mult = torch.where(ids_TK >= 0, (ids_TK.double() + 1) * w_TK.double(), 0.0)
    return (mult[:, :, None] * x_TD.double()[:, None, :]).sum(1)


def exact_round_trip(d: epmoe.Dispatcher, x_TD, ids_TK, w_TK, device) -> None:
    x_TD, ids_TK, w_TK = x_TD.to(device), ids_TK.to(device), w_TK.to(device)
    batch = d.dispatch(x_TD, ids_TK, w_TK)
    out = d.combine(scale_by_expert(batch, d.first_expert), batch)
    expect(out.shape == x_TD.shape and out.dtype == x_TD.dtype, f"{d.name}: out {out.shape} {out.dtype}")
    exp = expected_exact(x_TD.cpu(), ids_TK.cpu(), w_TK.cpu())
    got = out.double().cpu()
    if not torch.equal(got, exp):
        expect(False, f"{d.name}: not exact, max abs diff {(got - exp).abs().max().item()}")


def case_exact(name, group, device) -> None:
    """Rows encode (rank, token, column); random ids with -1; power-of-two weights; exact sums."""
    rank, R = world(group)
    E = experts_for(R)
    cfg = epmoe.MoEConfig(num_experts=E, top_k=3, hidden_size=13, intermediate_size=8, dtype=torch.float32)
    d = epmoe.make_dispatcher(name, cfg, group)
    g = torch.Generator().manual_seed(100 + rank)
    for T in (TOKEN_PATTERN[rank % 4], 3 + 2 * rank):
        ids = random_ids(T, E, 3, g)
        w = 2.0 ** torch.randint(-1, 2, (T, 3), generator=g).float()
        exact_round_trip(d, exact_tokens(T, 13, rank), ids, w, device)


def case_strided_inputs(name, group, device) -> None:
    """Non-contiguous x (every other column of a wider tensor), ids (a transposed [K, T] table) and weights
    (a column slice), int64 ids, and weights in bfloat16 (powers of two: exact); exact sums."""
    rank, R = world(group)
    E, K, D = experts_for(R), 3, 11
    cfg = epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=8, dtype=torch.float32)
    d = epmoe.make_dispatcher(name, cfg, group)
    g = torch.Generator().manual_seed(200 + rank)
    T = (6, 0, 3, 1)[rank % 4]
    wide = torch.zeros(T, 2 * D)
    wide[:, ::2] = exact_tokens(T, D, rank)
    ids_KT = random_ids(T, E, K, g).long().t().contiguous()
    w_T2K = 2.0 ** torch.randint(-1, 2, (T, 2 * K), generator=g).float()
    x, ids, w = wide[:, ::2], ids_KT.t(), w_T2K[:, K:]
    assert T < 2 or not (x.is_contiguous() or ids.is_contiguous() or w.is_contiguous())
    exact_round_trip(d, x, ids, w, device)
    exact_round_trip(d, x, ids, w.bfloat16(), device)


def case_one_expert(name, group, device) -> None:
    """Every token of every rank goes to the last expert (the last rank), other slots -1."""
    rank, R = world(group)
    E = experts_for(R)
    cfg = epmoe.MoEConfig(num_experts=E, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32)
    d = epmoe.make_dispatcher(name, cfg, group)
    T = 9 + rank
    ids = torch.full((T, 2), -1, dtype=torch.int64)
    ids[:, 0] = E - 1
    exact_round_trip(d, exact_tokens(T, 16, rank), ids, torch.full((T, 2), 0.5), device)


def case_all_no_expert(name, group, device) -> None:
    """All ids -1 on every rank: zeros out, nothing sent."""
    rank, R = world(group)
    cfg = epmoe.MoEConfig(num_experts=4 * R, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    d = epmoe.make_dispatcher(name, cfg, group)
    T = 4
    batch = d.dispatch(exact_tokens(T, 8, rank).to(device), torch.full((T, 2), -1, device=device),
                       torch.ones(T, 2, device=device))
    expect(int(batch.counts_L.sum()) == 0, f"{name}: rows for no expert")
    out = d.combine(scale_by_expert(batch, d.first_expert), batch)
    expect(torch.equal(out, torch.zeros(T, 8, device=device)), f"{name}: no-expert tokens not zero")


def case_top1(name, group, device) -> None:
    """K = 1: every rank sends a few tokens, then nothing (T = 0), then only -1 ids; at one rank also
    E = 1. Exact sums."""
    rank, R = world(group)
    for E in sorted({R, experts_for(R)}):
        cfg = epmoe.MoEConfig(num_experts=E, top_k=1, hidden_size=8, intermediate_size=8, dtype=torch.float32)
        d = epmoe.make_dispatcher(name, cfg, group)
        g = torch.Generator().manual_seed(300 + rank)
        T = 3 + rank
        for ids in (random_ids(T, E, 1, g), torch.empty(0, 1, dtype=torch.int32), torch.full((T, 1), -1)):
            n = ids.shape[0]
            w = 2.0 ** torch.randint(-1, 2, (n, 1), generator=g).float()
            exact_round_trip(d, exact_tokens(n, 8, rank), ids, w, device)


def case_counts(name, group, device) -> None:
    """counts_L/offsets_L1 hold exactly the pairs every rank sent to this rank's experts, rows sorted."""
    rank, R = world(group)
    E, K, D = 4 * R, 2, 8
    cfg = epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=8, dtype=torch.float32)
    d = epmoe.make_dispatcher(name, cfg, group)
    all_ids = [random_ids(5 + r, E, K, torch.Generator().manual_seed(7 + r)) for r in range(R)]
    x = exact_tokens(5 + rank, D, rank).to(device)
    batch = d.dispatch(x, all_ids[rank].to(device), torch.ones(5 + rank, K, device=device))
    L = d.num_local_experts
    ids_all = torch.cat(all_ids).long()
    want = torch.bincount(ids_all[ids_all >= 0], minlength=E)[rank * L:(rank + 1) * L]
    expect(batch.counts_L.cpu().tolist() == want.tolist(), f"{name}: counts {batch.counts_L} != {want}")
    if batch.layout is Layout.CONTIGUOUS:
        expect(batch.offsets_L1.cpu().tolist() == [0] + torch.cumsum(want, 0).tolist(),
               f"{name}: offsets {batch.offsets_L1}")
        # every row of expert l comes from a token that chose expert first + l
        for l in range(L):
            lo, hi = batch.offsets_L1[l].item(), batch.offsets_L1[l + 1].item()
            for row in batch.materialize().x[lo:hi].cpu():
                src_rank, t = int(row[0].item()) // 1000, int(row[0].item()) % 1000
                expect((all_ids[src_rank][t] == d.first_expert + l).any(),
                       f"{name}: row of rank {src_rank} token {t} under expert {d.first_expert + l}")
    d.combine(scale_by_expert(batch, d.first_expert), batch)


def case_bad_input(name, group, device) -> None:
    """Malformed input raises ValueError naming the problem on every rank before any communication (ids
    outside [-1, E) on a GPU, with a dispatcher that catches them on the device: at its next
    check_device_errors); the dispatcher still works afterwards (a half-started collective would hang or
    mismatch)."""
    rank, R = world(group)
    E, K, D = 4 * R, 2, 8
    cfg = epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=8, dtype=torch.float32)
    d = epmoe.make_dispatcher(name, cfg, group)
    x = exact_tokens(3, D, rank).to(device)
    ids = torch.zeros(3, K, dtype=torch.int32, device=device)
    w = torch.ones(3, K, device=device)
    bad = [
        ((x[:, :5], ids, w), "x_TD must be"),
        ((x.to(torch.bfloat16), ids, w), "dtype"),
        ((x, ids[:2], w), "ids_TK must be"),
        ((x, ids[:, :1], w[:, :1]), "K=2"),
        ((x, ids, w[:2]), "weights_TK must be"),
        ((x, ids.float(), w), "int32 or int64"),
        ((x, ids, w.int()), "float"),
        ((x, ids + E, w), f"expert id {E}"),
        ((x, ids - 2, w), "expert id -2"),
        ((x, ids.to("meta"), w), "meta"),
    ]
    for args, words in bad:
        # dispatchers that catch bad ids on a GPU raise at the next host read (check_device_errors syncs)
        deferred = "expert id" in words and d.checks_ids_on_device and args[1].is_cuda
        try:
            d.dispatch(*args)
            if deferred:
                d.check_device_errors()
        except ValueError as e:
            expect(words in str(e), f"{name}: {words!r} not in {e}")
        else:
            expect(False, f"{name}: no ValueError for input expected to say {words!r}")
    exact_round_trip(d, x, ids, w, device)
    if R > 1:
        uneven = dataclasses.replace(cfg, num_experts=4 * R + 1)
        expect(not epmoe.list_dispatchers(uneven, group)[name][0], f"{name}: listed for E % R != 0")
        try:
            epmoe.make_dispatcher(name, uneven, group)
        except ValueError as e:
            expect("not divisible" in str(e), str(e))
        else:
            expect(False, f"{name}: E not divisible by the world size was accepted")


def case_other_config(name, group, device) -> None:
    """The last rank built from another config (another hidden size, so rows of another size): every rank's
    dispatch refuses with ValueError naming the ranks, before rows cross, and the dispatchers work afterwards."""
    rank, R = world(group)
    cfg = epmoe.MoEConfig(num_experts=4 * R, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    mine = dataclasses.replace(cfg, hidden_size=12) if rank == R - 1 and R > 1 else cfg
    d = epmoe.make_dispatcher(name, mine, group)
    x, ids, w = exact_tokens(3, mine.hidden_size, rank), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    if R > 1:
        try:
            d.dispatch(x.to(device), ids.to(device), w.to(device))
        except ValueError as e:
            expect("another MoEConfig" in str(e) and str(R - 1 if rank < R - 1 else 0) in str(e), str(e))
        else:
            expect(False, f"{name}: a rank of another config was not refused")
    exact_round_trip(epmoe.make_dispatcher(name, cfg, group), exact_tokens(3, 8, rank), ids, w, device)


def case_fused_vs_oracle(name, group, device) -> None:
    """FusedMoE (sigmoid + bias + grouped routing, scaling 2.5, a shared expert, chunks of 4 tokens, so
    ranks make different numbers of chunks) against the float64 oracle, in fp32 and bf16: routed by the
    layer (the oracle routes with epmoe.oracle.route_ref), and with the caller's own ids and weights
    (random, skewed towards one expert, some -1, weights neither normalized nor float32)."""
    rank, R = world(group)
    E = experts_for(R)
    for dtype in (torch.float32, torch.bfloat16):
        cfg = epmoe.MoEConfig(num_experts=E, top_k=3, hidden_size=24, intermediate_size=10, dtype=dtype,
                              max_tokens_per_rank=4, scoring="sigmoid", num_groups=4, topk_groups=2,
                              routed_scaling_factor=2.5)
        weights = make_weights(cfg, 5, device)
        moe = build_layer(cfg, weights, group, name, "reference", device)
        oracle = layer_oracle(cfg, weights, device="cpu")
        T = (9, 2, 0, 5)[rank % 4]
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, 24, generator=g).to(dtype)
        logits = torch.randn(T, cfg.num_experts, generator=g)
        bias = weights.correction_bias_E
        w_ref, ids_ref = route_ref(logits, 3, scoring="sigmoid", num_groups=4, topk_groups=2, correction_bias_E=bias)
        ids = random_ids(T, E, 3, g).long()
        ids[::2, 0] = 1  # skewed: every other token's first choice is expert 1
        w = (torch.rand(T, 3, generator=g) * 2).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float64)
        for got, want in ((moe(x.to(device), logits.to(device), correction_bias_E=bias), oracle(x, ids_ref, w_ref)),
                          (moe(x.to(device), weights_TK=w.to(device), ids_TK=ids.to(device)), oracle(x, ids, w))):
            err = rel_error(got.cpu(), want)
            tol = TOLERANCES[precision(cfg)]
            expect(got.dtype == dtype and err <= tol, f"{name} {dtype}: rel err {err:.2e} > {tol}")


CASES = (case_exact, case_strided_inputs, case_top1, case_one_expert, case_all_no_expert, case_counts, case_bad_input,
         case_other_config, case_fused_vs_oracle)


def run_case(case, name: str, group, device) -> list[str]:
    """One case on this rank; returns its failures."""
    _failures.clear()
    case(name, group, device)
    return [f"rank {world(group)[0]} {name} {f}" for f in _failures]


def run_cases(ctx, names: tuple[str, ...]) -> list[str]:
    """Every case with every dispatcher in `names` on this rank; returns the failures (text)."""
    return [f for name in names for case in CASES for f in run_case(case, name, ctx.group, ctx.device)]
