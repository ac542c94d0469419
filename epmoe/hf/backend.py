"""The "epmoe" experts backend: transformers' experts modules run through a FusedMoE.

`experts_forward` is what `experts_implementation="epmoe"` dispatches to (registered by `epmoe.hf`): the
model's own router has chosen top-k ids and weights, and the experts module hands them over with its
tokens. The first call builds one FusedMoE (dispatcher `local`) per experts module, whose experts view
the module's own weight tensors (gate_up_proj [E, 2F, D] is w13's layout: no copy); it is kept outside
the module tree (the module's state_dict and `save_pretrained` do not see it) and rebuilt when the
module's weights are replaced (moved to another device, say), one it holds a copy of changes in place
(`Binding.current`), or the call's top-k changes.

Shape letters: T tokens, D hidden size, F expert intermediate size, E experts, L local experts, K top-k.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..graphs import GraphPool
from ..symm import indexed_device
from ..interfaces import Dispatcher
from ..layer import FusedMoE
from .experts import ExpertsWeights, describe, experts_weights

_BINDING = "_epmoe_experts"  # key in an experts module's __dict__ (not a submodule: not in its state_dict)
_WEIGHTS = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
DEFAULT_MAX_TOKENS = 4096
# The backend's layers replay CUDA graphs (epmoe.graphs) for calls of up to DEFAULT_MAX_TOKENS tokens (as
# many as fit in epmoe.graphs.GRAPH_MAX_BYTES), prefill-sized ones too: a transformers model's step is paced
# by its host (one H200 machine, Qwen3-30B-A3B's shapes, 4096 tokens: ~1 ms of host time an eager experts
# call against ~0.2 ms a replay, with the GPU idle for 3.5 of a 12 ms step). All layers on a device share
# one GraphPool (a model's layers run one after another): one layer's graph memory for the whole model.
_graph_pools: dict[torch.device, GraphPool] = {}


def graph_pool(device: torch.device) -> GraphPool:
    """The graph pool the backend's layers on `device` share (made on first use)."""
    device = indexed_device(device)
    if device not in _graph_pools:
        _graph_pools[device] = GraphPool(device)
    return _graph_pools[device]


def moe_layer(local: ExpertsWeights, *, num_experts: int, top_k: int, dtype: torch.dtype,
              group: dist.ProcessGroup | None, dispatcher: str | Dispatcher, experts: str,
              max_tokens_per_rank: int, device: torch.device) -> FusedMoE:
    """A FusedMoE over `group` holding this rank's experts `local` (views, no copy: the layer's experts
    keep the tensors they are given when their dtype and device already match, as here).

    Args:
        local: this rank's L = E / R experts (all E with group None).
        num_experts: E, the experts of the whole layer.
        top_k: K of the calls.
        dtype: the activations' dtype (the weights' for unquantized experts).
        dispatcher: a dispatcher name or a Dispatcher built for the same config and group (shared by the
            layers of a model).
    """
    E, D, F = num_experts, local.w2_EDF.shape[1], local.w2_EDF.shape[2]
    cfg = MoEConfig(num_experts=E, top_k=top_k, hidden_size=D, intermediate_size=F, dtype=dtype, quant=local.quant,
                    max_tokens_per_rank=max_tokens_per_rank)
    graphs = dict(graph_pool=graph_pool(device)) if device.type == "cuda" else {}
    moe = FusedMoE(cfg, group, dispatcher=dispatcher, experts=experts, device=device, **graphs)
    moe.experts.load(local.w13_END, local.w2_EDF, w13_scale=local.w13_scale, w2_scale=local.w2_scale)
    return moe


def check_inference(module: torch.nn.Module, hidden_states_TD: torch.Tensor, top_k_weights_TK: torch.Tensor) -> None:
    """ValueError when autograd would need gradients through epmoe's experts (they have no backward): for
    the hidden states, the router's weights or the experts' own weights (a fine-tune of the experts)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (
            hidden_states_TD, top_k_weights_TK, _tensor(module, "gate_up_proj"), _tensor(module, "down_proj"))):
        raise ValueError(f"{describe(module)}: epmoe's experts run inference only (no backward); call the model "
                         "under torch.no_grad() or torch.inference_mode()")


def run_moe(moe: FusedMoE, hidden_states_TD: torch.Tensor, top_k_index_TK: torch.Tensor,
            top_k_weights_TK: torch.Tensor) -> torch.Tensor:
    """moe on the router's choice; the output in the hidden states' dtype (casts only where they differ:
    a decode step's experts calls are paced by the host)."""
    dtype = hidden_states_TD.dtype
    x_TD = hidden_states_TD if dtype == moe.cfg.dtype else hidden_states_TD.to(moe.cfg.dtype)
    out_TD = moe.forward(x_TD, weights_TK=top_k_weights_TK, ids_TK=top_k_index_TK)  # (the layer has no hooks)
    return out_TD if out_TD.dtype == dtype else out_TD.to(dtype)


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """module's parameter, buffer or tensor attribute `name`, or None (dictionary reads: no
    Module.__getattr__, whose misses raise)."""
    t = module._parameters.get(name)
    if t is None:
        t = module._buffers.get(name)
    if t is None:
        t = module.__dict__.get(name)
    return t


def compute_dtype(module: torch.nn.Module, hidden_states_TD: torch.Tensor) -> torch.dtype:
    """The dtype the module's FusedMoE runs in: its weights' (unquantized), else the hidden states'."""
    w13 = _tensor(module, "gate_up_proj")
    return hidden_states_TD.dtype if w13 is None or w13.dtype.itemsize == 1 else w13.dtype


def weights_key(module: torch.nn.Module, top_k: int, dtype: torch.dtype) -> tuple:
    """What the module's FusedMoE was built from: K, dtype, its weights' addresses, shapes and strides and
    its scales' addresses (another dtype or device of a tensor is another allocation, at another address)."""
    w13, w2, s13, s2 = (_tensor(module, name) for name in _WEIGHTS)
    if w13 is None or w2 is None:
        return (top_k, dtype, None)  # (`experts_weights` refuses such a module)
    return (top_k, dtype, w13.data_ptr(), w13.shape, w13.stride(), w2.data_ptr(), w2.shape, w2.stride(),
            None if s13 is None else s13.data_ptr(), None if s2 is None else s2.data_ptr())


class Binding(NamedTuple):
    """An experts module's FusedMoE and what it was built from."""

    key: tuple  # weights_key
    moe: FusedMoE
    copies: tuple[tuple[torch.Tensor, int], ...]  # (tensor, its version counter) of the module's tensors the
    #   layer holds no view of (UE8M0 scales made float32, non-contiguous weights made contiguous)

    @classmethod
    def of(cls, module: torch.nn.Module, key: tuple, moe: FusedMoE) -> "Binding":
        held = (moe.experts.w13, moe.experts.w2, getattr(moe.experts, "w13_scale", None),
                getattr(moe.experts, "w2_scale", None))
        copies = tuple((t, t._version) for t, mine in zip((_tensor(module, name) for name in _WEIGHTS), held)
                       if t is not None and not t.is_inference()
                       and (mine is None or t.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr()))
        return cls(key, moe, copies)

    def current(self, key: tuple) -> bool:
        """Whether the layer still computes with the module's weights: the same key, and no tensor it copied
        changed in place since (`load_state_dict`, `copy_` under no_grad move its version counter; writes
        through `.data` and to inference tensors move none and are not seen)."""
        return key == self.key and all(t._version == version for t, version in self.copies)


def experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "epmoe" entry of transformers' ExpertsInterface: module's experts on one device through epmoe.

    Args:
        module: a transformers experts module (gate_up_proj [E, 2F, D], down_proj [E, D, F]; bf16/fp16/fp32,
            or FP8Experts' float8_e4m3fn weights with 128x128 float32 block scales, taken as they are).
        hidden_states: [T, D] tokens (T may be 0).
        top_k_index: int [T, K], the model's router's expert ids in [0, E); under transformers' own expert
            parallelism (torch.distributed initialized) also E (or any id above), for a slot whose expert
            is on another rank (with weight 0), which is skipped, as transformers' own backends skip it.
        top_k_weights: float [T, K], its weights (any scaling the model applies is already in them).

    Returns:
        [T, D] in hidden_states' dtype: sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(x[t]).

    Raises ValueError for modules epmoe cannot run exactly (biases, interleaved or transposed layouts,
    activations other than SiLU-gated, ...: `epmoe.hf.experts.unsupported`) and for calls that need a
    backward.
    """
    check_inference(module, hidden_states, top_k_weights)
    dtype = compute_dtype(module, hidden_states)
    key = weights_key(module, top_k_index.shape[-1], dtype)
    bound = module.__dict__.get(_BINDING)
    if bound is None or not bound.current(key):
        weights = experts_weights(module)
        moe = moe_layer(weights, num_experts=weights.shape[0], top_k=top_k_index.shape[-1], dtype=dtype, group=None,
                        dispatcher="local", experts="auto", max_tokens_per_rank=DEFAULT_MAX_TOKENS,
                        device=module.gate_up_proj.device)
        bound = module.__dict__[_BINDING] = Binding.of(module, key, moe)
    if dist.is_available() and dist.is_initialized():
        # transformers' expert parallelism hands this module's E local experts the ids of other ranks' as E
        # (its own experts backends skip any id >= E there)
        top_k_index = top_k_index.masked_fill(top_k_index >= bound.moe.cfg.num_experts, -1)
    return run_moe(bound.moe, hidden_states, top_k_index, top_k_weights)
