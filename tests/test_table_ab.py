"""epmoe.bench.table_ab: the order of the runs, the times read from each bench's JSON, the comparison, and the
whole command with the bench runs replaced by a stand-in that writes JSON according to the table it is given."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epmoe.bench import table_ab
from epmoe.kernels import configs
from epmoe.kernels.configs import GemmConfig


def _committed(tmp_path) -> Path:
    """The committed launch table, written to tmp_path/old.json."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"comment": "old", "tables": {
        key: [[b, c.to_dict()] for b, c in buckets] for key, buckets in configs._table().items()}}))
    return old


def test_schedule_alternates_the_tables_round_by_round():
    assert table_ab.schedule(1) == ["old", "new"]
    assert table_ab.schedule(3) == ["old", "new", "new", "old", "old", "new"]
    with pytest.raises(ValueError, match="rounds"):
        table_ab.schedule(0)


def test_times_of_each_bench():
    experts = {"points": [{"shape": "q", "tokens_per_expert": 16, "triton_bf16_ms": 1.0, "triton_fp8_ms": 0.5,
                           "triton_bf16_bat_ms": 0.9, "gmm_ms": 2.0}]}
    assert table_ab.times("experts", experts) == ({"q t=16 triton_bf16": 1.0, "q t=16 triton_fp8": 0.5,
                                                   "q t=16 triton_bf16_bat": 0.9}, [])
    moe = {"points": [{"shape": "q", "T": 256, "quant": "bf16", "impl": "transformers grouped_mm", "gpu_us": 900.0,
                       "ok": True},
                      {"shape": "q", "T": 256, "quant": "bf16", "impl": "epmoe auto", "gpu_us": 300.0, "ok": True},
                      {"shape": "q", "T": 256, "quant": "fp8_block", "impl": "epmoe triton", "gpu_us": 200.0,
                       "ok": False}]}
    assert table_ab.times("moe", moe) == ({"q T=256 bf16 epmoe auto": 0.3, "q T=256 fp8_block epmoe triton": 0.2},
                                          ["q T=256 fp8_block epmoe triton"])


def test_compare_takes_medians_over_the_points_every_run_has():
    runs = [("old", {"a": 2.0, "b": 1.0}), ("new", {"a": 1.0, "b": 1.0}), ("new", {"a": 1.2}),
            ("old", {"a": 2.4, "b": 1.0}), ("old", {"a": 2.2})]
    [row] = table_ab.compare(runs)
    assert row["point"] == "a" and row["old_ms"] == 2.2 and row["new_ms"] == pytest.approx(1.1)
    assert row["old_over_new"] == pytest.approx(2.2 / 1.1) and row["spread"] == pytest.approx(2.4)


def test_the_command_runs_each_table_in_turn(tmp_path, monkeypatch, capsys):
    old = _committed(tmp_path)
    seen = []

    def fake_bench(cmd, check, env, cwd, stdout):  # a bench twice as slow under the old table
        assert cmd[:5] == [sys.executable, "-m", "epmoe.cli", "bench", "experts"] and cmd[5:7] == ["--tokens", "16"]
        table = Path(env[configs.TABLE_ENV])
        seen.append("old" if table == old.resolve() else "new")
        folder = Path(cmd[cmd.index("--out") + 1])
        folder.mkdir(parents=True)
        ms = 2.0 if seen[-1] == "old" else 1.0
        (folder / "experts.json").write_text(json.dumps({"points": [
            {"shape": "q", "tokens_per_expert": 16, "triton_bf16_ms": ms, "triton_fp8_ms": ms / 2}]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(table_ab.subprocess, "run", fake_bench)
    table_ab.main(["--old", str(old), "--out", str(tmp_path / "ab"), "experts", "--tokens", "16"])
    assert seen == ["old", "new", "new", "old"]
    result = json.loads((tmp_path / "ab" / "ab.json").read_text())
    assert [r["old_over_new"] for r in result["rows"]] == [2.0, 2.0]
    assert result["tables"]["new"] == str(configs.table_path().resolve())  # the table for this GPU
    assert "q t=16 triton_fp8" in capsys.readouterr().out


def test_old_code_runs_the_other_revision_under_its_own_table(tmp_path, monkeypatch, capsys):
    """--old-code DIR: the old runs import DIR's epmoe (DIR first on the path and the working folder) with no
    table named, the new runs this checkout under its table; --set and --put are refused with it, as is a DIR
    without an epmoe package."""
    code = tmp_path / "old_tree"
    (code / "epmoe").mkdir(parents=True)
    (code / "epmoe" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv(configs.TABLE_ENV, str(tmp_path / "ignored.json"))
    seen = []

    def fake_bench(cmd, check, env, cwd, stdout):
        old = cwd is not None
        seen.append("old" if old else "new")
        if old:
            assert Path(cwd) == code.resolve() and configs.TABLE_ENV not in env
            assert env["PYTHONPATH"] == os.pathsep.join([str(code.resolve()), "/elsewhere"])
        else:
            assert env[configs.TABLE_ENV] == str(configs.table_path().resolve()) and env["PYTHONPATH"] == "/elsewhere"
        folder = Path(cmd[cmd.index("--out") + 1])
        assert folder.is_absolute()
        folder.mkdir(parents=True)
        (folder / "moe.json").write_text(json.dumps({"points": [
            {"shape": "q", "T": 256, "quant": "bf16", "impl": "epmoe auto", "gpu_us": 300.0 if old else 200.0,
             "ok": True}]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(table_ab.subprocess, "run", fake_bench)
    table_ab.main(["--old-code", str(code), "--out", str(tmp_path / "ab"), "moe", "--tokens", "256"])
    assert seen == ["old", "new", "new", "old"]
    result = json.loads((tmp_path / "ab" / "ab.json").read_text())
    assert result["old_code"] == str(code.resolve()) and result["tables"]["old"] is None
    assert [r["old_over_new"] for r in result["rows"]] == [pytest.approx(1.5)]
    capsys.readouterr()
    monkeypatch.setattr(table_ab.subprocess, "run", lambda *a, **k: pytest.fail("ran a bench"))
    for argv, says in ((["--old-code", str(code), "--set", "down:group_m=4"], "--set and --put"),
                       (["--old-code", str(tmp_path)], "no epmoe package"),
                       (["--old-code", str(code), "--old", str(code)], "not allowed with")):
        with pytest.raises(SystemExit) as exit_:
            table_ab.main([*argv, "--out", str(tmp_path / "ab2"), "moe"])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_the_command_refuses_a_table_that_cannot_serve_every_launch(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"comment": "", "tables": {}}))
    monkeypatch.setattr(table_ab.subprocess, "run", lambda *a, **k: pytest.fail("ran a bench"))
    for table, says in ((bad, "bad.json: no buckets for 'gate_up_bf16'"), (tmp_path / "absent.json", "absent.json")):
        with pytest.raises(SystemExit) as exit_:
            table_ab.main(["--old", str(table), "--out", str(tmp_path / "ab"), "moe"])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_set_derives_the_new_table_from_the_old(tmp_path):
    """--set PREFIX:FIELD=VALUE: the field set in every config of the entries whose key begins with PREFIX, the
    other entries as they were; settings that are malformed, not JSON or match no entry are refused."""
    old = _committed(tmp_path)
    path = table_ab.derive(old, ["down:group_m=4", "gate_up_bf16:num_stages=3"], tmp_path / "ab" / "new.json")
    new, before = configs._table(path), configs._table(old)
    for key, buckets in new.items():
        for (bound, cfg), (bound0, cfg0) in zip(buckets, before[key], strict=True):
            want = cfg0
            if key.startswith("down"):
                want = dataclasses.replace(want, group_m=4)
            if key.startswith("gate_up_bf16"):
                want = dataclasses.replace(want, num_stages=3)
            assert (bound, cfg) == (bound0, want), key
    assert "down:group_m=4, gate_up_bf16:num_stages=3" in json.loads(path.read_text())["comment"]
    for bad, says in (("down", "PREFIX:FIELD=VALUE"), ("down:group_m", "PREFIX:FIELD=VALUE"),
                      ("down:group_m=four", "not JSON"), ("up:group_m=4", "no entry")):
        with pytest.raises(ValueError, match=says):
            table_ab.derive(old, [bad], tmp_path / "bad.json")


def test_put_replaces_one_bucket(tmp_path):
    """--put KEY@BOUND=CONFIG: that bucket's config replaced (after any --set), every other config as it was;
    puts that are malformed, not a JSON object or name no entry or bucket are refused."""
    old = _committed(tmp_path)
    swapped = {"block_m": 16, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3, "swap_ab": True}
    path = table_ab.derive(old, ["down:group_m=4"], tmp_path / "new.json", [f"down_fp8@16={json.dumps(swapped)}"])
    new, before = configs._table(path), configs._table(old)
    for key, buckets in new.items():
        for (bound, cfg), (bound0, cfg0) in zip(buckets, before[key], strict=True):
            want = (GemmConfig(**swapped) if (key, bound) == ("down_fp8", 16) else
                    dataclasses.replace(cfg0, group_m=4) if key.startswith("down") else cfg0)
            assert (bound, cfg) == (bound0, want), (key, bound)
    assert "down_fp8@16=" in json.loads(path.read_text())["comment"]
    for bad, says in (("down_fp8=16", "KEY@BOUND=CONFIG"), ("down_fp8@x={}", "KEY@BOUND=CONFIG"),
                      ("down_fp8@16={", "not JSON"), ("down_fp8@16=[1]", "not a JSON object"),
                      ("down_fp8@17={}", "no entry 'down_fp8' with a bucket 17"), ("down@16={}", "no entry")):
        with pytest.raises(ValueError, match=says):
            table_ab.derive(old, [], tmp_path / "bad.json", [bad])


def test_the_command_times_the_derived_table(tmp_path, monkeypatch, capsys):
    old = _committed(tmp_path)
    tables = []

    def fake_bench(cmd, check, env, cwd, stdout):
        tables.append(Path(env[configs.TABLE_ENV]))
        folder = Path(cmd[cmd.index("--out") + 1])
        folder.mkdir(parents=True)
        (folder / "experts.json").write_text(json.dumps({"points": [
            {"shape": "q", "tokens_per_expert": 16, "triton_bf16_ms": 1.0}]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(table_ab.subprocess, "run", fake_bench)
    out = tmp_path / "ab"
    table_ab.main(["--old", str(old), "--set", "down:group_m=4", "--out", str(out), "experts"])
    assert tables == [old.resolve(), (out / "new.json").resolve(), (out / "new.json").resolve(), old.resolve()]
    assert all(cfg.group_m == 4 for _, cfg in configs._table((out / "new.json").resolve())["down_bf16"])
    with pytest.raises(SystemExit) as exit_:  # a derived table that cannot serve: refused before any run
        table_ab.main(["--old", str(old), "--set", "down:block_m=24", "--out", str(tmp_path / "bad"), "experts"])
    assert exit_.value.code == 2 and "power of two" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        table_ab.main(["--old", str(old), "--new", str(old), "--put", "down_fp8@16={}", "experts"])
    assert exit_.value.code == 2 and "not both" in capsys.readouterr().err
    assert len(tables) == 4
