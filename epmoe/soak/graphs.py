"""CUDA-graph replays: the layers with no host sync (`ll`, `ht(sync_free)`) captured once and replayed with
new routing every time, every replay checked against the float64 oracle.

The ranks are emulated on one GPU (every rank's phases in one graph: all sends, then all receives, the
experts, all combine sends, all combine receives), so one device runs the whole protocol. A replay copies
new inputs into the captured tensors: a random number T of active tokens per rank (0 included), the rest
with ids -1 (such a token sends nothing and must come back as a zero row); uniform, skewed and holed
routing (`load.call_inputs`). The experts are `triton` (the graph-safe implementation: no host sync). The
first `reruns` replays' inputs are replayed once more at the end: equal hashes mean the path is
deterministic. Memory is sampled every spec.sample_every replays.

Shape letters: T active tokens of one rank, Tmax = cfg.max_tokens_per_rank, D hidden size, K top-k, R ranks.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..oracle import MoERef
from ..registry import list_dispatchers, list_experts
from ..symm import EmulatedGroup
from ..testing import make_weights, tolerance
from .load import (WAIT_TIMEOUT_S, LoadSpec, MemoryTrace, Tally, call_inputs, check_outputs, digest, emulated_step,
                   emulated_world)

GRAPH_PATHS = ("ll", "ht_sync_free")


def graph_available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "CUDA graphs need a GPU"
    return True, "ok"


def _load(static: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], inputs) -> None:
    """Copy each rank's T active tokens into its captured Tmax rows; the rest: zeros, ids -1."""
    for (x_s, ids_s, w_s), (x, ids, w) in zip(static, inputs):
        T = x.shape[0]
        x_s[:T].copy_(x)
        x_s[T:].zero_()
        ids_s[:T].copy_(ids)
        ids_s[T:].fill_(-1)
        w_s[:T].copy_(w)
        w_s[T:].fill_(1.0)


def _check(tally: Tally, replay: int, inputs, outs: list[torch.Tensor], oracle: MoERef, dtype: torch.dtype) -> None:
    """The active rows against the oracle; the rows of tokens with ids all -1 must be zeros."""
    for (x, _, _), out in zip(inputs, outs):
        if out[x.shape[0]:].count_nonzero():
            tally.fail(replay, f"a token with ids all -1 came back non-zero (T {x.shape[0]})")
    check_outputs(tally, replay, inputs, [out[:x.shape[0]] for (x, _, _), out in zip(inputs, outs)], oracle, dtype)


def _captured(step, static, warmup_inputs, device: torch.device):
    """step(static) captured in a CUDA graph (after one eager call on a side stream, which compiles the
    kernels); returns a function that replays it and returns the captured outputs."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        _load(static, warmup_inputs)
        step(static)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(static)

    def replay() -> list[torch.Tensor]:
        graph.replay()
        return outs
    return replay


def replay_path(spec: LoadSpec, precision: str, d_key: str, replays: int, device: torch.device,
                capture: bool = True) -> Tally:
    """One captured graph of spec.emulated_ranks emulated ranks through dispatcher d_key; `replays` replays.
    capture=False runs the same calls eagerly on the captured tensors instead (the CPU's check of the
    replays' inputs and checks, under the interpreter)."""
    cfg = spec.config(precision)
    R, Tmax, label = spec.emulated_ranks, cfg.max_tokens_per_rank, d_key.replace("_sync_free", "(sync_free)")
    tally = Tally(f"{label}/triton/{precision} ({R} emulated ranks, CUDA graph)", tolerance(cfg))
    weights = make_weights(cfg, spec.seed, device)
    oracle = MoERef.build(weights.w13_END, weights.w2_EDF, fp8=cfg.quant == "fp8_block", device=device)
    dispatchers, experts = emulated_world(cfg, R, d_key, "triton", weights.w13_END, weights.w2_EDF, device,
                                          wait_timeout_s=WAIT_TIMEOUT_S)
    step = emulated_step(dispatchers, experts)
    static = [(torch.zeros(Tmax, cfg.hidden_size, dtype=cfg.dtype, device=device),
               torch.full((Tmax, cfg.top_k), -1, dtype=torch.int32, device=device),
               torch.ones(Tmax, cfg.top_k, device=device)) for _ in range(R)]
    inputs_of = lambda replay: [call_inputs(cfg, spec.seed, tally.path, replay, r, Tmax, device)  # noqa: E731
                                for r in range(R)]
    replay_once = _captured(step, static, inputs_of(0), device) if capture else lambda: step(static)
    trace = MemoryTrace(device)
    for replay in range(replays):
        inputs = inputs_of(replay)
        _load(static, inputs)
        outs = replay_once()
        tally.calls += 1
        tally.hashes.append(digest(outs))
        _check(tally, replay, inputs, outs, oracle, cfg.dtype)
        del inputs
        if any(d.timed_out() for d in dispatchers):
            tally.fail(replay, "a device-side wait gave up")
            break
        if replay % spec.sample_every == 0 or replay == replays - 1:
            trace.sample(replay)
    tally.memory_growth = trace.growth(max(5, replays // 10))
    if not tally.mismatches:
        tally.reruns = min(spec.reruns, replays)
        for replay in range(tally.reruns):
            _load(static, inputs_of(replay))
            tally.rerun_equal += digest(replay_once()) == tally.hashes[replay]
    return tally


def soak_graphs(spec: LoadSpec, precisions: Sequence[str], replays: int,
                device: torch.device) -> tuple[list[Tally], list[tuple[str, str, str]]]:
    """Every graph path (ll, ht(sync_free)) x precision; tallies and the skipped ones with why."""
    ok, why = graph_available(device)
    if not ok:
        return [], [("ll, ht(sync_free)", "triton", why)]
    tallies, skipped = [], []
    for prec in precisions:
        cfg = spec.config(prec)
        available, reason = list_experts(cfg, device)["triton"]
        if not available:
            skipped.append(("ll, ht(sync_free)", "triton", f"{prec}: {reason}"))
            continue
        group = EmulatedGroup.world(spec.emulated_ranks)[0]
        table = list_dispatchers(cfg, group)
        for d_key in GRAPH_PATHS:
            name = d_key.split("_")[0]
            if not table[name][0]:
                skipped.append((name, "triton", f"{prec}: {table[name][1]}"))
                continue
            try:
                tallies.append(replay_path(spec, prec, d_key, replays, device))
            except Exception as e:  # a path that cannot be captured is a failed path, not the end of the soak
                label = d_key.replace("_sync_free", "(sync_free)")
                tally = Tally(f"{label}/triton/{prec} (CUDA graph)", tolerance(cfg))
                tally.fail(0, f"{type(e).__name__}: {e}")
                tallies.append(tally)
    return tallies, skipped
