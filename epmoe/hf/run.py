"""`epmoe generate`: a checkpoint folder or a preset through epmoe, greedy decoding, tokens/s, `--check`.

One rank: the model runs with `experts_implementation="epmoe"` (a folder is read by `epmoe.hf.from_pretrained`).
R ranks (torchrun, or `--nproc R`): expert parallelism with data-parallel attention over the ranks; rank r
decodes its own prompts (`--batch` prompts per rank, a list gives each rank its own count, 0 allowed); a
folder is read by the slice, a preset is built whole on every rank and made expert-parallel.

`--check`: every rank also runs its prompts through the unmodified transformers model on its own device
(its eager experts; for fp8 experts, the same weights dequantized) and compares (`compare`): each MoE
layer's output against the eager experts on the same inputs (relative L2 error within `TOLERANCES`), the
logits of the generated positions up to the first differing token, and the greedy tokens (in fp32 both
required to agree). `--bench`: see `epmoe.hf.bench`.

Shape letters: B prompts of this rank, S prompt length, N new tokens, T = S + N, V vocabulary, D hidden size,
K top-k.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoConfig

from ..cli import DTYPES
from ..config import FP8_BLOCK
from ..launch import RankContext
from ..testing import TOLERANCES as TESTING_TOLERANCES
from ..testing import rel_error
from ..timing import sync
from .checkpoint import moe_sizes
from .fp8 import dequantize_experts, quantize_experts
from .loading import fp8_checkpoint, from_pretrained, load_dequantized
from .parallel import EPOptions, expert_parallel, experts_modules, generate
from .presets import build, preset_config

# Relative L2 error allowed against transformers' eager experts on the same inputs. fp8_block: epmoe
# quantizes the activations (x, and h between the GEMMs, per token per 128 columns; e4m3's rounding has an
# RMS of 2^-4/sqrt(3) ~ 3.6% each time) and the dequantized reference does not: ~5% apart, 1e-1 allowed.
# The other precisions as epmoe.testing.TOLERANCES.
TOLERANCES = {**TESTING_TOLERANCES, "fp8_block": 1e-1}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What `epmoe generate` runs (the same on every rank)."""

    model: str | None = None  # a checkpoint folder, or
    presets: tuple[str, ...] = ()  # preset names (`--bench` takes several)
    layers: int | None = None
    dtype: str = "bf16"
    quants: tuple[str, ...] = ("none",)  # "none" and/or "fp8" (experts quantized per 128x128 block)
    batch: tuple[int, ...] = (2,)  # prompts of rank r: batch[r % len(batch)]
    prompt_len: int = 16
    new_tokens: int = 16
    seed: int = 0
    options: EPOptions = field(default_factory=EPOptions)
    check: bool = False
    bench: bool = False
    bench_prefill: int = 4096
    bench_decode: int = 256
    repeats: int = 5
    warmup: int = 2
    out: str | None = None

    def source(self) -> str:
        return self.model if self.model is not None else self.presets[0]


def spec_from_args(args: argparse.Namespace, world_size: int) -> RunSpec:
    """The RunSpec of parsed arguments for a launch of `world_size` ranks; ValueError for bad values (before
    any rank starts), the models' expert counts and sizes included."""
    presets = tuple(args.preset.split(",")) if args.preset else ()
    configs = {name: preset_config(name, args.layers) for name in presets}  # (unknown names, bad layer counts)
    if len(presets) > 1 and not args.bench:
        raise ValueError("several presets are for --bench; generate runs one")
    if args.model is not None and args.quant is not None and not args.bench:
        raise ValueError("--model runs the checkpoint's own precision (fp8 checkpoints: fp8 experts); --quant is "
                         "for presets and --bench")
    quants = tuple((args.quant or ("none,fp8" if args.bench else "none")).split(","))
    if set(quants) - {"none", "fp8"} or (len(quants) > 1 and not args.bench):
        raise ValueError(f"--quant takes none or fp8 (--bench: also none,fp8), got {args.quant!r}")
    try:
        batch = tuple(int(b) for b in args.batch.split(","))
    except ValueError:
        batch = ()
    if not batch or min(batch) < 0 or max(batch) < 1:
        raise ValueError(f"--batch needs counts >= 0, one of them > 0, got {args.batch!r}")
    if args.model is not None and not os.path.isdir(args.model):
        raise ValueError(f"--model {args.model!r} is not a folder")
    if args.model is not None:
        configs[args.model] = AutoConfig.from_pretrained(args.model)
    if args.model is not None and args.bench and fp8_checkpoint(configs[args.model]):
        raise ValueError("--bench runs presets and unquantized checkpoints (transformers' own fp8 experts need its "
                         "hub kernels); --quant fp8 quantizes their experts")
    for source, config in configs.items():
        E, _, _, F = moe_sizes(config)
        if E % world_size:
            raise ValueError(f"{source}: its {E} experts do not divide over {world_size} ranks (--nproc)")
        if "fp8" in quants and not fp8_checkpoint(config) and F % FP8_BLOCK:
            raise ValueError(f"{source}: fp8 experts need an intermediate size divisible by {FP8_BLOCK}, it has "
                             f"F={F}: give --quant none")
    options = EPOptions(dispatcher=args.dispatcher, decode_dispatcher=args.decode_dispatcher, experts=args.experts,
                        max_tokens_per_rank=args.max_tokens, decode_max_tokens_per_rank=args.decode_max_tokens)
    return RunSpec(model=args.model, presets=presets, layers=args.layers, dtype=args.dtype, quants=quants,
                   batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=args.seed,
                   options=options, check=args.check, bench=args.bench, bench_prefill=args.bench_prefill,
                   bench_decode=args.bench_decode, repeats=args.repeats, warmup=args.warmup, out=args.out)


def preset_model(name: str, spec: RunSpec, quant: str, device: torch.device) -> torch.nn.Module:
    """Preset `name` with its random weights (the same on every rank); fp8: its experts quantized."""
    model = build(preset_config(name, spec.layers), dtype=DTYPES[spec.dtype], device=device, seed=spec.seed)
    return quantize_experts(model) if quant == "fp8" else model


def reference_model(spec: RunSpec, quant: str, device: torch.device,
                    model: torch.nn.Module | None = None) -> torch.nn.Module:
    """The unmodified transformers model of the run, all experts on this device, eager experts; fp8 experts
    dequantized (transformers' own fp8 kernels are not needed). For a preset, `model` is the run's model
    (built, not yet made expert-parallel)."""
    if spec.model is not None:
        from transformers import AutoModelForCausalLM
        ref = load_dequantized(spec.model, DTYPES[spec.dtype], device) if quant == "fp8" else \
            AutoModelForCausalLM.from_pretrained(spec.model, dtype=DTYPES[spec.dtype]).to(device).eval()
    elif quant == "fp8":
        ref = dequantize_experts(model, build(preset_config(spec.presets[0], spec.layers), dtype=DTYPES[spec.dtype],
                                               device=device, seed=spec.seed))
    else:
        ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    return ref


def _prompts(spec: RunSpec, rank: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s prompts: int [B, S] random token ids from the seed."""
    g = torch.Generator().manual_seed(spec.seed * 1009 + rank)
    B = spec.batch[rank % len(spec.batch)]
    return torch.randint(vocab, (B, spec.prompt_len), generator=g).to(device)


class StepTimes:
    """Wall time of each forward of a model (the device synchronized around it)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device, self.steps, self._t0 = device, [], 0.0
        base = getattr(model, "base_model", model)
        self._handles = [base.register_forward_pre_hook(self._start), base.register_forward_hook(self._stop)]

    def _start(self, module, args) -> None:
        sync(self.device)
        self._t0 = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        sync(self.device)
        self.steps.append(time.perf_counter() - self._t0)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class ExpertsCalls:
    """Every experts call of a model with tokens: (module name, hidden [T, D], ids [T, K], weights [T, K],
    output [T, D]), copies recorded by forward hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = []
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in experts_modules(model)]

    def _hook(self, name: str):
        def hook(module, args, output) -> None:
            if args[0].shape[0]:
                self.calls.append((name, *(t.detach().clone() for t in (*args[:3], output))))
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def errors(self, reference: torch.nn.Module) -> list[float]:
        """Each call's output against the reference model's experts module on the same inputs (rel. L2 error)."""
        modules = dict(reference.named_modules())
        with torch.no_grad():
            return [rel_error(out, modules[name](x, ids, w)) for name, x, ids, w, out in self.calls]


def _greedy(model: torch.nn.Module, prompts_BS: torch.Tensor, spec: RunSpec, synced: bool):
    """Greedy decoding of exactly spec.new_tokens tokens: (tokens int [B, S + N], logits float [N, B, V])."""
    kwargs = dict(max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens, do_sample=False,
                  output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    mask = torch.ones_like(prompts_BS)
    with torch.no_grad():
        out = generate(model, prompts_BS, mask, **kwargs) if synced else model.generate(prompts_BS, attention_mask=mask,
                                                                                         **kwargs)
    if not prompts_BS.shape[0]:
        return prompts_BS, None
    return out.sequences, torch.stack(out.logits).float()


def compare(tokens_BT: torch.Tensor, logits_NBV: torch.Tensor, ref_tokens_BT: torch.Tensor, ref_logits_NBV: torch.Tensor,
            layer_errors: list[float], precision: str) -> dict:
    """The check of one rank's run against the reference.

    Each MoE layer's output on the inputs it was given must be within the precision's tolerance of transformers'
    eager experts on the same inputs; in fp32 the whole model's logits too (over the generated positions up to
    the first token that differs) and the greedy tokens must agree. In lower precisions the whole-model numbers
    are reported only: a near tie in a router flips an expert for one token and moves its logits far.
    """
    tol = TOLERANCES[precision]
    same_NB = tokens_BT[:, -logits_NBV.shape[0]:].t() == ref_tokens_BT[:, -logits_NBV.shape[0]:].t()
    agree_N = same_NB.all(dim=1)
    upto = logits_NBV.shape[0] if bool(agree_N.all()) else int(agree_N.long().cumprod(0).sum()) + 1
    logits_err = rel_error(logits_NBV[:upto], ref_logits_NBV[:upto])
    layers_err = max(layer_errors, default=0.0)
    agree = bool(torch.equal(tokens_BT, ref_tokens_BT))
    ok = layers_err <= tol and (precision != "fp32" or (agree and logits_err <= tol))
    return dict(moe_layers_rel_error=layers_err, moe_calls=len(layer_errors), logits_rel_error=logits_err,
                positions_compared=upto, tokens_agree=agree, tolerance=tol, ok=ok)


def generate_rank(ctx: RankContext, spec: RunSpec) -> int:
    """`epmoe generate` on one rank (group None or world 1: one device); returns the exit code."""
    if spec.bench:
        from .bench import bench_rank
        return bench_rank(ctx, spec)
    device, world = ctx.device, ctx.world_size
    group = ctx.group if world > 1 else None
    if spec.model is not None:
        quant = "fp8" if fp8_checkpoint(AutoConfig.from_pretrained(spec.model)) else "none"
        ref = reference_model(spec, quant, device) if spec.check else None
        model = from_pretrained(spec.model, group, dtype=DTYPES[spec.dtype], device=device, options=spec.options)
    else:
        quant = spec.quants[0]
        model = preset_model(spec.presets[0], spec, quant, device)
        ref = reference_model(spec, quant, device, model) if spec.check else None
        if group is None:
            model.set_experts_implementation("epmoe")
        else:
            expert_parallel(model, group, options=spec.options)
    prompts = _prompts(spec, ctx.rank, model.config.get_text_config().vocab_size, device)
    reference = _greedy(ref, prompts, spec, synced=False) if ref is not None and prompts.shape[0] else None
    timer, calls = StepTimes(model, device), ExpertsCalls(model) if reference is not None else None
    tokens, logits = _greedy(model, prompts, spec, synced=group is not None)
    timer.close()
    B, S = prompts.shape
    steps = timer.steps
    result = dict(rank=ctx.rank, world_size=world, source=spec.source(), quant=quant, dtype=spec.dtype, prompts=B,
                  prompt_len=S, new_tokens=spec.new_tokens, forwards=len(steps), prefill_ms=steps[0] * 1e3,
                  decode_ms_per_step=sum(steps[1:]) * 1e3 / max(1, len(steps) - 1))
    if B:
        result.update(prefill_tokens_per_s=B * S / steps[0],
                      decode_tokens_per_s=B * (len(steps) - 1) / max(sum(steps[1:]), 1e-9))
        line = (f"rank {ctx.rank}/{world}: {B} prompts x {S} tokens, {spec.new_tokens} new: prefill "
                f"{result['prefill_tokens_per_s']:.0f} tok/s ({result['prefill_ms']:.1f} ms), decode "
                f"{result['decode_tokens_per_s']:.0f} tok/s ({result['decode_ms_per_step']:.2f} ms/step)")
    else:
        line = f"rank {ctx.rank}/{world}: no prompts; took part in {len(steps)} forwards"
    if reference is not None:
        calls.close()
        precision = "fp8_block" if quant == "fp8" else spec.dtype
        c = result["check"] = compare(tokens, logits, *reference, calls.errors(ref), precision)
        line += (f"\nrank {ctx.rank}/{world}: check against transformers (eager experts, one device): MoE layers "
                 f"rel error {c['moe_layers_rel_error']:.2e} (max of {c['moe_calls']} calls, tolerance "
                 f"{c['tolerance']:.0e}); logits {c['logits_rel_error']:.2e} over {c['positions_compared']} positions; "
                 f"greedy tokens {'agree' if c['tokens_agree'] else 'differ'}: {'PASS' if c['ok'] else 'FAIL'}")
    print(line, flush=True)
    if spec.out:
        os.makedirs(spec.out, exist_ok=True)
        with open(os.path.join(spec.out, f"generate_rank{ctx.rank}.json"), "w") as f:
            json.dump(dict(spec=asdict(spec), result=result), f, indent=1, default=str)
    return 0 if result.get("check", {}).get("ok", True) else 1
