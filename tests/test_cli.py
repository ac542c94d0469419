"""The `epmoe` command on CPU (`--device cpu`, also where there is a GPU): demo and check on two gloo ranks,
bench delegation."""
import json
import os
import subprocess
import sys

import pytest
import torch

from epmoe import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=240):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "epmoe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_demo_two_ranks():
    r = _run("demo", "--device", "cpu", "--nproc", "2", "-T", "9", "-D", "64", "-F", "32", "--repeats", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""  # no warnings
    assert "skipped: dispatcher local" in r.stdout and "single rank" in r.stdout
    assert "after 2 warm-up calls" in r.stdout and "not how fast epmoe is" in r.stdout  # what CPU times mean
    for name in ("allgather", "alltoall"):
        row = next(line for line in r.stdout.splitlines() if line.startswith(name))
        assert row.split()[1] == "reference" and row.rstrip().endswith("ok"), row


def test_check_two_ranks():
    r = _run("check", "--device", "cpu", "--nproc", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("t0_on_rank0") and "PASS" in line for line in lines)
    assert any(line.startswith("odd_D97_F45  ") and "fp8_block" in line for line in lines)
    assert "FAIL" not in r.stdout and lines[-1].endswith(" 0 failed")


def test_bench_layer_writes_json(tmp_path):
    r = _run("bench", "layer", "--device", "cpu", "--nproc", "1", "-T", "5", "-E", "8", "-D", "32", "-F", "16",
             "--groups", "2", "--topk-groups", "1", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "layer.json").exists() and "local/reference" in r.stdout
    record = json.loads((tmp_path / "layer.json").read_text())
    pairs = 5 * record["spec"]["top_k"]  # the router gives every token top_k distinct experts
    load = record["load"]
    assert load["rows_per_rank"] == [pairs] and load["rows_per_expert"]["mean"] == pairs / record["spec"]["num_experts"]
    assert 0 <= load["rows_per_expert"]["min"] <= load["rows_per_expert"]["median"] <= load["rows_per_expert"]["max"]
    assert f"per rank {pairs} (largest / mean 1.00)" in r.stdout
    from epmoe.bench.experts import mlp_floor  # the busiest rank's rows over all E experts
    floor = mlp_floor(pairs, record["spec"]["num_experts"], 32, 16, False).ms
    assert load["experts_floor_ms"] == pytest.approx(floor)  # (an H200's ceilings on the CPU)
    assert "H200" in load["floor_ceilings"] and "H200" not in r.stdout  # a GPU's floor says nothing of a CPU run


def test_bench_unknown_stage_and_missing_module(monkeypatch, capsys):
    assert cli.main(["bench", "nope"]) == 2
    monkeypatch.setitem(cli._BENCH_MODULES, "experts", "epmoe.bench.not_written_yet")
    assert cli.main(["bench", "experts", "--out", "x"]) == 2
    assert "not in this build" in capsys.readouterr().err


def test_bench_help_and_a_table_from_a_bad_file(tmp_path, capsys):
    """`epmoe bench --help` lists the benchmarks (exit 0); `bench experts --table-from` of a missing or
    foreign file is a one-line usage error."""
    assert cli.main(["bench", "--help"]) == 0
    assert "usage: epmoe bench {experts,dispatch,layer,moe}" in capsys.readouterr().out
    (tmp_path / "empty.json").write_text("{}")
    for path in (tmp_path / "missing.json", tmp_path / "empty.json"):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "experts", "--table-from", str(path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--table-from {path}: not a readable experts_tune.json" in err.splitlines()[-1]


def test_bench_dispatch_mode_ll_goes_to_the_ll_module(monkeypatch, capsys):
    monkeypatch.setitem(cli._BENCH_MODULES, "dispatch_ll", "epmoe.bench.ll_missing")
    assert cli.main(["bench", "dispatch", "--mode", "ll"]) == 2
    assert "epmoe.bench.ll_missing" in capsys.readouterr().err
    assert cli._without_mode(["--out", "o", "--mode", "ll", "-x", "--mode=ll"]) == ["--out", "o", "-x"]


def test_parser_rejects_unknown_option():
    with pytest.raises(SystemExit):
        cli.main(["demo", "--nope"])


def test_check_skips_chunked_batches_for_dispatchers_without_a_host_sync():
    """`ll` refuses a batch the layer would have to chunk (it cannot agree on a chunk count without a host
    sync): the check lists it as skipped for such a case, not as a FAIL; smaller batches keep it."""
    from epmoe.check import without_chunkless
    from epmoe.config import MoEConfig
    from epmoe.testing import Plan

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens_per_rank=8)
    todo = Plan(runs=[("ht", "triton"), ("ll", "triton"), ("ll", "reference")], skipped=[("local", "*", "x")])
    kept = without_chunkless(todo, cfg, [20, 3])
    assert kept.runs == [("ht", "triton")]
    assert kept.skipped[0] == ("local", "*", "x") and [s[0] for s in kept.skipped[1:]] == ["ll"]
    assert "max_tokens_per_rank" in kept.skipped[1][2]
    assert without_chunkless(todo, cfg, [8, 3]) == todo


def test_check_runs_the_cases_named():
    r = _run("check", "--device", "cpu", "--nproc", "2", "--cases", "one_expert")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.rstrip().endswith(("PASS", "FAIL"))]
    assert rows and all(line.split()[0] == "one_expert" for line in rows), rows
    assert len(set(rows)) == len(rows) and r.stdout.splitlines()[-1] == f"{len(rows)} passed, 0 failed"  # once each
    bad = _run("check", "--cases", "one_expert,nope")
    assert bad.returncode == 2 and "unknown case(s) ['nope']" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU says")
@pytest.mark.parametrize("argv", [["experts"], ["dispatch", "--out", "x"], ["dispatch", "--mode", "ll"], ["moe"]])
def test_gpu_benchmarks_without_a_gpu_exit_2(argv, capsys):
    try:
        code = cli.main(["bench", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2 and "GPU" in capsys.readouterr().err.splitlines()[-1]
