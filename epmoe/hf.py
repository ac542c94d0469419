"""Hugging Face integration: MoEConfig from a model config, and expert weights from a checkpoint's state dict.

No import of transformers here: `config_from_hf` reads attributes of any config object (e.g. one from
`transformers.AutoConfig.from_pretrained`), and `expert_weights` reads a plain state dict (e.g. from
`safetensors.torch.load_file`; `pip install 'epmoe[hf]'` installs both).

Shape letters: E experts, D hidden size, F expert intermediate size.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .config import MoEConfig

# Per-expert projection names: (gate, up, down). DeepSeek/Qwen name them *_proj; Mixtral w1/w3/w2.
_NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _first(hf_config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    return None


def config_from_hf(hf_config: Any, **overrides: Any) -> MoEConfig:
    """MoEConfig for one MoE layer of a Hugging Face model config.

    Reads (first present wins): experts from n_routed_experts / num_experts / num_local_experts; top-k from
    num_experts_per_tok; D from hidden_size; F from moe_intermediate_size / intermediate_size; sigmoid
    scoring when scoring_func == "sigmoid" (DeepSeek-V3); grouped top-k from n_group / topk_group;
    renormalize from norm_topk_prob (default True); routed_scaling_factor. `overrides` (dtype, quant,
    max_tokens_per_rank, ...) are passed to MoEConfig last.
    """
    num_experts = _first(hf_config, "n_routed_experts", "num_experts", "num_local_experts")
    top_k = _first(hf_config, "num_experts_per_tok")
    hidden = _first(hf_config, "hidden_size")
    inter = _first(hf_config, "moe_intermediate_size", "intermediate_size")
    missing = [name for name, v in (("number of experts", num_experts), ("num_experts_per_tok", top_k),
                                    ("hidden_size", hidden), ("intermediate size", inter)) if v is None]
    if missing:
        raise ValueError(f"the model config has no {', '.join(missing)}: is it a MoE model?")
    kwargs: dict[str, Any] = dict(num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                                  scoring="sigmoid" if _first(hf_config, "scoring_func") == "sigmoid" else "softmax")
    norm = _first(hf_config, "norm_topk_prob")
    kwargs["renormalize"] = True if norm is None else bool(norm)
    groups, topk_groups = _first(hf_config, "n_group"), _first(hf_config, "topk_group")
    if groups is not None and topk_groups is not None and groups > 1:
        kwargs.update(num_groups=groups, topk_groups=topk_groups)
    scaling = _first(hf_config, "routed_scaling_factor")
    if scaling is not None:
        kwargs["routed_scaling_factor"] = float(scaling)
    kwargs.update(overrides)
    return MoEConfig(**kwargs)


def expert_weights(state_dict: Mapping[str, torch.Tensor], prefix: str,
                   num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a checkpoint's per-expert projections into FusedMoE.load_experts' global layout.

    Args:
        state_dict: checkpoint tensors; expert e's are f"{prefix}{e}.{gate}.weight" [F, D],
            f"{prefix}{e}.{up}.weight" [F, D] and f"{prefix}{e}.{down}.weight" [D, F], with (gate, up, down)
            = (gate_proj, up_proj, down_proj) or Mixtral's (w1, w3, w2).
        prefix: the experts' key prefix, e.g. "model.layers.3.mlp.experts." (DeepSeek, Qwen) or
            "model.layers.3.block_sparse_moe.experts." (Mixtral).
        num_experts: E.

    Returns:
        w13_END [E, 2F, D] (gate rows, then up rows) and w2_EDF [E, D, F], in the checkpoint's dtype.
    """
    for gate, up, down in _NAMINGS:
        if f"{prefix}0.{gate}.weight" in state_dict:
            break
    else:
        raise ValueError(f"no expert 0 weights under prefix {prefix!r} (looked for "
                         f"{[f'{prefix}0.{names[0]}.weight' for names in _NAMINGS]})")

    def get(e: int, name: str) -> torch.Tensor:
        key = f"{prefix}{e}.{name}.weight"
        if key not in state_dict:
            raise ValueError(f"missing {key!r}")
        return state_dict[key]

    w13 = torch.stack([torch.cat([get(e, gate), get(e, up)], dim=0) for e in range(num_experts)])
    w2 = torch.stack([get(e, down) for e in range(num_experts)])
    return w13, w2
