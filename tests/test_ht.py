"""Tests of the `ht` dispatcher (epmoe/dispatch/ht/): round trips over emulated ranks in every mode, the
modes' choice, the chunk agreement, epochs, the host's read of the batch size, time-outs, bad input.

The kernels alone: test_ht_kernels.py; launch settings: test_ht_launch.py; sm_90 builds:
test_ht_compile.py; real ranks on several GPUs: test_ht_gpu.py. Inputs and references: ht_support.py.

Shape letters: T tokens, D hidden size, K top-k, E experts, L local experts, R ranks, N batch rows.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from epmoe.dispatch.ht import HtDispatcher, SyncFreeHtDispatcher, dense_pays
from epmoe.dispatch.ht.combine import FusedCombine
from epmoe.kernels.ht import layout as layout_kernels, launch as launch_module, send as send_kernels
from epmoe.registry import list_dispatchers, make_dispatcher
from epmoe.symm import EmulatedGroup
from ht_support import (COMBINE_TOL, EMU_DEVICE, check_round_trip, emulate_combine, emulate_dispatch, exact_inputs,
                        expected_batch_rows, expected_combine, expert_fn, fp8_exact_rows, ht_cfg, make_world)


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
    cfg = ht_cfg(E=E, K=K, D=D)
    dispatchers = make_world(cfg, R)
    check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, routing, seed=1, device=EMU_DEVICE)
                                        for r, T in enumerate(Ts)])


def test_combine_in_column_chunks(monkeypatch):
    """The combine gathers a row in column chunks: three of 32 columns for D 72 (the last one
    partial), two rows a step."""
    monkeypatch.setattr(launch_module, "COMBINE_CHUNK", 32)
    monkeypatch.setattr(launch_module, "COMBINE_STEP", 64)
    cfg = ht_cfg(E=8, K=4, D=72)
    check_round_trip(cfg, make_world(cfg, 2), [exact_inputs(cfg, r, T, "random", seed=4, device=EMU_DEVICE)
                                               for r, T in enumerate([5, 3])])


@pytest.mark.parametrize("R,D,routing", [(2, 208, "holes"), (3, 128, "random")])
def test_fp8_dispatch_matches_torch_quant(R, D, routing):
    cfg = ht_cfg(E=6, K=2, D=D, quant="fp8_block")
    dispatchers = make_world(cfg, R)
    inputs = []
    for r in range(R):
        x, ids, w = exact_inputs(cfg, r, 3, routing, seed=2, device=EMU_DEVICE)
        inputs.append((fp8_exact_rows(x.shape[0], D, seed=r).to(EMU_DEVICE), ids, w))
    check_round_trip(cfg, dispatchers, inputs)


def test_back_to_back_calls_and_sync_free():
    """Several calls reuse the buffers (both parities, epochs advance); sync_free pads to the worst case."""
    cfg = ht_cfg(E=4, K=2, D=32, C=4)
    for options in ({}, {"sync_free": True}):
        dispatchers = make_world(cfg, 2, **options)
        for call in range(3):
            Ts = [(call + 1) % 5, 4 - call]
            inputs = [exact_inputs(cfg, r, T, "holes", seed=10 + call, device=EMU_DEVICE) for r, T in enumerate(Ts)]
            check_round_trip(cfg, dispatchers, inputs)


@pytest.mark.parametrize("sync_free", [False, True])
def test_several_layout_blocks_and_spare_capacity(sync_free):
    """Sources send more rows than one layout block holds (K 4: 32 rows a block), capacity far above T.
    float32: token numbers up to 70 times expert ids are not exact in bf16 (and the interpreter rounds
    bf16 ties down), the layout does not depend on the dtype."""
    cfg = ht_cfg(E=16, K=4, D=32, C=96, dtype=torch.float32)
    dispatchers = make_world(cfg, 2, sync_free=sync_free)
    for call, Ts in enumerate(([37, 70], [0, 33])):
        check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, "holes", seed=30 + call, device=EMU_DEVICE)
                                            for r, T in enumerate(Ts)])


def test_repeated_expert_ids():
    """A token may name one expert in several slots (check_tokens allows it): each slot is a batch row of
    its own, in both modes; here the batch holds more rows than R * C * min(K, L)."""
    cfg = ht_cfg(E=4, K=4, D=16, C=2)
    for options in ({}, {"sync_free": True}):
        dispatchers = make_world(cfg, 2, **options)
        inputs = []
        for r in range(2):
            x, _, w = exact_inputs(cfg, r, 2, "random", seed=5, device=EMU_DEVICE)
            inputs.append((x, torch.tensor([[0, 0, 0, 0], [1, 1, 3, -1]], device=EMU_DEVICE), w))
        check_round_trip(cfg, dispatchers, inputs)


@pytest.mark.parametrize("dense", [False, True])
def test_chunk_counts_travel_with_the_dispatch(dense):
    """Each rank's caller's chunk count goes with its dispatch; every rank's batch carries the largest
    (`agreed_chunks`), per call (parities alternate), with the rows still exact; a sync_free dispatcher
    agrees none, and a dispatcher without agrees_chunks refuses a count."""
    cfg = ht_cfg(E=6, K=2, D=32, C=4)
    dispatchers = make_world(cfg, 3, dense=dense)
    inputs = [exact_inputs(cfg, r, T, "random", seed=3, device=EMU_DEVICE) for r, T in enumerate([4, 0, 2])]
    for counts in ([1, 5, 2], [3, 1, 1], [1, 1, 1]):
        pending = [d.dispatch_send(*inp, chunks=c) for d, inp, c in zip(dispatchers, inputs, counts)]
        batches = [d.dispatch_recv(p) for d, p in zip(dispatchers, pending)]
        assert [d.agreed_chunks(b) for d, b in zip(dispatchers, batches)] == [max(counts)] * 3
        for d, b in enumerate(batches):
            rows, _ = expected_batch_rows(cfg, 3, d, inputs)
            assert torch.equal(b.materialize().x.cpu(), torch.stack(rows) if rows else b.x[:0].cpu())
        outs = emulate_combine(dispatchers, [expert_fn(b, cfg, r, 2) for r, b in enumerate(batches)], batches)
        for out, (x, ids, w) in zip(outs, inputs):
            torch.testing.assert_close(out.cpu(), expected_combine(cfg, 3, x, ids, w), **COMBINE_TOL)
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
    cfg = ht_cfg(E=4, K=2, D=32, C=4)
    dispatchers = make_world(cfg, 2)
    inputs = [[exact_inputs(cfg, r, 3 + r, "random", seed=50 + call, device=EMU_DEVICE) for r in range(2)]
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
            torch.testing.assert_close(outs[r].cpu(), expected_combine(cfg, 2, x, ids, w), **COMBINE_TOL)


@pytest.mark.parametrize("R,E,K,D,Ts,routing", [c for c in CASES if c[0] > 2] + [(2, 8, 8, 72, [5, 0], "holes")])
def test_copy_engine_round_trip_exact(R, E, K, D, Ts, routing):
    """Copy-engine mode: every token's row goes to every rank at its own row (t), tokens with no expert
    there included (ids -1 at the receiver); batches and sums as with the send kernel."""
    cfg = ht_cfg(E=E, K=K, D=D)
    dispatchers = make_world(cfg, R, copy_engine=True)
    assert all(d.copy_engine for d in dispatchers)
    check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, routing, seed=1, device=EMU_DEVICE)
                                        for r, T in enumerate(Ts)])


def test_copy_engine_calls_alternate_parities():
    """Copy-engine mode over calls of shrinking and growing T: rows and ids left from an earlier call in
    the same parity (rows past this call's T, or of tokens now sent nowhere) are never read; two batches
    in flight keep their rows."""
    cfg = ht_cfg(E=4, K=2, D=32, C=6)
    dispatchers = make_world(cfg, 2, copy_engine=True)
    for call, Ts in enumerate(([6, 2], [1, 6], [3, 0], [6, 6])):
        check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, "holes", seed=60 + call, device=EMU_DEVICE)
                                            for r, T in enumerate(Ts)])
    inputs = [[exact_inputs(cfg, r, 4 - r, "random", seed=70 + call, device=EMU_DEVICE) for r in range(2)]
              for call in range(2)]
    batches = [emulate_dispatch(dispatchers, call_inputs) for call_inputs in inputs]
    for call_inputs, call_batches in zip(inputs, batches):
        outs = emulate_combine(dispatchers, [expert_fn(b, cfg, r, 2) for r, b in enumerate(call_batches)],
                               call_batches)
        for r, (x, ids, w) in enumerate(call_inputs):
            torch.testing.assert_close(outs[r].cpu(), expected_combine(cfg, 2, x, ids, w), **COMBINE_TOL)


def test_copy_engine_and_send_kernel_dispatchers_side_by_side(monkeypatch):
    """Dispatchers of both modes and one config on the same ranks keep their own flags (whose meaning
    differs) and epochs; a call whose numbering fails to launch leaves the host's count of calls (the
    copy engine's parity) where the device epoch is (emulated path; on GPUs the rows and their flag
    have left by then, and the dispatcher marks itself failed: test_gpu_dense_edges)."""
    cfg = ht_cfg(E=4, K=2, D=32, C=4)
    groups = EmulatedGroup.world(2)
    worlds = {engine: [HtDispatcher(cfg, g, device=EMU_DEVICE, copy_engine=engine, wait_timeout_s=0.01)
                       for g in groups] for engine in (False, True)}  # a short timeout: a shared flag fails fast
    for call, engine in enumerate((False, True, False, True)):
        check_round_trip(cfg, worlds[engine], [exact_inputs(cfg, r, 3, "holes", seed=80 + call, device=EMU_DEVICE)
                                               for r in range(2)])
    d = worlds[True][0]
    calls = d._schedule.calls

    def fails(*args, **kwargs):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(send_kernels, "number_pairs", fails)
    with pytest.raises(RuntimeError, match="launch failed"):
        d.dispatch_send(*exact_inputs(cfg, 0, 3, "random", seed=0, device=EMU_DEVICE))
    assert d._schedule.calls == calls == int(d.ws.local("dispatch_seq"))


def _age(dispatchers, calls: int) -> None:
    """Leave every rank's epochs, the flags that count calls, the host's count and its batch-size words
    as `calls` dispatches and combines of these dispatchers leave them."""
    for d in dispatchers:
        for name in ("dispatch_seq", "combine_seq", "meta_flag"):  # the numbering signals once a call
            d.ws.local(name).fill_(calls)
        # the copy engine's flag holds the epoch (no rank stamps its own); the send kernel's programs signal
        # once each a call
        flags = d.ws.local("dispatch_flag")
        flags.fill_(calls * (1 if d.copy_engine else d.launch.programs))
        if d.copy_engine:
            flags[d.rank] = 0
        d._schedule.calls = calls
        for epoch in (calls, calls - 1):  # each parity's word: its latest epoch's (rows 0, one chunk)
            d._schedule.sizes.sizes[epoch % 2, 0] = (epoch % layout_kernels.SIZE_EPOCHS.value) << 56 | 1 << 32


@pytest.mark.parametrize("options", [dict(), dict(copy_engine=True), dict(sync_free=True), dict(quant="fp8_block")])
def test_epochs_past_two_to_the_31(options):
    """Dispatchers 2^31 - 2 calls old keep working over the next three calls (round trips exact): the
    epochs and every flag compared with them are 64-bit (int32 ones would go negative at the second
    call, and the waits would pass before their signals)."""
    quant = options.pop("quant", None)
    cfg = ht_cfg(E=4, K=2, D=128, C=6, quant=quant)
    dispatchers = make_world(cfg, 2, wait_timeout_s=0.01, **options)  # a wait left unmet fails, not hangs
    _age(dispatchers, (1 << 31) - 2)
    for call in range(3):
        inputs = []
        for r, T in enumerate([6 - 2 * call, 3 + call]):
            x, ids, w = exact_inputs(cfg, r, T, "holes", seed=90 + call, device=EMU_DEVICE)
            inputs.append((fp8_exact_rows(T, cfg.hidden_size, seed=r).to(EMU_DEVICE) if quant else x, ids, w))
        check_round_trip(cfg, dispatchers, inputs)
    for d in dispatchers:
        assert int(d.ws.local("dispatch_seq")) == int(d.ws.local("combine_seq")) == (1 << 31) + 1
        assert not d.timed_out()


@pytest.mark.parametrize("R,E,quant", [(2, 8, None), (2, 8, "fp8_block"), (3, 12, "fp8_block")])
def test_dense_send_kernel_round_trip(R, E, quant):
    """Dense mode by the send kernel (K 8: nearly every token reaches every rank; fp8 rows, or bf16 with
    the copy engine off): every row at row t of every rank, ids -1 where a token has no expert; over
    calls of changing T, so both parities and rows left from an earlier call are seen."""
    cfg = ht_cfg(E=E, K=8, D=128, C=6, quant=quant)
    dispatchers = make_world(cfg, R)
    assert all(d.dense and not d.copy_engine for d in dispatchers)
    for call, Ts in enumerate(([6, 2, 5], [1, 6, 0], [0, 3, 6])):
        inputs = []
        for r, T in enumerate(Ts[:R]):
            x, ids, w = exact_inputs(cfg, r, T, "holes", seed=90 + call, device=EMU_DEVICE)
            inputs.append((fp8_exact_rows(T, cfg.hidden_size, seed=r).to(EMU_DEVICE) if quant else x, ids, w))
        check_round_trip(cfg, dispatchers, inputs)


def test_dense_and_copy_engine_choice():
    """dense=None picks dense mode for a host-synced dispatcher whose routing sends nearly every token to
    every rank, copy_engine=None the copy engine in dense mode for a process group with bf16 rows; the
    options say otherwise, and are refused where they cannot work."""
    assert [dense_pays(R, K) for R, K in ((2, 8), (2, 5), (2, 4), (3, 8), (3, 7), (4, 8), (1, 8))] == \
        [True, True, False, True, False, False, False]
    groups = EmulatedGroup.world(2)
    assert not HtDispatcher(ht_cfg(K=8, E=8), groups[0], device=EMU_DEVICE).copy_engine  # emulated: off
    dense = {(K, sync_free, quant): HtDispatcher(ht_cfg(K=K, E=8, D=128, quant=quant), groups[0], device=EMU_DEVICE,
                                                 sync_free=sync_free).dense
             for K in (4, 8) for sync_free in (False, True) for quant in (None, "fp8_block")}
    assert [key for key, on in dense.items() if on] == [(8, False, None), (8, False, "fp8_block")]
    assert not HtDispatcher(ht_cfg(K=8, E=8), groups[0], device=EMU_DEVICE, dense=False).dense
    assert HtDispatcher(ht_cfg(K=2, E=8), groups[0], device=EMU_DEVICE, dense=True).dense
    forced = HtDispatcher(ht_cfg(K=2, E=8), groups[0], device=EMU_DEVICE, copy_engine=True)  # implies dense
    assert forced.dense and forced.copy_engine
    with pytest.raises(ValueError, match="fp8"):
        HtDispatcher(ht_cfg(D=128, quant="fp8_block"), groups[0], device=EMU_DEVICE, copy_engine=True)
    for options in (dict(copy_engine=True, sync_free=True), dict(copy_engine=True, dense=False)):
        with pytest.raises(ValueError, match="copy_engine=True needs dense mode"):
            HtDispatcher(ht_cfg(), groups[0], device=EMU_DEVICE, **options)
    with pytest.raises(ValueError, match="dense=True needs sync_free=False"):
        HtDispatcher(ht_cfg(), groups[0], device=EMU_DEVICE, dense=True, sync_free=True)


def test_sparse_mode_at_top8():
    """dense=False where dense mode would pay (K 8): the rows follow the numbering, only where they have an
    expert; exact as in dense mode."""
    cfg = ht_cfg(E=8, K=8, D=64, C=6)
    dispatchers = make_world(cfg, 2, dense=False)
    assert not any(d.dense for d in dispatchers)
    check_round_trip(cfg, dispatchers, [exact_inputs(cfg, r, T, "holes", seed=95, device=EMU_DEVICE)
                                        for r, T in enumerate([6, 3])])


def test_batch_size_word_of_another_epoch_raises():
    """The host's read of the batch size takes only the word of its dispatch's epoch: a layout that ended
    without writing it (here: the pending dispatch claims a later epoch) raises instead of spinning."""
    cfg = ht_cfg(E=4, K=2, D=32, C=4)
    dispatchers = make_world(cfg, 2)
    inputs = [exact_inputs(cfg, r, 3, "random", seed=7, device=EMU_DEVICE) for r in range(2)]
    pending = [d.dispatch_send(*inp) for d, inp in zip(dispatchers, inputs)]
    with pytest.raises(RuntimeError, match="ended without writing the batch size"):
        dispatchers[0].dispatch_recv(dataclasses.replace(pending[0], epoch=pending[0].epoch + 2))


def test_waits_give_up_instead_of_hanging():
    """A combine whose peer never sends its partial rows, and a dispatch whose peer never sends: their
    waits give up after wait_timeout_s and set the flag (later waits return at once); the next size
    read on the host raises."""
    cfg = ht_cfg(E=4, K=2, D=64, C=4)
    dispatchers = make_world(cfg, 2, wait_timeout_s=1e-3)
    inputs = [exact_inputs(cfg, r, 3, "random", seed=5, device=EMU_DEVICE) for r in range(2)]
    batches = emulate_dispatch(dispatchers, inputs)
    d0 = dispatchers[0]
    assert not d0.timed_out()
    d0._combine_mode = FusedCombine(d0._setup, cfg.dtype)  # the real ranks' one kernel: it waits for rank 1's
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
    cfg = ht_cfg(E=R * L, K=2, D=D, C=6, quant=quant)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(R * L, 2 * F, D, generator=g) / D ** 0.5
    w2 = torch.randn(R * L, D, F, generator=g) / F ** 0.5
    experts = []
    for r in range(R):
        pair = TritonExperts(cfg, L, EMU_DEVICE), ReferenceExperts(cfg, L, EMU_DEVICE)
        for e in pair:
            e.load(w13[r * L:(r + 1) * L], w2[r * L:(r + 1) * L])
        experts.append(pair)
    dispatchers = make_world(cfg, R)
    oracle = MoERef.build(w13, w2, fp8=quant is not None, device="cpu")
    for call in range(2):
        inputs = [exact_inputs(cfg, r, 5 - r, "holes", seed=40 + call, device=EMU_DEVICE) for r in range(R)]
        if quant:  # rows the fp8 send maps exactly: under the interpreter it rounds some ties away from the even value
            inputs = [(fp8_exact_rows(5 - r, D, seed=call).to(EMU_DEVICE), ids, w)
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


def test_float32_dtype():
    cfg = ht_cfg(E=4, K=3, D=12, dtype=torch.float32)
    check_round_trip(cfg, make_world(cfg, 2), [exact_inputs(cfg, r, 3, "random", seed=3, device=EMU_DEVICE)
                                               for r in range(2)])


def test_refuses_bad_input():
    cfg = ht_cfg(D=12)  # 24-byte bf16 rows
    groups = EmulatedGroup.world(2)
    assert not HtDispatcher.availability(cfg, groups[0])[0]
    with pytest.raises(ValueError, match="multiple of 16"):
        HtDispatcher(cfg, groups[0], device=EMU_DEVICE)
    with pytest.raises(ValueError, match="fp8 rows"):
        HtDispatcher(ht_cfg(D=72, quant="fp8_block"), groups[0], device=EMU_DEVICE)  # 72 fp8 bytes
    cfg = ht_cfg(E=6)
    with pytest.raises(ValueError, match="divisible"):
        HtDispatcher(cfg, EmulatedGroup.world(4)[0], device=EMU_DEVICE)
    cfg = ht_cfg(C=2)
    d = make_world(cfg, 2)[0]
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        d.dispatch_send(*exact_inputs(cfg, 0, 3, "random", seed=0, device=EMU_DEVICE))
    with pytest.raises(ValueError, match="outside"):
        x, ids, w = exact_inputs(cfg, 0, 2, "random", seed=0, device=EMU_DEVICE)
        d.dispatch_send(x, ids + cfg.num_experts, w)


def test_cuda_device_gets_an_index(monkeypatch):
    """A dispatcher given device "cuda" keeps its buffers on cuda:N (the current device), as tensors
    made with device="cuda" report it, so that its device check accepts them."""
    from epmoe.symm import indexed_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed_device("cuda") == torch.device("cuda", 3)
    assert indexed_device("cuda:1") == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")


def test_registry_lists_ht():
    cfg = ht_cfg()
    assert "ht" in list_dispatchers(cfg, None)
    assert not list_dispatchers(cfg, None)["ht"][0]
    assert HtDispatcher.availability(cfg, EmulatedGroup.world(2)[0]) == (True, "ok")



def test_sync_free_is_a_front_class_of_its_own():
    """sync_free=True makes a SyncFreeHtDispatcher, whose capabilities are its class's: no host sync, no
    chunk agreement, no dense mode; the class refuses a contradicting sync_free."""
    cfg = ht_cfg(K=8, E=8)
    g = EmulatedGroup.world(2)[0]
    free, synced = HtDispatcher(cfg, g, sync_free=True), HtDispatcher(cfg, g)
    assert type(free) is SyncFreeHtDispatcher and type(synced) is HtDispatcher
    assert (free.sync_free, free.needs_host_sync, free.agrees_chunks, free.dense) == (True, False, False, False)
    assert (synced.sync_free, synced.needs_host_sync, synced.agrees_chunks, synced.dense) == (False, True, True, True)
    assert type(SyncFreeHtDispatcher(cfg, g)) is SyncFreeHtDispatcher
    with pytest.raises(ValueError, match="sync_free=False"):
        SyncFreeHtDispatcher(cfg, g, sync_free=False)
    assert type(make_dispatcher("ht", cfg, g, sync_free=True)) is SyncFreeHtDispatcher
