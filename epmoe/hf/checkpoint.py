"""Checkpoint tensors read by the key or by the slice, and a MoE layer's experts in epmoe's layout.

A checkpoint folder holds safetensors files: `model.safetensors`, or shards listed by
`model.safetensors.index.json` (what `save_pretrained` writes). Tensors are read on demand: `rows` reads
only the leading-dimension rows asked for, so a rank loads only its own experts' bytes.

Experts are stored either as fused 3-D tensors (transformers 5's in-memory layout: `{prefix}.gate_up_proj`
[E, 2F, D], `{prefix}.down_proj` [E, D, F], with `_scale_inv` block scales for fp8), or one tensor per
expert and projection as in the original DeepSeek, Qwen and Mixtral checkpoints (and `save_pretrained`
output): `{prefix}.{e}.gate_proj.weight` [F, D], `up_proj` [F, D], `down_proj` [D, F] (Mixtral: w1, w3,
w2), fp8 ones with `.weight_scale_inv` beside each weight.

Shape letters: E experts, L experts read (a rank's slice), D hidden size, F expert intermediate size.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch

from ..config import MoEConfig
from .experts import ExpertsWeights

# Per-expert projection names: (gate, up, down). DeepSeek/Qwen name them *_proj; Mixtral w1/w3/w2.
NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class TensorSource(Protocol):
    """Named tensors: a checkpoint folder, or a plain state dict (`StateDictSource`)."""

    def __contains__(self, key: str) -> bool: ...

    def shape_dtype(self, key: str) -> tuple[tuple[int, ...], torch.dtype]: ...

    def get(self, key: str) -> torch.Tensor: ...

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor: ...


class StateDictSource:
    """A state dict as a TensorSource."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.state_dict = state_dict

    def __contains__(self, key: str) -> bool:
        return key in self.state_dict

    def shape_dtype(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self.state_dict[key]
        return tuple(t.shape), t.dtype

    def get(self, key: str) -> torch.Tensor:
        return self.state_dict[key]

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self.state_dict[key][lo:hi]


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lies in a safetensors file."""

    file: str
    offset: int  # of its first byte in the file
    dtype: torch.dtype
    shape: tuple[int, ...]


def _entries(file: str) -> dict[str, _Entry]:
    """The tensors of a safetensors file: an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range in the data that follows."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {key!r} has the dtype {info['dtype']}, which epmoe does not read")
        entries[key] = _Entry(file, 8 + length + info["data_offsets"][0], _DTYPES[info["dtype"]], tuple(info["shape"]))
    return entries


class Checkpoint:
    """The safetensors tensors of a checkpoint folder, read on demand into CPU memory of their own.

    Plain file reads (no memory map): a read costs exactly the bytes asked for, and they are the only
    memory it holds, so a rank that reads its experts' rows holds only those.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        index = os.path.join(path, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
        elif os.path.isfile(os.path.join(path, _SINGLE)):
            files = [os.path.join(path, _SINGLE)]
        else:
            raise ValueError(f"{path!r} holds no {_SINGLE} and no {_INDEX}: not a safetensors checkpoint folder")
        self.path = path
        self._entries = {key: entry for file in files for key, entry in _entries(file).items()}

    def keys(self) -> set[str]:
        return set(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def shape_dtype(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        entry = self._entries[key]
        return entry.shape, entry.dtype

    def get(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        return self.rows(key, 0, entry.shape[0]) if entry.shape else self._read(entry, 0, ())

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of the leading dimension, reading only their bytes."""
        entry = self._entries[key]
        rows = entry.shape[0]
        if not 0 <= lo <= hi <= rows:
            raise ValueError(f"rows {lo}:{hi} of {key!r}, which has {rows}")
        row_bytes = math.prod(entry.shape[1:]) * entry.dtype.itemsize
        return self._read(entry, lo * row_bytes, (hi - lo, *entry.shape[1:]))

    @staticmethod
    def _read(entry: _Entry, skip: int, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(shape, dtype=entry.dtype)
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        with open(entry.file, "rb") as f:
            f.seek(entry.offset + skip)
            if f.readinto(buffer) != len(buffer):
                raise ValueError(f"{entry.file} ends inside a tensor: a truncated checkpoint?")
        return out


def _fused(source: TensorSource, prefix: str, lo: int, hi: int) -> ExpertsWeights | None:
    if f"{prefix}.gate_up_proj" not in source:
        return None
    parts = [source.rows(f"{prefix}.{name}", lo, hi) if f"{prefix}.{name}" in source else None
             for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")]
    if parts[1] is None:
        raise ValueError(f"{prefix}.gate_up_proj has no {prefix}.down_proj beside it")
    return ExpertsWeights(parts[0], parts[1], *(None if s is None else s.float() for s in parts[2:]))


def _per_expert(source: TensorSource, prefix: str, lo: int, hi: int) -> ExpertsWeights | None:
    for gate, up, down in NAMINGS:
        if f"{prefix}.{lo}.{gate}.weight" in source:
            break
    else:
        return None

    def key(e: int, name: str, suffix: str = "weight") -> str:
        key = f"{prefix}.{e}.{name}.{suffix}"
        if key not in source:
            raise ValueError(f"the checkpoint has no {key!r}")
        return key

    def get(e: int, name: str, suffix: str = "weight") -> torch.Tensor:
        return source.get(key(e, name, suffix))

    (F, D), dtype = source.shape_dtype(key(lo, gate))
    w13 = torch.empty(hi - lo, 2 * F, D, dtype=dtype)
    w2 = torch.empty(hi - lo, D, F, dtype=dtype)
    scaled = f"{prefix}.{lo}.{gate}.weight_scale_inv" in source
    if scaled:
        (gate_blocks, cols), _ = source.shape_dtype(key(lo, gate, "weight_scale_inv"))
        w13_scale = torch.empty(hi - lo, 2 * gate_blocks, cols)
        w2_scale = torch.empty(hi - lo, *source.shape_dtype(key(lo, down, "weight_scale_inv"))[0])
    for i, e in enumerate(range(lo, hi)):  # one expert's tensors at a time: no stacked temporaries
        w13[i, :F], w13[i, F:], w2[i] = get(e, gate), get(e, up), get(e, down)
        if scaled:
            w13_scale[i] = torch.cat([get(e, gate, "weight_scale_inv"), get(e, up, "weight_scale_inv")])
            w2_scale[i] = get(e, down, "weight_scale_inv")
    return ExpertsWeights(w13, w2, w13_scale, w2_scale) if scaled else ExpertsWeights(w13, w2, None, None)


def read_experts(source: TensorSource, prefixes: list[str], lo: int, hi: int) -> ExpertsWeights:
    """Experts lo:hi of one MoE layer, stacked in epmoe's layout (w13 [L, 2F, D] gate rows then up rows,
    w2 [L, D, F]; fp8 weights with float32 block scales), reading only those experts.

    prefixes: the layer's experts prefix in the checkpoint's naming, candidates in order (e.g.
    "model.layers.3.mlp.experts" and, for Mixtral's original naming, "model.layers.3.block_sparse_moe.experts").
    """
    for prefix in prefixes:
        found = _fused(source, prefix, lo, hi) or _per_expert(source, prefix, lo, hi)
        if found is not None:
            return found
    looked = [f"{p}.gate_up_proj" for p in prefixes] + [f"{p}.{lo}.{n[0]}.weight" for p in prefixes for n in NAMINGS]
    raise ValueError(f"no experts {lo}:{hi} in the checkpoint (looked for {looked})")


def expert_weights(state_dict: Mapping[str, torch.Tensor], prefix: str,
                   num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a state dict's per-expert projections (or take its fused ones) into FusedMoE.load_experts'
    global layout.

    Args:
        state_dict: checkpoint tensors; expert e's are f"{prefix}{e}.{gate}.weight" [F, D],
            f"{prefix}{e}.{up}.weight" [F, D] and f"{prefix}{e}.{down}.weight" [D, F], with (gate, up, down)
            = (gate_proj, up_proj, down_proj) or Mixtral's (w1, w3, w2); or f"{prefix}gate_up_proj" [E, 2F, D]
            and f"{prefix}down_proj" [E, D, F].
        prefix: the experts' key prefix, e.g. "model.layers.3.mlp.experts." (DeepSeek, Qwen) or
            "model.layers.3.block_sparse_moe.experts." (Mixtral).
        num_experts: E.

    Returns:
        w13_END [E, 2F, D] (gate rows, then up rows) and w2_EDF [E, D, F], in the checkpoint's dtype.
    """
    weights = read_experts(StateDictSource(state_dict), [prefix.removesuffix(".")], 0, num_experts)
    return weights.w13_END, weights.w2_EDF


def _first(hf_config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    return None


# How the routers of the model types epmoe knows turn logits into top-k weights, where a config does not
# say it (transformers' config classes have no scoring_func; a checkpoint's config.json may). Each was
# checked against its transformers router (tests/test_hf.py, test_config_from_hf_routes_as_the_router).
# Sigmoid scores, plus the router's score correction bias where it has one:
SIGMOID_MODEL_TYPES = frozenset({
    "afmoe", "axk1", "axk2", "bailing_hybrid", "deepseek_v3", "deepseek_v32", "dots1", "exaone_moe", "flint",
    "glm4_moe", "glm4_moe_lite", "glm4v_moe_text", "glm_moe_dsa", "hy_v3", "inkling2_text", "kimi_linear", "laguna",
    "mimo_v2_flash", "minicpm5_moe", "minimax_m2", "muse_spark_text", "solar_open"})
# Softmax scores, renormalized over the top k unless norm_topk_prob is false:
SOFTMAX_MODEL_TYPES = frozenset({
    "cohere2_moe", "deepseek_v2", "flex_olmo", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoeshared",
    "hunyuan_v1_moe", "lara_mini", "mellum", "minimax", "mixtral", "olmoe", "qwen2_moe", "qwen3_5_moe_text",
    "qwen3_moe", "qwen3_next", "qwen3_vl_moe_text"})
# Softmax scores taken as they are (no norm_topk_prob in their configs):
UNNORMALIZED_MODEL_TYPES = frozenset({"jamba"})
# Routers epmoe's routing cannot compute, and why:
UNSUPPORTED_ROUTERS = {
    "ernie4_5_moe": "a correction bias on softmax scores",
    "kolibri1": "a correction bias added to the logits before the sigmoid",
    "llama4_text": "weights sigmoid(top-k logit)",
    "phimoe": "sparsemixer weights",
}
_SCALING_NAMES = ("routed_scaling_factor", "router_scaling_factor", "route_scale")


def moe_sizes(hf_config: Any) -> tuple[int, int, int, int]:
    """(E, K, D, F) of a Hugging Face MoE model config's experts (see `config_from_hf`); ValueError naming
    what a config without experts lacks."""
    if hasattr(hf_config, "get_text_config"):
        hf_config = hf_config.get_text_config()
    sizes = (_first(hf_config, "n_routed_experts", "num_experts", "num_local_experts"),
             _first(hf_config, "num_experts_per_tok"), _first(hf_config, "hidden_size"),
             _first(hf_config, "moe_intermediate_size", "intermediate_size"))
    missing = [name for name, v in zip(("number of experts", "num_experts_per_tok", "hidden_size",
                                        "intermediate size"), sizes) if v is None]
    if missing:
        raise ValueError(f"the model config has no {', '.join(missing)}: is it a MoE model?")
    return sizes


def config_from_hf(hf_config: Any, **overrides: Any) -> MoEConfig:
    """MoEConfig for one MoE layer of a Hugging Face model config (routing included: for `moe(x, logits)`).

    Reads (first present wins; from a composite config's text config): experts from n_routed_experts /
    num_experts / num_local_experts; top-k from num_experts_per_tok; D from hidden_size; F from
    moe_intermediate_size / intermediate_size; scoring from scoring_func ("sigmoid" or "softmax"), else by
    model_type (SIGMOID_MODEL_TYPES, SOFTMAX_MODEL_TYPES, UNNORMALIZED_MODEL_TYPES); grouped top-k from
    n_group / topk_group (unless topk_method is "greedy", as DeepSeek-V2's default: a top-k over all
    experts); renormalize from norm_topk_prob (default: true but for UNNORMALIZED_MODEL_TYPES); the scaling
    from routed_scaling_factor / router_scaling_factor / route_scale. `overrides` (dtype, quant,
    max_tokens_per_rank, scoring, ...) are passed to MoEConfig last.

    Raises ValueError for a config without experts, for a model type whose router epmoe cannot compute
    (UNSUPPORTED_ROUTERS: route with the model's own router, `moe(x, weights_TK=..., ids_TK=...)`), and
    for a model type it does not know unless `overrides` give its scoring (and renormalize and
    routed_scaling_factor where the config's norm_topk_prob and scaling do not say them).
    """
    if hasattr(hf_config, "get_text_config"):
        hf_config = hf_config.get_text_config()
    num_experts, top_k, hidden, inter = moe_sizes(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if model_type in UNSUPPORTED_ROUTERS:
        raise ValueError(f"epmoe's routing cannot compute a {model_type!r} model's router "
                         f"({UNSUPPORTED_ROUTERS[model_type]}): "
                         "route with the model's own router and call moe(x, weights_TK=..., ids_TK=...)")
    known = model_type in SIGMOID_MODEL_TYPES | SOFTMAX_MODEL_TYPES | UNNORMALIZED_MODEL_TYPES
    if not known and "scoring" not in overrides:
        raise ValueError(f"config_from_hf does not know how a model_type={model_type!r} router weighs its experts: "
                         "give scoring= ('softmax' or 'sigmoid'), and renormalize= and routed_scaling_factor= where "
                         "the config's norm_topk_prob and routed_scaling_factor do not say them")
    scoring = _first(hf_config, "scoring_func")
    if scoring is None:
        scoring = "sigmoid" if model_type in SIGMOID_MODEL_TYPES else "softmax"
    kwargs: dict[str, Any] = dict(num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                                  scoring=scoring)
    norm = _first(hf_config, "norm_topk_prob")
    kwargs["renormalize"] = model_type not in UNNORMALIZED_MODEL_TYPES if norm is None else bool(norm)
    groups, topk_groups = _first(hf_config, "n_group"), _first(hf_config, "topk_group")
    greedy = _first(hf_config, "topk_method") == "greedy"  # DeepSeek-V2's plain top-k, groups unused
    if groups is not None and topk_groups is not None and groups > 1 and not greedy:
        kwargs.update(num_groups=groups, topk_groups=topk_groups)
    scaling = _first(hf_config, *_SCALING_NAMES)
    if scaling is not None:
        kwargs["routed_scaling_factor"] = float(scaling)
    kwargs.update(overrides)
    return MoEConfig(**kwargs)
