"""Inputs, references and emulated ranks shared by the `ll` tests (tests/test_ll*.py).

Shape letters: T tokens, D hidden size, K top-k, E experts, L local experts, M rows per expert slot,
R ranks.

Checks are exact where the data allows: every rank's received rows are compared, as a multiset per
expert, with the rows the senders hold (quantized by epmoe.quant.quantize_act_ref for fp8); combine
outputs against a float32 reference from the same expert outputs.
"""
from __future__ import annotations

import torch

from epmoe.config import MoEConfig
from epmoe.dispatch.ll import LLDispatcher
from epmoe.quant import dequantize_act_ref, quantize_act_ref
from epmoe.symm import EmulatedGroup

EMU_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- inputs and references (shared by the emulated and the multi-GPU tests) --------------------

def make_inputs(cfg: MoEConfig, R: int, tokens: list[int], seed: int, skew: bool = False,
                drop: float = 0.1) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per rank (x_TD, ids_TK int32, weights_TK float32) on the CPU; ids distinct per token, some -1.

    skew: every token's first choice is expert 0 (one hot expert). Deterministic in `seed`, so every
    rank of a real run can build every rank's inputs.
    """
    g = torch.Generator().manual_seed(seed)
    E, K, D = cfg.num_experts, cfg.top_k, cfg.hidden_size
    out = []
    for r in range(R):
        T = tokens[r]
        x = torch.randn(T, D, generator=g).to(cfg.dtype)
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
        if skew and T:
            first = ids[:, :1].clone()
            ids = torch.where(ids == 0, first, ids)
            ids[:, 0] = 0
        ids = torch.where(torch.rand(T, K, generator=g) < drop, -1, ids)
        w = torch.rand(T, K, generator=g) + 0.1
        out.append((x, ids.to(torch.int32), w))
    return out


def as_sent(cfg: MoEConfig, x_TD: torch.Tensor) -> torch.Tensor:
    """float32 rows as the experts see them after dispatch (fp8 round trip when quantized)."""
    if cfg.quant == "fp8_block":
        return dequantize_act_ref(*quantize_act_ref(x_TD))
    return x_TD.float()


def expert_scale(E: int, device="cpu") -> torch.Tensor:
    """The stand-in expert: expert e multiplies its rows by (e + 1) / E."""
    return (torch.arange(E, dtype=torch.float32, device=device) + 1) / E


def fake_experts(cfg: MoEConfig, batch, first_expert: int) -> torch.Tensor:
    """y [L, M, D] = scale(e) * x for rows below counts_L, NaN in padding rows. No host sync."""
    x = batch.x.float() if batch.x_scale is None else dequantize_act_ref(batch.x, batch.x_scale)
    L, M = x.shape[:2]
    s = expert_scale(cfg.num_experts, x.device)[first_expert:first_expert + L]  # no copy: graph-safe
    pad = torch.arange(M, device=x.device)[None, :] >= batch.counts_L[:, None]
    y = torch.where(pad[..., None], float("nan"), x * s[:, None, None])
    return y.to(cfg.dtype)


def sent_rows(cfg: MoEConfig, R: int, inputs, dest: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank `dest` must receive, on `device`: (local expert [n] int64, rows [n, D] float32 as the
    experts see them), in no particular order. References are computed on the CPU (as_sent)."""
    L = cfg.num_experts // R
    experts, rows = [], []
    for x, ids, _ in inputs:
        t, k = (ids >= 0).nonzero(as_tuple=True)
        e = ids[t, k].long()
        mine = e // L == dest
        experts.append((e[mine] - dest * L).to(device))
        rows.append(as_sent(cfg, x).to(device)[t[mine].to(device)])
    return torch.cat(experts), torch.cat(rows)


def expected_out(cfg: MoEConfig, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 [T, D]: sum_k w * y, with y as fake_experts rounds it."""
    s = expert_scale(cfg.num_experts)
    xs = as_sent(cfg, x)
    out = torch.zeros(x.shape[0], cfg.hidden_size)
    for k in range(ids.shape[1]):
        valid = ids[:, k] >= 0
        e = ids[:, k].clamp_min(0).long()
        y = (xs * s[e][:, None]).to(cfg.dtype).float()
        out += torch.where(valid[:, None], w[:, k:k + 1] * y, 0.0)
    return out


def _canonical(experts: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (expert, row) pairs by expert, then by a random projection of the row (a multiset's order)."""
    g = torch.Generator().manual_seed(0)
    proj = torch.rand(rows.shape[1], generator=g, dtype=torch.float64).to(rows.device)
    order = (rows.double() * proj).sum(dim=1).argsort(stable=True)
    order = order[experts[order].argsort(stable=True)]
    return experts[order], rows[order]


def check_batch(cfg: MoEConfig, R: int, inputs, dest: int, batch) -> list[str]:
    """Compare one rank's ExpertBatch with what the senders hold, exactly, as a multiset of rows per
    expert; vectorized on the batch's device. Returns failure messages."""
    dev = batch.x.device
    exp_e, exp_rows = sent_rows(cfg, R, inputs, dest, dev)
    L, M = batch.x.shape[:2]
    counts = batch.counts_L.long()
    want = torch.bincount(exp_e, minlength=L)
    if not torch.equal(counts, want):
        bad = (counts != want).nonzero()[:, 0].tolist()[:5]
        return [f"rank {dest}: counts differ at local experts {bad}: got {counts[bad].tolist()}, "
                f"want {want[bad].tolist()}"]
    held = torch.arange(M, device=dev)[None, :] < counts[:, None]
    got_e = held.nonzero()[:, 0]
    if batch.x_scale is None:
        got_rows = batch.x[held].float()
    else:  # index the fp8 bytes (indexing float8 tensors is not implemented everywhere)
        q = batch.x.view(torch.uint8)[held].view(batch.x.dtype)
        got_rows = dequantize_act_ref(q, batch.x_scale[held])
    exp_e, exp_rows = _canonical(exp_e, exp_rows)
    got_e, got_rows = _canonical(got_e, got_rows)
    if not torch.equal(got_rows, exp_rows):
        bad = sorted(set(exp_e[(got_rows != exp_rows).any(dim=1)].tolist()))[:5]
        return [f"rank {dest}: rows of local experts {bad} differ"]
    return []


def check_out(cfg: MoEConfig, inputs, src: int, out: torch.Tensor, combine: str) -> list[str]:
    x, ids, w = inputs[src]
    ref = expected_out(cfg, x, ids, w)
    # "reduce" rounds each rank's partial sum to cfg.dtype once more than "source" does.
    tol = {"source": 1e-2, "reduce": 2e-2}[combine] if cfg.dtype != torch.float32 else 1e-5
    try:
        torch.testing.assert_close(out.cpu().float(), ref, rtol=tol, atol=tol)
    except AssertionError as exc:
        return [f"rank {src}: combine output: {str(exc)[:300]}"]
    return []


# ---- emulated ranks ----------------------------------------------------------------------------

def emulate_dispatch(dispatchers: list[LLDispatcher], inputs, device) -> list:
    """Every rank's dispatch_send, then every rank's dispatch_recv (so waits are already satisfied)."""
    handles = [d.dispatch_send(x.to(device), ids.to(device), w.to(device))
               for d, (x, ids, w) in zip(dispatchers, inputs)]
    return [d.dispatch_recv(h) for d, h in zip(dispatchers, handles)]


def emulate_combine(dispatchers: list[LLDispatcher], ys: list[torch.Tensor], batches: list) -> list[torch.Tensor]:
    handles = [d.combine_send(y, b) for d, y, b in zip(dispatchers, ys, batches)]
    return [d.combine_recv(h) for d, h in zip(dispatchers, handles)]


def make_world(cfg: MoEConfig, R: int, combine: str) -> list[LLDispatcher]:
    return [LLDispatcher(cfg, g, combine=combine, device=EMU_DEVICE) for g in EmulatedGroup.world(R)]


def run_calls(dispatchers, cfg: MoEConfig, calls) -> list[str]:
    """Run consecutive dispatch/combine calls (like consecutive layers) and check every one."""
    R = len(dispatchers)
    errors = []
    for inputs in calls:
        batches = emulate_dispatch(dispatchers, inputs, EMU_DEVICE)
        for r, b in enumerate(batches):
            errors += check_batch(cfg, R, inputs, r, b)
        ys = [fake_experts(cfg, b, d.first_expert) for d, b in zip(dispatchers, batches)]
        outs = emulate_combine(dispatchers, ys, batches)
        for r, out in enumerate(outs):
            errors += check_out(cfg, inputs, r, out, dispatchers[0].combine_mode)
    assert not any(d.timed_out() for d in dispatchers)
    return errors
