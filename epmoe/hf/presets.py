"""Random-weight models at the real shapes of well-known MoE checkpoints, for runs with no model hub.

Each preset is the config of the published checkpoint (hidden and expert sizes, experts, top-k, attention
shapes, routing, which layers are dense), with a chosen number of decoder layers; the weights are
transformers' own random initialization. Rotary scaling variants (YaRN) are left out: they change no shape.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=1.0,
        topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, rms_norm_eps=1e-6,
        max_position_embeddings=163840, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False),
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
        first_k_dense_replace=3, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=163840,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False),
}


def preset_config(name: str, layers: int | None = None) -> PretrainedConfig:
    """The config of preset `name` with `layers` decoder layers (default: the checkpoint's). Leading dense
    layers (DeepSeek's first_k_dense_replace) are kept, but at most layers - 1 of them: one layer is MoE."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    kwargs = dict(PRESETS[name])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        kwargs["num_hidden_layers"] = layers
        if "first_k_dense_replace" in kwargs:
            kwargs["first_k_dense_replace"] = min(kwargs["first_k_dense_replace"], layers - 1)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def build(config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device | str, seed: int) -> torch.nn.Module:
    """A causal LM of `config` with transformers' random initialization from `seed` (the same on every rank
    and every call), built on `device` directly, in eval mode."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
