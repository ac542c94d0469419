"""Tests of the `ll` dispatcher over R ranks emulated in one process (CPU interpreter, or one GPU):
consecutive calls in every mode, graph-style fixed-size inputs, bad input, time-outs (FusedMoE over it:
test_layer.py).

Real ranks on several GPUs: test_ll_gpu.py; sm_90 builds: test_ll_compile.py. Inputs, references and
the emulated world: ll_support.py.

Shape letters: T tokens, D hidden size, K top-k, E experts, L local experts, M rows per expert slot,
R ranks.
"""
from __future__ import annotations

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.dispatch.ll import COMBINE_MODES, LLDispatcher
from epmoe.registry import list_dispatchers, make_dispatcher
from epmoe.symm import EmulatedGroup
from ll_support import EMU_DEVICE, check_batch, check_out, fake_experts, make_inputs, make_world, run_calls


CASES = [
    # (R, E, K, D, Tmax, quant, combine)
    (2, 4, 2, 128, 4, None, "source"),
    (2, 4, 2, 128, 4, None, "reduce"),
    (2, 6, 3, 200, 5, "fp8_block", "reduce"),
    (2, 6, 3, 200, 5, "fp8_block", "source"),
    (3, 6, 1, 72, 3, None, "reduce"),
    (3, 9, 4, 130, 4, "fp8_block", "source"),
]


@pytest.mark.parametrize("R,E,K,D,Tmax,quant,combine", CASES)
def test_emulated_consecutive_calls(R, E, K, D, Tmax, quant, combine):
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=32, quant=quant,
                    max_tokens_per_rank=Tmax)
    dispatchers = make_world(cfg, R, combine)
    tokens = [[Tmax] * R, [1] + [0] * (R - 1), [Tmax - 1, 0] + [Tmax] * (R - 2), [Tmax] * R]
    calls = [make_inputs(cfg, R, t, seed=i, skew=(i == 3), drop=0.0 if i == 0 else 0.25)
             for i, t in enumerate(tokens)]
    assert run_calls(dispatchers, cfg, calls) == []


def test_emulated_static_max_size_inputs():
    """What graph replays do: T stays Tmax, unused tokens carry ids -1, the active count changes."""
    cfg = MoEConfig(num_experts=8, top_k=3, hidden_size=256, intermediate_size=8, quant="fp8_block",
                    max_tokens_per_rank=6)
    dispatchers = make_world(cfg, 2, "reduce")
    calls = []
    for i, active in enumerate([(6, 6), (2, 0), (0, 5), (1, 1), (6, 3)]):
        inputs = make_inputs(cfg, 2, [6, 6], seed=50 + i, drop=0.0)
        for (_, ids, _), n in zip(inputs, active):
            ids[n:] = -1
        calls.append(inputs)
    assert run_calls(dispatchers, cfg, calls) == []


@pytest.mark.parametrize("combine", COMBINE_MODES)
def test_emulated_int64_ids_and_bf16_weights(combine):
    """ids in int64 (what torch.topk gives a caller's own gate) and weights in bfloat16 go the way int32 ids
    and float32 weights go; 3 ranks, skewed routing, -1 ids, a rank with no tokens."""
    cfg = MoEConfig(num_experts=6, top_k=3, hidden_size=64, intermediate_size=8, max_tokens_per_rank=4)
    dispatchers = make_world(cfg, 3, combine)
    calls = []
    for i, tokens in enumerate([[4, 0, 3], [1, 4, 2]]):
        inputs = make_inputs(cfg, 3, tokens, seed=60 + i, skew=i == 1, drop=0.25)
        calls.append([(x, ids.long(), w.bfloat16()) for x, ids, w in inputs])
    assert all(ids.dtype == torch.int64 for _, ids, _ in calls[0])
    assert run_calls(dispatchers, cfg, calls) == []


def test_emulated_all_dropped_and_float32():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=8, dtype=torch.float32,
                    max_tokens_per_rank=3)
    dispatchers = make_world(cfg, 2, "source")
    calls = [make_inputs(cfg, 2, [3, 2], seed=7, drop=1.0), make_inputs(cfg, 2, [3, 3], seed=8)]
    assert run_calls(dispatchers, cfg, calls) == []


def test_emulated_base_class_path_and_registry():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=8, max_tokens_per_rank=2)
    groups = EmulatedGroup.world(2)
    assert list_dispatchers(cfg, groups[0])["ll"] == (True, "ok")
    ds = [make_dispatcher("ll", cfg, g, device=EMU_DEVICE) for g in groups]
    # A single rank can run the whole call when R = 1.
    cfg1 = MoEConfig(num_experts=3, top_k=2, hidden_size=128, intermediate_size=8, max_tokens_per_rank=2)
    (g1,) = EmulatedGroup.world(1)
    d1 = make_dispatcher("ll", cfg1, g1, device=EMU_DEVICE)
    inputs = make_inputs(cfg1, 1, [2], seed=3)
    x, ids, w = (t.to(EMU_DEVICE) for t in inputs[0])
    batch = d1.dispatch(x, ids, w)
    assert check_batch(cfg1, 1, inputs, 0, batch) == []
    out = d1.combine(fake_experts(cfg1, batch, 0), batch)
    assert check_out(cfg1, inputs, 0, out, "reduce") == []
    assert ds[0].rows_per_expert == 4


def test_refuses_bad_input():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=8, max_tokens_per_rank=2)
    d = make_world(cfg, 2, "reduce")[0]
    x = torch.randn(3, 128, dtype=torch.bfloat16, device=EMU_DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int32, device=EMU_DEVICE)
    w = torch.ones(3, 2, device=EMU_DEVICE)
    with pytest.raises(ValueError, match="max_tokens_per_rank=2"):
        d.dispatch_send(x, ids, w)
    with pytest.raises(ValueError, match="expert id 4"):
        d.dispatch_send(x[:2], ids[:2] + 4, w[:2])
    with pytest.raises(ValueError, match="combine must be one of"):
        LLDispatcher(cfg, EmulatedGroup.world(2)[0], combine="dest")
    with pytest.raises(ValueError, match="wait_timeout_s"):
        LLDispatcher(cfg, EmulatedGroup.world(2)[0], wait_timeout_s=0)
    assert LLDispatcher.availability(cfg, None)[0] is False
    cfg5 = MoEConfig(num_experts=5, top_k=2, hidden_size=128, intermediate_size=8)
    assert LLDispatcher.availability(cfg5, EmulatedGroup.world(2)[0])[0] is False


def test_emulated_wait_times_out_instead_of_hanging():
    """A rank whose peer never sends: its wait gives up after wait_timeout_s and sets the flag; later
    waits then return at once."""
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=8, max_tokens_per_rank=2)
    d0 = [LLDispatcher(cfg, g, device=EMU_DEVICE, wait_timeout_s=1e-3) for g in EmulatedGroup.world(2)][0]
    x, ids, w = (t.to(EMU_DEVICE) for t in make_inputs(cfg, 2, [2, 2], seed=5)[0])
    assert not d0.timed_out()
    batch = d0.dispatch_recv(d0.dispatch_send(x, ids, w))  # rank 1 never sends
    assert d0.timed_out()
    d0.combine_recv(d0.combine_send(fake_experts(cfg, batch, 0), batch))  # returns, no spinning
