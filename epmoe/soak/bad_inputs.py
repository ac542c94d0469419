"""Bad inputs at every public entry point, and the error each one gave: the table `epmoe soak` prints.

A row passes when the entry point raised ValueError with a message that names the bad value (every word of
`names` in it); for the command line, when it stopped with a usage error (exit code 2) or a message that
names the value, before starting any rank (`launch.spawn` and `launch.from_torchrun` are replaced by a
stand-in that raises while the command runs). Inputs on the host are refused before any communication:
the multi-rank tests check that (tests/moe_cases.py, case_bad_input: the same dispatcher works afterwards).

Shape letters: T tokens, D hidden size, K top-k, E experts, F intermediate size.
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from .. import cli, launch
from ..config import MoEConfig
from ..layer import FusedMoE
from ..registry import make_dispatcher
from ..routing import route
from ..symm import EmulatedGroup

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32,
                max_tokens_per_rank=8)


@dataclass(frozen=True)
class Case:
    entry: str
    tried: str
    call: Callable[[], object]
    names: tuple[str, ...]  # words the message must hold


@dataclass(frozen=True)
class Row:
    entry: str
    tried: str
    error: str  # type and message (first line), or what happened instead
    ok: bool


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8)
    return MoEConfig(**{**base, **kw})


def _inputs(T: int = 3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, 16, generator=g)
    ids = torch.rand(T, 8, generator=g).argsort(dim=1)[:, :2].to(torch.int32)
    return x, ids, torch.rand(T, 2, generator=g)


def _layer(**kw) -> FusedMoE:
    moe = FusedMoE(CFG, None, dispatcher="local", experts="reference", device="cpu", **kw)
    moe.load_experts(torch.randn(8, 16, 16), torch.randn(8, 16, 8))
    return moe


def _combine_with(y_change: Callable[[torch.Tensor], torch.Tensor]):
    d = make_dispatcher("local", CFG)
    batch = d.dispatch(*_inputs())
    return d.combine(y_change(torch.zeros(batch.out_shape)), batch)


def _ll(cfg: MoEConfig = CFG, **options):
    return make_dispatcher("ll", cfg, EmulatedGroup.world(2)[0], device="cpu", **options)


def api_cases() -> list[Case]:
    x, ids, w = _inputs()
    logits = torch.randn(3, 8)
    d = make_dispatcher("local", CFG)
    moe = _layer()
    fp8_w13 = torch.zeros(8, 16, 16, dtype=torch.float8_e4m3fn)
    return [
        Case("MoEConfig", "num_experts=0", lambda: _cfg(num_experts=0), ("num_experts", "0")),
        Case("MoEConfig", "top_k=9 > num_experts=8", lambda: _cfg(top_k=9), ("top_k=9",)),
        Case("MoEConfig", "hidden_size=-4", lambda: _cfg(hidden_size=-4), ("hidden_size", "-4")),
        Case("MoEConfig", "hidden_size=16.0 (a float)", lambda: _cfg(hidden_size=16.0), ("hidden_size", "16.0")),
        Case("MoEConfig", "intermediate_size=True", lambda: _cfg(intermediate_size=True),
             ("intermediate_size", "True")),
        Case("MoEConfig", "max_tokens_per_rank=0", lambda: _cfg(max_tokens_per_rank=0), ("max_tokens_per_rank", "0")),
        Case("MoEConfig", "dtype=torch.int32", lambda: _cfg(dtype=torch.int32), ("dtype", "int32")),
        Case("MoEConfig", "quant='int4'", lambda: _cfg(quant="int4"), ("int4",)),
        Case("MoEConfig", "scoring='relu'", lambda: _cfg(scoring="relu"), ("relu",)),
        Case("MoEConfig", "num_groups=4 without topk_groups", lambda: _cfg(num_groups=4),
             ("num_groups", "topk_groups")),
        Case("MoEConfig", "num_groups=3 (E=8)", lambda: _cfg(num_groups=3, topk_groups=1), ("num_groups=3",)),
        Case("MoEConfig", "topk_groups=5 > num_groups=4", lambda: _cfg(num_groups=4, topk_groups=5),
             ("topk_groups=5",)),
        Case("MoEConfig", "routed_scaling_factor=0", lambda: _cfg(routed_scaling_factor=0.0),
             ("routed_scaling_factor", "0")),
        Case("MoEConfig", "routed_scaling_factor=nan", lambda: _cfg(routed_scaling_factor=float("nan")),
             ("routed_scaling_factor", "nan")),
        Case("MoEConfig", "routed_scaling_factor='2'", lambda: _cfg(routed_scaling_factor="2"),
             ("routed_scaling_factor", "'2'")),
        Case("MoEConfig", "num_groups=2.0 (a float)", lambda: _cfg(num_groups=2.0, topk_groups=1),
             ("num_groups", "2.0")),
        Case("MoEConfig", "renormalize='no'", lambda: _cfg(renormalize="no"), ("renormalize", "'no'")),
        Case("route", "logits_TE [3, 7] for E=8", lambda: route(torch.randn(3, 7), CFG), ("E=8", "(3, 7)")),
        Case("route", "logits_TE int64", lambda: route(torch.zeros(3, 8, dtype=torch.int64), CFG), ("int64",)),
        Case("route", "logits_TE 1-D [8]", lambda: route(torch.randn(8), CFG), ("(8,)",)),
        Case("route", "correction_bias_E [4]", lambda: route(logits, CFG, scoring="sigmoid",
                                                             correction_bias_E=torch.zeros(4)), ("(4,)",)),
        Case("route", "correction_bias_E with softmax", lambda: route(logits, CFG, correction_bias_E=torch.zeros(8)),
             ("sigmoid",)),
        Case("route", "correction_bias_E on meta", lambda: route(logits, CFG, scoring="sigmoid",
                                                                correction_bias_E=torch.zeros(8, device="meta")),
             ("meta",)),
        Case("route", "scoring='relu'", lambda: route(logits, CFG, scoring="relu"), ("relu",)),
        Case("route", "num_groups=3 (E=8)", lambda: route(logits, CFG, num_groups=3, topk_groups=1), ("num_groups=3",)),
        Case("make_dispatcher", "name 'nope'", lambda: make_dispatcher("nope", CFG), ("nope",)),
        Case("make_dispatcher", "'alltoall' without a process group", lambda: make_dispatcher("alltoall", CFG),
             ("alltoall", "process group")),
        Case("make_dispatcher", "'local' with option foo=1", lambda: make_dispatcher("local", CFG, foo=1), ("foo",)),
        Case("make_dispatcher", "'ll' over 3 ranks, E=8", lambda: make_dispatcher("ll", CFG, EmulatedGroup.world(3)[0]),
             ("num_experts=8", "3")),
        Case("make_dispatcher", "'ht' with D=12 bf16 (24-byte rows)",
             lambda: make_dispatcher("ht", _cfg(hidden_size=12), EmulatedGroup.world(2)[0]), ("hidden_size=12", "16")),
        Case("make_dispatcher", "'ll' combine='dest'", lambda: _ll(combine="dest"), ("dest",)),
        Case("make_dispatcher", "'ll' wait_timeout_s=0", lambda: _ll(wait_timeout_s=0), ("wait_timeout_s", "0")),
        Case("dispatch", "x_TD [3, 15] for D=16", lambda: d.dispatch(x[:, :15], ids, w), ("D=16", "(3, 15)")),
        Case("dispatch", "x_TD bfloat16, cfg float32", lambda: d.dispatch(x.bfloat16(), ids, w), ("bfloat16",)),
        Case("dispatch", "x_TD 1-D [16]", lambda: d.dispatch(x[0], ids, w), ("(16,)",)),
        Case("dispatch", "ids_TK [2, 2] for T=3", lambda: d.dispatch(x, ids[:2], w), ("T=3", "(2, 2)")),
        Case("dispatch", "ids_TK [3, 1] for K=2", lambda: d.dispatch(x, ids[:, :1], w), ("K=2", "(3, 1)")),
        Case("dispatch", "ids_TK float32", lambda: d.dispatch(x, ids.float(), w), ("float32",)),
        Case("dispatch", "weights_TK int64", lambda: d.dispatch(x, ids, w.long()), ("int64",)),
        Case("dispatch", "an id 8 (E=8)", lambda: d.dispatch(x, ids.masked_fill(ids == ids[0, 0], 8), w),
             ("expert id 8",)),
        Case("dispatch", "an id -2", lambda: d.dispatch(x, ids.masked_fill(ids == ids[0, 0], -2), w), ("-2",)),
        Case("dispatch", "ids_TK on meta", lambda: d.dispatch(x, ids.to("meta"), w), ("meta",)),
        Case("dispatch", "'ll': T=9 > max_tokens_per_rank=8", lambda: _ll().dispatch_send(*_inputs(9)),
             ("max_tokens_per_rank=8", "9")),
        Case("combine", "y one row short", lambda: _combine_with(lambda y: y[1:]), ("(5, 16)", "(6, 16)")),
        Case("combine", "y bfloat16, cfg float32", lambda: _combine_with(lambda y: y.bfloat16()), ("bfloat16",)),
        Case("combine", "'ll' given a 'local' batch",
             lambda: _ll().combine_send(torch.zeros(6, 16), d.dispatch(x, ids, w)), ("'ll'",)),
        Case("FusedMoE", "dispatcher 'nope'", lambda: FusedMoE(CFG, dispatcher="nope", device="cpu"), ("nope",)),
        Case("FusedMoE", "experts 'nope'", lambda: FusedMoE(CFG, experts="nope", device="cpu"), ("nope",)),
        Case("FusedMoE", "experts 'grouped_mm' for float32",
             lambda: FusedMoE(CFG, experts="grouped_mm", device="cpu"), ("grouped_mm", "float32")),
        Case("FusedMoE", "a dispatcher built for top_k=1",
             lambda: FusedMoE(CFG, dispatcher=make_dispatcher("local", _cfg(top_k=1)), device="cpu"),
             ("another config",)),
        Case("FusedMoE", "forward before load_experts",
             lambda: FusedMoE(CFG, device="cpu")(x, logits), ("load",)),
        Case("FusedMoE.load_experts", "w13 [8, 16, 15]", lambda: moe.load_experts(torch.zeros(8, 16, 15),
                                                                                torch.zeros(8, 16, 8)),
             ("w13", "(8, 16, 15)")),
        Case("FusedMoE.load_experts", "fp8 weights into an unquantized layer",
             lambda: moe.load_experts(fp8_w13, torch.zeros(8, 16, 8, dtype=torch.float8_e4m3fn),
                                      w13_scale=torch.ones(8, 1, 1), w2_scale=torch.ones(8, 1, 1)), ("fp8_block",)),
        Case("FusedMoE.forward", "x_TD [3, 15]", lambda: moe(x[:, :15], logits), ("D=16", "(3, 15)")),
        Case("FusedMoE.forward", "logits_TE and ids_TK both", lambda: moe(x, logits, weights_TK=w, ids_TK=ids),
             ("not both",)),
        Case("FusedMoE.forward", "weights_TK without ids_TK", lambda: moe(x, weights_TK=w), ("ids_TK",)),
        Case("FusedMoE.forward", "logits_TE of 2 rows, x_TD of 3", lambda: moe(x, logits[:2]), ("(3,)", "(2, 8)")),
        Case("FusedMoE.forward", "x_TD on meta", lambda: moe(x.to("meta"), logits), ("meta",)),
        Case("FusedMoE.forward", "caller's id 8 (E=8)", lambda: moe(x, weights_TK=w, ids_TK=ids.clamp(max=7) + 1),
             ("expert id 8",)),
        Case("FusedMoE.forward", "correction_bias_E with caller's ids",
             lambda: moe(x, weights_TK=w, ids_TK=ids, correction_bias_E=torch.zeros(8)), ("correction_bias_E",)),
    ] + hf_cases()


def hf_cases() -> list[Case]:
    """The Hugging Face entry points that read a config or a state dict without transformers."""
    from ..hf import config_from_hf, expert_weights
    prefix = "model.layers.0.mlp.experts."
    partial = {f"{prefix}{e}.{n}.weight": torch.zeros(8, 16) for e in range(2) for n in ("gate_proj", "up_proj")}
    dense = SimpleNamespace(hidden_size=16, intermediate_size=8)
    deepseek = SimpleNamespace(model_type="deepseek_v3", n_routed_experts=8, num_experts_per_tok=2, hidden_size=16,
                               moe_intermediate_size=8, n_group=3, topk_group=1)
    return [
        Case("hf.config_from_hf", "a dense model's config (no experts)", lambda: config_from_hf(dense),
             ("num_experts_per_tok",)),
        Case("hf.config_from_hf", "n_group=3 for 8 experts", lambda: config_from_hf(deepseek), ("num_groups=3",)),
        Case("hf.expert_weights", "no expert under the prefix", lambda: expert_weights({}, prefix, 8), (prefix,)),
        Case("hf.expert_weights", "expert 0's down_proj missing", lambda: expert_weights(partial, prefix, 2),
             ("0.down_proj",)),
    ]


CLI_CASES = [  # (arguments, words)
    (["demo", "--nproc", "0"], ("nproc", "0")),
    (["demo", "-E", "0"], ("0",)),
    (["demo", "-K", "9", "-E", "8"], ("top_k=9",)),
    (["demo", "--dtype", "fp64"], ("fp64",)),
    (["demo", "--quant", "int4"], ("int4",)),
    (["check", "--cases", "nope"], ("nope",)),
    (["check", "--nproc", "-1"], ("nproc", "-1")),
    (["bench", "nope"], ("nope",)),
    (["soak", "--calls", "0"], ("calls", "0")),
    (["soak", "--parts", "nope"], ("nope",)),
]


class _RanksWouldStart(Exception):
    pass


def _no_ranks(*args, **kwargs):
    raise _RanksWouldStart()


def run_cli(argv: list[str], names: tuple[str, ...]) -> Row:
    """One command line, with rank start-up replaced by a stand-in that raises."""
    tried = "epmoe " + " ".join(argv)
    saved = launch.spawn, launch.from_torchrun
    launch.spawn, launch.from_torchrun = _no_ranks, _no_ranks
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
        message, refused = err.getvalue().strip(), code not in (0, None)
    except _RanksWouldStart:
        return Row("CLI", tried, "no error before the ranks started", False)
    except SystemExit as e:  # argparse's usage error (2), or a message
        message = str(e.code) if not isinstance(e.code, int) else err.getvalue().strip()
        refused = e.code != 0
    except Exception as e:  # an entry point's error, reported as the row's result
        message, refused = f"{type(e).__name__}: {e}", isinstance(e, ValueError)
    finally:
        launch.spawn, launch.from_torchrun = saved
    last = message.splitlines()[-1] if message else "(no message)"
    return Row("CLI", tried, last[:200], refused and all(n in message for n in names))


def run_case(case: Case) -> Row:
    try:
        case.call()
    except ValueError as e:
        message = str(e)
        return Row(case.entry, case.tried, f"ValueError: {message.splitlines()[0][:200]}",
                   all(n in message for n in case.names))
    except Exception as e:  # not a ValueError: the row fails, with what was raised
        return Row(case.entry, case.tried, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                   False)
    return Row(case.entry, case.tried, "accepted (no error)", False)


def bad_input_rows(with_cli: bool = True) -> list[Row]:
    rows = [run_case(c) for c in api_cases()]
    if with_cli:
        rows += [run_cli(argv, names) for argv, names in CLI_CASES]
    return rows
