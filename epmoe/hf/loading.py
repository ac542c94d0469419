"""A transformers model for expert parallelism from a checkpoint folder, each rank reading only its experts.

The model is built on the meta device from its config, its experts modules are given no storage, every
other weight is materialized on the device and read from the checkpoint, and each MoE layer's experts
are read by the slice (`Checkpoint.rows`, or only this rank's per-expert tensors): a rank's memory holds
the dense weights and its L = E / R experts, never all E.

Checkpoint names: the model's own parameter names, or those `save_pretrained` writes (transformers'
conversions reverted, e.g. Mixtral's `block_sparse_moe`). FP8 checkpoints (`quantization_config`
quant_method "fp8", 128x128 blocks, dynamic activations): the experts keep their float8_e4m3fn weights and
block scales (epmoe's fp8_block experts run them as they are); the dense fp8 weights are dequantized into
the model's dtype (transformers' own fp8 linear kernels are not needed).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.core_model_loading import revert_weight_conversion

from ..config import FP8_BLOCK
from ..quant import FP8_DTYPE, dequantize_weight_ref, num_groups
from ..registry import default_device
from ..symm import group_rank_world
from .checkpoint import Checkpoint, read_experts
from .parallel import EPOptions, experts_modules, install, set_local_experts

_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def fp8_checkpoint(config) -> bool:
    """Whether the config describes a block-128 fp8 checkpoint epmoe runs; ValueError for other quantizations."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return False
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{type(config).__name__}: quantization {method!r} is not supported (fp8 block-128 only)")
    block = tuple(quant.get("weight_block_size") or ())
    if block != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(f"fp8 checkpoint with weight_block_size {block}: epmoe's fp8_block needs (128, 128)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 checkpoint with activation_scheme={quant['activation_scheme']!r}: epmoe quantizes "
                         "activations dynamically (per token per 128 columns)")
    return True


def _checkpoint_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """For each state key, the names it may have in a checkpoint: its own, and the one `save_pretrained`
    writes (transformers' weight conversions reverted: renamed tensors keep their identity)."""
    reverted = revert_weight_conversion(model, dict(state))
    saved_as = {id(t): key for key, t in reverted.items()}
    return {key: list(dict.fromkeys([key, saved_as.get(id(t), key)])) for key, t in state.items()}


def _dense(ckpt: Checkpoint, names: list[str], like: torch.Tensor) -> torch.Tensor | None:
    """The checkpoint's tensor for one dense weight, in `like`'s dtype (fp8 ones dequantized); None if absent."""
    for name in names:
        if name in ckpt:
            t = ckpt.get(name)
            scale_name = name.removesuffix("weight") + "weight_scale_inv"
            if t.dtype == FP8_DTYPE:
                if scale_name not in ckpt:
                    raise ValueError(f"the fp8 checkpoint tensor {name!r} has no {scale_name!r}")
                scale = ckpt.get(scale_name).float()
                if tuple(scale.shape) != tuple(num_groups(n) for n in t.shape):
                    raise ValueError(f"{scale_name!r} is {tuple(scale.shape)}: not 128x128 blocks of {tuple(t.shape)}")
                t = dequantize_weight_ref(t, scale)
            if t.shape != like.shape:
                raise ValueError(f"the checkpoint's {name!r} is {tuple(t.shape)}, the model's is {tuple(like.shape)}")
            return t.to(like.dtype)
    return None


def _expert_prefixes(model: torch.nn.Module, name: str, module: torch.nn.Module) -> list[str]:
    """The experts module's key prefix in the model and as `save_pretrained` writes it."""
    state = {f"{name}.{p}": getattr(module, p) for p in _EXPERT_PARAMS}
    saved = revert_weight_conversion(model, state)
    prefixes = [name] + [key.rsplit(".", 3)[0] for key in saved if key.count(".") >= 3]
    return list(dict.fromkeys(prefixes))


def _load(path: str | os.PathLike, rank: int, world: int, dtype: torch.dtype | None, device: torch.device,
          dequantize: bool) -> tuple[torch.nn.Module, dict]:
    """The model of the checkpoint with this rank's experts (L = E / R of each MoE layer) as its experts
    modules' parameters; returns (model, {name: (experts module, its ExpertsWeights, E)}). `dequantize`:
    fp8 experts are dequantized into the model's dtype."""
    config = AutoConfig.from_pretrained(path)
    fp8 = fp8_checkpoint(config)
    if fp8:
        del config.quantization_config
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # configs may name it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    modules = experts_modules(model)
    prefixes = {name: _expert_prefixes(model, name, module) for name, module in modules}
    expert_keys = {f"{name}.{p}" for name, _ in modules for p in _EXPERT_PARAMS}
    dense_state = {k: t for k, t in model.state_dict(keep_vars=True).items() if k not in expert_keys}
    names = _checkpoint_names(model, dense_state)
    num_experts = {name: module.gate_up_proj.shape[0] for name, module in modules}
    for _, module in modules:
        for p in _EXPERT_PARAMS:
            setattr(module, p, None)
    model.to_empty(device=device)

    ckpt = Checkpoint(path)
    state = model.state_dict(keep_vars=True)
    missing = []
    local = {}
    with torch.no_grad():
        for key, candidates in names.items():
            t = _dense(ckpt, candidates, state[key])
            if t is None:
                missing.append(key)
                continue
            state[key].copy_(t)
            state[key]._is_hf_initialized = True
        for name, module in modules:
            E = num_experts[name]
            if E % world:
                raise ValueError(f"{name}: {E} experts do not divide over {world} ranks")
            L = E // world
            weights = read_experts(ckpt, prefixes[name], rank * L, (rank + 1) * L)
            if (weights.w13_scale is not None) != fp8:
                raise ValueError(f"{name}: the experts are {'not ' if fp8 else ''}fp8 but the config says "
                                 f"{'fp8' if fp8 else 'unquantized'}")
            weights = weights.dequantized(dtype) if dequantize else weights
            weights = weights.to(device, None if weights.quant else dtype)
            set_local_experts(module, weights)
            for p in module.parameters(recurse=False):
                p._is_hf_initialized = True
            local[name] = (module, weights, E)
    model.initialize_weights()  # what the checkpoint does not hold: non-persistent buffers (rotary), tied weights
    model.tie_weights()
    loaded = {t.data_ptr() for k, t in model.state_dict().items() if k not in missing}
    untied = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded]
    if untied:
        raise ValueError(f"the checkpoint in {os.fspath(path)!r} has no {untied[:8]}{' ...' if len(untied) > 8 else ''}")
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval(), local


def from_pretrained(path: str | os.PathLike, group: dist.ProcessGroup | None = None, *,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    options: EPOptions = EPOptions()) -> torch.nn.Module:
    """A causal LM from a safetensors checkpoint folder, expert-parallel over `group`, reading only this rank's
    experts (see the module docstring for the formats).

    Args:
        path: the folder (config.json, model.safetensors or its index and shards, generation_config.json).
        group: the expert-parallel ranks; None: one rank (all experts, dispatcher `local`).
        dtype: the dense weights' and activations' dtype (default: the config's, else float32).
        device: where the model lives (default: the current CUDA device, else the CPU).
        options: dispatchers, experts and token limits (`EPOptions`).

    Returns the model in eval mode, ready for `epmoe.hf.generate`. Collective: every rank calls it.
    """
    device = default_device() if device is None else torch.device(device)
    rank, world = group_rank_world(group)
    model, local = _load(path, rank, world, dtype, device, dequantize=False)
    return install(model, group, local, options, device)


def load_dequantized(path: str | os.PathLike, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> torch.nn.Module:
    """The checkpoint's model with every expert, fp8 weights dequantized into `dtype`, on transformers' own
    experts (no epmoe): the reference an fp8 checkpoint's epmoe runs are compared with."""
    device = default_device() if device is None else torch.device(device)
    return _load(path, 0, 1, dtype, device, dequantize=True)[0]
