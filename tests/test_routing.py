"""epmoe.route against hand-computed cases."""
import math

import pytest
import torch

import epmoe


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


@pytest.mark.parametrize("kwargs, logits, words", [
    ({}, torch.zeros(2, 5), "logits_TE must be [T, E=4]"),
    ({}, torch.zeros(2, 4, dtype=torch.int64), "float"),
    ({"correction_bias_E": torch.zeros(3)}, torch.zeros(2, 4), "correction_bias_E must be"),
    ({"correction_bias_E": torch.zeros(4)}, torch.zeros(2, 4), "sigmoid"),
    ({"num_groups": 3, "topk_groups": 1}, torch.zeros(2, 4), "num_groups=3"),
])
def test_route_refuses_bad_input(kwargs, logits, words):
    with pytest.raises(ValueError) as e:
        epmoe.route(logits, _cfg(4, 2), **kwargs)
    assert words in str(e.value)
