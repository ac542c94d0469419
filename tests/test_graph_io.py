"""The CUDA graphs' input and output kernels (epmoe/kernels/graph_io.py), exactly: the call's rows copied
through the address table into the static inputs (ids past T set to -1, weights to 0), the output's
rows into the caller's tensor and nothing else; strided rows, int32/int64 ids, bf16/fp32 weights, T = 0,
1 and B, odd D; each call reading its own ring row, over more calls than the ring has rows, and a call
abandoned; on CPU tensors under the Triton interpreter, on a GPU where there is one. (Their sm_90 build
is checked beside the layout engine's: compile_layout.py.)"""
import pytest
import torch

from epmoe.kernels.graph_io import IOTable, rows_contiguous

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter)] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,T,D,K", [(8, 0, 64, 2), (8, 1, 97, 1), (8, 8, 64, 3), (16, 11, 130, 8), (1, 1, 5, 4)])
@pytest.mark.parametrize("ids_dtype,w_dtype", [(torch.int64, torch.bfloat16), (torch.int32, torch.float32)])
def test_stage_and_unstage_move_exactly_the_call_rows(device, B, T, D, K, ids_dtype, w_dtype):
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + K)
    wide = torch.randn(T, D + 3, generator=g).to(torch.bfloat16)
    x = wide[:, 1:D + 1]  # rows with strides of their own, here and below
    ids = torch.randint(-1, 9, (T, K + 2), generator=g).to(ids_dtype)[:, 1:K + 1]
    w = torch.rand(T, K + 3, generator=g).to(w_dtype)[:, 2:K + 2]
    x_BD = torch.randn(B, D, generator=g).to(torch.bfloat16)
    ids_BK = torch.randint(0, 9, (B, K), generator=g).to(ids_dtype)  # what an earlier call left
    w_BK = torch.rand(B, K, generator=g).to(w_dtype)
    y_BD = torch.randn(B, D, generator=g).to(torch.bfloat16)
    out = torch.full((T + 2, D + 4), 7.0, dtype=torch.bfloat16)
    x, ids, w, x_BD, ids_BK, w_BK, y_BD, out = (t.to(device) for t in (x, ids, w, x_BD, ids_BK, w_BK, y_BD, out))
    before = x_BD.clone()
    io = IOTable(torch.device(device))
    io.point(x, ids, w, out[1:T + 1, 2:D + 2])
    io.stage(x_BD, ids_BK, w_BK)
    io.unstage(y_BD)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(x_BD[:T], x) and torch.equal(x_BD[T:], before[T:])
    assert torch.equal(ids_BK[:T], ids) and (ids_BK[T:] == -1).all()
    assert torch.equal(w_BK[:T], w) and (w_BK[T:] == 0).all()
    assert torch.equal(out[1:T + 1, 2:D + 2], y_BD[:T])
    outside = torch.ones_like(out, dtype=torch.bool)
    outside[1:T + 1, 2:D + 2] = False
    assert (out[outside] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_calls_read_their_own_ring_rows_and_an_abandoned_call_is_skipped(device):
    dev = torch.device(device)
    io = IOTable(dev)
    B, D, K, N = 2, 4, 1, IOTable.RING_ROWS + 3
    ids = torch.zeros(1, K, dtype=torch.int64, device=dev)
    w = torch.ones(1, K, device=dev)
    x_BD = torch.zeros(B, D, device=dev)
    ids_BK = torch.zeros(B, K, dtype=torch.int64, device=dev)
    w_BK = torch.zeros(B, K, device=dev)
    outs = torch.zeros(N, 1, D, device=dev)
    xs = [torch.full((1, D), float(i), device=dev) for i in range(N)]
    for i in range(N):
        io.point(xs[i], ids, w, outs[i])
        if i == 5:  # a call whose replay never ran
            io.abandon()
            continue
        io.stage(x_BD, ids_BK, w_BK)
        io.unstage(x_BD + 1)  # (a graph's routed part in between)
    got = outs[:, 0, 0].cpu()
    want = torch.arange(N, dtype=torch.float32) + 1
    want[5] = 0
    assert torch.equal(got, want)
    assert int(io.counter.item()) == N


def test_a_table_made_in_inference_mode_abandons_a_call_outside_it():
    """A layer's first graphed call (which makes the table) under torch.inference_mode, a failed replay
    later outside it: the counter, an inference tensor, is still set to the rows written."""
    with torch.inference_mode():
        io = IOTable(torch.device("cpu"))
    x, ids, w = torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    for _ in range(2):
        io.point(x, ids, w, torch.zeros(1, 4))
    io.abandon()
    assert io.counter.is_inference() and int(io.counter.item()) == 2


def test_rows_contiguous_copies_only_strided_columns():
    t = torch.arange(12.0).reshape(3, 4)
    assert rows_contiguous(t) is t
    assert rows_contiguous(t[:, 1:]).data_ptr() == t[:, 1:].data_ptr()  # rows strided, columns unit: no copy
    cols = t.t()
    assert torch.equal(rows_contiguous(cols), cols) and rows_contiguous(cols).stride(-1) == 1


@pytest.mark.gpu
def test_ring_rows_are_written_again_only_after_their_copies_ran():
    """Three rounds of the host ring and more queued behind a busy GPU, with a switch of streams in
    between: every call's stage still copies its own x (a row written too early would give an earlier
    or later call's) and its unstage writes its own output."""
    dev = torch.device("cuda", torch.cuda.current_device())
    io = IOTable(dev)
    B, D, K, N = 4, 8, 2, 3 * IOTable.RING_ROWS + 5
    xs = [torch.full((1, D), float(i), device=dev) for i in range(N)]  # (fp32: bf16 holds no 257)
    ids = torch.zeros(1, K, dtype=torch.int64, device=dev)
    w = torch.ones(1, K, dtype=torch.float32, device=dev)
    outs = torch.zeros(N, 1, D, device=dev)
    statics = [(torch.zeros(B, D, device=dev), torch.zeros(B, K, dtype=torch.int64, device=dev),
                torch.zeros(B, K, dtype=torch.float32, device=dev)) for _ in range(N)]
    side = torch.cuda.Stream(dev)
    torch.cuda._sleep(200_000_000)  # the host runs far ahead of the GPU
    for i in range(N):
        stream = side if N // 2 <= i < N // 2 + 7 else torch.cuda.current_stream(dev)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000)  # and the GPU stays behind after each wait of the host
            io.point(xs[i], ids, w, outs[i])
            io.stage(*statics[i])
            io.unstage(statics[i][0])
    torch.cuda.synchronize(dev)
    got = [int(s[0][0, 0].item()) for s in statics]
    assert got == list(range(N))
    assert outs[:, 0, 0].tolist() == list(range(N))
    assert all((s[0][1:] == 0).all() and (s[1][1:] == -1).all() for s in statics)
