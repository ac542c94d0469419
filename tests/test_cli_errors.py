"""The `epmoe` command's argument and configuration errors: exit code 2 and one line on stderr, in the
launching process, before any rank starts (argparse's usage of the subcommand, then the line, for
options it cannot parse)."""
import os
import subprocess
import sys

import pytest
import torch

from epmoe import cli, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if torch.cuda.is_available():
    _CUDA_ERROR = (["demo", "--device", "cuda", "--nproc", "99"], "99 ranks on cuda need 99 GPUs")
else:
    _CUDA_ERROR = (["demo", "--device", "cuda"], "no CUDA device is visible here")


@pytest.fixture(autouse=True)
def _no_rank_starts(monkeypatch):
    """Every test here fails if a rank is started, or if it runs as a rank of a torchrun launch."""
    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launch, "spawn", refuse)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _exit_code(argv) -> int:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code


@pytest.mark.parametrize("argv, words", [
    (["demo", "--device", "cpu", "-K", "99"], "MoEConfig.top_k=99 exceeds num_experts=16"),
    (["demo", "--device", "cpu", "-E", "15"],
     "num_experts=15 is not divisible by the world size 2 (the layer: -E 15 -K 4 --groups None"),
    (["demo", "--device", "cpu", "-E", "15", "--groups", "4", "--topk-groups", "2"],
     "MoEConfig.num_groups=4 must divide num_experts=15 (the layer: -E 15 -K 4 --groups 4"),
    (["demo", "--device", "cpu", "--nproc", "3"], "num_experts=16 is not divisible by the world size 3"),
    (["demo", "--device", "cpu", "-E", "6", "--groups", "3", "--topk-groups", "1", "-K", "2", "--nproc", "4"],
     "num_experts=6 is not divisible by the world size 4"),
    (["demo", "--device", "cpu", "--scaling", "0"], "MoEConfig.routed_scaling_factor must be a finite number > 0"),
    (["demo", "--device", "cpu", "--scaling", "nan"], "MoEConfig.routed_scaling_factor must be a finite number > 0"),
    _CUDA_ERROR,
    (["check", "--cases", "one_expert,nope"], "unknown case(s) ['nope']"),
    (["check", "--device", "cpu", "--nproc", "5"],
     "no case can run on 5 ranks: the cases' expert counts [8, 16] do not divide over them (--nproc 1, 2, 4, 8 runs"),
    (["check", "--device", "cpu", "--nproc", "16", "--cases", "one_expert"],
     "no case can run on 16 ranks: the cases' expert counts [8] do not divide over them (--nproc 1, 2, 4, 8 runs"),
    (["bench", "layer", "--device", "cpu", "--experts", "nope"], "unknown experts 'nope'"),
    (["bench", "layer", "--device", "cpu", "-K", "17"], "MoEConfig.top_k=17 exceeds num_experts=16"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_config_errors_are_one_line(argv, words, capsys):
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("epmoe ") and ": error: " in err and words in err, err


@pytest.mark.parametrize("argv, words", [
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["check", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["demo", "--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
    (["demo", "-T", "-1"], "argument --tokens/-T: must be >= 0, got -1"),
    (["demo", "-K", "two"], "argument --topk/-K: not an integer: 'two'"),
    (["bench", "layer", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_option_errors_show_the_subcommands_usage(argv, words, capsys):
    assert _exit_code(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    command = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    assert lines[0].startswith(f"usage: epmoe {command} ") and lines[-1] == f"epmoe {command}: error: {words}"


def test_a_config_error_from_the_shell_has_no_traceback():
    """`epmoe demo -K 99` as a newcomer types it (on CPU): one line, exit code 2, no traceback, nothing started."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "epmoe.cli", "demo", "--device", "cpu", "-K", "99"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["epmoe demo: error: MoEConfig.top_k=99 exceeds num_experts=16 (the layer: -E 16 "
                                     "-K 99 --groups None --topk-groups None --scaling 2.5, on 2 ranks)"]
