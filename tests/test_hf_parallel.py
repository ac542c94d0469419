"""epmoe.hf over 2-4 gloo ranks: every family expert-parallel with data-parallel attention (ranks with
different batch sizes and prompt lengths, a rank with none), prefill and decode through different
dispatchers, checkpoints read by the slice (and the memory that takes), transformers' own expert
parallelism with ep_implementation="epmoe", and `epmoe generate`."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="epmoe.hf needs transformers (pip install 'epmoe[hf]')")

from epmoe.launch import spawn  # noqa: E402

import hf_cases  # noqa: E402
from epmoe.hf.parallel import EPOptions  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPAWN_TIMEOUT_S = 400
SWITCH = EPOptions(dispatcher="alltoall", decode_dispatcher="allgather", experts="reference")


def _report(results: list[list[str]]) -> None:
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures)


def test_two_ranks(tmp_path):
    """Every family in fp32 (2 and 1 prompts), loading by the slice in three formats, the loader's memory."""
    cases = [("case_families", (hf_cases.hf_models.FAMILIES, torch.float32, (2, 1), SWITCH)),
             ("case_loading", (str(tmp_path),)), ("case_memory", (str(tmp_path),))]
    _report(spawn(hf_cases.run, 2, "cpu", (cases,), timeout_s=SPAWN_TIMEOUT_S))


def test_three_ranks_with_an_idle_one():
    """2, 1 and 0 prompts: bf16 Qwen3-MoE per MoE call, fp32 DeepSeek-V3 end to end."""
    cases = [("case_families", (("qwen3_moe",), torch.bfloat16, (2, 1, 0), SWITCH)),
             ("case_families", (("deepseek_v3",), torch.float32, (2, 1, 0), SWITCH))]
    _report(spawn(hf_cases.run, 3, "cpu", (cases,), timeout_s=SPAWN_TIMEOUT_S))


def test_four_ranks():
    """1, 0, 3 and 2 prompts, allgather for prefill and alltoall for decode."""
    options = EPOptions(dispatcher="allgather", decode_dispatcher="alltoall")
    cases = [("case_families", (("mixtral", "deepseek_v2"), torch.float32, (1, 0, 3, 2), options))]
    _report(spawn(hf_cases.run, 4, "cpu", (cases,), timeout_s=SPAWN_TIMEOUT_S))


def test_transformers_ep_implementation(tmp_path):
    """DistributedConfig(ep_size=2, ep_implementation="epmoe"), with TP 2 and with FSDP 2."""
    try:
        from transformers.distributed.expert_parallel import EPImplementationInterface  # noqa: F401
    except ImportError:
        pytest.skip("this transformers has no EPImplementationInterface (before 5.24)")
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' distributed loading needs accelerate")
    _report(spawn(hf_cases.run, 2, "cpu", ([("case_ep_implementation", (str(tmp_path),))],),
                  timeout_s=SPAWN_TIMEOUT_S))


def test_generate_command(tmp_path, capsys):
    """`epmoe generate --check` on 2 spawned ranks (3 prompts and none), `--bench` on one (bf16 and fp8 rows,
    JSON), and an unknown preset refused before anything runs."""
    import hf_models
    from epmoe import cli
    folder = tmp_path / "model"
    hf_models.tiny_model("qwen3_moe", hidden=160, inter=128).save_pretrained(folder)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "epmoe.cli", "generate", "--device", "cpu", "--model", str(folder),
                        "--dtype", "fp32", "--nproc", "2", "--batch", "3,0", "--check", "--new-tokens", "4",
                        "--dispatcher", "alltoall", "--decode-dispatcher", "allgather", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=SPAWN_TIMEOUT_S, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 1/2: no prompts; took part in 4 forwards" in r.stdout and "greedy tokens agree: PASS" in r.stdout
    result = json.loads((tmp_path / "out" / "generate_rank0.json").read_text())["result"]
    assert result["check"]["ok"] and result["prompts"] == 3 and result["forwards"] == 4
    assert result["check"]["moe_calls"] == 4 * 2  # forwards x MoE layers
    assert cli.main(["generate", "--device", "cpu", "--model", str(folder), "--bench", "--bench-prefill", "24",
                     "--bench-decode", "3", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "bench")]) == 0
    records = json.loads((tmp_path / "bench" / "generate_bench.json").read_text())
    assert [rec["quant"] for rec in records] == ["none", "fp8"] and "grouped_mm" in records[0]
    assert all(rec["epmoe"][step]["moe_ms"] > 0 for rec in records for step in ("prefill", "decode"))
    assert "prefill 24" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown preset 'nope'"):
        cli.main(["generate", "--device", "cpu", "--preset", "nope"])
