"""Expert parallelism with data-parallel attention for transformers models.

Every rank of a process group holds the model's dense weights and runs its own batch through attention;
each MoE layer's experts module dispatches its tokens through a FusedMoE over the group, and each rank
holds only its L = E / R experts (rank r: experts [r*L, (r+1)*L)). Ranks may hold different batch sizes,
and a rank with no prompts still takes part (`generate`); every rank must make the same model calls.

Prefill and decode calls may use different dispatchers (`ht` for prefill, `ll` for decode, say). All ranks
must pick the same one for the same call, so the choice cannot follow each rank's own token count: it
follows the call's phase, which is the same on every rank under synced generation. A model forward that
starts from an empty cache (or none) is prefill; one that continues a cache (`past_key_values` / `cache`
holding tokens) is decode. A forward pre-hook on the model's base model reads it once per forward.

Shape letters: B batch, S sequence, T tokens of this rank, D hidden size, E experts, L local experts, K top-k.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..interfaces import Dispatcher
from ..layer import FusedMoE
from ..symm import group_rank_world
from .backend import _BINDING, DEFAULT_MAX_TOKENS, check_inference, moe_layer, run_moe
from .experts import ExpertsWeights, describe, experts_weights, is_experts_module, unsupported

_PHASE = "_epmoe_phase"  # key in the model's __dict__


@dataclass(kw_only=True)
class Phase:
    """What the current model call is, for every MoE layer of one expert-parallel model.

    decode: the forward continues a cache (set by the pre-hook on each forward).
    idle: this rank has no tokens of its own; its MoE layers send none (set by `generate`).
    ranks: the size of the expert-parallel group (1: generation needs no syncing).
    """

    decode: bool = False
    idle: bool = False
    ranks: int = 1


@dataclass(frozen=True, kw_only=True)
class EPOptions:
    """How an expert-parallel model's MoE layers reach their experts.

    dispatcher: dispatcher of prefill calls (see `epmoe.list_dispatchers`; "auto" picks one).
    decode_dispatcher: dispatcher of decode calls (None: the prefill one's name).
    experts: the experts implementation ("auto", "triton", "grouped_mm", "reference").
    max_tokens_per_rank: the most tokens a prefill dispatch moves per rank (larger calls are chunked).
    decode_max_tokens_per_rank: the same for decode calls (None: max_tokens_per_rank); dispatchers without a
        host sync (`ll`) take at most this many tokens per call and size their buffers from it. Decode calls
        run on layers of their own where the dispatcher or this limit differs from prefill's.
    """

    dispatcher: str = "auto"
    decode_dispatcher: str | None = None
    experts: str = "auto"
    max_tokens_per_rank: int = DEFAULT_MAX_TOKENS
    decode_max_tokens_per_rank: int | None = None


class ExpertParallelExperts:
    """An experts module's forward under expert parallelism (installed as the module's `forward`).

    prefill, decode: FusedMoE layers over the group, whose experts view the same local weights (decode may
    be prefill); phase: the model's Phase. The module is held weakly: installed in it, a strong reference
    would be a cycle, and a dropped model's layers (and the process group they hold) would wait for the
    garbage collector.
    """

    def __init__(self, module: torch.nn.Module, prefill: FusedMoE, decode: FusedMoE, phase: Phase) -> None:
        self._module = weakref.ref(module)
        self.prefill, self.decode, self.phase = prefill, decode, phase

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """[T, D] tokens with the router's global ids int [T, K] and weights float [T, K] -> [T, D]."""
        check_inference(self._module(), hidden_states, top_k_weights)
        moe = self.decode if self.phase.decode else self.prefill
        if not self.phase.idle:
            return run_moe(moe, hidden_states, top_k_index, top_k_weights)
        run_moe(moe, hidden_states[:0], top_k_index[:0], top_k_weights[:0])  # takes part, sends nothing
        return torch.zeros_like(hidden_states)


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every transformers experts module of `model`, each checked to be one epmoe runs.

    Raises ValueError naming the model's class when it has none, or when one is unsupported (and why).
    """
    found = [(name, m) for name, m in model.named_modules() if is_experts_module(m)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no transformers experts module (gate_up_proj [E, 2F, D], "
                         "down_proj [E, D, F], as transformers 5's MoE models have)")
    for name, module in found:
        reasons = unsupported(module)
        if reasons:
            raise ValueError(f"epmoe cannot run {type(model).__name__}: its {type(module).__name__} ({name}) has "
                             f"{'; '.join(reasons)}")
    return found


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's hidden states have: its input embeddings'."""
    return model.get_input_embeddings().weight.dtype


def top_k_of(model: torch.nn.Module) -> int:
    config = model.config.get_text_config()
    top_k = getattr(config, "num_experts_per_tok", None)
    if top_k is None:
        raise ValueError(f"{type(config).__name__} has no num_experts_per_tok")
    return top_k


def _phase_hook(phase: Phase):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values")  # transformers 5.24 names it `cache`
        cache = kwargs.get("cache") if cache is None else cache
        phase.decode = cache is not None and cache.get_seq_length() > 0
    return hook


def _refuse_parallel(model: torch.nn.Module) -> None:
    if _PHASE in model.__dict__:
        raise ValueError(f"{type(model).__name__} is expert-parallel already")


def install(model: torch.nn.Module, group: dist.ProcessGroup | None,
            local: dict[str, tuple[torch.nn.Module, ExpertsWeights, int]], options: EPOptions,
            device: torch.device) -> torch.nn.Module:
    """Run each experts module `local` names through FusedMoE layers over `group` holding its local experts.

    local: name -> (experts module, this rank's experts of it, E of the layer). Collective (dispatchers may
    set up shared buffers): every rank calls it with the same modules in the same order. The layers of one
    phase and shape share one dispatcher.
    """
    _refuse_parallel(model)
    phase = Phase(ranks=group_rank_world(group)[1])
    top_k, dtype = top_k_of(model), activation_dtype(model)
    limits = {"prefill": options.max_tokens_per_rank,
              "decode": options.decode_max_tokens_per_rank or options.max_tokens_per_rank}
    names = {"prefill": options.dispatcher, "decode": options.decode_dispatcher or options.dispatcher}
    dispatchers: dict[tuple, Dispatcher] = {}  # (phase, E, D, F, quant) -> the dispatcher its layers share

    def layer(which: str, weights: ExpertsWeights, num_experts: int) -> FusedMoE:
        key = (which, num_experts, *weights.shape[1:], weights.quant)
        moe = moe_layer(weights, num_experts=num_experts, top_k=top_k, dtype=dtype, group=group,
                        dispatcher=dispatchers.get(key, names[which]), experts=options.experts,
                        max_tokens_per_rank=limits[which], device=device)
        dispatchers[key] = moe.dispatcher
        return moe

    for name, (module, weights, num_experts) in local.items():
        prefill = layer("prefill", weights, num_experts)
        same = options.decode_dispatcher is None and limits["decode"] == limits["prefill"]
        decode = prefill if same else layer("decode", weights, num_experts)
        module.forward = ExpertParallelExperts(module, prefill, decode, phase)
    model.__dict__[_PHASE] = phase
    getattr(model, "base_model", model).register_forward_pre_hook(_phase_hook(phase), with_kwargs=True)
    return model


def set_local_experts(module: torch.nn.Module, local: ExpertsWeights) -> None:
    """Make the experts module hold only `local` (its num_experts becomes L), as its parameters."""
    for name, tensor in (("gate_up_proj", local.w13_END), ("down_proj", local.w2_EDF),
                         ("gate_up_proj_scale_inv", local.w13_scale), ("down_proj_scale_inv", local.w2_scale)):
        if tensor is not None:
            setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))
    module.num_experts = local.w13_END.shape[0]
    module.__dict__.pop(_BINDING, None)  # the epmoe backend's layer of all E experts (it holds their weights)


def expert_parallel(model: torch.nn.Module, group: dist.ProcessGroup | None, *,
                    options: EPOptions = EPOptions()) -> torch.nn.Module:
    """Make every MoE layer of `model` expert-parallel over `group`, attention data-parallel; in place.

    Args:
        model: a transformers model holding every expert (the same weights on every rank, e.g. from
            `from_pretrained`); on this rank's device. Each experts module keeps only this rank's L = E / R
            experts afterwards (its gate_up_proj [L, 2F, D], down_proj [L, D, F], fp8 scales likewise); the
            rest is freed. To load only the slice from a checkpoint folder, use `epmoe.hf.from_pretrained`.
        group: the expert-parallel ranks (None: one rank).
        options: dispatchers, experts and token limits (`EPOptions`).

    Returns the model. Collective: every rank calls it. Run it with `epmoe.hf.generate` (synced; a rank
    may hold no prompts) or with forwards that every rank makes together.
    """
    _refuse_parallel(model)
    rank, world = group_rank_world(group)
    everything = {name: (module, experts_weights(module)) for name, module in experts_modules(model)}
    for name, (module, weights) in everything.items():  # every check before any change
        if weights.shape[0] % world:
            raise ValueError(f"{describe(module)} ({name}): its {weights.shape[0]} experts do not divide over "
                             f"{world} ranks")
    local = {}
    for name, (module, weights) in everything.items():
        E = weights.shape[0]
        L = E // world
        mine = weights.experts(rank * L, (rank + 1) * L).clone()
        set_local_experts(module, mine)
        local[name] = (module, mine, E)
    del everything
    device = next(iter(local.values()))[1].w13_END.device
    return install(model, group, local, options, device)


def phase_of(model: torch.nn.Module) -> Phase:
    """The Phase of an expert-parallel model (ValueError for a model that is not)."""
    phase = model.__dict__.get(_PHASE)
    if phase is None:
        raise ValueError(f"{type(model).__name__} is not expert-parallel: make it so with epmoe.hf.expert_parallel "
                         "or load it with epmoe.hf.from_pretrained")
    return phase


def generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             **generate_kwargs) -> torch.Tensor:
    """`model.generate` for an expert-parallel model on every rank: synced (`synced_gpus=True`, an all-reduce
    over the default process group at each step), so ranks whose sequences finish keep taking part until
    every rank's have; each rank its own prompts. On one rank, plain `model.generate`.

    Args:
        input_ids: int [B, S], this rank's prompts; B may differ between ranks and may be 0: that rank still
            takes part, running a one-token stand-in through attention and sending no token to the MoE
            layers, as long as any rank generates.
        attention_mask: [B, S] (left padding), or None.
        generate_kwargs: passed to `model.generate`; the number of forwards must depend on the ranks'
            progress only (greedy or sampled decoding; no prefill chunking).

    Returns what `model.generate` returns; on a rank with no prompts, input_ids itself.
    """
    phase = phase_of(model)
    if "synced_gpus" in generate_kwargs:
        raise ValueError("epmoe.hf.generate sets synced_gpus itself (True over several ranks): do not pass it")
    if input_ids.shape[0]:
        return model.generate(input_ids, attention_mask=attention_mask, synced_gpus=phase.ranks > 1,
                              **generate_kwargs)
    if phase.ranks == 1:
        return input_ids
    stand_in = torch.zeros((1, 1), dtype=input_ids.dtype, device=input_ids.device)
    phase.idle = True
    try:
        model.generate(stand_in, attention_mask=torch.ones_like(stand_in), synced_gpus=True, max_new_tokens=1,
                       do_sample=False, pad_token_id=0)
    finally:
        phase.idle = False
    return input_ids
