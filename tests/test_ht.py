"""Tests of the `ht` dispatcher.

CPU: several ranks emulated in one process (EmulatedGroup), Triton under TRITON_INTERPRET=1, phases run
rank by rank (every rank's send, then every rank's receive). Inputs are checkable exactly: each row
encodes its source rank and token, weights are powers of two, the "experts" multiply by (global id + 1).
GPU (2 devices): the same exact checks across processes, random data against `alltoall`, a CUDA graph.

Shape letters: T tokens, D hidden size, K top-k, E experts, L local experts, R ranks, N batch rows.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

# Before epmoe's kernels are defined: interpret Triton on CPU-only machines. With CUDA, the emulated-rank
# tests run the compiled kernels on one GPU, and the multi-GPU tests run too.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from epmoe.config import MoEConfig
from epmoe.kernels.sync import DeviceWait
from epmoe.quant import dequantize_act_ref, quantize_act_ref
from epmoe.registry import list_dispatchers, make_dispatcher
from epmoe.symm import EmulatedGroup
from compile_run import OTHER_TRITONS, assert_compiles
from gpu_ranks import gpu_test_ranks, multiple_of

_INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
_EMU_DEVICE = "cpu" if _INTERPRET else "cuda"  # where emulated ranks keep their buffers
# The interpreter's fp32 -> bf16/fp16 cast rounds ties down (the GPU rounds to nearest even): combine
# results may then differ from the exact expectation by one ulp of each partial and of the sum (two
# ulps, 0.0139 relative, seen with R 2; a bf16 ulp is up to 2^-7 relative). On the GPU: exact.
_COMBINE_TOL = dict(rtol=2 ** -5, atol=0) if _INTERPRET else dict(rtol=0, atol=0)


def _cfg(E=8, K=2, D=64, C=8, dtype=torch.bfloat16, quant=None) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=16, dtype=dtype, quant=quant,
                     max_tokens_per_rank=C)


# -- inputs and the exact expected results ----------------------------------------------------------

def exact_inputs(cfg: MoEConfig, rank: int, T: int, routing: str, seed: int, device="cpu"):
    """x_TD rows: col 0 = rank + 1, col 1 = token + 1, the rest +-powers of two; weights 2^-j."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    D, K, E = cfg.hidden_size, cfg.top_k, cfg.num_experts
    sign = torch.randint(0, 2, (T, D), generator=g) * 2 - 1
    x = sign * torch.exp2(torch.randint(-2, 3, (T, D), generator=g).float())
    if T:
        x[:, 0] = rank + 1
        x[:, 1] = torch.arange(T) + 1
    if routing == "one_expert":
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[:, 0] = E - 1
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.empty(0, K, dtype=torch.int64)
        if routing == "holes" and T:
            ids[torch.rand(T, K, generator=g) < 0.3] = -1
    w = torch.exp2(-torch.randint(0, 4, (T, K), generator=g).float())
    return x.to(cfg.dtype).to(device), ids.to(device), w.to(device)


def expected_batch_rows(cfg: MoEConfig, R: int, dest: int, inputs) -> tuple[list[torch.Tensor], list[int]]:
    """Rows dest's experts get, in batch order (expert, source rank, token, slot), and per-expert counts."""
    L = cfg.num_experts // R
    rows, counts = [], []
    for lid in range(L):
        n = 0
        for (x, ids, _) in inputs:
            for t in range(x.shape[0]):
                for k in range(cfg.top_k):
                    if int(ids[t, k]) == dest * L + lid:
                        rows.append(x[t].cpu())
                        n += 1
        counts.append(n)
    return rows, counts


def fp8_exact_rows(T: int, D: int, seed: int) -> torch.Tensor:
    """bf16 rows that block quantization maps exactly: e4m3 values times 2^j per 128-column group, each
    group holding +-448, so the scale is 2^j and x / scale needs no rounding. (The interpreter's fp8
    cast rounds values just under a power of two down a binade, so inexact inputs are tested on GPU.)"""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (T, D), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    q = torch.where(q.isnan(), 0.0, q)
    q[:, ::128] = 448.0 * (torch.randint(0, 2, (T, 1), generator=g) * 2 - 1)
    j = torch.arange(D) // 128
    return (q * torch.exp2((j % 5 - 2).float())).to(torch.bfloat16)


def assert_fp8_close(q: torch.Tensor, q_ref: torch.Tensor) -> None:
    """fp8 values equal to the torch reference's but for rare rounding ties (the interpreter's casts) or
    an ulp of fp32 division (the GPU's): those may differ by one fp8 step."""
    a, b = q.float(), q_ref.float()
    assert int((a != b).sum()) <= 0.02 * a.numel(), f"{int((a != b).sum())} of {a.numel()} fp8 values differ"
    torch.testing.assert_close(a, b, rtol=0.13, atol=2 ** -9)


def expert_fn(batch, cfg: MoEConfig, rank: int, L: int) -> torch.Tensor:
    """The test's experts: y = x * (global expert id + 1) over the valid rows, fp32 -> cfg.dtype."""
    batch = batch.materialize()
    x = batch.x.float() if batch.x_scale is None else dequantize_act_ref(batch.x, batch.x_scale)
    mult = torch.zeros(x.shape[0], device=x.device)
    offs = batch.offsets_L1.tolist()
    for lid in range(L):
        mult[offs[lid]:offs[lid + 1]] = rank * L + lid + 1
    return (x * mult.unsqueeze(1)).to(cfg.dtype)


def expected_combine(cfg: MoEConfig, R: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                     rowfn=lambda x: x.float()) -> torch.Tensor:
    """out[t] = dtype(sum_r dtype(sum_{k on rank r} w * dtype(row(x) * (id + 1)))) in float64."""
    L = cfg.num_experts // R
    x, ids, w = x.cpu(), ids.cpu(), w.cpu()
    T, D = x.shape
    out = torch.zeros(T, D, dtype=torch.float64)
    xr = rowfn(x)
    for t in range(T):
        for r in range(R):
            part = torch.zeros(D, dtype=torch.float64)
            for k in range(cfg.top_k):
                e = int(ids[t, k])
                if e >= 0 and e // L == r:
                    part += float(w[t, k]) * (xr[t] * (e + 1)).to(cfg.dtype).double()
            out[t] += part.to(cfg.dtype).double()
    return out.to(cfg.dtype)


# -- emulated ranks ---------------------------------------------------------------------------------

def make_world(cfg: MoEConfig, R: int, **options):
    from epmoe.dispatch.ht import HtDispatcher
    return [HtDispatcher(cfg, g, device=_EMU_DEVICE, **options) for g in EmulatedGroup.world(R)]


def emulate_dispatch(dispatchers, inputs):
    pending = [d.dispatch_send(*inp) for d, inp in zip(dispatchers, inputs)]
    return [d.dispatch_recv(p) for d, p in zip(dispatchers, pending)]


def emulate_combine(dispatchers, ys, batches):
    pending = [d.combine_send(y, b) for d, y, b in zip(dispatchers, ys, batches)]
    return [d.combine_recv(p) for d, p in zip(dispatchers, pending)]


def check_round_trip(cfg, dispatchers, inputs):
    R = len(dispatchers)
    L = cfg.num_experts // R
    batches = emulate_dispatch(dispatchers, inputs)
    for d, b in enumerate(batches):
        assert b.row_index_N is not None  # rows are read through the index, not copied per expert
        b = b.materialize()
        rows, counts = expected_batch_rows(cfg, R, d, inputs)
        assert b.counts_L.tolist() == counts
        assert b.offsets_L1.tolist() == [sum(counts[:i]) for i in range(L + 1)]
        n = sum(counts)
        if dispatchers[d].sync_free:
            assert b.x.shape[0] == dispatchers[d].max_recv_rows
        else:
            assert b.x.shape[0] == n
        want = torch.stack(rows) if rows else torch.empty(0, cfg.hidden_size, dtype=cfg.dtype)
        if cfg.quant is None:
            assert torch.equal(b.x[:n].cpu(), want)
            assert b.x_scale is None
        else:
            q_ref, s_ref = quantize_act_ref(want)
            assert b.x.dtype == torch.float8_e4m3fn and b.x_scale.dtype == torch.float32
            assert b.x_scale.shape == (b.x.shape[0], -(-cfg.hidden_size // 128))
            torch.testing.assert_close(b.x_scale[:n].cpu(), s_ref, rtol=1e-6, atol=0)
            assert_fp8_close(b.x[:n].cpu(), q_ref)
    ys = [expert_fn(b, cfg, r, L) for r, b in enumerate(batches)]
    outs = emulate_combine(dispatchers, ys, batches)
    rowfn = (lambda x: x.float()) if cfg.quant is None else (lambda x: dequantize_act_ref(*quantize_act_ref(x)))
    for r, (x, ids, w) in enumerate(inputs):
        assert outs[r].shape == x.shape and outs[r].dtype == cfg.dtype
        tol = dict(rtol=0, atol=0) if cfg.dtype == torch.float32 else _COMBINE_TOL
        torch.testing.assert_close(outs[r].cpu(), expected_combine(cfg, R, x, ids, w, rowfn), **tol)


# -- CPU tests (emulated) ---------------------------------------------------------------------------

CASES = [  # (R, E, K, D, tokens per rank, routing)
    (2, 4, 2, 64, [5, 3], "random"),
    (2, 8, 8, 72, [4, 0], "random"),  # K == E, odd D, 0 tokens on a rank
    (3, 6, 3, 40, [3, 1, 4], "holes"),  # world 3, -1 ids
    (4, 8, 2, 64, [2, 0, 3, 1], "one_expert"),  # all tokens to one expert
    (4, 4, 1, 16, [1, 1, 0, 2], "random"),  # L = 1, D*2 = 32 bytes
]


@pytest.mark.parametrize("R,E,K,D,Ts,routing", CASES)
def test_round_trip_exact(R, E, K, D, Ts, routing):
    cfg = _cfg(E=E, K=K, D=D)
    dispatchers = make_world(cfg, R)
    check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, routing, seed=1, device=_EMU_DEVICE)
                                        for r, T in enumerate(Ts)])


def test_combine_in_column_chunks(monkeypatch):
    """The combine gathers a row in column chunks: three of 32 columns for D 72 (the last one
    partial), two rows a step."""
    from epmoe.kernels import ht
    monkeypatch.setattr(ht, "COMBINE_CHUNK", 32)
    monkeypatch.setattr(ht, "COMBINE_STEP", 64)
    cfg = _cfg(E=8, K=4, D=72)
    check_round_trip(cfg, make_world(cfg, 2), [exact_inputs(cfg, r, T, "random", seed=4, device=_EMU_DEVICE)
                                               for r, T in enumerate([5, 3])])


@pytest.mark.parametrize("R,D,routing", [(2, 208, "holes"), (3, 128, "random")])
def test_fp8_dispatch_matches_torch_quant(R, D, routing):
    cfg = _cfg(E=6, K=2, D=D, quant="fp8_block")
    dispatchers = make_world(cfg, R)
    inputs = []
    for r in range(R):
        x, ids, w = exact_inputs(cfg, r, 3, routing, seed=2, device=_EMU_DEVICE)
        inputs.append((fp8_exact_rows(x.shape[0], D, seed=r).to(_EMU_DEVICE), ids, w))
    check_round_trip(cfg, dispatchers, inputs)


def test_back_to_back_calls_and_sync_free():
    """Several calls reuse the buffers (both parities, epochs advance); sync_free pads to the worst case."""
    cfg = _cfg(E=4, K=2, D=32, C=4)
    for options in ({}, {"sync_free": True}):
        dispatchers = make_world(cfg, 2, **options)
        for call in range(3):
            Ts = [(call + 1) % 5, 4 - call]
            inputs = [exact_inputs(cfg, r, T, "holes", seed=10 + call, device=_EMU_DEVICE) for r, T in enumerate(Ts)]
            check_round_trip(cfg, dispatchers, inputs)


@pytest.mark.parametrize("sync_free", [False, True])
def test_several_layout_blocks_and_spare_capacity(sync_free):
    """Sources send more rows than one layout block holds (K 4: 32 rows a block), capacity far above T.
    float32: token numbers up to 70 times expert ids are not exact in bf16 (and the interpreter rounds
    bf16 ties down), the layout does not depend on the dtype."""
    cfg = _cfg(E=16, K=4, D=32, C=96, dtype=torch.float32)
    dispatchers = make_world(cfg, 2, sync_free=sync_free)
    for call, Ts in enumerate(([37, 70], [0, 33])):
        check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, "holes", seed=30 + call, device=_EMU_DEVICE)
                                            for r, T in enumerate(Ts)])


def test_repeated_expert_ids():
    """A token may name one expert in several slots (check_tokens allows it): each slot is a batch row of
    its own, in both modes; here the batch holds more rows than R * C * min(K, L)."""
    cfg = _cfg(E=4, K=4, D=16, C=2)
    for options in ({}, {"sync_free": True}):
        dispatchers = make_world(cfg, 2, **options)
        inputs = []
        for r in range(2):
            x, _, w = exact_inputs(cfg, r, 2, "random", seed=5, device=_EMU_DEVICE)
            inputs.append((x, torch.tensor([[0, 0, 0, 0], [1, 1, 3, -1]], device=_EMU_DEVICE), w))
        check_round_trip(cfg, dispatchers, inputs)


@pytest.mark.parametrize("dense", [False, True])
def test_chunk_counts_travel_with_the_dispatch(dense):
    """Each rank's caller's chunk count goes with its dispatch; every rank's batch carries the largest
    (`agreed_chunks`), per call (parities alternate), with the rows still exact; a sync_free dispatcher
    agrees none, and a dispatcher without agrees_chunks refuses a count."""
    cfg = _cfg(E=6, K=2, D=32, C=4)
    dispatchers = make_world(cfg, 3, dense=dense)
    inputs = [exact_inputs(cfg, r, T, "random", seed=3, device=_EMU_DEVICE) for r, T in enumerate([4, 0, 2])]
    for counts in ([1, 5, 2], [3, 1, 1], [1, 1, 1]):
        pending = [d.dispatch_send(*inp, chunks=c) for d, inp, c in zip(dispatchers, inputs, counts)]
        batches = [d.dispatch_recv(p) for d, p in zip(dispatchers, pending)]
        assert [d.agreed_chunks(b) for d, b in zip(dispatchers, batches)] == [max(counts)] * 3
        for d, b in enumerate(batches):
            rows, _ = expected_batch_rows(cfg, 3, d, inputs)
            assert torch.equal(b.materialize().x.cpu(), torch.stack(rows) if rows else b.x[:0].cpu())
        outs = emulate_combine(dispatchers, [expert_fn(b, cfg, r, 2) for r, b in enumerate(batches)], batches)
        for out, (x, ids, w) in zip(outs, inputs):
            torch.testing.assert_close(out.cpu(), expected_combine(cfg, 3, x, ids, w), **_COMBINE_TOL)
    for bad in (0, 2.0, True, 1 << 24):
        with pytest.raises(ValueError, match="chunks must be an int in"):
            dispatchers[0].dispatch_send(*inputs[0], chunks=bad)
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        dispatchers[0].dispatch_checked(*inputs[0], chunks=2.0)
    free = make_world(cfg, 2, sync_free=True)
    assert not free[0].agrees_chunks
    with pytest.raises(ValueError, match="agrees no chunk count"):
        free[0].dispatch_send(*inputs[0], chunks=2)
    batches = emulate_dispatch(free, inputs[:2])
    with pytest.raises(ValueError, match="agrees no chunk count"):
        free[0].agreed_chunks(batches[0])
    local = make_dispatcher("local", cfg, None)
    assert not local.agrees_chunks
    x, ids, w = (t.cpu() for t in inputs[0])
    with pytest.raises(ValueError, match="agrees no chunk count"):
        local.dispatch_checked(x, ids, w, chunks=1)
    with pytest.raises(ValueError, match="agrees no chunk count"):
        local.agreed_chunks(local.dispatch_checked(x, ids, w))


def test_two_dispatches_in_flight():
    """Batch n's rows, read through its row index, survive dispatch n+1 (the other parity of the receive
    buffer); both batches then combine in order."""
    cfg = _cfg(E=4, K=2, D=32, C=4)
    dispatchers = make_world(cfg, 2)
    inputs = [[exact_inputs(cfg, r, 3 + r, "random", seed=50 + call, device=_EMU_DEVICE) for r in range(2)]
              for call in range(2)]
    batches = [emulate_dispatch(dispatchers, call_inputs) for call_inputs in inputs]
    for call_inputs, call_batches in zip(inputs, batches):
        for d, b in enumerate(call_batches):
            rows, _ = expected_batch_rows(cfg, 2, d, call_inputs)
            assert torch.equal(b.materialize().x[:len(rows)].cpu(), torch.stack(rows))
    for call_inputs, call_batches in zip(inputs, batches):
        outs = emulate_combine(dispatchers, [expert_fn(b, cfg, r, 2) for r, b in enumerate(call_batches)],
                               call_batches)
        for r, (x, ids, w) in enumerate(call_inputs):
            torch.testing.assert_close(outs[r].cpu(), expected_combine(cfg, 2, x, ids, w), **_COMBINE_TOL)


@pytest.mark.parametrize("R,E,K,D,Ts,routing", [c for c in CASES if c[0] > 2] + [(2, 8, 8, 72, [5, 0], "holes")])
def test_copy_engine_round_trip_exact(R, E, K, D, Ts, routing):
    """Copy-engine mode: every token's row goes to every rank at its own row (t), tokens with no expert
    there included (ids -1 at the receiver); batches and sums as with the send kernel."""
    cfg = _cfg(E=E, K=K, D=D)
    dispatchers = make_world(cfg, R, copy_engine=True)
    assert all(d.copy_engine for d in dispatchers)
    check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, routing, seed=1, device=_EMU_DEVICE)
                                        for r, T in enumerate(Ts)])


def test_copy_engine_calls_alternate_parities():
    """Copy-engine mode over calls of shrinking and growing T: rows and ids left from an earlier call in
    the same parity (rows past this call's T, or of tokens now sent nowhere) are never read; two batches
    in flight keep their rows."""
    cfg = _cfg(E=4, K=2, D=32, C=6)
    dispatchers = make_world(cfg, 2, copy_engine=True)
    for call, Ts in enumerate(([6, 2], [1, 6], [3, 0], [6, 6])):
        check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, "holes", seed=60 + call, device=_EMU_DEVICE)
                                            for r, T in enumerate(Ts)])
    inputs = [[exact_inputs(cfg, r, 4 - r, "random", seed=70 + call, device=_EMU_DEVICE) for r in range(2)]
              for call in range(2)]
    batches = [emulate_dispatch(dispatchers, call_inputs) for call_inputs in inputs]
    for call_inputs, call_batches in zip(inputs, batches):
        outs = emulate_combine(dispatchers, [expert_fn(b, cfg, r, 2) for r, b in enumerate(call_batches)],
                               call_batches)
        for r, (x, ids, w) in enumerate(call_inputs):
            torch.testing.assert_close(outs[r].cpu(), expected_combine(cfg, 2, x, ids, w), **_COMBINE_TOL)


def test_copy_engine_and_send_kernel_dispatchers_side_by_side(monkeypatch):
    """Dispatchers of both modes and one config on the same ranks keep their own flags (whose meaning
    differs) and epochs; a call whose numbering fails to launch leaves the host's count of calls (the
    copy engine's parity) where the device epoch is (emulated path; on GPUs the rows and their flag
    have left by then, and the dispatcher marks itself failed: test_gpu_dense_edges)."""
    from epmoe.kernels import ht
    cfg = _cfg(E=4, K=2, D=32, C=4)
    from epmoe.dispatch.ht import HtDispatcher
    groups = EmulatedGroup.world(2)
    worlds = {engine: [HtDispatcher(cfg, g, device=_EMU_DEVICE, copy_engine=engine, wait_timeout_s=0.01)
                       for g in groups] for engine in (False, True)}  # a short timeout: a shared flag fails fast
    for call, engine in enumerate((False, True, False, True)):
        check_round_trip(cfg, worlds[engine], [exact_inputs(cfg, r, 3, "holes", seed=80 + call, device=_EMU_DEVICE)
                                               for r in range(2)])
    d = worlds[True][0]
    calls = d._dispatch_calls

    def fails(*args, **kwargs):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(ht, "number_pairs", fails)
    with pytest.raises(RuntimeError, match="launch failed"):
        d.dispatch_send(*exact_inputs(cfg, 0, 3, "random", seed=0, device=_EMU_DEVICE))
    assert d._dispatch_calls == calls == int(d.ws.local("dispatch_seq"))


def _age(dispatchers, calls: int) -> None:
    """Leave every rank's epochs, the flags that count calls, the host's count and its batch-size words
    as `calls` dispatches and combines of these dispatchers leave them."""
    from epmoe.kernels import ht
    for d in dispatchers:
        for name in ("dispatch_seq", "combine_seq", "meta_flag"):  # the numbering signals once a call
            d.ws.local(name).fill_(calls)
        # the copy engine's flag holds the epoch (no rank stamps its own); the send kernel's programs signal
        # once each a call
        flags = d.ws.local("dispatch_flag")
        flags.fill_(calls * (1 if d.copy_engine else d.launch.programs))
        if d.copy_engine:
            flags[d.rank] = 0
        d._dispatch_calls = calls
        for epoch in (calls, calls - 1):  # each parity's word: its latest epoch's (rows 0, one chunk)
            d._sizes[epoch % 2, 0] = (epoch % ht.SIZE_EPOCHS.value) << 56 | 1 << 32


@pytest.mark.parametrize("options", [dict(), dict(copy_engine=True), dict(sync_free=True), dict(quant="fp8_block")])
def test_epochs_past_two_to_the_31(options):
    """Dispatchers 2^31 - 2 calls old keep working over the next three calls (round trips exact): the
    epochs and every flag compared with them are 64-bit (int32 ones went negative at the second call,
    and the waits passed before their signals)."""
    quant = options.pop("quant", None)
    cfg = _cfg(E=4, K=2, D=128, C=6, quant=quant)
    dispatchers = make_world(cfg, 2, wait_timeout_s=0.01, **options)  # a wait left unmet fails, not hangs
    _age(dispatchers, (1 << 31) - 2)
    for call in range(3):
        inputs = []
        for r, T in enumerate([6 - 2 * call, 3 + call]):
            x, ids, w = exact_inputs(cfg, r, T, "holes", seed=90 + call, device=_EMU_DEVICE)
            inputs.append((fp8_exact_rows(T, cfg.hidden_size, seed=r).to(_EMU_DEVICE) if quant else x, ids, w))
        check_round_trip(cfg, dispatchers, inputs)
    for d in dispatchers:
        assert int(d.ws.local("dispatch_seq")) == int(d.ws.local("combine_seq")) == (1 << 31) + 1
        assert not d.timed_out()


@pytest.mark.parametrize("R,E,quant", [(2, 8, None), (2, 8, "fp8_block"), (3, 12, "fp8_block")])
def test_dense_send_kernel_round_trip(R, E, quant):
    """Dense mode by the send kernel (K 8: nearly every token reaches every rank; fp8 rows, or bf16 with
    the copy engine off): every row at row t of every rank, ids -1 where a token has no expert; over
    calls of changing T, so both parities and rows left from an earlier call are seen."""
    cfg = _cfg(E=E, K=8, D=128, C=6, quant=quant)
    dispatchers = make_world(cfg, R)
    assert all(d.dense and not d.copy_engine for d in dispatchers)
    for call, Ts in enumerate(([6, 2, 5], [1, 6, 0], [0, 3, 6])):
        inputs = []
        for r, T in enumerate(Ts[:R]):
            x, ids, w = exact_inputs(cfg, r, T, "holes", seed=90 + call, device=_EMU_DEVICE)
            inputs.append((fp8_exact_rows(T, cfg.hidden_size, seed=r).to(_EMU_DEVICE) if quant else x, ids, w))
        check_round_trip(cfg, dispatchers, inputs)


def test_dense_and_copy_engine_choice():
    """dense=None picks dense mode for a host-synced dispatcher whose routing sends nearly every token to
    every rank, copy_engine=None the copy engine in dense mode for a process group with bf16 rows; the
    options say otherwise, and are refused where they cannot work."""
    from epmoe.dispatch.ht import HtDispatcher, dense_pays
    assert [dense_pays(R, K) for R, K in ((2, 8), (2, 5), (2, 4), (3, 8), (3, 7), (4, 8), (1, 8))] == \
        [True, True, False, True, False, False, False]
    groups = EmulatedGroup.world(2)
    assert not HtDispatcher(_cfg(K=8, E=8), groups[0], device=_EMU_DEVICE).copy_engine  # emulated: off
    dense = {(K, sync_free, quant): HtDispatcher(_cfg(K=K, E=8, D=128, quant=quant), groups[0], device=_EMU_DEVICE,
                                                 sync_free=sync_free).dense
             for K in (4, 8) for sync_free in (False, True) for quant in (None, "fp8_block")}
    assert [key for key, on in dense.items() if on] == [(8, False, None), (8, False, "fp8_block")]
    assert not HtDispatcher(_cfg(K=8, E=8), groups[0], device=_EMU_DEVICE, dense=False).dense
    assert HtDispatcher(_cfg(K=2, E=8), groups[0], device=_EMU_DEVICE, dense=True).dense
    forced = HtDispatcher(_cfg(K=2, E=8), groups[0], device=_EMU_DEVICE, copy_engine=True)  # implies dense
    assert forced.dense and forced.copy_engine
    with pytest.raises(ValueError, match="fp8"):
        HtDispatcher(_cfg(D=128, quant="fp8_block"), groups[0], device=_EMU_DEVICE, copy_engine=True)
    for options in (dict(copy_engine=True, sync_free=True), dict(copy_engine=True, dense=False)):
        with pytest.raises(ValueError, match="copy_engine=True needs dense mode"):
            HtDispatcher(_cfg(), groups[0], device=_EMU_DEVICE, **options)
    with pytest.raises(ValueError, match="dense=True needs sync_free=False"):
        HtDispatcher(_cfg(), groups[0], device=_EMU_DEVICE, dense=True, sync_free=True)


def test_sparse_mode_at_top8():
    """dense=False where dense mode would pay (K 8): the rows follow the numbering, only where they have an
    expert; exact as in dense mode."""
    cfg = _cfg(E=8, K=8, D=64, C=6)
    dispatchers = make_world(cfg, 2, dense=False)
    assert not any(d.dense for d in dispatchers)
    check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, "holes", seed=95, device=_EMU_DEVICE)
                                        for r, T in enumerate([6, 3])])


def _size_word(epoch: int, chunks: int, low: int) -> int:
    """A value of layout_count's size word: 7 bits of the epoch, 24 of the chunk count, 32 of the rows."""
    return (epoch % 128) << 56 | chunks << 32 | low


def test_host_poll_for_the_batch_size():
    """The host's poll (process groups): it returns the size and chunk count once its epoch's word is
    written (here by another thread, after the poll started), takes no word of another epoch (the word
    of a parity holds epoch - 2's before; 7 bits of the epoch tell them apart), and gives up with None
    once the layout's event has completed without the word."""
    import ctypes
    import threading

    from epmoe.dispatch.ht import SIZE_POLL_CHECK_S, _poll_size

    class Event:  # stands in for the layout's CUDA event
        def __init__(self):
            self.done = False

        def query(self):
            return self.done
    buf = torch.full((1,), _size_word(5, 1, 9), dtype=torch.int64)  # epoch 5's word
    word = ctypes.c_int64.from_address(buf.data_ptr())
    ready = Event()
    writer = threading.Timer(5 * SIZE_POLL_CHECK_S, lambda: buf.fill_(_size_word(7, 3, 42)))
    writer.start()
    assert _poll_size(word, 7, ready) == (42, 3)
    writer.join()
    ready.done = True
    assert _poll_size(word, 9, ready) is None
    buf.fill_(_size_word(9, 1, 0xFFFFFFFF))  # a wait that gave up
    assert _poll_size(word, 9, ready) == (-1, 1)
    buf.fill_(_size_word(130, (1 << 24) - 1, 2 ** 32 - 2))  # every field at its largest
    assert _poll_size(word, 130, ready) == (2 ** 32 - 2, (1 << 24) - 1) and _poll_size(word, 128, ready) is None


def test_batch_size_word_of_another_epoch_raises():
    """The host's read of the batch size takes only the word of its dispatch's epoch: a layout that ended
    without writing it (here: the pending dispatch claims a later epoch) raises instead of spinning."""
    import dataclasses
    cfg = _cfg(E=4, K=2, D=32, C=4)
    dispatchers = make_world(cfg, 2)
    inputs = [exact_inputs(cfg, r, 3, "random", seed=7, device=_EMU_DEVICE) for r in range(2)]
    pending = [d.dispatch_send(*inp) for d, inp in zip(dispatchers, inputs)]
    with pytest.raises(RuntimeError, match="ended without writing the batch size"):
        dispatchers[0].dispatch_recv(dataclasses.replace(pending[0], epoch=pending[0].epoch + 2))


@pytest.mark.parametrize("R,Ts,lag,dtype", [
    (2, [11, 7], 0.0, torch.float32),
    (2, [0, 11], 2.0, torch.float32),
    (3, [12, 0, 5], 1.0, torch.float32),
    (3, [9, 1, 12], 40.0, torch.bfloat16),
])
def test_one_kernel_combine_with_its_local_items_trailing(monkeypatch, R, Ts, lag, dtype):
    """The combine as real ranks run it (remote and local items in one kernel, local items `lag` waves of
    tickets behind; 40 waves: all of them after the remote ones) on each rank in turn, run after the
    other ranks' remote halves and before their local halves (the only order in which emulated ranks,
    run in turn, cannot wait forever). Items of 2 rows: several per peer; T 0 on a rank; two rounds, so
    both parities and ready stamps of several epochs; no wait gives up; the ticket counters are back to
    0 after each, and the kernel advanced the combine's epoch once per call on every path."""
    from epmoe.kernels import ht
    monkeypatch.setattr(ht, "COMBINE_CHUNK", 32)
    monkeypatch.setattr(ht, "COMBINE_STEP", 64)
    cfg = _cfg(E=2 * R, K=2, D=64, C=12, dtype=dtype)
    dispatchers = make_world(cfg, R, wait_timeout_s=1.0)
    assert dispatchers[0].launch.combine_tiles(cfg.hidden_size)[1] == 2
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else _COMBINE_TOL
    for call, whole in enumerate(list(range(R)) * 2):
        inputs = [exact_inputs(cfg, r, T, "holes", seed=70 + call, device=_EMU_DEVICE) for r, T in enumerate(Ts)]
        batches = emulate_dispatch(dispatchers, inputs)
        ys = [expert_fn(b, cfg, r, 2) for r, b in enumerate(batches)]
        for r, d in enumerate(dispatchers):
            d._emulated = r != whole  # rank `whole` takes the real ranks' path: combine_send runs it all
            d.launch = dataclasses.replace(d.launch, combine_lag=lag)
        pending = {r: dispatchers[r].combine_send(ys[r], batches[r]) for r in range(R) if r != whole}
        pending[whole] = dispatchers[whole].combine_send(ys[whole], batches[whole])
        assert pending[whole].local_args is None
        outs = [dispatchers[r].combine_recv(pending[r]) for r in range(R)]
        for r, (x, ids, w) in enumerate(inputs):
            torch.testing.assert_close(outs[r].cpu(), expected_combine(cfg, R, x, ids, w), **tol)
        assert all(d.ws.local("control")[:2].tolist() == [0, 0] for d in dispatchers)
        assert all(int(d.ws.local("combine_seq")) == call + 1 for d in dispatchers)  # one epoch per call
        assert not any(d.timed_out() for d in dispatchers)


def test_device_barrier_signals_every_rank():
    """Emulated ranks run in turn, so rank 1's barrier (first) gives up waiting for rank 0's signal; rank
    0's then finds every signal there and passes; each rank's flags count one call from each rank."""
    from epmoe.kernels.sync import device_barrier
    from epmoe.symm import BufferSpec
    specs = [BufferSpec("flag", (2,), torch.int64), BufferSpec("err", (1,), torch.int32)]
    ws = [g.workspace("barrier", specs, torch.device(_EMU_DEVICE)) for g in EmulatedGroup.world(2)]
    waits = [DeviceWait(err_1=w.local("err"), timeout_ns=20_000) for w in ws]
    for r in (1, 0):
        device_barrier(ws[r].peers("flag"), ws[r].local("flag"), 1, r, waits[r])
    assert [w.local("err").item() for w in ws] == [0, 1]
    assert all(w.local("flag").tolist() == [1, 1] for w in ws)
    ws[1].local("err").zero_()  # a second round: the flags count on
    for r in (0, 1):
        device_barrier(ws[r].peers("flag"), ws[r].local("flag"), 2, r, waits[r])
    assert [w.local("err").item() for w in ws] == [1, 0]
    assert all(w.local("flag").tolist() == [2, 2] for w in ws)


def test_waits_give_up_instead_of_hanging():
    """A combine whose peer never sends its partial rows, and a dispatch whose peer never sends: their
    waits give up after wait_timeout_s and set the flag (later waits return at once); the next size
    read on the host raises."""
    cfg = _cfg(E=4, K=2, D=64, C=4)
    dispatchers = make_world(cfg, 2, wait_timeout_s=1e-3)
    inputs = [exact_inputs(cfg, r, 3, "random", seed=5, device=_EMU_DEVICE) for r in range(2)]
    batches = emulate_dispatch(dispatchers, inputs)
    d0 = dispatchers[0]
    assert not d0.timed_out()
    d0._emulated = False  # the real ranks' one-kernel combine: its local items wait for rank 1's
    d0.combine_recv(d0.combine_send(expert_fn(batches[0], cfg, 0, 2), batches[0]))
    assert d0.timed_out() and d0.ws.local("control")[:2].tolist() == [0, 0]
    with pytest.raises(RuntimeError, match="gave up after 0.001 s"):
        d0.dispatch_recv(d0.dispatch_send(*inputs[0]))
    d0 = make_world(cfg, 2, wait_timeout_s=1e-3)[0]
    with pytest.raises(RuntimeError, match="rank 0.*rebuild the dispatcher"):
        d0.dispatch_recv(d0.dispatch_send(*inputs[0]))  # rank 1 never sends
    assert d0.timed_out()
    with pytest.raises(ValueError, match="wait_timeout_s"):
        make_world(cfg, 2, wait_timeout_s=0)


@pytest.mark.parametrize("quant", [None, "fp8_block"])
def test_triton_experts_read_the_receive_buffer(quant):
    """The `triton` experts on ht's batch (the gate-up kernel reads the receive buffer through the row
    index, scales too for fp8) match the reference experts (given the materialized batch by
    Experts.__call__), and the combined outputs the float64 oracle; two calls, so both parities of the
    buffer are read."""
    from epmoe.experts.reference import ReferenceExperts
    from epmoe.oracle import MoERef
    from epmoe.experts.triton import TritonExperts
    from epmoe.testing import TOLERANCES, rel_error
    R, L, D, F = 2, 2, 128, 16
    cfg = _cfg(E=R * L, K=2, D=D, C=6, quant=quant)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(R * L, 2 * F, D, generator=g) / D ** 0.5
    w2 = torch.randn(R * L, D, F, generator=g) / F ** 0.5
    experts = []
    for r in range(R):
        pair = TritonExperts(cfg, L, _EMU_DEVICE), ReferenceExperts(cfg, L, _EMU_DEVICE)
        for e in pair:
            e.load(w13[r * L:(r + 1) * L], w2[r * L:(r + 1) * L])
        experts.append(pair)
    dispatchers = make_world(cfg, R)
    oracle = MoERef.build(w13, w2, fp8=quant is not None, device="cpu")
    for call in range(2):
        inputs = [exact_inputs(cfg, r, 5 - r, "holes", seed=40 + call, device=_EMU_DEVICE) for r in range(R)]
        if quant:  # rows the fp8 send maps exactly: under the interpreter it rounds some ties away from the even value
            inputs = [(fp8_exact_rows(5 - r, D, seed=call).to(_EMU_DEVICE), ids, w)
                      for r, (_, ids, w) in enumerate(inputs)]
        batches = emulate_dispatch(dispatchers, inputs)
        ys = []
        for (triton_experts, reference), b in zip(experts, batches):
            assert b.row_index_N is not None
            y, y_ref = triton_experts(b), reference(b)
            n = int(b.offsets_L1[-1])
            assert y.shape == y_ref.shape == b.out_shape
            assert rel_error(y[:n], y_ref[:n]) <= TOLERANCES["fp8_block" if quant else "bf16"]
            ys.append(y)
        for out, (x, ids, w) in zip(emulate_combine(dispatchers, ys, batches), inputs):
            assert rel_error(out.cpu(), oracle(x, ids, w)) <= TOLERANCES["fp8_block" if quant else "bf16"]


def test_layout_scan_matches_torch(monkeypatch):
    """The scan over per-block counts, with several steps of blocks per program in both passes and a
    last program of fewer experts (L 250: 8 experts a program, 32 blocks a step)."""
    from epmoe.kernels import ht
    monkeypatch.setattr(ht, "SCAN_BLOCKS", 32)
    monkeypatch.setattr(ht, "SCAN_SUM_STEP", 32 * 256)
    B, L, R = 100, 250, 3
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 5, (B, L), generator=g, dtype=torch.int32)
    recv_count = torch.randint(0, 50, (2, R), generator=g, dtype=torch.int32)
    seq = torch.tensor([7], dtype=torch.int64)
    counts, offsets, start, recv = (t.cpu() for t in ht.layout_scan(table.to(_EMU_DEVICE), recv_count.to(_EMU_DEVICE),
                                                                     seq.to(_EMU_DEVICE)))
    want_counts = table.sum(0, dtype=torch.int32)
    want_offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(want_counts, 0, dtype=torch.int32)])
    assert torch.equal(counts, want_counts) and torch.equal(offsets, want_offsets)
    assert torch.equal(start, torch.cumsum(table, 0, dtype=torch.int32) - table + want_offsets[:L])
    assert torch.equal(recv, recv_count[1])  # parity 7 % 2


def test_size_word_at_its_largest_fields():
    """layout_count's size word at epoch 2^40 + 130 (its 7 bits wrap: 2 mod 128), the largest chunk count
    and a large pair count: batch_size reads back what the ranks sent, and no other epoch's word."""
    from epmoe.kernels import ht
    R, C, K, L = 2, 1, 1, 1
    epoch = 2 ** 40 + 130
    i32, i64 = (dict(dtype=dtype, device=_EMU_DEVICE) for dtype in (torch.int32, torch.int64))
    chunks = torch.tensor([[ht.MAX_CHUNKS.value - 1, 3], [1, 1]], **i32)  # parity 0: row 0
    pairs = torch.tensor([[2 ** 31 - 1, 6], [0, 0]], **i32)  # summed in int64
    size_1 = torch.zeros(1, **i64)
    wait = DeviceWait(err_1=torch.zeros(1, **i32), timeout_ns=10 ** 6)
    ht.layout_count(torch.full((2, R, C, K), -1, **i32), torch.zeros(2, R, **i32), torch.tensor([epoch], **i64),
                    ht.layout_blocks(C, K), L, torch.full((R,), epoch, **i64), pairs, chunks, size_1, wait)
    assert ht.batch_size(int(size_1), epoch) == (2 ** 31 + 5, ht.MAX_CHUNKS.value - 1)  # (a 32-bit field)
    assert ht.batch_size(int(size_1), epoch - 1) is None and ht.batch_size(int(size_1), epoch - 2) is None
    assert wait.err_1.item() == 0


@pytest.mark.parametrize("T,R,ids_dtype", [(2500, 3, torch.int64), (1, 2, torch.int32), (0, 4, torch.int64),
                                            (450, 2, torch.int32)])
def test_number_pairs_matches_torch(monkeypatch, T, R, ids_dtype):
    """The sender's slots (blocks of 64 tokens, the earlier blocks summed 8 at a time; ids -1 and out of
    range) against a torch prefix sum; the tokens and pairs it stores into every rank's recv_count and
    pairs buffers and the ids and weights into its receive region, both signalled, and what the layout's
    count kernel makes of them (waiting for the signals, or giving up)."""
    from epmoe.kernels import ht
    monkeypatch.setattr(ht, "NUMBER_BLOCK", 64)
    monkeypatch.setattr(ht, "NUMBER_STEP", 8)
    L, K, rank = 4, 3, R - 1
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(-1, R * L + 2, (T, K), generator=g).to(ids_dtype)  # R*L, R*L+1: out of range
    seq = torch.full((1,), 5, dtype=torch.int64, device=_EMU_DEVICE)
    C = max(T, 1)
    bufs = {name: [torch.full(shape, fill, dtype=dtype, device=_EMU_DEVICE) for _ in range(R)]
            for name, shape, fill, dtype in [("pairs", (2, R), -7, torch.int32), ("recv_count", (2, R), -7, torch.int32),
                                             ("chunks", (2, R), -7, torch.int32),
                                             ("recv_ids", (2, R, C, K), -7, torch.int32),
                                             ("recv_w", (2, R, C, K), -7.0, torch.float32),
                                             ("meta_flag", (R,), 0, torch.int64)]}
    peers = {name: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=_EMU_DEVICE)
             for name, ts in bufs.items()}
    w = torch.rand(T, K, generator=g)
    done = torch.zeros(1, dtype=torch.int32, device=_EMU_DEVICE)
    slot_TR, epoch_1 = ht.number_pairs(ids.to(_EMU_DEVICE), w.to(_EMU_DEVICE), seq, done, R, C, L, peers, rank,
                                       chunks=T + 3)
    assert seq.item() == 6 and epoch_1.item() == 6 and done.item() == 0  # the epoch advanced, counter reset
    dest = torch.where((ids >= 0) & (ids < R * L), ids.long() // L, R)
    wants_TR = torch.zeros(T, R + 1, dtype=torch.int32).scatter_(1, dest, 1)[:, :R]
    hits_TR = torch.zeros(T, R + 1, dtype=torch.int32).scatter_add_(1, dest, torch.ones_like(dest, dtype=torch.int32))
    want = torch.where(wants_TR > 0, torch.cumsum(wants_TR, 0) - 1, -1)
    assert torch.equal(slot_TR.cpu(), want.to(torch.int32))
    for r in range(R):  # parity 6 % 2 = 0 at [0, rank]; the other parity untouched
        pairs, recv_count = bufs["pairs"][r].cpu(), bufs["recv_count"][r].cpu()
        assert pairs[0, rank].item() == int(hits_TR[:, r].sum())
        assert recv_count[0, rank].item() == int(wants_TR[:, r].sum())
        assert pairs[1].eq(-7).all() and recv_count[1].eq(-7).all()
        assert bufs["chunks"][r][0, rank].item() == T + 3 and bufs["chunks"][r][1].eq(-7).all()
        assert bufs["meta_flag"][r].tolist() == [int(i == rank) for i in range(R)]  # one signal from `rank`
        sent = want[:, r] >= 0  # the ids (local to r, -1 elsewhere) and weights at the tokens' slots
        lid = torch.where((ids >= r * L) & (ids < (r + 1) * L), ids - r * L, -1)
        assert torch.equal(bufs["recv_ids"][r][0, rank, :int(sent.sum())].cpu(), lid[sent].int())
        assert torch.equal(bufs["recv_w"][r][0, rank, :int(sent.sum())].cpu(), w[sent])
    flags, pairs = bufs["meta_flag"], bufs["pairs"]
    flags[0].fill_(6)  # as if every rank had signalled epoch 6
    pairs[0][0] = torch.arange(R, dtype=torch.int32) * 10
    bufs["chunks"][0][0] = torch.arange(R, dtype=torch.int32) + 11  # the largest: rank R - 1's
    wait = DeviceWait(err_1=torch.zeros(1, dtype=torch.int32, device=_EMU_DEVICE), timeout_ns=10 ** 6)
    blocks = ht.layout_blocks(C, K)

    size_1 = torch.full((1,), _size_word(5, 1, 0), dtype=torch.int64, device=_EMU_DEVICE)  # epoch 5's: 0 pairs

    def count():  # rank 0's layout count: its per-block expert counts and the pairs it receives in all
        return ht.layout_count(bufs["recv_ids"][0], bufs["recv_count"][0], epoch_1, blocks, L, flags[0], pairs[0],
                               bufs["chunks"][0], size_1, wait)
    assert ht.batch_size(int(size_1), 6) is None and ht.batch_size(int(size_1), 5) == (0, 1)
    table = count()
    assert ht.batch_size(int(size_1), 6) == (10 * R * (R - 1) // 2, R + 10) and wait.err_1.item() == 0
    assert ht.batch_size(int(size_1), 5) is None
    lid0 = torch.where((ids >= 0) & (ids < L), ids, -1)[want[:, 0] >= 0]  # rank 0's ids of the tokens sent there
    per_source = table.cpu().view(R, blocks.blocks_per_rank, L).sum(1)
    assert torch.equal(per_source[rank], torch.bincount(lid0[lid0 >= 0].long(), minlength=L).int())
    assert per_source[:rank].eq(0).all()  # recv_count of the other sources: -7, no rows
    flags[0][R - 1] = 5  # rank R - 1 has not signalled epoch 6: the wait gives up and says so
    count()
    assert ht.batch_size(int(size_1), 6) == (-1, R + 10) and wait.err_1.item() == 1
    with pytest.raises(ValueError, match="chunks must be in"):
        ht.number_pairs(ids.to(_EMU_DEVICE), w.to(_EMU_DEVICE), seq, done, R, C, L, peers, rank, chunks=1 << 24)


def test_float32_dtype():
    cfg = _cfg(E=4, K=3, D=12, dtype=torch.float32)
    check_round_trip(cfg, make_world(cfg, 2), [exact_inputs(cfg, r, 3, "random", seed=3, device=_EMU_DEVICE)
                                               for r in range(2)])


def test_refuses_bad_input():
    from epmoe.dispatch.ht import HtDispatcher
    cfg = _cfg(D=12)  # 24-byte bf16 rows
    groups = EmulatedGroup.world(2)
    assert not HtDispatcher.availability(cfg, groups[0])[0]
    with pytest.raises(ValueError, match="multiple of 16"):
        HtDispatcher(cfg, groups[0], device=_EMU_DEVICE)
    with pytest.raises(ValueError, match="fp8 rows"):
        HtDispatcher(_cfg(D=72, quant="fp8_block"), groups[0], device=_EMU_DEVICE)  # 72 fp8 bytes
    cfg = _cfg(E=6)
    with pytest.raises(ValueError, match="divisible"):
        HtDispatcher(cfg, EmulatedGroup.world(4)[0], device=_EMU_DEVICE)
    cfg = _cfg(C=2)
    d = make_world(cfg, 2)[0]
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        d.dispatch_send(*exact_inputs(cfg, 0, 3, "random", seed=0, device=_EMU_DEVICE))
    with pytest.raises(ValueError, match="outside"):
        x, ids, w = exact_inputs(cfg, 0, 2, "random", seed=0, device=_EMU_DEVICE)
        d.dispatch_send(x, ids + cfg.num_experts, w)


@pytest.mark.parametrize("field,value,match", [
    ("combine_lag", -1.0, "combine_lag"), ("combine_lag", float("nan"), "combine_lag"),
    ("combine_step", 3000, "power of two"), ("combine_chunk", 1000, "power of two"),
    ("combine_warps", 3, "power of two"), ("combine_programs", 0, ">= 1"), ("programs", 0, ">= 1"),
    ("combine_registers", 0, "combine_registers"), ("combine_registers", 256, "combine_registers")])
def test_launch_settings_are_checked(field, value, match):
    from epmoe.kernels.ht import HtLaunch
    good = dict(programs=2, num_warps=1, combine_programs=3, combine_warps=1)
    HtLaunch(**good)
    HtLaunch(**good, combine_registers=128)
    with pytest.raises(ValueError, match=match):
        HtLaunch(**{**good, field: value})


def test_combine_register_cap_fits_its_programs():
    """Four programs of 4 warps an SM: 128 registers a thread, six (the default): 80; the cap is a multiple of
    8 and at most 255."""
    from epmoe.kernels.ht import registers_per_thread
    assert registers_per_thread(4, 4) == 128
    assert registers_per_thread(6, 4) == 80  # 85 rounded down
    assert registers_per_thread(3, 4) == 168  # 170 rounded down to ptxas's step
    assert registers_per_thread(1, 1) == 255


def test_gpu_launch_on_an_h200():
    """ht_launch's GPU rule on 132 SMs: what `epmoe bench dispatch` reports running on the H200s."""
    from epmoe.kernels.ht import HtLaunch, gpu_launch
    assert gpu_launch(2 * 7168, 132) == HtLaunch(programs=105, num_warps=8, combine_programs=792, combine_warps=4,
                                                 combine_registers=80, combine_chunk=2048, combine_step=2048,
                                                 combine_lag=1.5)
    assert gpu_launch(2 * 1024, 132).num_warps == 4


def test_cuda_device_gets_an_index(monkeypatch):
    """A dispatcher given device "cuda" keeps its buffers on cuda:N (the current device), as tensors
    made with device="cuda" report it, so that its device check accepts them."""
    from epmoe.symm import indexed_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed_device("cuda") == torch.device("cuda", 3)
    assert indexed_device("cuda:1") == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")


def test_registry_lists_ht():
    cfg = _cfg()
    assert "ht" in list_dispatchers(cfg, None)
    assert not list_dispatchers(cfg, None)["ht"][0]
    from epmoe.dispatch.ht import HtDispatcher
    assert HtDispatcher.availability(cfg, EmulatedGroup.world(2)[0]) == (True, "ok")


@pytest.mark.parametrize("triton_dir", [None] + OTHER_TRITONS)
def test_kernels_compile_for_hopper(triton_dir):
    """The ht kernels compile for sm_90 (H100/H200) with the launch configs used there: no spills (the
    combine, under its register cap: a few words), 16-byte vector stores on the big rows
    (tests/compile_ht.py; with the installed triton, or the one in triton_dir)."""
    assert_compiles("compile_ht.py", triton_dir)


# -- GPU tests (2 devices, real symmetric memory) ---------------------------------------------------

def _gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= gpu_test_ranks() and not _INTERPRET


needs_gpus = pytest.mark.skipif(not _gpus(), reason=f"needs {gpu_test_ranks()} GPUs and TRITON_INTERPRET=0")


_GPU_EXACT_CASES = [  # (E, K, D bf16, D fp8, tokens of ranks 0, 1 (repeated for more ranks), routing)
    (8, 3, 256, 256, [37, 0], "holes"), (16, 8, 7168, 7168, [64, 129], "random"),
    (4, 4, 72, 208, [5, 9], "one_expert")]


def _gpu_exact(ctx, quant, calls):
    """Each case: `calls` dispatches with new inputs (zeroed and freed right after dispatch_send), two in
    flight at a time (dispatch n, dispatch n+1, then their combines), with and without sync_free; the
    first two cases also with one combine program per rank (its tickets alone must finish the combine:
    the ticket order is deadlock-free);
    bf16: every case with the copy engine and with the send kernel (the default picks one per K).
    No device-side wait gives up."""
    import dataclasses

    from epmoe.dispatch.ht import HtDispatcher
    from epmoe.kernels.ht import ht_launch
    R = ctx.world_size
    runs = [(case, sf, {}, None) for sf in (False, True) for case in _GPU_EXACT_CASES]
    runs += [(case, False, dict(combine_programs=1), None) for case in _GPU_EXACT_CASES[:2]]
    if quant is None:
        runs += [(case, False, {}, engine) for case in _GPU_EXACT_CASES for engine in (False, True)]
    for (E, K, D_bf16, D_fp8, Ts, routing), sync_free, changes, copy_engine in runs:
        D = D_fp8 if quant else D_bf16
        E, Ts = multiple_of(E, R), (Ts * R)[:R]  # a token count per rank
        cfg = _cfg(E=E, K=K, D=D, C=max(Ts) + 3, quant=quant)
        launch = dataclasses.replace(ht_launch(cfg.row_bytes, ctx.device), **changes)
        d = HtDispatcher(cfg, ctx.group, sync_free=sync_free, launch=launch, copy_engine=copy_engine,
                         wait_timeout_s=10.0)
        L = cfg.num_experts // R
        for first in range(0, calls, 2):
            in_flight = []
            for call in range(first, min(first + 2, calls)):
                case = (E, K, D, Ts, routing, sync_free, changes, d.copy_engine, call)
                inputs = [exact_inputs(cfg, r, T, routing, seed=20 + call) for r, T in enumerate(Ts)]
                x, ids, w = (t.to(ctx.device) for t in inputs[ctx.rank])
                pending = d.dispatch_send(x, ids, w)
                x.zero_()  # the caller may overwrite and free x once dispatch_send returns
                del x
                b = d.dispatch_recv(pending)
                rows, counts = expected_batch_rows(cfg, R, ctx.rank, inputs)
                assert b.counts_L.tolist() == counts, (case, b.counts_L.tolist(), counts)
                n = sum(counts)
                assert b.out_shape[0] == (d.max_recv_rows if sync_free else n), case
                m = b.materialize()
                want = torch.stack(rows) if rows else torch.empty(0, D, dtype=cfg.dtype)
                if quant is None:
                    assert torch.equal(m.x[:n].cpu(), want), case
                else:
                    q_ref, s_ref = quantize_act_ref(want)
                    torch.testing.assert_close(m.x_scale[:n].cpu(), s_ref, rtol=1e-6, atol=0)
                    assert_fp8_close(m.x[:n].cpu(), q_ref)
                in_flight.append((b, expert_fn(m, cfg, ctx.rank, L), inputs))
            for b, y, inputs in in_flight:
                out = d.combine(y, b)
                if quant is None:
                    expected, tol = expected_combine(cfg, R, *inputs[ctx.rank]), dict(rtol=0, atol=0)
                else:  # the rows are rounded to fp8 on the way (ties may differ by an fp8 step): tolerance
                    rowfn = lambda x: dequantize_act_ref(*quantize_act_ref(x))  # noqa: E731
                    expected, tol = expected_combine(cfg, R, *inputs[ctx.rank], rowfn), dict(rtol=0.13, atol=0.05)
                torch.testing.assert_close(out.cpu(), expected, **tol)
        assert not d.timed_out(), (E, K, D, Ts, routing, sync_free, changes, d.copy_engine)
    return True


@needs_gpus
@pytest.mark.gpu2
@pytest.mark.parametrize("quant", [None, "fp8_block"])
def test_gpu_exact(quant):
    """Exact rows and combine sums across gpu_test_ranks() GPUs, with and without sync_free, 3 calls each
    (the first two in flight together); 129 tokens on a rank: two numbering programs."""
    from epmoe.launch import spawn
    assert all(spawn(_gpu_exact, gpu_test_ranks(), "cuda", (quant, 3), timeout_s=240))


def _gpu_dense_edges(ctx, copy_engine):
    """Dense mode over real ranks, rows by the copy engine or the send kernel: (1) inputs made late on
    the stream (behind a 1 ms spin) and
    passed to _dispatch_send, which skips check_tokens' host sync, then x, ids and weights overwritten
    at once: the side stream's numbering and own-rows copy still read this call's inputs, the rows and
    sums are exact, and every rank gets the largest of the ranks' chunk counts; (2) a numbering that
    fails to queue after the rows and their flag have left marks the dispatcher failed on every rank:
    timed_out(), and the next dispatch raises; (3) the GPU has 64-bit stream memory operations, and
    without them copy_engine=None picks the send kernel and copy_engine=True is refused."""
    from unittest import mock

    from epmoe import cuda_driver
    from epmoe.dispatch.ht import HtDispatcher
    from epmoe.kernels import ht
    R = ctx.world_size
    E, K, D, T = multiple_of(8, R), 8, 256, 37
    cfg = _cfg(E=E, K=K, D=D, C=T)
    if not copy_engine:
        assert cuda_driver.can_write_value(ctx.device.index)
        with mock.patch.object(cuda_driver, "can_write_value", lambda index: False):
            forced_dense = HtDispatcher(cfg, ctx.group, dense=True)  # where copy_engine=None would pick the engine
            assert forced_dense.dense and not forced_dense.copy_engine
            with pytest.raises(ValueError, match="needs 64-bit stream memory operations"):
                HtDispatcher(cfg, ctx.group, copy_engine=True)
    d = HtDispatcher(cfg, ctx.group, copy_engine=copy_engine, wait_timeout_s=10.0)
    assert d.dense and d.copy_engine == copy_engine
    for call in range(2):
        inputs = [exact_inputs(cfg, r, T, "random", seed=40 + call) for r in range(R)]
        staged = [t.to(ctx.device) for t in inputs[ctx.rank]]
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
        x, ids, w = (t.clone() for t in staged)  # ready only after the spin
        counts = [1 + (3 * r + 2 * call) % 7 for r in range(R)]  # rank 0: 1 then 3; rank 1: 4 then 6
        pending = d._dispatch_send(x, ids, w.float(), counts[ctx.rank])
        x.zero_()
        ids.fill_(-1)
        w.zero_()
        b = d.dispatch_recv(pending)
        assert d.agreed_chunks(b) == max(counts), (call, d.agreed_chunks(b), counts)
        rows, counts = expected_batch_rows(cfg, R, ctx.rank, inputs)
        assert b.counts_L.tolist() == counts, (call, b.counts_L.tolist(), counts)
        assert torch.equal(b.materialize().x[:sum(counts)].cpu(), torch.stack(rows)), call
        out = d.combine(expert_fn(b.materialize(), cfg, ctx.rank, E // R), b)
        torch.testing.assert_close(out.cpu(), expected_combine(cfg, R, *inputs[ctx.rank]), rtol=0, atol=0)
    assert not d.timed_out()

    def fails(*args, **kwargs):
        raise RuntimeError("numbering failed to launch")
    x, ids, w = (t.to(ctx.device) for t in exact_inputs(cfg, ctx.rank, T, "random", seed=50))
    with mock.patch.object(ht, "number_pairs", fails):
        with pytest.raises(RuntimeError, match="numbering failed"):
            d.dispatch_send(x, ids, w)
    assert d.timed_out()
    with pytest.raises(RuntimeError, match="rebuild the dispatcher"):
        d.dispatch(x, ids, w)
    return True


@needs_gpus
@pytest.mark.gpu2
@pytest.mark.parametrize("copy_engine", [True, False])
def test_gpu_dense_edges(copy_engine):
    from epmoe.launch import spawn
    assert all(spawn(_gpu_dense_edges, gpu_test_ranks(), "cuda", (copy_engine,), timeout_s=240))


def rows_by_expert(x: torch.Tensor, offsets_L1: torch.Tensor) -> torch.Tensor:
    """The valid rows of a contiguous batch of 2-byte values, each expert's rows in a canonical order
    (by their first 4 values' bit patterns): batches that differ only in the order of rows within an
    expert give equal results."""
    n = int(offsets_L1[-1])
    x = x[:n]
    expert_N = torch.searchsorted(offsets_L1[1:].long(), torch.arange(n, device=x.device), right=True)
    bits = x.view(torch.int16).long()
    order = torch.arange(n, device=x.device)
    for key in [bits[:, c] for c in reversed(range(min(4, x.shape[1])))] + [expert_N]:  # least significant first
        order = order[torch.argsort(key[order], stable=True)]
    return x[order]


def assert_combine_bounded(cfg: MoEConfig, R: int, out: torch.Tensor, x, ids, w) -> None:
    """Random data, experts y = dtype(x * (id + 1)) as in expert_fn: out[t] must be the float64 value
    sum_r dtype(p_r), p_r = sum_{k on rank r} w * y, within what rounding allows: each rank's fp32 partial
    may round to the other neighbour in dtype (summation order, fused multiply-add: one ulp, at most
    2^-7 |p_r| in bf16), fp32 sums lose 2^-20 of the magnitude of their terms, and the final sum rounds
    once more (at most 2^-7 |out|). A wrong row or weight is off by O(|terms|)."""
    L = cfg.num_experts // R
    ref = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    partials = torch.zeros_like(ref)
    terms = torch.zeros_like(ref)
    for r in range(R):
        p = torch.zeros_like(ref)
        for k in range(cfg.top_k):
            on = ((ids[:, k] >= 0) & (ids[:, k] // L == r)).unsqueeze(1)
            y = (x.float() * (ids[:, k] + 1).float().unsqueeze(1)).to(cfg.dtype).double()
            wy = torch.where(on, w[:, k].double().unsqueeze(1) * y, 0.0)
            p += wy
            terms += wy.abs()
        ref += p.to(cfg.dtype).double()
        partials += p.abs()
    bound = 2 ** -7 * (partials + ref.abs()) + 2 ** -20 * terms
    err = (out.double() - ref).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), \
        f"{int((err > bound).sum())} of {err.numel()} values off; worst: got {float(out.view(-1)[worst])}, " \
        f"float64 {float(ref.view(-1)[worst])}, bound {float(bound.view(-1)[worst])}"


def _gpu_vs_alltoall(ctx, cases, calls):
    """ht against the NCCL alltoall dispatcher on random data: same per-expert counts and row sets (the
    order of rows within an expert is not part of the contract), both combines within rounding of the
    float64 reference (their fp32 partial sums differ in order and fusion, so they may differ from each
    other by an ulp of each rank's partial, more than any fixed tolerance when the partials cancel)."""
    for T, D, E, K in cases:
        _vs_alltoall(ctx, T, D, E, K, calls)
    return True


def _vs_alltoall(ctx, T, D, E, K, calls):
    from epmoe.dispatch.alltoall import AllToAllDispatcher
    from epmoe.dispatch.ht import HtDispatcher
    R = ctx.world_size
    E = multiple_of(E, R)
    cfg = _cfg(E=E, K=K, D=D, C=T)
    L = E // R
    ht, a2a = HtDispatcher(cfg, ctx.group), AllToAllDispatcher(cfg, ctx.group)
    g = torch.Generator(device=ctx.device).manual_seed(ctx.rank + 7)
    for call in range(calls):
        Tc = T - 3 * call - ctx.rank  # T differs per call and rank (capacity stays T)
        x = torch.randn(Tc, D, device=ctx.device, generator=g).to(cfg.dtype)
        ids = torch.rand(Tc, E, device=ctx.device, generator=g).topk(K, dim=1).indices
        if call == 1:  # some -1 ids, and tokens with none at all
            ids[torch.rand(Tc, K, device=ctx.device, generator=g) < 0.3] = -1
            ids[: Tc // 10] = -1
        w = torch.rand(Tc, K, device=ctx.device, generator=g)
        b1, b2 = ht.dispatch(x, ids, w), a2a.dispatch(x, ids, w)
        assert torch.equal(b1.counts_L, b2.counts_L) and torch.equal(b1.offsets_L1, b2.offsets_L1)
        assert b1.out_shape == b2.x.shape
        x1 = b1.materialize().x
        assert torch.equal(rows_by_expert(x1, b1.offsets_L1), rows_by_expert(b2.x, b2.offsets_L1))
        out1 = ht.combine(expert_fn(b1, cfg, ctx.rank, L), b1)
        out2 = a2a.combine(expert_fn(b2, cfg, ctx.rank, L), b2)
        assert_combine_bounded(cfg, R, out1, x, ids, w)
        assert_combine_bounded(cfg, R, out2, x, ids, w)


@needs_gpus
@pytest.mark.gpu2
def test_gpu_random_matches_alltoall():
    from epmoe.launch import spawn
    cases = [(1024, 7168, 256, 8), (333, 2048, 16, 3)]  # (T, D, E, K); E rounded up to a multiple of R
    assert all(spawn(_gpu_vs_alltoall, gpu_test_ranks(), "cuda", (cases, 3), timeout_s=240))


def _gpu_graph(ctx, T, D, E, K, replays):
    """A sync_free dispatch + combine captured once, replayed with new x and routing: the eager call and
    every replay within rounding of the float64 expectation (assert_combine_bounded), and every replay
    equal to an eager call on its inputs."""
    from epmoe.dispatch.ht import HtDispatcher
    E = multiple_of(E, ctx.world_size)
    cfg = _cfg(E=E, K=K, D=D, C=T)
    d = HtDispatcher(cfg, ctx.group, sync_free=True)
    L = E // ctx.world_size
    x = torch.randn(T, D, device=ctx.device).to(cfg.dtype)
    ids = torch.rand(T, E, device=ctx.device).topk(K, dim=1).indices
    w = torch.rand(T, K, device=ctx.device)

    def step():
        b = d.dispatch(x, ids, w)
        x_N = b.materialize().x
        mult = torch.searchsorted(b.offsets_L1[1:].long(), torch.arange(x_N.shape[0], device=ctx.device),
                                  right=True) + ctx.rank * L + 1
        return d.combine((x_N.float() * mult.unsqueeze(1)).to(cfg.dtype), b)

    assert_combine_bounded(cfg, ctx.world_size, step(), x, ids, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i in range(replays):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.rand(T, E, device=ctx.device).topk(K, dim=1).indices)
        ids[torch.rand(T, K, device=ctx.device) < 0.2] = -1
        w.copy_(torch.rand(T, K, device=ctx.device))
        graph.replay()
        assert_combine_bounded(cfg, ctx.world_size, out, x, ids, w)
        if i < 3:
            torch.testing.assert_close(out, step(), rtol=0, atol=0)
    return True


@needs_gpus
@pytest.mark.gpu2
def test_gpu_cuda_graph_sync_free():
    from epmoe.launch import spawn
    assert all(spawn(_gpu_graph, gpu_test_ranks(), "cuda", (256, 1024, 16, 4, 20), timeout_s=240))
