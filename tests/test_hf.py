"""Hugging Face integration: MoEConfig from model configs, and checkpoint expert weights into FusedMoE."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F_

import epmoe
from epmoe.hf import config_from_hf, expert_weights


def test_config_from_deepseek_v3():
    hf = SimpleNamespace(n_routed_experts=256, num_experts_per_tok=8, hidden_size=7168, intermediate_size=18432,
                         moe_intermediate_size=2048, scoring_func="sigmoid", n_group=8, topk_group=4,
                         norm_topk_prob=True, routed_scaling_factor=2.5)
    cfg = config_from_hf(hf, max_tokens_per_rank=128)
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (256, 8, 7168, 2048)
    assert (cfg.scoring, cfg.num_groups, cfg.topk_groups, cfg.routed_scaling_factor) == ("sigmoid", 8, 4, 2.5)
    assert cfg.renormalize and cfg.max_tokens_per_rank == 128


def test_config_from_qwen3_and_mixtral():
    qwen = config_from_hf(SimpleNamespace(num_experts=128, num_experts_per_tok=8, hidden_size=2048,
                                          moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=False))
    assert (qwen.num_experts, qwen.intermediate_size, qwen.scoring, qwen.renormalize) == (128, 768, "softmax", False)
    assert qwen.num_groups is None
    mixtral = config_from_hf(SimpleNamespace(num_local_experts=8, num_experts_per_tok=2, hidden_size=4096,
                                             intermediate_size=14336), dtype=torch.float32)
    assert (mixtral.num_experts, mixtral.top_k, mixtral.intermediate_size) == (8, 2, 14336)
    assert mixtral.renormalize and mixtral.dtype == torch.float32


def test_config_from_dense_model_is_refused():
    with pytest.raises(ValueError, match="number of experts"):
        config_from_hf(SimpleNamespace(hidden_size=64, intermediate_size=128))


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_checkpoint_experts_in_fused_moe(names):
    E, K, D, F, T = 4, 2, 32, 24, 7
    prefix = "model.layers.1.mlp.experts."
    g = torch.Generator().manual_seed(0)
    sd = {}
    for e in range(E):
        for name, shape in zip(names, ((F, D), (F, D), (D, F))):
            sd[f"{prefix}{e}.{name}.weight"] = torch.randn(shape, generator=g) / 8
    cfg = epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=F, dtype=torch.float32)
    moe = epmoe.FusedMoE(cfg, device="cpu")
    moe.load_experts(*expert_weights(sd, prefix, E))
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    out = moe(x, logits)
    weights, ids = epmoe.route(logits, cfg)
    gate, up, down = names
    expected = torch.zeros(T, D)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            h = F_.silu(sd[f"{prefix}{e}.{gate}.weight"] @ x[t]) * (sd[f"{prefix}{e}.{up}.weight"] @ x[t])
            expected[t] += weights[t, k] * (sd[f"{prefix}{e}.{down}.weight"] @ h)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_checkpoint_missing_expert_is_refused():
    sd = {f"experts.0.{n}.weight": torch.zeros(2, 2) for n in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(ValueError, match="experts.1.gate_proj.weight"):
        expert_weights(sd, "experts.", 2)
    with pytest.raises(ValueError, match="no expert 0 weights"):
        expert_weights(sd, "model.experts.", 2)
