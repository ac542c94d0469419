"""The fused one-rank path: `local` dispatch through the layout kernels, the experts reading x through the row
index and weighting rows in the down projection, the combine kernel; against the plain float64 loop of
epmoe.oracle. On CPU the layout kernels run under the Triton interpreter (forced here: the
dispatchers use the torch references on CPU tensors); on a GPU, also with no host sync at all."""
import dataclasses

import pytest
import torch

import epmoe
from epmoe.dispatch import _layout
from epmoe.testing import layer_oracle, make_weights, rel_error, tolerance

import moe_cases

PRECISIONS = [dict(dtype=torch.float32), dict(dtype=torch.bfloat16), dict(dtype=torch.bfloat16, quant="fp8_block")]


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(_layout, "runs_kernels", lambda t: True)


def _layer(cfg, experts: str, device, seed: int = 3):
    weights = make_weights(cfg, seed, device)
    moe = epmoe.FusedMoE(cfg, None, dispatcher="local", experts=experts, device=device)
    moe.load_experts(weights.w13_END, weights.w2_EDF)
    return moe, weights


def _inputs(cfg, T: int, seed: int, device, weights_dtype=torch.float32, ids_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(cfg.dtype)
    ids = moe_cases.random_ids(T, cfg.num_experts, cfg.top_k, g, drop=0.2).to(ids_dtype)
    w = torch.rand(T, cfg.top_k, generator=g).to(weights_dtype)
    return x.to(device), ids.to(device), w.to(device)


def _reference(x, ids, w, weights, cfg) -> torch.Tensor:
    """The float64 oracle (epmoe.oracle; for fp8_block on the weights and activations rounded as the format
    defines), on the CPU."""
    return layer_oracle(cfg, weights, shared=False, device="cpu")(x.cpu(), ids.cpu(), w.cpu().float())


def _expect_close(moe, weights, x, ids, w, cfg) -> None:
    out = moe(x, weights_TK=w, ids_TK=ids)
    ref = _reference(x, ids, w, weights, cfg)
    assert out.shape == x.shape and out.dtype == cfg.dtype
    err = rel_error(out.cpu(), ref)
    assert err <= tolerance(cfg), f"rel err {err:.2e}"


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("experts", ["reference", "triton"])
@pytest.mark.parametrize("E,K,T", [(8, 2, 0), (8, 2, 1), (8, 2, 33), (5, 1, 9), (4, 4, 6), (1, 1, 5)])
@pytest.mark.interpreter
def test_local_layer_through_the_layout_kernels(kernels_on_cpu, precision, experts, E, K, T):
    cfg = epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=72, intermediate_size=40, **precision)
    moe, weights = _layer(cfg, experts, "cpu")
    _expect_close(moe, weights, *_inputs(cfg, T, E * 10 + T, "cpu"), cfg)


@pytest.mark.interpreter
def test_local_layer_takes_caller_dtypes_and_all_tokens_on_one_expert(kernels_on_cpu):
    cfg = epmoe.MoEConfig(num_experts=6, top_k=3, hidden_size=40, intermediate_size=24, dtype=torch.float32)
    moe, weights = _layer(cfg, "triton", "cpu")
    for w_dtype, ids_dtype in ((torch.bfloat16, torch.int32), (torch.float16, torch.int64)):
        _expect_close(moe, weights, *_inputs(cfg, 11, 1, "cpu", w_dtype, ids_dtype), cfg)
    x, ids, w = _inputs(cfg, 17, 2, "cpu")
    ids[:] = 4
    ids[::2, 1] = -1
    _expect_close(moe, weights, x, ids, w, cfg)
    # non-contiguous inputs
    x2, ids2, w2 = _inputs(cfg, 20, 3, "cpu")
    _expect_close(moe, weights, x2[::2], ids2[::2], w2[::2], cfg)


@pytest.mark.interpreter
def test_a_path_without_backward_refuses_inputs_that_need_gradients(kernels_on_cpu):
    """The kernels record no backward: inputs that require gradients, in grad mode, are an error (not a
    silently missing gradient); the same call under torch.no_grad() runs. The reference experts with the
    torch layout (the CPU's) keep autograd."""
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32)
    moe, weights = _layer(cfg, "triton", "cpu")
    x, ids, w = _inputs(cfg, 5, 0, "cpu")
    for needs in (x, w):
        needs.requires_grad_(True)
        with pytest.raises(ValueError, match="no backward"):
            moe(x, weights_TK=w, ids_TK=ids)
        with torch.no_grad():
            _expect_close(moe, weights, x, ids, w, cfg)
        needs.requires_grad_(False)
    logits = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(ValueError, match="no backward"):
        moe(x, logits)


@pytest.mark.parametrize("experts", ["reference", "triton"])
@pytest.mark.interpreter
def test_routed_scaling_reaches_the_sum_before_its_rounding(kernels_on_cpu, experts):
    """float16, a routed_scaling_factor of 0.25 and two experts whose rows are 40940 each: the sum (81880)
    is past float16's range, the scaled result (20470) is not."""
    cfg = epmoe.MoEConfig(num_experts=2, top_k=2, hidden_size=64, intermediate_size=32, dtype=torch.float16,
                          routed_scaling_factor=0.25)
    moe = epmoe.FusedMoE(cfg, None, dispatcher="local", experts=experts, device="cpu")
    moe.load_experts(torch.full((2, 64, 64), 0.125), torch.full((2, 64, 32), 20.0))
    out = moe(torch.ones(3, 64, dtype=torch.float16), weights_TK=torch.ones(3, 2), ids_TK=torch.tensor([[0, 1]] * 3))
    h = torch.nn.functional.silu(torch.tensor(8.0)) * 8.0  # x W1 = x W3 = 64 * 0.125
    row = h.half().float() * 20.0 * 32
    torch.testing.assert_close(out.float(), torch.full((3, 64), 0.25 * 2 * row.item()), rtol=1e-3, atol=0)


@pytest.mark.parametrize("experts", ["reference", "triton"])
@pytest.mark.interpreter
def test_routed_scaling_of_bfloat16_weights_is_not_rounded_to_bfloat16(kernels_on_cpu, experts):
    """A caller's bfloat16 top-k weights times routed_scaling_factor 2.5 keep the product's float32 value
    (1 + 2^-7 times 2.5 is not a bfloat16) on its way to a float32 layer's sum."""
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32,
                          routed_scaling_factor=2.5)
    moe, weights = _layer(cfg, experts, "cpu")
    x, ids, _ = _inputs(cfg, 5, 1, "cpu")
    w = torch.full((5, 2), 1 + 2 ** -7, dtype=torch.bfloat16)
    ref = _reference(x, ids, w.float(), weights, cfg)  # (the oracle scales by cfg.routed_scaling_factor)
    assert rel_error(moe(x, weights_TK=w, ids_TK=ids), ref) < 1e-5


def test_the_reference_path_on_cpu_keeps_autograd():
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32)
    moe, _ = _layer(cfg, "reference", "cpu")
    x = torch.randn(5, 16, requires_grad=True)
    logits = torch.randn(5, 4, requires_grad=True)
    moe(x, logits).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and logits.grad.abs().sum() > 0


def test_local_layer_on_cpu_refuses_bad_ids_before_any_work():
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32)
    moe, _ = _layer(cfg, "reference", "cpu")
    x, ids, w = _inputs(cfg, 5, 0, "cpu")
    ids[2, 1] = 4
    with pytest.raises(ValueError, match="expert id 4"):
        moe(x, weights_TK=w, ids_TK=ids)


@pytest.mark.interpreter
def test_device_checked_ids_poison_their_tokens_and_raise_on_the_next_call(kernels_on_cpu):
    """The kernels' id check (on a GPU by default; forced on CPU tensors here past the host check, which
    CPU inputs always get): a bad id's token is NaN, the others are right, the next call raises once."""
    cfg = epmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=24, intermediate_size=16, dtype=torch.float32)
    moe, weights = _layer(cfg, "triton", "cpu")
    d = moe.dispatcher
    x, ids, w = _inputs(cfg, 9, 4, "cpu")
    bad = ids.clone()
    bad[3, 0], bad[6, 1] = 8, -7
    batch = d.dispatch_checked(x, bad, w)  # past check_tokens, as a GPU input would be
    out = d.combine(moe.experts(batch, weighted=True), batch, weighted=True)
    assert out[3].isnan().all() and out[6].isnan().all()
    ok = [t for t in range(9) if t not in (3, 6)]
    ref = _reference(x, ids, w, weights, cfg)
    assert rel_error(out[ok], ref[ok]) <= tolerance(cfg)
    with pytest.raises(ValueError, match=r"expert id (8|-7), outside \[-1, E=8\)"):
        moe(x, weights_TK=w, ids_TK=ids)
    _expect_close(moe, weights, x, ids, w, cfg)  # raised once; the layer works on
    d.dispatch_checked(x, bad, w)
    with pytest.raises(ValueError, match="expert id"):
        moe.check_errors()
    moe.check_errors()


@pytest.mark.interpreter
def test_a_deep_copy_of_a_layer_that_ran_catches_its_own_bad_ids(kernels_on_cpu):
    """The copy's device id check writes and reads words of its own: a bad id through the copy raises on the
    copy only (a copied word once read the original's address)."""
    import copy
    cfg = epmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=24, intermediate_size=16, dtype=torch.float32)
    moe, weights = _layer(cfg, "triton", "cpu")
    x, ids, w = _inputs(cfg, 9, 4, "cpu")
    moe.dispatcher.dispatch_checked(x, ids, w)  # the original's word exists
    twin = copy.deepcopy(moe)
    bad = ids.clone()
    bad[3, 0] = 8
    batch = twin.dispatcher.dispatch_checked(x, bad, w)  # past check_tokens, as a GPU input would be
    out = twin.dispatcher.combine(twin.experts(batch, weighted=True), batch, weighted=True)
    assert out[3].isnan().all()
    moe.check_errors()
    with pytest.raises(ValueError, match="expert id 8"):
        twin.check_errors()
    _expect_close(twin, weights, x, ids, w, cfg)


def test_experts_weight_rows_only_where_they_can():
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32)
    moe, _ = _layer(cfg, "reference", "cpu")
    x, ids, w = _inputs(cfg, 3, 0, "cpu")
    batch = moe.dispatcher.dispatch(x, ids, w)
    with pytest.raises(ValueError, match="weight no rows"):
        moe.experts(batch, weighted=True)
    y = moe.experts(batch)
    no_weights = dataclasses.replace(batch, weights_N=None)
    with pytest.raises(ValueError, match="weights_N"):
        moe.dispatcher.combine(y, no_weights, weighted=True)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("T", [0, 1, 77, 4096])
def test_gpu_local_layer_without_host_sync(precision, T):
    """On a GPU the caller-ids path syncs nothing (torch's sync debug mode raises on any sync), and matches
    the float64 loop; a bad id gives NaN rows and a ValueError on the next call."""
    cfg = epmoe.MoEConfig(num_experts=64, top_k=6, hidden_size=256, intermediate_size=192, **precision)
    moe, weights = _layer(cfg, "triton", "cuda")
    x, ids, w = _inputs(cfg, T, T, "cuda", weights_dtype=torch.bfloat16, ids_dtype=torch.int32)
    moe(x, weights_TK=w, ids_TK=ids)  # warm-up: compiles and allocates the error word
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe(x, weights_TK=w, ids_TK=ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = _reference(x, ids, w, weights, cfg)
    assert rel_error(out.cpu(), ref) <= tolerance(cfg)
    if T > 1:
        bad = ids.clone()
        bad[T // 2, 0] = cfg.num_experts
        out = moe(x, weights_TK=w, ids_TK=bad)
        torch.cuda.synchronize()
        assert out[T // 2].isnan().all() and not out[T // 2 + 1].isnan().any()
        with pytest.raises(ValueError, match=f"expert id {cfg.num_experts}"):
            moe(x, weights_TK=w, ids_TK=ids)


@pytest.mark.gpu
def test_gpu_graph_replays_equal_the_eager_path():
    """The routed part replayed as CUDA graphs (epmoe.graphs) gives the eager path's output bit for bit, for
    token counts that share a bucket in any order (rows past T route nowhere) and in the top bucket of a cap
    that is no power of two, returns outputs the next call does not touch, follows new weights, and runs
    eagerly inside the caller's own capture."""
    cfg = epmoe.MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    moe, weights = _layer(cfg, "triton", "cuda")
    eager = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="triton", device="cuda", cuda_graphs=False)
    eager.load_experts(weights.w13_END, weights.w2_EDF)
    assert moe.graphs is not None and moe.graphs.max_tokens >= 64 and eager.graphs is None
    syncing = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="reference", device="cuda")
    assert syncing.graphs is None  # the reference experts read counts on the host: nothing to capture
    outs = []
    for T in (7, 3, 8, 5, 64, 1):
        x, ids, w = _inputs(cfg, T, T, "cuda", weights_dtype=torch.bfloat16)
        got = moe(x, weights_TK=w, ids_TK=ids)
        assert torch.equal(got, eager(x, weights_TK=w, ids_TK=ids)), T
        outs.append((got, got.clone()))
    assert all(torch.equal(a, b) for a, b in outs)
    capped = [epmoe.FusedMoE(dataclasses.replace(cfg, max_tokens_per_rank=100), None, dispatcher="local",
                             experts="triton", device="cuda", cuda_graphs=graphed) for graphed in (True, False)]
    for layer in capped:
        layer.load_experts(weights.w13_END, weights.w2_EDF)
    for T in (100, 70):  # a cap of 100: its own bucket, not 64's (the power of two below it)
        x, ids, w = _inputs(cfg, T, T, "cuda", weights_dtype=torch.bfloat16)
        assert torch.equal(capped[0](x, weights_TK=w, ids_TK=ids), capped[1](x, weights_TK=w, ids_TK=ids)), T
    assert [key[0] for key in capped[0].graphs._graphs] == [100]
    new = make_weights(cfg, 9, "cuda")
    for layer in (moe, eager):
        layer.load_experts(new.w13_END, new.w2_EDF)
    x, ids, w = _inputs(cfg, 6, 0, "cuda")
    assert torch.equal(moe(x, weights_TK=w, ids_TK=ids), eager(x, weights_TK=w, ids_TK=ids))
    static = [t.clone() for t in (x, ids, w)]
    graph = torch.cuda.CUDAGraph()
    moe(*static[:1], weights_TK=static[2], ids_TK=static[1])
    with torch.cuda.graph(graph):
        captured = moe(static[0], weights_TK=static[2], ids_TK=static[1])
    graph.replay()
    assert torch.equal(captured, eager(x, weights_TK=w, ids_TK=ids))


@pytest.mark.gpu
def test_gpu_replays_of_inputs_as_given_and_of_checked_ones_agree(monkeypatch):
    """A graphed layer's plain calls ([T, D] x, [T, K] ids and weights with unit column strides: the
    replay reads them as given, no input check runs) and its calls through the general path (x as [B, S,
    D], ids and weights with column strides of 2, float32 weights with int32 ids strided too: checked,
    reshaped or copied, then replayed) give the eager output bit for bit, every one of them a replay;
    inputs the plain path passes over are still checked (ValueError)."""
    cfg = epmoe.MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    moe, weights = _layer(cfg, "triton", "cuda")
    eager = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="triton", device="cuda", cuda_graphs=False)
    eager.load_experts(weights.w13_END, weights.w2_EDF)
    calls = {"checks": 0, "replays": 0}

    def counted(obj, name, key):
        f = getattr(obj, name)

        def run(*args, **kwargs):
            calls[key] += 1
            return f(*args, **kwargs)
        monkeypatch.setattr(obj, name, run)

    counted(moe, "_check_inputs", "checks")
    counted(moe.graphs, "replay_checked", "replays")

    def strided(t):  # the same values with column stride 2
        return torch.stack([t, t], -1)[..., 0]

    def expect(want, path, *args, **kwargs):
        before = dict(calls)
        got = moe(*args, **kwargs)
        assert torch.equal(got.view(want.shape), want) and got.shape == args[0].shape
        assert calls["replays"] == before["replays"] + 1, path
        assert calls["checks"] == before["checks"] + (path == "general"), path

    for T in (6, 64):
        x, ids, w = _inputs(cfg, T, T, "cuda", weights_dtype=torch.bfloat16)
        want = eager(x, weights_TK=w, ids_TK=ids)
        assert moe.graphs.reads_as_given(x, ids, w)
        expect(want, "plain", x, weights_TK=w, ids_TK=ids)
        assert ids.stride(1) == 1 and strided(ids).stride(1) == 2
        assert not moe.graphs.reads_as_given(x, strided(ids), strided(w))
        expect(want, "general", x, weights_TK=strided(w), ids_TK=strided(ids))
        expect(want, "general", x.view(2, T // 2, -1), weights_TK=w.view(2, T // 2, -1), ids_TK=ids.view(2, T // 2, -1))
        want32 = eager(x, weights_TK=w.float(), ids_TK=ids.int())
        expect(want32, "plain", x, weights_TK=w.float(), ids_TK=ids.int())
        expect(want32, "general", x, weights_TK=strided(w.float()), ids_TK=strided(ids.int()))
    assert set(moe.graphs._graphs) == {(B, i, f) for B in (8, 64) for i, f in ((torch.int64, torch.bfloat16),
                                                                                 (torch.int32, torch.float32))}
    with pytest.raises(ValueError, match="x_TD dtype"):
        moe(x.float(), weights_TK=w, ids_TK=ids)
    with pytest.raises(ValueError, match="ids_TK must be"):
        moe(x, weights_TK=w, ids_TK=ids[:, :2])
    with pytest.raises(ValueError, match="ids_TK is on cpu"):
        moe(x, weights_TK=w, ids_TK=ids.cpu())
    with pytest.raises(ValueError, match="no backward"):
        moe(x, weights_TK=w.float().requires_grad_(), ids_TK=ids)


def test_only_inputs_the_replay_reads_as_given_skip_the_checks(monkeypatch):
    """`RoutedGraphs.reads_as_given`, the plain path's one predicate, on CPU tensors standing in for the
    GPU's (is_cuda patched): true for [T, D] x in cfg.dtype with [T, K] int ids and float weights, unit
    column strides, 1 <= T <= max_tokens and no capture; false for every other input (which FusedMoE then
    checks), and for tensors that are not on a GPU at all."""
    from epmoe.graphs import RoutedGraphs
    cfg = epmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=40, intermediate_size=24, dtype=torch.bfloat16)
    graphs = RoutedGraphs(lambda *a: None, cfg, torch.device("cpu"), max_tokens=16)
    x, ids, w = _inputs(cfg, 5, 0, "cpu", weights_dtype=torch.bfloat16)
    assert not graphs.reads_as_given(x, ids, w)  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert graphs.reads_as_given(x, ids, w)
    assert graphs.reads_as_given(x, ids.int(), w.float()) and graphs.reads_as_given(x, ids, w.half())
    big = _inputs(cfg, 17, 1, "cpu")
    other = {
        "x [B, S, D]": (x.view(1, 5, -1), ids, w), "x [D]": (x[0], ids, w), "T = 0": (x[:0], ids[:0], w[:0]),
        "T > max_tokens": big, "x float32": (x.float(), ids, w), "x [T, D + 1]": (torch.cat([x, x[:, :1]], 1), ids, w),
        "ids [T, K - 1]": (x, ids[:, :1], w), "ids float": (x, ids.float(), w), "ids int16": (x, ids.short(), w),
        "weights int": (x, ids, ids), "weights [T - 1, K]": (x, ids, w[:4]),
        "x strided": (torch.stack([x, x], -1)[..., 0], ids, w),
        "ids strided": (x, torch.stack([ids, ids], -1)[..., 0], w),
        "weights strided": (x, ids, torch.stack([w, w], -1)[..., 0]),
    }
    for name, args in other.items():
        assert not graphs.reads_as_given(*args), name
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not graphs.reads_as_given(x, ids, w)  # the caller's capture: the eager path is what it records


class _Replay:
    """A CUDA graph's stand-in on the CPU: a replay runs what was captured again."""

    def __init__(self, run) -> None:
        self.replay = run


@pytest.fixture
def graphs_on_cpu(kernels_on_cpu, monkeypatch):
    """RoutedGraphs on CPU tensors: the CUDA graph replaced by running the captured function again, the
    kernels under the interpreter."""
    from epmoe.graphs import RoutedGraphs
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(RoutedGraphs, "_record", lambda self, run: (run(), _Replay(run))[1])


@pytest.mark.interpreter
def test_graph_capture_and_replays_through_the_address_table_on_cpu(graphs_on_cpu):
    """RoutedGraphs' capture and replays (epmoe.graphs) on CPU tensors (`graphs_on_cpu`): two layers sharing
    one GraphPool, calls that reuse a bucket with fewer and more tokens and other id dtypes, each output the
    eager path's bit for bit and untouched by the calls after it."""
    from epmoe.graphs import GraphPool, RoutedGraphs
    pool = GraphPool("cpu")
    cfg = epmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=40, intermediate_size=24, dtype=torch.float32)
    layers = []
    for seed in (1, 2):
        moe, _ = _layer(cfg, "triton", "cpu", seed=seed)
        layers.append((moe, RoutedGraphs(moe._routed, cfg, torch.device("cpu"), pool=pool)))
    outs = []
    for T, ids_dtype in ((5, torch.int64), (3, torch.int64), (8, torch.int32), (1, torch.int64), (7, torch.int32)):
        for i, (moe, graphs) in enumerate(layers):
            x, ids, w = _inputs(cfg, T, 10 * T + i, "cpu", ids_dtype=ids_dtype)
            if i:  # rows with strides of their own
                x, ids, w = (torch.cat([t, t[:, :1]], 1)[:, :-1] for t in (x, ids, w))
            got = graphs(x, ids, w)
            assert torch.equal(got, moe(x, weights_TK=w, ids_TK=ids)), (T, i)
            outs.append((got, got.clone()))
    assert all(torch.equal(a, b) for a, b in outs)
    assert {(key[0], key[4]) for key in pool._static} == {(1, torch.int64), (4, torch.int64), (8, torch.int32),
                                                           (8, torch.int64)}


@pytest.mark.interpreter
def test_a_cap_that_is_no_power_of_two_is_the_top_bucket(graphs_on_cpu):
    """With max_tokens_per_rank = 6 the graphs take every call up to 6 tokens (not only up to 4, the power of
    two below): 5 and 6 tokens replay the 6-token bucket's graph, 3 the 4-token one's, each the eager
    path's output bit for bit."""
    from epmoe.graphs import RoutedGraphs
    cfg = epmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=40, intermediate_size=24, dtype=torch.float32,
                          max_tokens_per_rank=6)
    moe, _ = _layer(cfg, "triton", "cpu")
    graphs = RoutedGraphs(moe._routed, cfg, torch.device("cpu"))
    assert graphs.max_tokens == 6 and [graphs.bucket(T) for T in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    for T in (5, 6, 3):
        x, ids, w = _inputs(cfg, T, T, "cpu")
        assert torch.equal(graphs(x, ids, w), moe(x, weights_TK=w, ids_TK=ids)), T
    assert sorted(key[0] for key in graphs._graphs) == [4, 6]


def test_max_bucket_is_the_cap_or_the_largest_power_of_two_that_fits():
    """`max_bucket`: max_tokens_per_rank itself where its bucket fits the byte budget (3000 as well as
    4096), else the largest power of two below it that fits, else 0."""
    from epmoe.graphs import bucket_bytes, max_bucket
    for cap in (3000, 4096, 1):
        cfg = epmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens_per_rank=cap)
        assert max_bucket(cfg) == cap
        assert max_bucket(cfg, bucket_bytes(cfg, 1) - 1) == 0
    cfg = epmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens_per_rank=3000)
    assert max_bucket(cfg, bucket_bytes(cfg, 2999)) == 2048
    assert max_bucket(cfg, bucket_bytes(cfg, 2048) - 1) == 1024
    cfg = dataclasses.replace(cfg, max_tokens_per_rank=4096)
    assert max_bucket(cfg, bucket_bytes(cfg, 4095)) == 2048


def test_graph_pool_must_be_a_graph_pool():
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, dtype=torch.float32)
    with pytest.raises(ValueError, match="graph_pool must be an epmoe.graphs.GraphPool, got tuple"):
        epmoe.FusedMoE(cfg, None, dispatcher="local", experts="reference", device="cpu", graph_pool=(0, 1))


@pytest.mark.gpu
def test_gpu_layers_sharing_a_graph_pool_replay_their_own_outputs():
    """Three layers (other weights, one of them fp8) sharing one GraphPool, called in turn with token counts
    that revisit buckets with fewer and more tokens: each gives its eager output bit for bit, though their
    graphs read the same static inputs; the later layers' graphs add no static tensors where the shapes
    agree."""
    from epmoe.graphs import GraphPool
    pool = GraphPool("cuda")
    layers = []
    for seed, quant in ((3, None), (4, None), (5, "fp8_block")):
        cfg = epmoe.MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16,
                              quant=quant)
        weights = make_weights(cfg, seed, "cuda")
        pair = []
        for graphs in (dict(graph_pool=pool), dict(cuda_graphs=False)):
            moe = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="triton", device="cuda", **graphs)
            moe.load_experts(weights.w13_END, weights.w2_EDF)
            pair.append(moe)
        layers.append((cfg, *pair))
    for T in (5, 8, 300, 3, 64, 1, 7):
        for i, (cfg, graphed, eager) in enumerate(layers):
            x, ids, w = _inputs(cfg, T, 100 * i + T, "cuda", weights_dtype=torch.bfloat16)
            got = graphed(x, weights_TK=w, ids_TK=ids)
            assert torch.equal(got, eager(x, weights_TK=w, ids_TK=ids)), (i, T)
    assert len(pool._static) == len({(1 << (T - 1).bit_length()) for T in (5, 8, 300, 3, 64, 1, 7)})


def test_on_device_makes_another_gpu_current_and_leaves_the_rest(monkeypatch):
    """`on_device` (what the public entry points run under) switches only to a GPU that is not the current
    one; the CPU and the current GPU get no context."""
    from contextlib import nullcontext
    from epmoe.interfaces import on_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    other = on_device(torch.device("cuda", 1))
    assert isinstance(other, torch.cuda.device) and other.idx == 1
    for device in (torch.device("cuda", 0), torch.device("cpu"), torch.device("cuda")):
        assert isinstance(on_device(device), nullcontext), device


@pytest.mark.gpu2
@pytest.mark.parametrize("precision", PRECISIONS[1:], ids=["bf16", "fp8"])
def test_gpu_layer_on_the_second_gpu_runs_there_while_the_first_is_current(precision):
    """A layer of a model split over GPUs (on cuda:1 while cuda:0 is current, as transformers' device_map
    leaves it) launches its kernels and captures its graphs on its own device: graphed, eager (routing
    logits) and part-by-part calls give what they give with cuda:1 current, bit for bit, close to the float64
    loop, and leave cuda:0 current."""
    cfg = epmoe.MoEConfig(num_experts=64, top_k=6, hidden_size=256, intermediate_size=192, **precision)
    torch.cuda.set_device(0)
    moe, weights = _layer(cfg, "triton", "cuda:1")
    eager = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="triton", device="cuda:1", cuda_graphs=False)
    eager.load_experts(weights.w13_END, weights.w2_EDF)
    assert moe.graphs is not None
    x, ids, w = _inputs(cfg, 77, 5, "cuda:1", weights_dtype=torch.bfloat16, ids_dtype=torch.int32)
    logits = torch.randn(77, cfg.num_experts, generator=torch.Generator().manual_seed(6)).to("cuda:1")

    def calls() -> list[torch.Tensor]:
        batch = moe.dispatcher.dispatch(x, ids, w)
        return [moe(x, weights_TK=w, ids_TK=ids), eager(x, weights_TK=w, ids_TK=ids), moe(x, logits),
                moe.dispatcher.combine(moe.experts(batch), batch)]

    got = calls()
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        want = calls()
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.device == torch.device("cuda", 1) and torch.equal(a, b), i
    assert rel_error(got[0].cpu(), _reference(x, ids, w, weights, cfg)) <= tolerance(cfg)
