"""epmoe as one of transformers' own expert-parallel implementations (`EPImplementationInterface`, 5.24+):

    AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(
        ep_size=N, tp_size=..., ep_implementation="epmoe"))

transformers shards each experts module's weights over its EP mesh (rank r of the EP group holds experts
[r*L, (r+1)*L)) and hands each experts call to the implementation. The ranks of a TP group share one
batch: each dispatches only its slice of the tokens (rows [t*ceil(T/P), (t+1)*ceil(T/P)) on TP rank t of
P) through epmoe over the EP group, and the slices' outputs are all-gathered over TP (SGLang's attention
TP > 1 case). The experts modules' FusedMoE layers are built at their first call (the weights are loaded
by then) and view the local shards (no copy); the layers of one mesh and shape share one dispatcher.

Shape letters: T tokens of the TP group's batch, D hidden size, K top-k, P TP ranks, L local experts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.distributed.expert_parallel import EPImplementation

from ..layer import FusedMoE
from .backend import DEFAULT_MAX_TOKENS, Binding, check_inference, compute_dtype, moe_layer, run_moe, weights_key
from .experts import experts_weights

# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SHARED = "_epmoe_dispatchers"  # on the EP mesh: (E, D, F, quant, K, dtype) -> the dispatcher its layers share


class EpmoeEP(EPImplementation):
    """Dispatches each TP rank's slice of the shared batch through a FusedMoE (dispatcher "auto") over the
    EP group, and all-gathers the outputs over the TP group."""

    def __init__(self, experts: torch.nn.Module, ep_mesh, tp_mesh) -> None:
        super().__init__(experts, ep_mesh, tp_mesh)
        self.module = experts
        self.ep_group, self.tp_group = ep_mesh.get_group(), tp_mesh.get_group()
        self.tp_size, self.tp_rank = tp_mesh.size(), tp_mesh.get_local_rank()
        self._bound: Binding | None = None
        self._shared = ep_mesh.__dict__.setdefault(_SHARED, {})

    def _moe(self, top_k: int, dtype: torch.dtype) -> FusedMoE:
        key = weights_key(self.module, top_k, dtype)
        if self._bound is None or not self._bound.current(key):
            local = experts_weights(self.module)  # this rank's shard: the weights are local tensors in a call
            E = local.shape[0] * dist.get_world_size(self.ep_group)
            shared = (E, *local.shape[1:], local.quant, top_k, dtype)
            moe = moe_layer(local, num_experts=E, top_k=top_k, dtype=dtype, group=self.ep_group,
                            dispatcher=self._shared.get(shared, "auto"), experts="auto",
                            max_tokens_per_rank=DEFAULT_MAX_TOKENS, device=local.w13_END.device)
            self._shared[shared] = moe.dispatcher
            self._bound = Binding.of(self.module, key, moe)
        return self._bound.moe

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """[T, D] tokens (the same on every rank of the TP group), global ids int [T, K], weights float [T, K]
        -> [T, D], sum_k weights * expert_{ids}(x) for every token."""
        check_inference(self.module, hidden_states, top_k_weights)
        moe = self._moe(top_k_index.shape[-1], compute_dtype(self.module, hidden_states))
        T, D = hidden_states.shape
        rows = -(-T // self.tp_size)
        lo, hi = min(T, self.tp_rank * rows), min(T, (self.tp_rank + 1) * rows)
        out_TD = run_moe(moe, hidden_states[lo:hi], top_k_index[lo:hi], top_k_weights[lo:hi])
        if self.tp_size == 1:
            return out_TD
        mine = out_TD.new_zeros(rows, D)
        mine[:hi - lo] = out_TD
        gathered = out_TD.new_empty(rows * self.tp_size, D)
        _all_gather(gathered, mine, group=self.tp_group)
        return gathered[:T]
