"""Tests of the `ht` kernels (epmoe/kernels/ht/) through their launchers, against torch: the sender's
numbering, the layout's scan and size word, the host's poll for it, the one-kernel combine, the device
barrier (epmoe/kernels/sync.py). Emulated ranks' buffers: ht_support.kernel_world.

Shape letters: T tokens, K top-k, L local experts, R ranks, C capacity, B blocks of received rows.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading

import pytest
import torch

from epmoe.dispatch.ht.combine import FusedCombine, SplitCombine
from epmoe.dispatch.ht.layout import SIZE_POLL_CHECK_S, poll_size
from epmoe.kernels.ht import launch as launch_module, layout as layout_kernels, send as send_kernels
from epmoe.kernels.layout import layout_blocks
from epmoe.kernels.sync import DeviceWait, device_barrier
from epmoe.symm import BufferSpec, EmulatedGroup
from ht_support import (COMBINE_TOL, EMU_DEVICE, emulate_dispatch, exact_inputs, expected_combine, expert_fn, ht_cfg,
                        kernel_world, make_world, size_word)


def test_host_poll_for_the_batch_size():
    """The host's poll (process groups): it returns the size and chunk count once its epoch's word is
    written (here by another thread, after the poll started), takes no word of another epoch (the word
    of a parity holds epoch - 2's before; 7 bits of the epoch tell them apart), and gives up with None
    once the layout's event has completed without the word."""
    class Event:  # stands in for the layout's CUDA event
        def __init__(self):
            self.done = False

        def query(self):
            return self.done
    buf = torch.full((1,), size_word(5, 1, 9), dtype=torch.int64)  # epoch 5's word
    word = ctypes.c_int64.from_address(buf.data_ptr())
    ready = Event()
    writer = threading.Timer(5 * SIZE_POLL_CHECK_S, lambda: buf.fill_(size_word(7, 3, 42)))
    writer.start()
    assert poll_size(word, 7, ready) == (42, 3)
    writer.join()
    ready.done = True
    assert poll_size(word, 9, ready) is None
    buf.fill_(size_word(9, 1, 0xFFFFFFFF))  # a wait that gave up
    assert poll_size(word, 9, ready) == (-1, 1)
    buf.fill_(size_word(130, (1 << 24) - 1, 2 ** 32 - 2))  # every field at its largest
    assert poll_size(word, 130, ready) == (2 ** 32 - 2, (1 << 24) - 1) and poll_size(word, 128, ready) is None



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
    monkeypatch.setattr(launch_module, "COMBINE_CHUNK", 32)
    monkeypatch.setattr(launch_module, "COMBINE_STEP", 64)
    cfg = ht_cfg(E=2 * R, K=2, D=64, C=12, dtype=dtype)
    dispatchers = make_world(cfg, R, wait_timeout_s=1.0)
    assert dispatchers[0].launch.combine_tiles(cfg.hidden_size)[1] == 2
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else COMBINE_TOL
    for call, whole in enumerate(list(range(R)) * 2):
        inputs = [exact_inputs(cfg, r, T, "holes", seed=70 + call, device=EMU_DEVICE) for r, T in enumerate(Ts)]
        batches = emulate_dispatch(dispatchers, inputs)
        ys = [expert_fn(b, cfg, r, 2) for r, b in enumerate(batches)]
        for r, d in enumerate(dispatchers):
            # rank `whole` takes the real ranks' path: combine_send runs it all
            setup = dataclasses.replace(d._setup, launch=dataclasses.replace(d.launch, combine_lag=lag))
            d._combine_mode = (SplitCombine if r != whole else FusedCombine)(setup, cfg.dtype)
        pending = {r: dispatchers[r].combine_send(ys[r], batches[r]) for r in range(R) if r != whole}
        pending[whole] = dispatchers[whole].combine_send(ys[whole], batches[whole])
        assert pending[whole].local_half is None
        outs = [dispatchers[r].combine_recv(pending[r]) for r in range(R)]
        for r, (x, ids, w) in enumerate(inputs):
            torch.testing.assert_close(outs[r].cpu(), expected_combine(cfg, R, x, ids, w), **tol)
        assert all(d.ws.local("control")[:2].tolist() == [0, 0] for d in dispatchers)
        assert all(int(d.ws.local("combine_seq")) == call + 1 for d in dispatchers)  # one epoch per call
        assert not any(d.timed_out() for d in dispatchers)


def test_device_barrier_signals_every_rank():
    """Emulated ranks run in turn, so rank 1's barrier (first) gives up waiting for rank 0's signal; rank
    0's then finds every signal there and passes; each rank's flags count one call from each rank."""
    specs = [BufferSpec("flag", (2,), torch.int64), BufferSpec("err", (1,), torch.int32)]
    ws = [g.workspace("barrier", specs, torch.device(EMU_DEVICE)) for g in EmulatedGroup.world(2)]
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



def test_layout_scan_matches_torch(monkeypatch):
    """The scan over per-block counts, with several steps of blocks per program in both passes and a
    last program of fewer experts (L 250: 8 experts a program, 32 blocks a step)."""
    monkeypatch.setattr(layout_kernels, "SCAN_BLOCKS", 32)
    monkeypatch.setattr(layout_kernels, "SCAN_SUM_STEP", 32 * 256)
    B, L, R = 100, 250, 3
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 5, (B, L), generator=g, dtype=torch.int32)
    recv_count = torch.randint(0, 50, (2, R), generator=g, dtype=torch.int32)
    seq = torch.tensor([7], dtype=torch.int64)
    scanned = layout_kernels.layout_scan(table.to(EMU_DEVICE), recv_count.to(EMU_DEVICE), seq.to(EMU_DEVICE))
    counts, offsets, start, recv = (t.cpu() for t in scanned)
    want_counts = table.sum(0, dtype=torch.int32)
    want_offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(want_counts, 0, dtype=torch.int32)])
    assert torch.equal(counts, want_counts) and torch.equal(offsets, want_offsets)
    assert torch.equal(start, torch.cumsum(table, 0, dtype=torch.int32) - table + want_offsets[:L])
    assert torch.equal(recv, recv_count[1])  # parity 7 % 2



def test_size_word_at_its_largest_fields():
    """layout_count's size word at epoch 2^40 + 130 (its 7 bits wrap: 2 mod 128), the largest chunk count
    and a large pair count: batch_size reads back what the ranks sent, and no other epoch's word."""
    R, C, K, L = 2, 1, 1, 1
    b = kernel_world(ht_cfg(E=R * L, K=K, D=16, C=C), R)[0]
    epoch = 2 ** 40 + 130
    i32, i64 = (dict(dtype=dtype, device=EMU_DEVICE) for dtype in (torch.int32, torch.int64))
    b.recv_ids.fill_(-1)
    b.meta_flag.fill_(epoch)  # every rank has signalled
    b.chunks.copy_(torch.tensor([[layout_kernels.MAX_CHUNKS.value - 1, 3], [1, 1]], **i32))  # parity 0: row 0
    b.pairs.copy_(torch.tensor([[2 ** 31 - 1, 6], [0, 0]], **i32))  # summed in int64
    size_1 = torch.zeros(1, **i64)
    wait = DeviceWait(err_1=torch.zeros(1, **i32), timeout_ns=10 ** 6)
    layout_kernels.layout_count(b, torch.tensor([epoch], **i64), layout_blocks(C, K), L, size_1, wait)
    assert layout_kernels.batch_size(int(size_1), epoch) == (2 ** 31 + 5, layout_kernels.MAX_CHUNKS.value - 1)
    assert layout_kernels.batch_size(int(size_1), epoch - 1) is None
    assert layout_kernels.batch_size(int(size_1), epoch - 2) is None
    assert wait.err_1.item() == 0


@pytest.mark.parametrize("T,R,ids_dtype", [(2500, 3, torch.int64), (1, 2, torch.int32), (0, 4, torch.int64),
                                            (450, 2, torch.int32)])
def test_number_pairs_matches_torch(monkeypatch, T, R, ids_dtype):
    """The sender's slots (blocks of 64 tokens, the earlier blocks summed 8 at a time; ids -1 and out of
    range) against a torch prefix sum; the tokens and pairs it stores into every rank's recv_count and
    pairs buffers and the ids and weights into its receive region, both signalled, and what the layout's
    count kernel makes of them (waiting for the signals, or giving up)."""
    monkeypatch.setattr(send_kernels, "NUMBER_BLOCK", 64)
    monkeypatch.setattr(send_kernels, "NUMBER_STEP", 8)
    L, K, rank = 4, 3, R - 1
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(-1, R * L + 2, (T, K), generator=g).to(ids_dtype)  # R*L, R*L+1: out of range
    C = max(T, 1)
    world = kernel_world(ht_cfg(E=R * L, K=K, D=16, C=C), R)
    for b in world:  # -7: never written
        for t in (b.pairs, b.recv_count, b.chunks, b.recv_ids, b.recv_w):
            t.fill_(-7)
    sender = world[rank]
    sender.dispatch_seq.fill_(5)
    w = torch.rand(T, K, generator=g)
    slot_TR, epoch_1 = send_kernels.number_pairs(sender, ids.to(EMU_DEVICE), w.to(EMU_DEVICE), L, chunks=T + 3)
    # the epoch advanced, the counter is back to 0
    assert sender.dispatch_seq.item() == 6 and epoch_1.item() == 6 and sender.number_done.item() == 0
    dest = torch.where((ids >= 0) & (ids < R * L), ids.long() // L, R)
    wants_TR = torch.zeros(T, R + 1, dtype=torch.int32).scatter_(1, dest, 1)[:, :R]
    hits_TR = torch.zeros(T, R + 1, dtype=torch.int32).scatter_add_(1, dest, torch.ones_like(dest, dtype=torch.int32))
    want = torch.where(wants_TR > 0, torch.cumsum(wants_TR, 0) - 1, -1)
    assert torch.equal(slot_TR.cpu(), want.to(torch.int32))
    for r, b in enumerate(world):  # parity 6 % 2 = 0 at [0, rank]; the other parity untouched
        pairs, recv_count = b.pairs.cpu(), b.recv_count.cpu()
        assert pairs[0, rank].item() == int(hits_TR[:, r].sum())
        assert recv_count[0, rank].item() == int(wants_TR[:, r].sum())
        assert pairs[1].eq(-7).all() and recv_count[1].eq(-7).all()
        assert b.chunks[0, rank].item() == T + 3 and b.chunks[1].eq(-7).all()
        assert b.meta_flag.tolist() == [int(i == rank) for i in range(R)]  # one signal from `rank`
        sent = want[:, r] >= 0  # the ids (local to r, -1 elsewhere) and weights at the tokens' slots
        lid = torch.where((ids >= r * L) & (ids < (r + 1) * L), ids - r * L, -1)
        assert torch.equal(b.recv_ids[0, rank, :int(sent.sum())].cpu(), lid[sent].int())
        assert torch.equal(b.recv_w[0, rank, :int(sent.sum())].cpu(), w[sent])
    receiver = world[0]
    receiver.meta_flag.fill_(6)  # as if every rank had signalled epoch 6
    receiver.pairs[0] = torch.arange(R, dtype=torch.int32) * 10
    receiver.chunks[0] = torch.arange(R, dtype=torch.int32) + 11  # the largest: rank R - 1's
    wait = DeviceWait(err_1=torch.zeros(1, dtype=torch.int32, device=EMU_DEVICE), timeout_ns=10 ** 6)
    blocks = layout_blocks(C, K)

    size_1 = torch.full((1,), size_word(5, 1, 0), dtype=torch.int64, device=EMU_DEVICE)  # epoch 5's: 0 pairs

    def count():  # rank 0's layout count: its per-block expert counts and the pairs it receives in all
        return layout_kernels.layout_count(receiver, epoch_1, blocks, L, size_1, wait)
    assert layout_kernels.batch_size(int(size_1), 6) is None and layout_kernels.batch_size(int(size_1), 5) == (0, 1)
    table = count()
    assert layout_kernels.batch_size(int(size_1), 6) == (10 * R * (R - 1) // 2, R + 10) and wait.err_1.item() == 0
    assert layout_kernels.batch_size(int(size_1), 5) is None
    lid0 = torch.where((ids >= 0) & (ids < L), ids, -1)[want[:, 0] >= 0]  # rank 0's ids of the tokens sent there
    per_source = table.cpu().view(R, blocks.blocks, L).sum(1)
    assert torch.equal(per_source[rank], torch.bincount(lid0[lid0 >= 0].long(), minlength=L).int())
    assert per_source[:rank].eq(0).all()  # recv_count of the other sources: -7, no rows
    receiver.meta_flag[R - 1] = 5  # rank R - 1 has not signalled epoch 6: the wait gives up and says so
    count()
    assert layout_kernels.batch_size(int(size_1), 6) == (-1, R + 10) and wait.err_1.item() == 1
    with pytest.raises(ValueError, match="chunks must be in"):
        send_kernels.number_pairs(sender, ids.to(EMU_DEVICE), w.to(EMU_DEVICE), L, chunks=1 << 24)
