"""Tiny transformers MoE models of every family epmoe.hf runs, checkpoints of them in each format, and the
eager reference runs they are compared with (shared by test_hf*.py and their spawned ranks).

Every model is made from a seed, identically on every rank. E = 12 experts divide over 1 to 4 ranks.
"""
from __future__ import annotations

import json
import os

import torch
import transformers
from safetensors.torch import save_file

from epmoe.hf.experts import is_experts_module
from epmoe.quant import quantize_weight_ref

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")
VOCAB = 96
_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16)


def tiny_config(family: str, *, experts: int = 12, hidden: int = 64, inter: int = 32, layers: int = 2,
                **overrides) -> transformers.PretrainedConfig:
    """A `family` config with E = experts, D = hidden, F = inter (the experts'), top-k 2; DeepSeek's and
    GLM-4-MoE's first layer dense."""
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_experts_per_tok=2,
                  tie_word_embeddings=False)
    kinds = {
        "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=inter, num_experts=experts, **_ATTENTION),
        "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=inter, num_experts=experts,
                          shared_expert_intermediate_size=48, **_ATTENTION),
        "mixtral": dict(intermediate_size=inter, num_local_experts=experts, **_ATTENTION),
        "deepseek_v2": dict(intermediate_size=96, moe_intermediate_size=inter, n_routed_experts=experts,
                            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, topk_method="greedy",
                            n_group=1, topk_group=1, norm_topk_prob=False, **_MLA),
        "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=inter, n_routed_experts=experts,
                            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, n_group=2, topk_group=1,
                            routed_scaling_factor=2.5, **_MLA),
        "glm4_moe": dict(intermediate_size=96, moe_intermediate_size=inter, n_routed_experts=experts,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                         routed_scaling_factor=2.0, **_ATTENTION),
        "gpt_oss": dict(intermediate_size=inter, num_local_experts=experts, layer_types=["full_attention"] * layers,
                        **_ATTENTION),
    }
    return transformers.AutoConfig.for_model(family, **{**common, **kinds[family], **overrides})


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **config) -> torch.nn.Module:
    """A random `family` model (eager experts), the same for the same arguments."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **config), dtype=dtype)
    with torch.no_grad():
        for name, experts in ((n, m) for n, m in model.named_modules() if is_experts_module(m)):
            # experts of weight O(1/sqrt(fan-in)): their outputs matter as much as the residual stream
            experts.gate_up_proj.normal_(0, experts.gate_up_proj.shape[-1] ** -0.5)
            experts.down_proj.normal_(0, experts.down_proj.shape[-1] ** -0.5)
            # decisive routing: top-k margins far above the rounding of the router's inputs
            router = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "gate", None)
            if router is not None:
                router.weight.normal_(0, 4 * router.weight.shape[-1] ** -0.5)
    model.set_experts_implementation("eager")
    return model.eval()


# Small sizes for a model of any family, each given where the family's config has the field (E = 12, K = 3)
_ANY_FAMILY = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
    intermediate_size=64, moe_intermediate_size=32, expert_intermediate_size=32, num_experts=12, n_routed_experts=12,
    num_local_experts=12, moe_num_experts=12, num_experts_per_tok=3, moe_k=3, first_k_dense_replace=0,
    decoder_sparse_step=1, tie_word_embeddings=False, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=16, qk_head_dim=32, n_shared_experts=1, shared_expert_intermediate_size=32,
    mlp_only_layers=[], moe_layer_freq=1, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=1,
    attn_layer_offset=0, n_group=4, topk_group=2, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, router_jitter_noise=0.0, input_jitter_noise=0.0, pad_token_id=0)


# What some families need beside _ANY_FAMILY (a tiny model of their own shape)
_FAMILY_SIZES = {
    "glm4v_moe_text": dict(head_dim=128),  # its multimodal rotary sections fill a 128-wide head
    "mimo_v2_flash": dict(layer_types=["full_attention"] * 2, mlp_layer_types=["sparse"] * 2, v_head_dim=16),
}


def routed_call(model_type: str, tokens: int = 24):
    """One MoE block's routing in a tiny random `model_type` model (transformers' config class of that
    type, E = 12, K = 3; its routers' weights and any score correction bias drawn large enough for decisive
    choices): (config, the router's logits float [T, E], the bias [E] or None, and the ids [T, K] and
    weights [T, K] that the block handed its experts)."""
    cls = transformers.models.auto.configuration_auto.CONFIG_MAPPING[model_type]
    defaults = cls()
    sizes = {k: v for k, v in _ANY_FAMILY.items() if hasattr(defaults, k)}
    config = cls(**{**sizes, **_FAMILY_SIZES.get(model_type, {})})
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM  # (a composite model's text config: the text model itself)
    auto = auto if type(config) in auto._model_mapping else transformers.AutoModel
    model = auto.from_config(config, dtype=torch.float32).eval()
    block = [m for m in model.modules() if is_experts_module(getattr(m, "experts", None) or torch.nn.Module())][-1]
    routers = [m for n, m in block.named_children() if n in ("gate", "router")]
    bias = None
    with torch.no_grad():
        for name, t in [*block.named_buffers(), *block.named_parameters()]:
            if "correction_bias" in name and t.shape == (12,):
                bias = t.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
        for p in (p for r in routers for p in r.parameters() if p.dim() == 2):
            p.normal_(0, 4 * p.shape[-1] ** -0.5)
    seen = {}
    hooks = [routers[0].register_forward_hook(lambda m, args, out: seen.setdefault("router", out)),
             block.experts.register_forward_pre_hook(lambda m, args: seen.setdefault("experts", args))]
    with torch.no_grad():
        model(input_ids=torch.randint(VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1)), use_cache=False)
    for hook in hooks:
        hook.remove()
    out = seen["router"]  # the logits, or a tuple holding them (with the top-k ids and weights, in some order)
    logits = next(t for t in (out if isinstance(out, (tuple, list)) else (out,))
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-1] == 12)
    logits = logits.reshape(tokens, -1).float()
    _, ids, weights = seen["experts"]
    return config, logits, None if bias is None else bias.float(), ids.reshape(tokens, -1), weights.reshape(tokens, -1)


def prompts(rank: int, batch: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(VOCAB, (batch, length), generator=g)


def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, run=None):
    """Greedy decoding of exactly new_tokens tokens: (tokens [B, S + N], logits float [N, B, V]); `run` is the
    generate function (default model.generate)."""
    run = run or (lambda m, x, **kw: m.generate(x, **kw))
    out = run(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    if not ids.shape[0]:
        return out, None
    return out.sequences, torch.stack(out.logits).float()


def save_fused(model: torch.nn.Module, path: str) -> None:
    """A checkpoint in transformers 5's in-memory names (fused 3-D experts: gate_up_proj [E, 2F, D])."""
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))


def save_fp8(model: torch.nn.Module, path: str, dense: tuple[str, ...] = ("o_proj",)) -> None:
    """An FP8 checkpoint as DeepSeek-V3 and Qwen3-30B-A3B-FP8 ship them: save_pretrained's per-expert keys with
    every expert projection, and the dense projections whose names end in `dense`, as float8_e4m3fn weights
    with 128x128 float32 `weight_scale_inv` blocks, and a block-128 quantization_config."""
    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    from safetensors.torch import load_file
    tensors = load_file(file)
    quantized = {}
    for key, t in tensors.items():
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and (".experts." in key or name.endswith(dense)):
            q, scale = quantize_weight_ref(t)
            quantized[key], quantized[f"{name}.weight_scale_inv"] = q, scale
        else:
            quantized[key] = t
    save_file(quantized, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                         weight_block_size=[128, 128])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
