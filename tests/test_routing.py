"""epmoe.route against hand-computed cases, through both its versions (torch operations; the Triton
kernel, under the interpreter on the CPU), and the kernel against the torch version on random logits."""
import math
import os

import pytest
import torch

import epmoe
import epmoe.routing
from compile_run import OTHER_TRITONS, assert_compiles
from epmoe.kernels.routing import route_topk
from epmoe.oracle import route_ref


@pytest.fixture(params=["torch", "kernel"], autouse=True)
def version(request, monkeypatch):
    """Every test of this module runs with route's torch version and with its kernel (on CPU tensors
    under the Triton interpreter, so not where a GPU turns the interpreter off, except GPU tests)."""
    if (request.param == "kernel" and os.environ.get("TRITON_INTERPRET") != "1"
            and request.node.get_closest_marker("gpu") is None):
        pytest.skip("the kernel on CPU tensors needs TRITON_INTERPRET=1")
    monkeypatch.setattr(epmoe.routing, "_use_kernel", lambda logits_TE, E: request.param == "kernel")
    return request.param


def _cfg(E, K, **kw):
    return epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=8, intermediate_size=8, **kw)


def _logit(p):
    return math.log(p / (1 - p))


def test_softmax_with_and_without_renormalize():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))  # softmax = [.1, .2, .3, .4]
    w, ids = epmoe.route(logits, _cfg(4, 2, renormalize=False))
    assert ids.tolist() == [[3, 2]] and ids.dtype == torch.int32
    torch.testing.assert_close(w, torch.tensor([[0.4, 0.3]]))
    w, ids = epmoe.route(logits, _cfg(4, 2))
    assert ids.tolist() == [[3, 2]] and w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([[4 / 7, 3 / 7]]))


def test_routed_scaling_factor_multiplies_weights():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    w, _ = epmoe.route(logits, _cfg(4, 2), routed_scaling_factor=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.5 * 4 / 7, 2.5 * 3 / 7]]))


def test_deepseek_v2_grouped_softmax():
    # softmax = [5, 1, 4, 4, .5, .5] / 15; groups {0,1} {2,3} {4,5} ranked by their max: group 0 (5) wins,
    # so both experts come from it although experts 2 and 3 score higher than expert 1.
    logits = torch.log(torch.tensor([[5.0, 1.0, 4.0, 4.0, 0.5, 0.5]]))
    cfg = _cfg(6, 2, renormalize=False, num_groups=3, topk_groups=1)
    w, ids = epmoe.route(logits, cfg)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[5 / 15, 1 / 15]]))
    _, ids = epmoe.route(logits, cfg, num_groups=None, topk_groups=None)  # no grouping: 0 and 2 or 3
    assert ids[0, 0] == 0 and ids[0, 1] in (2, 3)


def test_deepseek_v3_sigmoid_bias_grouped():
    p = [0.9, 0.1, 0.6, 0.55, 0.8, 0.7, 0.2, 0.3]
    logits = torch.tensor([[_logit(v) for v in p]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.6])
    # biased = [.9, .1, .6, .55, .3, .7, .2, .9]; group score = sum of its two best biased scores:
    # g0 1.0, g1 1.15, g2 1.0, g3 1.1 -> keep g1, g3; best biased there: 7 (.9), 2 (.6).
    # Weights are the unbiased scores .3 and .6, renormalized -> 1/3, 2/3, then x2.5.
    cfg = _cfg(8, 2, scoring="sigmoid", num_groups=4, topk_groups=2)
    w, ids = epmoe.route(logits, cfg, correction_bias_E=bias)
    assert ids.tolist() == [[7, 2]]
    torch.testing.assert_close(w, torch.tensor([[1 / 3, 2 / 3]]))
    w, _ = epmoe.route(logits, cfg, correction_bias_E=bias, renormalize=False, routed_scaling_factor=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.5 * 0.3, 2.5 * 0.6]]))
    # without the bias: g0 1.0, g1 1.15, g2 1.5, g3 0.5 -> keep g2, g1; expert 0 (the best, .9) is
    # in a dropped group, so the choice is 4 (.8), 5 (.7)
    _, ids = epmoe.route(logits, cfg)
    assert ids.tolist() == [[4, 5]]


def test_route_zero_tokens_and_ids_distinct():
    cfg = _cfg(16, 4, scoring="sigmoid", num_groups=4, topk_groups=2)
    w, ids = epmoe.route(torch.empty(0, 16), cfg)
    assert w.shape == (0, 4) and ids.shape == (0, 4)
    w, ids = epmoe.route(torch.randn(33, 16, generator=torch.Generator().manual_seed(0)), cfg)
    assert all(len(set(row)) == 4 for row in ids.tolist())
    torch.testing.assert_close(w.sum(1), torch.ones(33))
    groups = (ids // 4).tolist()
    assert all(len(set(g)) <= 2 for g in groups)


@pytest.mark.parametrize("E, K, kw", [
    (8, 2, dict()), (16, 4, dict(renormalize=False)), (24, 3, dict(num_groups=4, topk_groups=2)),
    (32, 8, dict(scoring="sigmoid", num_groups=8, topk_groups=4)), (16, 16, dict(scoring="sigmoid")), (5, 1, dict()),
])
def test_route_matches_the_oracle(E, K, kw):
    """Random logits (and a bias for sigmoid scoring) against epmoe.oracle.route_ref, which routes token by
    token in float64 from the definition: the same ids in the same order, weights to float32 rounding."""
    g = torch.Generator().manual_seed(E + K)
    logits = torch.randn(37, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1 if kw.get("scoring") == "sigmoid" else None
    cfg = _cfg(E, K, **kw)
    w, ids = epmoe.route(logits, cfg, correction_bias_E=bias, routed_scaling_factor=1.5)
    w_ref, ids_ref = route_ref(logits, K, scoring=cfg.scoring, renormalize=cfg.renormalize, num_groups=cfg.num_groups,
                               topk_groups=cfg.topk_groups, correction_bias_E=bias)
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w.double(), w_ref * 1.5, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs, logits, words", [
    ({}, torch.zeros(2, 5), "logits_TE must be [T, E=4]"),
    ({}, torch.zeros(2, 4, dtype=torch.int64), "float"),
    ({"correction_bias_E": torch.zeros(3)}, torch.zeros(2, 4), "correction_bias_E must be"),
    ({"correction_bias_E": torch.zeros(4)}, torch.zeros(2, 4), "sigmoid"),
    ({"num_groups": 3, "topk_groups": 1}, torch.zeros(2, 4), "num_groups=3"),
    ({"correction_bias_E": torch.zeros(4, device="meta"), "scoring": "sigmoid"}, torch.zeros(2, 4), "is on meta"),
])
def test_route_refuses_bad_input(kwargs, logits, words):
    with pytest.raises(ValueError) as e:
        epmoe.route(logits, _cfg(4, 2), **kwargs)
    assert words in str(e.value)


def _both(monkeypatch, logits, cfg, **kw):
    """(weights, ids) of the kernel and of the torch version for the same route arguments."""
    monkeypatch.setattr(epmoe.routing, "_use_kernel", lambda logits_TE, E: True)
    got = epmoe.route(logits, cfg, **kw)
    monkeypatch.setattr(epmoe.routing, "_use_kernel", lambda logits_TE, E: False)
    return got, epmoe.route(logits, cfg, **kw)


def _assert_same_choice(got, want, logits, cfg, bias=None, scale=1.0):
    """ids equal, in order, on at least 90% of the rows; on the others the choice scores at both sets of
    ids agree to 1e-5 (ties, or near ties that the scores' last bits decide). Weights on every row are the
    scores of the ids chosen there (renormalized as cfg says, times `scale`)."""
    (w, ids), (w_ref, ids_ref) = got, want
    scores_TE = _choice(logits, cfg.scoring)
    choice_TE = _choice(logits, cfg.scoring, bias)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == ids_ref.shape
    differ = (ids != ids_ref).any(1)
    assert int(differ.sum()) <= 0.1 * ids.shape[0], f"{int(differ.sum())} of {ids.shape[0]} rows differ"
    if differ.any():
        rows = differ.nonzero()[:, 0]
        a = choice_TE[rows].gather(1, ids[rows].long()).sort(1).values
        b = choice_TE[rows].gather(1, ids_ref[rows].long()).sort(1).values
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    picked = scores_TE.gather(1, ids.long())
    if cfg.renormalize:
        picked = picked / picked.sum(1, keepdim=True)
    torch.testing.assert_close(w, picked * scale, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w[~differ], w_ref[~differ], atol=1e-6, rtol=1e-5)


def _choice(logits, scoring, bias=None):
    scores = torch.softmax(logits.float(), -1) if scoring == "softmax" else torch.sigmoid(logits.float())
    return scores if bias is None else scores + bias.float()


@pytest.mark.parametrize("E, K, kw, dtype", [
    (16, 4, dict(renormalize=False), torch.bfloat16),  # bf16: equal logits, either expert of a tie
    (64, 6, dict(), torch.bfloat16),
    (60, 5, dict(num_groups=6, topk_groups=2), torch.float32),  # groups of 10 experts (not a power of two)
    (64, 8, dict(num_groups=8, topk_groups=3, renormalize=False), torch.float32),
    (64, 8, dict(scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling_factor=2.5), torch.float32),
    (16, 16, dict(scoring="sigmoid"), torch.bfloat16),  # K = E
    (24, 3, dict(scoring="sigmoid", num_groups=24, topk_groups=5), torch.float16),  # groups of one expert
    (1000, 8, dict(scoring="sigmoid", num_groups=8, topk_groups=4), torch.float32),  # 4 tokens a program
])
@pytest.mark.parametrize("version", ["kernel"], indirect=True)  # compares the kernel with the torch version
@pytest.mark.parametrize("T", [1, 37])
def test_kernel_matches_torch_on_random_logits(version, monkeypatch, E, K, kw, dtype, T):
    """Grouped cases in float32: a tie between group scores would let the versions keep different
    groups (the check allows ties between experts only)."""
    g = torch.Generator().manual_seed(E * 100 + T)
    cfg_kw = {k: v for k, v in kw.items() if k != "routed_scaling_factor"}
    cfg = _cfg(E, K, **cfg_kw)
    logits = torch.randn(T, E + 3, generator=g)[:, 3:].to(dtype)  # a row stride other than E
    bias = (torch.randn(E, 2, generator=g) * 0.1)[:, 0] if cfg.scoring == "sigmoid" else None  # stride 2
    route_kw = {"correction_bias_E": bias, "routed_scaling_factor": kw.get("routed_scaling_factor", 1.0)}
    got, want = _both(monkeypatch, logits, cfg, **route_kw)
    _assert_same_choice(got, want, logits, cfg, bias, route_kw["routed_scaling_factor"])
    assert all(len(set(row)) == K for row in got[1].tolist())


@pytest.mark.parametrize("version", ["kernel"], indirect=True)  # compares the kernel with the torch version
def test_kernel_ranks_nan_scores_first_as_torch_topk_does(version, monkeypatch):
    """A NaN score ranks above every number (torch.topk's order) and makes its row's weights NaN (after
    renormalization, all of them); ids stay distinct and in range; other rows are untouched."""
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    logits[1] = float("nan")
    logits[2, 5] = float("nan")
    logits[3, 9] = float("nan")
    cfg = _cfg(32, 4, scoring="sigmoid", num_groups=4, topk_groups=2)
    (w, ids), (w_ref, ids_ref) = _both(monkeypatch, logits, cfg)
    for row in ids.tolist():
        assert len(set(row)) == 4 and all(0 <= i < 32 for i in row)
    assert w[1:].isnan().all() and w_ref[1:].isnan().all()
    assert ids[2, 0] == ids_ref[2, 0] == 5 and ids[3, 0] == ids_ref[3, 0] == 9
    torch.testing.assert_close(w[0], w_ref[0])
    assert torch.equal(ids[0], ids_ref[0])
    w, _ = route_topk(logits[3:], 4, sigmoid=True, correction_bias_E=None, num_groups=4, topk_groups=2,
                      renormalize=False, routed_scaling_factor=1.0)
    assert w[0, 0].isnan() and not w[0, 1:].isnan().any()  # without renormalization only the NaN pick


@pytest.mark.parametrize("version", ["kernel"], indirect=True)  # compares the kernel with the torch version
@pytest.mark.gpu
def test_kernel_matches_torch_on_gpu_at_deepseek_v3_scale(version, monkeypatch):
    """4096 tokens, 256 experts, DeepSeek-V3's grouped sigmoid choice with a bias (and softmax top-8); 300
    tokens at K = E = 64 and at 4096 experts in 64 groups."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4096, 256, device="cuda", generator=g)
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    for cfg, b in [(_cfg(256, 8, scoring="sigmoid", num_groups=8, topk_groups=4), bias),
                   (_cfg(256, 8), None), (_cfg(128, 8, renormalize=False), None)]:
        x = logits[:, :cfg.num_experts]
        got, want = _both(monkeypatch, x, cfg, correction_bias_E=b)
        _assert_same_choice(got, want, x, cfg, b)
    # the launches of other blocks and warps: K = E = 64 (32 tokens a program), 4096 experts (one, 8 warps)
    wide = torch.randn(300, 4096, device="cuda", generator=g)
    wide_bias = torch.randn(4096, device="cuda", generator=g) * 0.1
    for cfg, b in [(_cfg(64, 64, scoring="sigmoid"), None),
                   (_cfg(4096, 8, scoring="sigmoid", num_groups=64, topk_groups=8), wide_bias)]:
        x = wide[:, :cfg.num_experts]
        got, want = _both(monkeypatch, x, cfg, correction_bias_E=b)
        _assert_same_choice(got, want, x, cfg, b)
    monkeypatch.undo()  # route's own choice of version from here
    w, _ = epmoe.route(logits.clone().requires_grad_(), _cfg(256, 8))
    assert w.requires_grad  # logits that need a gradient take the torch version
    if torch.cuda.device_count() > 1:  # logits on another GPU than the current one
        x = logits.to("cuda:1")
        got, want = epmoe.route(x, _cfg(256, 8)), epmoe.routing._route_torch(x, 8, "softmax", None, None, None,
                                                                             True, 1.0)
        _assert_same_choice(got, want, x, _cfg(256, 8))


@pytest.mark.parametrize("version", ["kernel"], indirect=True)  # the kernel's compile check
@pytest.mark.parametrize("triton_dir", [None] + OTHER_TRITONS)
def test_kernel_compiles_for_hopper(version, triton_dir):
    """The routing kernel compiles for sm_90 without spills at the launcher's blocks
    (tests/compile_routing.py; with the installed triton, or the one in triton_dir)."""
    assert_compiles("compile_routing.py", triton_dir)
