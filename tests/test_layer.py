"""Single rank, in-process: the `local` dispatcher through every shared case, FusedMoE against the dense
loop, the layer's input checks, and the registry's tables."""
import dataclasses

import pytest
import torch

import epmoe
from epmoe.launch import spawn
from epmoe.symm import EmulatedGroup
from epmoe.oracle import route_ref
from epmoe.testing import (TOLERANCES, build_layer, layer_oracle, make_tokens, make_weights, precision, rank_rows,
                           reference_layer, rel_error, shared_expert)
from gpu_ranks import gpu_test_ranks

import moe_cases


@pytest.mark.parametrize("case", moe_cases.CASES, ids=lambda c: c.__name__)
def test_local_dispatcher(case):
    failures = moe_cases.run_case(case, "local", None, torch.device("cpu"))
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("case", moe_cases.CASES, ids=lambda c: c.__name__)
def test_local_dispatcher_cuda(case):
    failures = moe_cases.run_case(case, "local", None, torch.device("cuda"))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("T", [0, 1, 7, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_softmax_vs_oracle(T, dtype):
    """Softmax routing without scaling or shared experts; chunks of 5 tokens; odd D and F. Routed by the
    layer (the oracle routes with route_ref), and with the caller's ids and weights: random, a hot expert,
    -1 ids, a token with none, weights unnormalized in bf16 / float64, non-contiguous ids and x."""
    cfg = epmoe.MoEConfig(num_experts=6, top_k=2, hidden_size=19, intermediate_size=7, dtype=dtype,
                          max_tokens_per_rank=5)
    weights = make_weights(cfg, 3, "cpu")
    moe = build_layer(cfg, weights, None, "auto", "auto", "cpu", shared=False)
    oracle = layer_oracle(cfg, weights, shared=False)
    tol = TOLERANCES[precision(cfg)]
    g = torch.Generator().manual_seed(T)
    x, logits = torch.randn(T, 19, generator=g).to(dtype), torch.randn(T, 6, generator=g)
    out = moe(x, logits)
    assert out.shape == (T, 19) and out.dtype == dtype
    w_ref, ids_ref = route_ref(logits, 2)
    assert rel_error(out, oracle(x, ids_ref, w_ref)) <= tol
    ids_KT = moe_cases.random_ids(T, 6, 2, g).long().t().contiguous()
    ids_KT[0, ::3] = 5
    if T:
        ids_KT[:, -1] = -1
    w = torch.rand(T, 2, generator=g, dtype=torch.float64) * 3
    for w_TK in (w, w.bfloat16()):
        x_wide = torch.stack([x, -x], dim=2)
        out = moe(x_wide[..., 0], weights_TK=w_TK, ids_TK=ids_KT.t())
        assert rel_error(out, oracle(x, ids_KT.t(), w_TK)) <= tol


def test_fused_moe_all_tokens_one_expert_with_shared_and_scaling():
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32,
                          routed_scaling_factor=2.5)
    weights = make_weights(cfg, 4, "cpu")
    moe = build_layer(cfg, weights, None, "local", "reference", "cpu")
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[3, -1]] * 9)
    w = torch.full((9, 2), 0.75)
    assert rel_error(moe(x, weights_TK=w, ids_TK=ids), layer_oracle(cfg, weights)(x, ids, w)) <= TOLERANCES["fp32"]


def test_fused_moe_refuses_bad_input():
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    moe = build_layer(cfg, make_weights(cfg, 0, "cpu"), None, "local", "reference", "cpu")
    x, logits = torch.randn(3, 8), torch.randn(3, 4)
    w, ids = epmoe.route(logits, cfg)
    for kwargs, words in [
        ({"logits_TE": logits, "weights_TK": w, "ids_TK": ids}, "not both"),
        ({"weights_TK": w}, "both weights_TK and ids_TK"),
        ({"logits_TE": logits[:, :3]}, "logits_TE must be"),
        ({"weights_TK": w, "ids_TK": ids + 4}, "expert id"),
    ]:
        with pytest.raises(ValueError) as e:
            moe(x, **kwargs)
        assert words in str(e.value)
    with pytest.raises(ValueError, match="x_TD is on meta"):
        moe(x.to("meta"), logits)


def test_fused_moe_checks_its_arguments_before_the_shared_experts_run():
    """forward runs the shared experts first (their GPU work overlaps the host's routing and dispatch):
    an argument error is raised before they are called, and they run once per call."""
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    moe = build_layer(cfg, make_weights(cfg, 0, "cpu"), None, "local", "reference", "cpu")
    calls = []
    moe.shared_experts.register_forward_hook(lambda module, inputs, out: calls.append(inputs[0].shape))
    x, logits = torch.randn(3, 8), torch.randn(3, 4)
    w, ids = epmoe.route(logits, cfg)
    for args, kwargs in [((x, logits), {"weights_TK": w, "ids_TK": ids}), ((x,), {"weights_TK": w}),
                         ((x.to("meta"), logits), {}), ((x[:, :7], logits), {}), ((x.double(), logits), {}),
                         ((x[0], logits), {}), ((x, logits[:, :3]), {}), ((x, logits[:2]), {}),
                         ((x, logits), {"correction_bias_E": torch.zeros(3)}),
                         ((x, logits), {"correction_bias_E": torch.zeros(4)}),  # softmax scoring: no bias
                         ((x,), {"weights_TK": w, "ids_TK": ids + 4}), ((x,), {"weights_TK": w[:2], "ids_TK": ids})]:
        with pytest.raises(ValueError):
            moe(*args, **kwargs)
    assert calls == []
    moe(x, logits)
    assert calls == [x.shape]


def test_fused_moe_reads_ids_on_the_host_only_when_the_caller_gives_them(monkeypatch):
    """The range check of ids_TK (a host sync) runs for caller-given ids, not for the router's own,
    which are in range by construction."""
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    moe = build_layer(cfg, make_weights(cfg, 0, "cpu"), None, "local", "reference", "cpu")
    x, logits = torch.randn(3, 8), torch.randn(3, 4)
    w, ids = epmoe.route(logits, cfg)
    reads = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: reads.append(t.shape) or aminmax(t))
    by_router = moe(x, logits)
    assert reads == []
    torch.testing.assert_close(moe(x, weights_TK=w, ids_TK=ids), by_router, rtol=0, atol=0)
    assert reads == [ids.shape]
    with pytest.raises(ValueError, match=r"w13 must be \[E=4"):
        moe.load_experts(torch.zeros(3, 16, 8), torch.zeros(4, 8, 8))
    with pytest.raises(ValueError, match=r"w2 must be \[E=4"):
        moe.load_experts(torch.zeros(4, 16, 8), torch.zeros(4, 8, 9))


def test_config_refuses_bad_values():
    for kwargs, words in [({"top_k": 5}, "top_k=5"), ({"hidden_size": 0}, "hidden_size"),
                          ({"dtype": torch.int32}, "dtype"), ({"quant": "int4"}, "quant"),
                          ({"num_groups": 3, "topk_groups": 1}, "num_groups=3")]:
        with pytest.raises(ValueError) as e:
            epmoe.MoEConfig(**{"num_experts": 4, "top_k": 2, "hidden_size": 8, "intermediate_size": 8, **kwargs})
        assert words in str(e.value)
    with pytest.raises(ValueError, match="not divisible"):
        epmoe.MoEConfig(num_experts=6, top_k=2, hidden_size=8, intermediate_size=8).local_experts(4)


def test_registry_tables():
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    dispatchers = epmoe.list_dispatchers(cfg)
    assert {"local", "allgather", "alltoall"} <= set(dispatchers)
    assert dispatchers["local"] == (True, "ok")
    assert dispatchers["allgather"][0] is False and "process group" in dispatchers["allgather"][1]
    assert all(isinstance(ok, bool) and isinstance(why, str) for ok, why in dispatchers.values())
    experts = epmoe.list_experts(cfg, "cpu")
    assert experts["reference"] == (True, "ok")
    assert epmoe.make_dispatcher("auto", cfg).name == "local"
    with pytest.raises(ValueError, match="unknown dispatcher 'nope'"):
        epmoe.make_dispatcher("nope", cfg)
    with pytest.raises(ValueError, match="not available"):
        epmoe.make_dispatcher("alltoall", cfg)
    with pytest.raises(ValueError, match="unknown experts 'nope'"):
        epmoe.make_experts("nope", cfg, 4, "cpu")


def test_fused_moe_takes_a_dispatcher_built_for_its_config():
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    weights = make_weights(cfg, 5, "cpu")
    x, logits = make_tokens(cfg, 5, [6], "cpu")
    by_name = build_layer(cfg, weights, None, "local", "reference", "cpu")
    given = epmoe.FusedMoE(cfg, dispatcher=epmoe.make_dispatcher("local", cfg), experts="reference", device="cpu",
                           shared_experts=shared_expert(cfg, weights, "cpu"))
    given.load_experts(weights.w13_END, weights.w2_EDF)
    torch.testing.assert_close(given(x, logits), by_name(x, logits), rtol=0, atol=0)
    other = epmoe.MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="another config"):
        epmoe.FusedMoE(cfg, dispatcher=epmoe.make_dispatcher("local", other))


def _no_sync_dispatcher_refuses_a_second_chunk(ctx) -> bool:
    from epmoe.dispatch.allgather import AllGatherDispatcher
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32,
                          max_tokens_per_rank=4)
    d = AllGatherDispatcher(cfg, ctx.group)
    d.needs_host_sync = False  # as a dispatcher with no host sync declares (ll, ht sync_free)
    weights = make_weights(cfg, 0, "cpu")
    moe = epmoe.FusedMoE(cfg, ctx.group, dispatcher=d, experts="reference", device="cpu",
                         shared_experts=shared_expert(cfg, weights, "cpu"))
    moe.load_experts(weights.w13_END, weights.w2_EDF)
    calls = []
    moe.shared_experts.register_forward_hook(lambda module, inputs, out: calls.append(inputs[0].shape))
    with pytest.raises(ValueError, match="no host sync to agree on a chunk count"):
        moe(torch.randn(5, 8), torch.randn(5, 4))
    with pytest.raises(ValueError, match="x_TD must be"):
        moe(torch.tensor(1.0), torch.randn(1, 4))
    assert calls == []
    with pytest.raises(ValueError, match="another group"):
        epmoe.FusedMoE(cfg, None, dispatcher=d)
    return moe(torch.randn(4, 8), torch.randn(4, 4)).shape == (4, 8)


def test_fused_moe_refuses_more_tokens_than_a_dispatcher_without_host_sync_takes():
    """Such a dispatcher cannot agree on a chunk count: the layer refuses T > max_tokens_per_rank before
    the shared experts run (2 gloo ranks, allgather posing as one)."""
    assert all(spawn(_no_sync_dispatcher_refuses_a_second_chunk, 2, "cpu", (), timeout_s=120))


def _layer_with_agreed_chunks(ctx) -> list[int]:
    """FusedMoE over a dispatcher that agrees chunk counts itself (alltoall posing as one, as ht does,
    its agreement an all-reduce inside each dispatch): the layer passes its own count with every chunk,
    runs the agreed number (rank 0: 20 tokens in chunks of 8, rank 1: 3 tokens and two empty chunks),
    queues no all-reduce of its own, and matches the single-rank result."""
    import torch.distributed as dist
    from epmoe.dispatch.alltoall import AllToAllDispatcher

    class Agreeing(AllToAllDispatcher):
        agrees_chunks = True

        def __init__(self, *args):
            super().__init__(*args)
            self.sent, self.agreed = [], []

        def _dispatch(self, x_TD, ids_TK, weights_TK, chunks=None):
            n = torch.tensor([chunks])
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
            self.sent.append(chunks)
            self.agreed.append(int(n))
            return super()._dispatch(x_TD, ids_TK, weights_TK)

        def _agreed_chunks(self, batch):
            return self.agreed[-1]

    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32,
                          max_tokens_per_rank=8)
    weights = make_weights(cfg, 0, "cpu")
    d = Agreeing(cfg, ctx.group)
    moe = epmoe.FusedMoE(cfg, ctx.group, dispatcher=d, experts="reference", device="cpu",
                         shared_experts=shared_expert(cfg, weights, "cpu"))
    moe.load_experts(weights.w13_END, weights.w2_EDF)
    tokens = [20, 3]
    x_all, logits_all = make_tokens(cfg, 5, tokens, "cpu")
    rows = rank_rows(tokens, ctx.rank)
    all_reduce, reduces = dist.all_reduce, []

    def counted(*args, **kwargs):
        reduces.append(args[0].clone())
        return all_reduce(*args, **kwargs)
    dist.all_reduce = counted  # (a spawned process of its own)
    out = moe(x_all[rows], logits_all[rows])
    dist.all_reduce = all_reduce
    assert len(reduces) == 3  # the dispatcher's own, one per chunk: none of the layer's
    ref = reference_layer(cfg, weights, "cpu")(x_all[rows], logits_all[rows])
    assert rel_error(out, ref) <= 1e-5
    assert d.sent == [(3, 1)[ctx.rank]] * 3 and d.agreed == [3, 3, 3]
    return d.sent


def test_fused_moe_takes_the_chunk_count_a_dispatcher_agrees():
    assert spawn(_layer_with_agreed_chunks, 2, "cpu", (), timeout_s=120) == [[3, 3, 3], [1, 1, 1]]


def _graph_layer(ctx, T: int) -> bool:
    """FusedMoE with a dispatcher that never syncs the host (ht sync_free, ll), captured in a CUDA graph:
    replays on new tokens equal eager calls, and eager calls and replays match the single-rank reference."""
    from epmoe.dispatch.ht import HtDispatcher
    cfg = epmoe.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, dtype=torch.bfloat16,
                          max_tokens_per_rank=T, scoring="sigmoid", num_groups=4, topk_groups=2,
                          routed_scaling_factor=2.5)
    weights = make_weights(cfg, 7, ctx.device)
    ref = reference_layer(cfg, weights, ctx.device)
    for dispatcher in (HtDispatcher(cfg, ctx.group, sync_free=True), "ll"):
        moe = epmoe.FusedMoE(cfg, ctx.group, dispatcher=dispatcher, experts="triton", device=ctx.device,
                             shared_experts=shared_expert(cfg, weights, ctx.device))
        moe.load_experts(weights.w13_END, weights.w2_EDF)
        x_all, logits_all = make_tokens(cfg, 7, [T] * ctx.world_size, ctx.device)
        mine = rank_rows([T] * ctx.world_size, ctx.rank)
        x, logits = x_all[mine].clone(), logits_all[mine].clone()
        bias = weights.correction_bias_E
        tol = TOLERANCES["bf16"]
        assert rel_error(moe(x, logits, correction_bias_E=bias), ref(x, logits, correction_bias_E=bias)) <= tol
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x, logits, correction_bias_E=bias)
        for seed in range(3):
            g = torch.Generator(device=ctx.device).manual_seed(seed)
            x.copy_(torch.randn(x.shape, generator=g, device=ctx.device).to(x.dtype))
            logits.copy_(torch.randn(logits.shape, generator=g, device=ctx.device))
            graph.replay()
            assert rel_error(out, ref(x, logits, correction_bias_E=bias)) <= tol
            torch.testing.assert_close(out, moe(x, logits, correction_bias_E=bias), rtol=0, atol=0)
    return True


@pytest.mark.gpu2
def test_gpu_fused_moe_without_host_sync_in_a_cuda_graph():
    assert all(spawn(_graph_layer, gpu_test_ranks(), "cuda", (256,), timeout_s=240))


def test_fused_moe_weights_are_module_state_and_fp8_checkpoints_load_as_they_are():
    """The local weights are the experts' buffers (state_dict); a forward before loading is a ValueError;
    fp8 weights with block scales load as they are and give what quantizing the same weights gives."""
    from epmoe.quant import quantize_weight_ref
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, quant="fp8_block")
    x = torch.randn(5, 256).to(torch.bfloat16)
    w, ids = torch.rand(5, 2), torch.randint(0, 4, (5, 2))
    fresh = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="reference", device="cpu")
    with pytest.raises(ValueError, match="load"):
        fresh(x, weights_TK=w, ids_TK=ids)
    assert "experts.w13" not in fresh.state_dict()
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(4, 256, 256, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(4, 256, 128, generator=g) * 0.05).to(torch.bfloat16)
    fresh.load_experts(w13, w2)
    state = fresh.state_dict()
    assert state["experts.w13"].dtype == torch.float8_e4m3fn and state["experts.w2_scale"].shape == (4, 2, 1)
    q13, s13 = quantize_weight_ref(w13)
    q2, s2 = quantize_weight_ref(w2)
    ckpt = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="reference", device="cpu")
    ckpt.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
    assert torch.equal(ckpt(x, weights_TK=w, ids_TK=ids), fresh(x, weights_TK=w, ids_TK=ids))
    with pytest.raises(ValueError, match="w13_scale must be float32"):
        ckpt.load_experts(q13, q2, w13_scale=s13[:, :1], w2_scale=s2)
    with pytest.raises(ValueError, match="both"):
        ckpt.load_experts(q13, q2, w13_scale=s13)
    # a state dict loads into a layer built with the same config whose experts are not loaded yet
    restored = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="reference", device="cpu")
    restored.load_state_dict(ckpt.state_dict())
    assert torch.equal(restored(x, weights_TK=w, ids_TK=ids), fresh(x, weights_TK=w, ids_TK=ids))
    other = epmoe.FusedMoE(dataclasses.replace(cfg, hidden_size=128), None, dispatcher="local",
                           experts="reference", device="cpu")
    with pytest.raises(RuntimeError, match="w13 must be"):
        other.load_state_dict(ckpt.state_dict())
    with pytest.raises(RuntimeError, match="Missing key.*experts.w2"):
        other.load_state_dict({k: v for k, v in ckpt.state_dict().items() if k != "experts.w2"})
    bf16 = epmoe.FusedMoE(dataclasses.replace(cfg, quant=None), None, dispatcher="local", experts="reference",
                          device="cpu")
    with pytest.raises(ValueError, match="fp8_block"):
        bf16.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)


@pytest.mark.parametrize("name,options", [("ht", {}), ("ht", dict(sync_free=True)), ("ll", dict(combine="reduce")),
                                          ("ll", dict(combine="source"))])
def test_fused_moe_over_one_emulated_rank_of_the_nvlink_dispatchers(name, options):
    """FusedMoE with `ht` or `ll` over one emulated rank (a layer's calls cannot run in turn on several)
    against the float64 oracle; 0 tokens too. On one GPU where there is one (the compiled kernels)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = epmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=16, max_tokens_per_rank=8)
    weights = make_weights(cfg, 5, device)
    (group,) = EmulatedGroup.world(1)
    dispatcher = epmoe.make_dispatcher(name, cfg, group, device=device, **options)
    moe = build_layer(cfg, weights, group, dispatcher, "reference", device, shared=False)
    g = torch.Generator().manual_seed(2)
    for T in (6, 0):
        x, logits = torch.randn(T, 64, generator=g).to(cfg.dtype), torch.randn(T, 4, generator=g)
        w, ids = epmoe.route(logits, cfg)
        out = moe(x.to(device), logits.to(device)).cpu()
        assert out.shape == (T, 64) and out.dtype == cfg.dtype
        assert rel_error(out, layer_oracle(cfg, weights, shared=False, device="cpu")(x, ids, w)) <= TOLERANCES["bf16"]
