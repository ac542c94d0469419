"""Expert-parallel cases of epmoe.hf run on every spawned gloo rank (one spawn runs several; test_hf_parallel.py).

Each rank builds the same tiny model from the seed, decodes its own prompts (batch sizes and prompt lengths
differ by rank, 0 prompts included) through the unmodified model with eager experts, then through epmoe
(expert parallelism with data-parallel attention), and records wrong results with `expect` instead of
raising, so every rank goes through the same collectives; `run` returns the failures as text.
"""
from __future__ import annotations

import copy
import os
import traceback

import torch
import torch.distributed as dist

import epmoe.hf
import hf_models
from epmoe.hf.parallel import EPOptions, experts_modules
from epmoe.hf.run import TOLERANCES, ExpertsCalls
from epmoe.testing import rel_error

NEW = 4
_failures: list[str] = []


def expect(ok, message: str) -> None:
    if not ok:
        _failures.append(f"{traceback.extract_stack(limit=2)[0].name} rank {dist.get_rank()}: {message}")


def _synced(model, ids, **kwargs):
    return epmoe.hf.generate(model, ids, **kwargs)


class _Counted:
    """Counts a dispatcher's dispatches (an instance attribute over its method)."""

    def __init__(self, dispatcher) -> None:
        self.calls, self._inner = 0, dispatcher.dispatch_checked
        dispatcher.dispatch_checked = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._inner(*args, **kwargs)


def case_families(ctx, families, dtype, batch, options: EPOptions) -> None:
    """Each family expert-parallel against its eager self on each rank's own prompts: fp32 logits within 1e-5
    and equal greedy tokens; bf16 every MoE call within its tolerance of the eager experts (fp32 math, same
    inputs). Prefill calls go through options.dispatcher, decode calls through options.decode_dispatcher."""
    B, S = batch[ctx.rank % len(batch)], 3 + ctx.rank
    ids = hf_models.prompts(ctx.rank, B, S).to(ctx.device)
    for family in families:
        model = hf_models.tiny_model(family, dtype=dtype).to(ctx.device)
        exact = dtype == torch.float32
        ref = hf_models.greedy(model, ids, NEW) if B and exact else None
        full = None if exact else dict(copy.deepcopy(model).float().named_modules())  # same weights, fp32 math
        epmoe.hf.expert_parallel(model, ctx.group, options=options)
        layers = experts_modules(model)
        L = 12 // ctx.world_size
        expect(all(m.gate_up_proj.shape[0] == L for _, m in layers), f"{family}: not {L} local experts")
        first = layers[0][1].forward
        counts = (_Counted(first.prefill.dispatcher), _Counted(first.decode.dispatcher))
        calls = ExpertsCalls(model)  # on a rank with no prompts: the stand-in's calls, whose outputs are zeros
        tokens, logits = hf_models.greedy(model, ids, NEW, run=_synced)
        calls.close()
        if options.decode_dispatcher is not None:
            expect([c.calls for c in counts] == [len(layers), len(layers) * (NEW - 1)],
                   f"{family}: prefill/decode dispatches {[c.calls for c in counts]}")
        if ref is not None:
            err = rel_error(logits, ref[1])
            expect(err <= TOLERANCES["fp32"], f"{family}: logits rel error {err:.2e}")
            expect(torch.equal(tokens, ref[0]), f"{family}: greedy tokens differ")
        if full is not None:
            with torch.no_grad():
                errors = [rel_error(out, full[name](x.float(), i, w.float())) for name, x, i, w, out in calls.calls]
            expect(len(errors) == NEW * len(layers), f"{family}: {len(errors)} MoE calls with tokens")
            if B:
                expect(max(errors) <= TOLERANCES["bf16"], f"{family}: MoE rel error {max(errors):.2e}")
        if not B:
            expect(tokens.shape == (0, S), f"{family}: idle rank returned {tuple(tokens.shape)}")
            expect(all(not out.any() for *_, out in calls.calls), f"{family}: idle rank's MoE outputs not zero")


def _expert_weights(model, nbytes: bool = False) -> int:
    """Expert weights (gate_up_proj and down_proj of every experts module) of a model: count, or bytes."""
    return sum(p.numel() * (p.element_size() if nbytes else 1) for n, p in model.named_parameters()
               if n.endswith(("experts.gate_up_proj", "experts.down_proj")))


def _write_checkpoints(ctx, folder: str) -> None:
    if ctx.rank == 0:
        hf_models.tiny_model("qwen2_moe").save_pretrained(os.path.join(folder, "per_expert"))
        hf_models.save_fused(hf_models.tiny_model("mixtral"), os.path.join(folder, "fused"))
        hf_models.save_fp8(hf_models.tiny_model("deepseek_v3", hidden=160, inter=128), os.path.join(folder, "fp8"))
    dist.barrier()


def case_loading(ctx, folder: str) -> None:
    """epmoe.hf.from_pretrained over the group, each rank reading only its experts, from save_pretrained's
    per-expert keys, fused 3-D keys and an fp8 checkpoint, against transformers' own load of the same folder
    (fp8: dequantized) with eager experts."""
    from transformers import AutoModelForCausalLM
    _write_checkpoints(ctx, folder)
    B = 2 - ctx.rank % 2
    ids = hf_models.prompts(ctx.rank, B, 4)
    for name in ("per_expert", "fused", "fp8"):
        path = os.path.join(folder, name)
        if name == "fp8":
            reference = epmoe.hf.loading.load_dequantized(path, device="cpu")
        else:
            reference = AutoModelForCausalLM.from_pretrained(path)
        reference.set_experts_implementation("eager")
        model = epmoe.hf.from_pretrained(path, ctx.group, device="cpu",
                                         options=EPOptions(dispatcher="allgather", decode_dispatcher="alltoall"))
        experts, full = _expert_weights(model), _expert_weights(reference)
        expect(experts * ctx.world_size == full, f"{name}: {experts} expert weights of {full} on a rank")
        calls = ExpertsCalls(model)
        tokens, logits = hf_models.greedy(model, ids, NEW, run=_synced)
        calls.close()
        if name == "fp8":
            errors = calls.errors(reference)
            expect(max(errors) <= TOLERANCES["fp8_block"], f"fp8: MoE rel error {max(errors):.2e}")
        else:
            ref_tokens, ref_logits = hf_models.greedy(reference, ids, NEW)
            expect(rel_error(logits, ref_logits) <= TOLERANCES["fp32"] and torch.equal(tokens, ref_tokens),
                   f"{name}: logits rel error {rel_error(logits, ref_logits):.2e}")


def _memory_mb() -> dict[str, float]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def case_memory(ctx, folder: str) -> None:
    """A rank's memory holds its E/R experts, never all E: the growth of its peak resident memory while
    from_pretrained loads (the peak reset first) stays under 3/4 of all the experts' bytes at R = 2, and its
    expert weights are exactly E/R experts'."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = os.path.join(folder, "big")
    if ctx.rank == 0:
        hf_models.tiny_model("qwen3_moe", experts=8, hidden=512, inter=1024).save_pretrained(path)
    dist.barrier()
    full_mb = 2 * 8 * 3 * 512 * 1024 * 4 / 2**20  # layers x E x 3 matrices [F, D] x fp32
    with torch.device("meta"):  # the model's code imported before the measurement
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _memory_mb()
    model = epmoe.hf.from_pretrained(path, ctx.group, device="cpu", options=EPOptions(dispatcher="alltoall"))
    grown = _memory_mb()["VmHWM"] - before["VmRSS"]
    experts_mb = _expert_weights(model, nbytes=True) / 2**20
    expect(experts_mb * ctx.world_size == full_mb, f"{experts_mb} MB of experts on a rank, of {full_mb} MB")
    expect(grown < 0.75 * full_mb, f"peak resident memory grew {grown:.0f} MB loading, all experts are {full_mb} MB")


def case_ep_implementation(ctx, folder: str) -> None:
    """transformers' own expert parallelism with ep_implementation="epmoe": EP 2 x TP 2 (the TP group shares a
    batch: each rank dispatches its slice) and EP 2 x FSDP 2 (each rank its own batch), logits against the
    unmodified model on each rank."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from epmoe.hf.ep_interface import EpmoeEP
    path = os.path.join(folder, "per_expert")
    if ctx.rank == 0 and not os.path.isdir(path):
        hf_models.tiny_model("qwen2_moe").save_pretrained(path)
    dist.barrier()
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    reference.set_experts_implementation("eager")
    for layout in (dict(tp_size=2), dict(fsdp_size=2)):
        config = DistributedConfig(ep_size=2, ep_implementation="epmoe", **layout)
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config).eval()
        batch_rank = ctx.rank // config.tp_size
        ids = hf_models.prompts(batch_rank, 3 - batch_rank, 5)
        with torch.no_grad():
            err = rel_error(model(ids).logits, reference(ids).logits)
        implementations = [cell.cell_contents for _, m in experts_modules(model) for cell in m.forward.__closure__
                           if isinstance(cell.cell_contents, EpmoeEP)]
        expect(len(implementations) == 2 and all(i._bound is not None for i in implementations),
               f"{layout}: {len(implementations)} experts modules ran through epmoe")
        expect(len({id(i._shared) for i in implementations}) == 1 and len(implementations[0]._shared) == 1,
               f"{layout}: the layers do not share one dispatcher")
        expect(err <= TOLERANCES["fp32"], f"{layout}: logits rel error {err:.2e}")


def run(ctx, cases: list[tuple[str, tuple]]) -> list[str]:
    """Run the named cases of this module on this rank; the failures as text."""
    _failures.clear()
    for name, args in cases:
        try:
            globals()[name](ctx, *args)
        except Exception:
            _failures.append(f"{name} rank {ctx.rank}: raised\n{traceback.format_exc()}")
            raise
    return list(_failures)
