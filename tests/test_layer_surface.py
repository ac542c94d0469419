"""FusedMoE's public surface on one process: [..., D] inputs, device errors as ValueError, the expert
weights as module state under the documented names, and what `.to()` does with them."""
import pytest
import torch

import epmoe
from epmoe.symm import EmulatedGroup
from epmoe.testing import build_layer, layer_oracle, make_weights



def _layer(dtype=torch.float32, **kw):
    cfg = epmoe.MoEConfig(num_experts=6, top_k=2, hidden_size=19, intermediate_size=7, dtype=dtype,
                          max_tokens_per_rank=4, **kw)
    weights = make_weights(cfg, 5, "cpu")
    return cfg, weights, build_layer(cfg, weights, None, "local", "reference", "cpu")


@pytest.mark.parametrize("lead", [(2, 3), (1, 0), (3, 1, 2), ()])
def test_fused_moe_takes_leading_dims(lead):
    """[..., D] tokens (with [..., E] logits, or [..., K] weights and ids, a -1 among them) give [..., D],
    equal to the dense loop over the flattened tokens; 0 tokens and a single [D] token included."""
    cfg, weights, moe = _layer()
    g = torch.Generator().manual_seed(len(lead))
    x = torch.randn(*lead, 19, generator=g)
    logits = torch.randn(*lead, 6, generator=g)
    x_TD = x.reshape(-1, 19)
    w_TK, ids_TK = epmoe.route(logits.reshape(-1, 6), cfg)
    out = moe(x, logits)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = layer_oracle(cfg, weights, device="cpu")(x_TD, ids_TK, w_TK)
    torch.testing.assert_close(out.reshape(-1, 19).double(), ref, rtol=1e-5, atol=1e-5)
    ids_TK[::2, 1] = -1
    got = moe(x, weights_TK=w_TK.view(*lead, 2), ids_TK=ids_TK.view(*lead, 2))
    assert got.shape == x.shape
    ref = layer_oracle(cfg, weights, device="cpu")(x_TD, ids_TK, w_TK)
    torch.testing.assert_close(got.reshape(-1, 19).double(), ref, rtol=1e-5, atol=1e-5)


def test_fused_moe_refuses_mismatched_leading_dims_and_devices():
    cfg, _, moe = _layer()
    x, logits = torch.randn(2, 3, 19), torch.randn(2, 3, 6)
    w, ids = epmoe.route(logits.view(6, 6), cfg)
    for args, kwargs, words in [
        ((x, logits.view(6, 6)), {}, "logits_TE must be [..., E] with x_TD's leading dims (2, 3), got (6, 6)"),
        ((x,), {"weights_TK": w.view(2, 3, 2), "ids_TK": ids}, "ids_TK must be [..., K] with x_TD's leading dims"),
        ((x,), {"weights_TK": w.view(2, 3, 2)[..., 0], "ids_TK": ids.view(2, 3, 2)},
         "weights_TK must be [..., K] with x_TD's leading dims (2, 3), got (2, 3)"),
        ((x,), {"weights_TK": w.view(2, 3, 2), "ids_TK": ids.view(2, 3, 2), "correction_bias_E": torch.zeros(6)},
         "correction_bias_E corrects the routing of logits_TE"),
        ((x[..., :18], logits), {}, "x_TD must be [..., D=19]"),
        ((x, logits.to("meta")), {}, "logits_TE is on meta"),
        ((x,), {"weights_TK": w.view(2, 3, 2), "ids_TK": ids.view(2, 3, 2).to("meta")}, "ids_TK is on meta"),
    ]:
        with pytest.raises(ValueError) as e:
            moe(*args, **kwargs)
        assert words in str(e.value)


def test_fused_moe_refuses_shared_experts_of_another_shape_and_takes_cpu_0():
    cfg, weights, _ = _layer()
    moe = epmoe.FusedMoE(cfg, dispatcher="local", experts="reference", device="cpu:0",
                         shared_experts=lambda x: x[:, :1])
    moe.load_experts(weights.w13_END, weights.w2_EDF)
    assert moe.device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"shared_experts must map x_TD \(4, 19\) to the same shape, gave \(4, 1\)"):
        moe(torch.randn(4, 19), torch.randn(4, 6))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the errors of a machine without CUDA")
def test_fused_moe_on_cuda_without_cuda_is_a_value_error():
    cfg, _, moe = _layer()
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(ValueError, match="no CUDA device"):
            epmoe.FusedMoE(cfg, device=device)
    with pytest.raises(ValueError, match="cannot move"):
        moe.to("cuda")
    assert moe.device == torch.device("cpu") and moe.experts.w13.device.type == "cpu"


def test_fused_moe_state_and_to():
    """The expert weights (and the shared expert's) are module state under the names the docstring
    gives; `.to(device)` moves a single-rank layer and its weights; a cast to another dtype is refused
    before anything moves; fp8 weights and their float32 scales keep their dtypes."""
    cfg, weights, moe = _layer()
    state = moe.state_dict()
    assert sorted(state) == ["experts.w13", "experts.w2", "shared_experts.w13", "shared_experts.w2"]
    assert torch.equal(state["experts.w13"], weights.w13_END) and torch.equal(state["experts.w2"], weights.w2_EDF)
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double()):
        with pytest.raises(ValueError, match="cannot be cast"):
            cast(moe)
        assert all(t.dtype == torch.float32 for t in moe.state_dict().values())
    assert moe.to(torch.float32) is moe and moe.to("cpu").device == torch.device("cpu")
    moved = moe.to("meta")
    assert moved.device == torch.device("meta") and moved.experts.device == torch.device("meta")
    assert {t.device.type for t in moved.state_dict().values()} == {"meta"}
    with pytest.raises(ValueError, match="x_TD is on cpu, the layer on meta"):
        moved(torch.randn(2, 19), torch.randn(2, 6))

    cfg8 = epmoe.MoEConfig(num_experts=2, top_k=1, hidden_size=128, intermediate_size=128, quant="fp8_block")
    fp8 = epmoe.FusedMoE(cfg8, None, dispatcher="local", experts="reference", device="cpu")
    fp8.load_experts(torch.randn(2, 256, 128), torch.randn(2, 128, 128))
    before = {name: t.clone() for name, t in fp8.state_dict().items()}
    fp8.to(torch.bfloat16)
    after = fp8.state_dict()
    assert sorted(after) == ["experts.w13", "experts.w13_scale", "experts.w2", "experts.w2_scale"]
    assert all(after[n].dtype == t.dtype and torch.equal(after[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in before.items())


def test_multi_rank_layer_stays_where_it_was_built():
    """A layer over several ranks (here ht over emulated ranks, whose buffers cannot move) refuses `.to()`
    to another device, and takes a `.to()` that moves nothing."""
    from epmoe.dispatch.ht import HtDispatcher
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = epmoe.MoEConfig(num_experts=4, top_k=1, hidden_size=64, intermediate_size=16, max_tokens_per_rank=8)
    group = EmulatedGroup.world(2)[0]
    ok, reason = HtDispatcher.availability(cfg, group)
    if not ok:
        pytest.skip(reason)
    moe = epmoe.FusedMoE(cfg, group, dispatcher=HtDispatcher(cfg, group, device=device), experts="reference",
                         device=device)
    with pytest.raises(ValueError, match="stays on"):
        moe.to("meta")
    assert moe.to(device) is moe and moe.device.type == device


def test_weights_given_as_parameters_are_detached_views():
    """Weights handed over as Parameters that require gradients (a model's own, in grad mode) are kept as
    views that need none: no gradient reaches them, and the layer deep-copies like any module."""
    import copy
    cfg = epmoe.MoEConfig(num_experts=6, top_k=2, hidden_size=19, intermediate_size=7, dtype=torch.float32)
    weights = make_weights(cfg, 5, "cpu")
    p13, p2 = torch.nn.Parameter(weights.w13_END.clone()), torch.nn.Parameter(weights.w2_EDF.clone())
    moe = epmoe.FusedMoE(cfg, None, dispatcher="local", experts="reference", device="cpu")
    moe.load_experts(p13, p2)
    assert moe.experts.w13.data_ptr() == p13.data_ptr() and moe.experts.w2.data_ptr() == p2.data_ptr()
    assert not moe.experts.w13.requires_grad and not moe.experts.w2.requires_grad
    x, logits = torch.randn(5, 19), torch.randn(5, 6)
    out = moe(x, logits)
    assert not out.requires_grad
    assert torch.equal(copy.deepcopy(moe)(x, logits), out)
    with torch.no_grad():
        p13.mul_(2)  # still views: the change reaches the layer
    assert not torch.equal(moe(x, logits), out)
