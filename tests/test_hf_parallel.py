"""epmoe.hf over 2 and 4 gloo ranks (one rank: test_hf.py): every family expert-parallel with data-parallel attention (ranks with
different batch sizes and prompt lengths, a rank with none), prefill and decode through different
dispatchers, checkpoints read by the slice (and the memory that takes), transformers' own expert
parallelism with ep_implementation="epmoe", and `epmoe generate`."""
import importlib.util
import json

import pytest
import torch

pytest.importorskip("transformers", reason="epmoe.hf needs transformers (pip install 'epmoe[hf]')")

from epmoe.launch import spawn  # noqa: E402

import hf_cases  # noqa: E402
from epmoe.hf.parallel import EPOptions  # noqa: E402

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


def test_four_ranks_with_an_idle_one():
    """1, 0, 3 and 2 prompts: Mixtral in fp32 end to end with allgather for prefill and alltoall for decode;
    bf16 Qwen3-MoE per MoE call, the idle rank's MoE outputs zeros."""
    options = EPOptions(dispatcher="allgather", decode_dispatcher="alltoall")
    cases = [("case_families", (("mixtral",), torch.float32, (1, 0, 3, 2), options)),
             ("case_families", (("qwen3_moe",), torch.bfloat16, (1, 0, 3, 2), SWITCH))]
    _report(spawn(hf_cases.run, 4, "cpu", (cases,), timeout_s=SPAWN_TIMEOUT_S))


@pytest.mark.gpu2
def test_two_gpus_ht_prefill_ll_decode():
    """Over NCCL on 2 GPUs: every family in bf16 (per MoE call) and fp32 (end to end), 2 prompts and none,
    prefill through ht and decode through ll, Triton experts."""
    options = EPOptions(dispatcher="ht", decode_dispatcher="ll", experts="triton", decode_max_tokens_per_rank=64)
    cases = [("case_families", (hf_cases.hf_models.FAMILIES, torch.bfloat16, (2, 0), options)),
             ("case_families", (("qwen3_moe", "deepseek_v3"), torch.float32, (1, 3), options))]
    _report(spawn(hf_cases.run, 2, "cuda", (cases,), timeout_s=SPAWN_TIMEOUT_S))


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


def test_generate_command(tmp_path, capfd):
    """`epmoe generate --check` on 2 spawned ranks (3 prompts and none), `--bench` on one (bf16 and fp8 rows,
    JSON), and an unknown preset refused before anything runs."""
    import hf_models
    from epmoe import cli
    folder = tmp_path / "model"
    hf_models.tiny_model("qwen3_moe", hidden=160, inter=128).save_pretrained(folder)
    assert cli.main(["generate", "--device", "cpu", "--model", str(folder), "--dtype", "fp32", "--nproc", "2",
                     "--batch", "3,0", "--check", "--new-tokens", "4", "--dispatcher", "alltoall",
                     "--decode-dispatcher", "allgather", "--out", str(tmp_path / "out")]) == 0
    out = capfd.readouterr().out
    assert "rank 1/2: no prompts; took part in 4 forwards" in out and "greedy tokens agree: PASS" in out
    result = json.loads((tmp_path / "out" / "generate_rank0.json").read_text())["result"]
    assert result["check"]["ok"] and result["prompts"] == 3 and result["forwards"] == 4
    assert result["check"]["moe_calls"] == 4 * 2  # forwards x MoE layers
    assert cli.main(["generate", "--device", "cpu", "--model", str(folder), "--bench", "--bench-prefill", "24",
                     "--bench-decode", "3", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "bench")]) == 0
    records = json.loads((tmp_path / "bench" / "generate_bench.json").read_text())
    assert [rec["quant"] for rec in records] == ["none", "fp8"] and records[0]["grouped_mm"] is not None
    assert all(records[0][impl][step][key] > 0 for impl in ("grouped_mm", "epmoe") for step in ("prefill", "decode")
               for key in ("step_ms", "moe_ms", "moe_alone_ms"))
    assert all("moe_alone" in records[0]["speedup"][step] for step in ("prefill", "decode"))
    assert all(rec["epmoe"][step]["moe_ms"] > 0 for rec in records for step in ("prefill", "decode"))
    assert "prefill 24" in capfd.readouterr().out
    with pytest.raises(SystemExit) as refused:  # one line and exit code 2, before any rank starts
        cli.main(["generate", "--device", "cpu", "--preset", "nope"])
    assert refused.value.code == 2 and "unknown preset 'nope'" in capfd.readouterr().err


def test_generate_refuses_what_its_ranks_could_not_run_before_they_start(tmp_path, capfd):
    """Names, counts and the model's shapes are checked before any rank starts: one line, exit code 2."""
    import hf_models
    from epmoe import cli
    folder = tmp_path / "model"
    hf_models.tiny_model("qwen3_moe").save_pretrained(folder)  # E = 12 experts of F = 32
    base = ["generate", "--device", "cpu", "--model", str(folder)]
    for argv, words in [
        (["--dispatcher", "nope"], "argument --dispatcher: invalid choice: 'nope'"),
        (["--experts", "nope"], "argument --experts: invalid choice: 'nope'"),
        (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
        (["--decode-max-tokens", "0"], "argument --decode-max-tokens: must be >= 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
        (["--batch", "x"], "--batch needs counts >= 0, one of them > 0, got 'x'"),
        (["--nproc", "5"], "its 12 experts do not divide over 5 ranks"),
        (["--bench"], "fp8 experts need an intermediate size divisible by 128, it has F=32: give --quant none"),
    ]:
        with pytest.raises(SystemExit) as refused:
            cli.main(base + argv)
        err = capfd.readouterr().err
        assert refused.value.code == 2 and words in err.splitlines()[-1] and "Traceback" not in err, (argv, err)
