"""`epmoe soak`, short: randomized load through every path the library lists on this machine (one rank, gloo
ranks, emulated ranks under the interpreter), the CUDA-graph replay loop (eagerly on the CPU, captured on a
GPU), faults over gloo and emulated ranks, the bad-input table, and the command itself.
Every run asserts the soak's goals: no mismatch with the oracle, deterministic reruns, no device memory growth,
a clear error on every rank of every fault inside its time-out and a working fresh group, every bad input
refused with a ValueError naming it."""
import dataclasses
import json

import pytest
import torch

from epmoe.launch import spawn
from epmoe.soak import bad_inputs, faults, graphs, load, run

# Padding rows of kernel intermediates are uninitialized memory; the interpreter's numpy math warns on them.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPEC = dataclasses.replace(load.GPU_LOAD if DEVICE.type == "cuda" else load.CPU_LOAD, calls=25, interpreted_calls=2,
                           reruns=1)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_goals(tallies):
    assert tallies
    for t in tallies:
        assert t.mismatches == 0, f"{t.path}: {t.first_mismatch}"
        assert t.outputs > 0 and t.calls > 0, t.path
        assert t.reruns and t.rerun_equal == t.reruns, f"{t.path}: {t.rerun_equal} of {t.reruns} reruns equal"
        assert t.memory_growth["allocated"] == 0 and t.memory_growth["reserved"] == 0, (t.path, t.memory_growth)


def test_call_inputs_depend_on_the_call_alone():
    """A call's inputs come from (seed, path, call, rank): the same again, other ranks and calls differ; token
    counts 0 and 1 and every routing appear over a few calls; ids in [-1, E), distinct per token."""
    cfg = SPEC.config("bf16")
    a = load.call_inputs(cfg, 0, "p", 3, 1, 20, torch.device("cpu"))
    b = load.call_inputs(cfg, 0, "p", 3, 1, 20, torch.device("cpu"))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    counts, none = set(), 0
    for call in range(60):
        x, ids, w = load.call_inputs(cfg, 0, "p", call, 0, 20, torch.device("cpu"))
        counts.add(x.shape[0])
        none += bool(x.shape[0]) and bool((ids == -1).all())
        assert ids.shape == (x.shape[0], cfg.top_k) and w.shape == ids.shape
        assert all(-1 <= i < cfg.num_experts for i in ids.view(-1).tolist())
        valid = [[i for i in row if i >= 0] for row in ids.tolist()]
        assert all(len(set(r)) == len(r) for r in valid)
    assert {0, 1} <= counts and max(counts) > 10 and none


def test_warm_up_token_counts_cover_every_graph_bucket():
    """On a GPU the load's warm-up calls one token count per power-of-two bucket up to the largest call (each
    CUDA graph of `local` is captured before memory is watched), with the token count asked for."""
    assert load.warmup_tokens(64) == [1, 2, 4, 8, 16, 32, 64] and load.warmup_tokens(160)[-2:] == [128, 160]
    assert load.warmup_tokens(1) == [1]
    cfg = SPEC.config("bf16")
    x, ids, w = load.call_inputs(cfg, 0, "p", 3, 1, 20, torch.device("cpu"), tokens=13)
    assert x.shape[0] == 13 and ids.shape == (13, cfg.top_k) == w.shape


def test_load_on_one_rank_and_emulated_ranks(one_thread):
    """Every experts implementation on one rank; the emulated paths with the triton experts (the slowest under
    the interpreter: the full soak runs them all)."""
    tallies, skipped = load.soak_layers(SPEC, ("fp32", "bf16", "fp8_block"), None, 0, 1, DEVICE)
    emulated, more = load.soak_emulated(SPEC, ("bf16", "fp8_block"), DEVICE, experts=("triton",))
    assert_goals(tallies + emulated)
    names = {t.path.split(" ")[0] for t in tallies + emulated}
    assert {"local/reference/fp32", "local/reference/fp8_block", "local/grouped_mm/bf16", "local/triton/fp8_block",
            "ll/triton/bf16", "ht(sync_free)/triton/bf16", "ht/triton/bf16", "ll/triton/fp8_block"} <= names


def _gloo_load(ctx):
    torch.set_num_threads(1)
    return load.soak_layers(SPEC, ("bf16", "fp8_block"), ctx.group, ctx.rank, ctx.world_size, ctx.device)


def test_load_on_gloo_ranks():
    results = spawn(_gloo_load, 2, "cpu", (), timeout_s=300)
    tallies = run.merge([r[0] for r in results])
    assert_goals(tallies)
    assert {"allgather/reference/bf16", "alltoall/reference/fp8_block"} <= {t.path.split(" ")[0] for t in tallies}


def test_a_wrong_output_is_a_mismatch(one_thread):
    """The soak's own check fails a path whose layer drops the routed scaling (a planted bug)."""
    cfg = SPEC.config("bf16")
    weights = load.make_weights(cfg, SPEC.seed, "cpu")
    oracle = load.layer_oracle(cfg, weights, device="cpu")
    tally = load.Tally("planted", load.tolerance(cfg))

    def build():
        moe = load.build_layer(cfg, weights, None, "local", "reference", "cpu")
        return lambda inputs: [moe(x, weights_TK=w, ids_TK=ids) / cfg.routed_scaling_factor for x, ids, w in inputs]
    load.drive(tally, build, cfg, oracle, SPEC, 10, [0], 8, torch.device("cpu"))
    assert tally.mismatches > 0 and "rel err" in tally.first_mismatch


@pytest.mark.parametrize("d_key", graphs.GRAPH_PATHS)
def test_graph_replay_loop(d_key, one_thread):
    """The replay loop: new inputs into the captured tensors (inactive tokens: ids -1, zero rows), every
    replay against the oracle; captured in a CUDA graph on a GPU, the same calls eagerly on the CPU."""
    tally = graphs.replay_path(SPEC, "bf16", d_key, 4, DEVICE, capture=DEVICE.type == "cuda")
    assert_goals([tally])
    assert tally.calls == 4


@pytest.mark.gpu
def test_graphs_gpu():
    tallies, skipped = graphs.soak_graphs(SPEC, ("bf16", "fp8_block"), 50, DEVICE)
    assert_goals(tallies)
    assert len(tallies) == 4 and all(t.calls == 50 for t in tallies), skipped


def assert_clear(outcomes, limit_s):
    assert outcomes
    for o in outcomes:
        assert o.clear, o
        assert o.ended != "output", o
        assert o.fresh_group_ok is not False, o
        if o.ended == "error" and "gloo" in o.path:
            assert o.seconds <= limit_s, o


def test_faults_over_gloo():
    """Every fault through alltoall (allgather: the full soak), collectives timing out after 2 s."""
    outcomes = faults.group_faults(2.0, d_names=("alltoall",))
    assert_clear(outcomes, 2.0 + run.FAULT_SLACK_S)
    assert {o.fault for o in outcomes} == set(faults.FAULTS) and len(outcomes) == 2 * len(faults.FAULTS)
    timed_out = [o for o in outcomes if o.rank == 0 and o.fault in ("never_arrives", "ids_out_of_range")]
    assert all("Timed out" in o.error for o in timed_out)
    assert all("another MoEConfig" in o.error for o in outcomes if o.fault == "other_config")


def test_faults_of_emulated_ranks(one_thread):
    outcomes, why = faults.emulated_faults(DEVICE, 1.0 if DEVICE.type == "cuda" else 2e-3,
                                           faults=("never_arrives", "ids_out_of_range", "dies_mid_call"),
                                           d_keys=("ht", "ll"))
    assert not why
    assert_clear(outcomes, float("inf"))
    assert any("gave up" in o.error for o in outcomes if o.path.startswith("ht ") and o.rank == 0)


def test_bad_inputs_are_refused_naming_the_value():
    rows = bad_inputs.bad_input_rows(with_cli=False)
    assert len(rows) > 50
    assert [r for r in rows if not r.ok] == []
    assert {r.entry.split(".")[0] for r in rows} >= {"MoEConfig", "route", "make_dispatcher", "dispatch", "combine",
                                                     "FusedMoE", "hf"}


@pytest.mark.parametrize("argv,names", bad_inputs.CLI_CASES, ids=lambda v: " ".join(v))
def test_bad_command_lines_are_refused_before_ranks_start(argv, names):
    row = bad_inputs.run_cli(argv, names)
    assert row.ok, row


def test_soak_command(tmp_path):
    """`epmoe soak` end to end, at the CI size, on one rank: JSON written, exit code 0, figures filled."""
    code = run.main(["--quick", "--parts", "load,inputs", "--nproc", "0", "--precisions", "fp32,bf16",
                     "--experts", "reference", "--calls", "8", "--interpreted-calls", "1", "--reruns", "1",
                     "--threads", str(torch.get_num_threads()), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "soak.json").read_text())
    summary = report["summary"]
    cli_misses = [m for m in summary["missed"] if m.startswith("bad input CLI")]
    assert summary["missed"] == cli_misses and code == int(bool(cli_misses))
    assert summary["mismatches"] == 0 and summary["deterministic_paths"] == summary["paths"] >= 2
    assert summary["calls"] >= 2 * 8 and summary["outputs_compared"] > 0
    assert summary["bad_inputs_refused"] == summary["bad_inputs"] - len(cli_misses)


def test_a_soak_that_runs_nothing_fails(capsys):
    """The graph part on the CPU (CUDA graphs need a GPU) checks nothing: the soak says so and exits 1."""
    assert run.main(["--device", "cpu", "--parts", "graphs", "--quick"]) == 1
    assert "nothing ran: every path of --parts graphs was skipped" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "-1"], "argument --nproc: must be >= 0, got -1"),
    (["--fault-timeout", "0"], "argument --fault-timeout: must be a finite number > 0, got 0"),
    (["--wait-timeout", "nan"], "argument --wait-timeout: must be a finite number > 0, got nan"),
] + ([] if torch.cuda.is_available() else
     [(["--device", "cuda"], "--device cuda: no CUDA device is visible here (--device cpu runs on the CPU)")]))
def test_soak_option_errors_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        run.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"epmoe soak: error: {words}"
