"""`epmoe bench moe`: its refusal on a machine without a GPU, its pure parts (floors, kernel attribution,
tables), the transformers adapter against epmoe's reference experts, and the whole sweep on CPU at a tiny
shape (timings there are wall times, only the plumbing is checked). The real run is the `gpu` test.

Shape letters: T tokens, D hidden size, E experts, K top-k, F intermediate size.
"""
import collections
import json
import statistics

import pytest
import torch

from epmoe import cli
from epmoe.bench import hf_peer, moe
from epmoe.bench.hf_peer import MoEShape
from epmoe.config import MoEConfig
from epmoe.layer import FusedMoE
from epmoe.registry import list_experts
from epmoe.testing import TOLERANCES, rel_error

TINY = MoEShape(name="tiny", family="qwen3_moe", hidden_size=64, num_experts=8, top_k=2, intermediate_size=40)


def test_without_a_gpu_it_says_why_in_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert moe.main(["--shapes", "qwen3-30b-a3b", "--tokens", "1"]) == 2
    assert cli.main(["bench", "moe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["epmoe bench moe: needs a CUDA GPU (it times GPU kernels), and none is visible here"] * 2


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--repeats", "0"], ["--quant", "fp4"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        moe.main(argv)
    assert exc.value.code == 2


def test_block_floor():
    qwen, mixtral = moe.SHAPES["qwen3-30b-a3b"], moe.SHAPES["mixtral-8x7b"]
    # T = 4096: 6 * 4096*8 * 2048 * 768 = 309.2 GFLOP at 686 TFLOP/s
    assert moe.block_floor(qwen, 4096, 128, fp8=False).ms == pytest.approx(0.45078, rel=1e-4)
    # T = 1 on 8 experts: 8 * 3 * 2048 * 768 weights (2 bytes, fp8 1) + x and out (2 * 2048 * 2 bytes) at 4.16 TB/s
    assert moe.block_floor(qwen, 1, 8, fp8=False).ms * 1e3 == pytest.approx(75_505_664 / 4.16e6, rel=1e-6)
    assert moe.block_floor(qwen, 1, 8, fp8=True).ms * 1e3 == pytest.approx(37_756_928 / 4.16e6, rel=1e-6)
    # fp8 compute at 1276 TFLOP/s: 6 * 16384*2 * 4096 * 14336 = 11.54 TFLOP
    assert moe.block_floor(mixtral, 16384, 8, fp8=True).ms == pytest.approx(9.0477, rel=1e-4)


@pytest.mark.parametrize("name, gemm", [
    ("_grouped_gemm_kernel", True),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm90<cutlass::gemm::kernel::Gemm", True),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNN", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", True),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, float, 128, 16, 4, 4, false>", True),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", True),
    ("_w8a8_block_fp8_matmul", True),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", False),
    ("_quantize_act_kernel", False),
    ("Memcpy DtoD (Device -> Device)", False),
    ("void at::native::index_elementwise_kernel<128, 4>", False),
])
def test_gemm_kernels_are_recognised_by_name(name, gemm):
    assert moe.is_gemm_kernel(name) is gemm


def test_kernels_are_split_by_the_window_holding_their_midpoint():
    windows = {"a": (0.0, 100.0), "b": (110.0, 200.0)}
    kernels = [("_grouped_gemm_kernel", 10.0, 40.0), ("fill_kernel", 40.0, 50.0),
               ("nvjet_x", 95.0, 103.0),            # midpoint 99: a
               ("cutlass_y", 108.0, 130.0),         # midpoint 119: b
               ("index_kernel", 150.0, 160.0),
               ("gemm_outside", 102.0, 108.0)]      # midpoint 105: in no window
    assert moe.split_kernel_time(kernels, windows) == {"a": (38.0, 48.0), "b": (22.0, 32.0)}
    assert moe.split_kernel_time([], {"a": (0.0, 1.0)}) == {"a": (0.0, 0.0)}


@pytest.mark.parametrize("T, D, sets", [(1, 2048, 8), (4096, 2048, 4), (16384, 7168, 2)])
def test_input_sets_cover_twice_the_l2(T, D, sets):
    assert moe.input_sets(T, D) == sets


@pytest.mark.parametrize("runs", [1, 2, 3, 4, 5, 6])
def test_turn_orders_let_every_run_follow_every_other_equally_often(runs):
    orders = moe.turn_orders(runs)
    assert len(orders) == (runs if runs % 2 == 0 else 2 * runs)
    assert all(sorted(order) == list(range(runs)) for order in orders)
    follows = collections.Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert set(follows) == {(a, b) for a in range(runs) for b in range(runs) if a != b}
    assert len(set(follows.values())) <= 1


@pytest.mark.parametrize("repeats, sets", [(1, 1), (3, 2), (10, 8)])
def test_runs_take_turns_in_rounds_of_a_lead_in_and_timed_calls(repeats, sets, monkeypatch):
    """After WARMUP_CALLS of each, each round takes every run in turn in the next of `turn_orders`, each a
    lead-in call and ROUND_CALLS timed ones, over whole sets of the orders; a run's consecutive calls read
    different input sets, every run the same sequence of them; the medians are of each run's own timed
    calls (CPU: wall times, here from a clock that each call advances by its cost)."""
    clock = [0.0]
    calls = []

    def make_run(r, cost_s):
        def run(inp):
            calls.append((r, inp))
            clock[0] += cost_s * (1 + inp)  # a call on input set s costs (1 + s) x the run's cost
        return run
    monkeypatch.setattr(moe.time, "perf_counter", lambda: clock[0])
    costs = (1.0, 2.0, 5.0)
    runs = [make_run(r, cost / 1e3) for r, cost in enumerate(costs)]
    times = moe.time_in_turns(runs, list(range(sets)), repeats, torch.device("cpu"))
    warm = moe.WARMUP_CALLS * 3
    assert [r for r, _ in calls[:warm]] == [r for r in range(3) for _ in range(moe.WARMUP_CALLS)]
    timed_calls = calls[warm:]
    per_round = 1 + moe.ROUND_CALLS
    orders = moe.turn_orders(3)
    rounds = len(orders) * -(-repeats // (moe.ROUND_CALLS * len(orders)))
    assert [r for r, _ in timed_calls] == [i for k in range(rounds) for i in orders[k % len(orders)]
                                            for _ in range(per_round)]
    turn_sets = [[(m * per_round + j) % sets for j in range(per_round)] for m in range(rounds)]
    assert [inp for _, inp in timed_calls] == [k for m in range(rounds) for _ in range(3) for k in turn_sets[m]]
    for r, cost in enumerate(costs):
        own = [cost * (1 + inp) for c, (run, inp) in enumerate(timed_calls) if run == r and c % per_round]
        assert sorted(own) == sorted(costs[r] * (1 + k) for m in range(rounds) for k in turn_sets[m][1:])
        assert len(own) == rounds * moe.ROUND_CALLS >= repeats
        assert times[r].gpu_ms == pytest.approx(statistics.median(own)) == times[r].host_ms
        q1, _, q3 = statistics.quantiles(own, n=4, method="inclusive") if len(own) > 1 else (0, 0, 0)
        assert times[r].spread_pct == pytest.approx(100 * (q3 - q1) / statistics.median(own))


def test_the_host_waits_for_the_call_queued_calls_back_before_queueing_the_next(monkeypatch):
    """On a GPU: a CUDA event after each call; before call c the host waits for the end of call
    c - QUEUED_CALLS (never a later one), outside the call's host time."""
    log = []

    class FakeEvent:
        made = 0

        def __init__(self, enable_timing):
            self.index = FakeEvent.made
            FakeEvent.made += 1

        def record(self):
            log.append(("record", self.index))

        def synchronize(self):
            log.append(("wait", self.index))

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(moe.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(moe, "sync", lambda device: None)
    runs = [lambda inp, r=r: log.append(("call", r)) for r in range(2)]
    times = moe.time_in_turns(runs, [0, 1, 2], 4, torch.device("cuda"))
    assert [t.gpu_ms for t in times] == [1.0, 1.0]
    timed = log[log.index(("record", 0)) + 1:]
    calls = [i for i, e in enumerate(timed) if e[0] == "call"]
    for c, at in enumerate(calls):
        assert timed[at + 1] == ("record", c + 1)  # event c + 1 marks the end of call c
        waits = [e for e in timed[:at] if e[0] == "wait"]
        if c >= moe.QUEUED_CALLS:
            assert timed[at - 1] == ("wait", c + 1 - moe.QUEUED_CALLS)
        assert all(index <= c + 1 - moe.QUEUED_CALLS for _, index in waits)


def test_markdown_table():
    assert moe.markdown_table(["a", "b"], [[1, "x"], [2.5, "-"]]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | - |\n"


def _routing(T, shape, skew, gen):
    logits_TE = torch.randn(T, shape.num_experts, generator=gen)
    if skew:  # every token's first choice is expert 3
        logits_TE[:, 3] += 100.0
    top_TK, ids_TK = logits_TE.softmax(-1).topk(shape.top_k, dim=-1)
    return (top_TK / top_TK.sum(-1, keepdim=True)).to(torch.bfloat16), ids_TK


@pytest.mark.parametrize("family", sorted(hf_peer.FAMILIES))
@pytest.mark.parametrize("T, skew", [(1, False), (7, False), (9, True)])
def test_transformers_experts_match_epmoe_reference(family, T, skew):
    pytest.importorskip("transformers")
    shape = MoEShape(name="t", family=family, hidden_size=64, num_experts=6, top_k=2, intermediate_size=24)
    gen = torch.Generator().manual_seed(T)
    w13_END = torch.randn(6, 48, 64, generator=gen).mul_(0.125).to(torch.bfloat16)
    w2_EDF = torch.randn(6, 64, 24, generator=gen).mul_(0.2).to(torch.bfloat16)
    x_TD = torch.randn(T, 64, generator=gen).to(torch.bfloat16)
    weights_TK, ids_TK = _routing(T, shape, skew, gen)
    cfg = MoEConfig(num_experts=6, top_k=2, hidden_size=64, intermediate_size=24, dtype=torch.bfloat16)
    ref = FusedMoE(cfg, None, dispatcher="local", experts="reference", device="cpu")
    ref.load_experts(w13_END, w2_EDF)
    ref_TD = ref(x_TD, weights_TK=weights_TK, ids_TK=ids_TK)
    for backend in ("grouped_mm", "eager"):
        experts = hf_peer.experts_module(shape, backend, w13_END, w2_EDF)
        assert experts.gate_up_proj.data_ptr() == w13_END.data_ptr()  # shared, not copied
        with torch.inference_mode():
            out_TD = experts(x_TD, ids_TK, weights_TK)
        assert out_TD.shape == (T, 64) and out_TD.dtype == torch.bfloat16
        assert rel_error(out_TD, ref_TD) < TOLERANCES["bf16"], backend


def test_the_sweep_runs_on_cpu_and_writes_json_table_and_plot(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    # transformers' FP8 experts are built and called; where their hub kernel cannot load they fail on the
    # first call, are reported, and fp8 rows are compared with transformers' bf16 grouped_mm instead
    monkeypatch.setattr(hf_peer, "fp8_unavailable_reason", lambda: None)
    assert moe.run([TINY], [3], ["bf16", "fp8_block"], 1, 0, str(tmp_path), torch.device("cpu")) == 0
    result = json.loads((tmp_path / "moe.json").read_text())
    points = result["points"]
    keys = {f"{p['impl']} {p['quant']}" for p in points}
    expected = {"transformers grouped_mm bf16", "transformers eager bf16"}
    for quant in ("bf16", "fp8_block"):
        available = list_experts(moe.layer_config(TINY, quant, 3), "cpu")
        expected |= {f"epmoe {n} {quant}" for n in moe.EPMOE_EXPERTS if n == "auto" or available[n][0]}
    fp8_ran = "transformers grouped_mm fp8_block" in keys
    assert keys - {"transformers grouped_mm fp8_block", "transformers eager fp8_block"} == expected
    assert fp8_ran or "transformers grouped_mm fp8_block" in result["skipped"]
    for p in points:
        assert p["ok"] and p["rel_err"] < TOLERANCES[p["quant"]], p
        assert p["T"] == 3 and p["input_sets"] == moe.input_sets(3, 64) and p["gemm_pct"] is None
        assert p["alloc_retries"] == 0 and p["spread_pct"] >= 0
        assert p["baseline"] == ("transformers grouped_mm fp8_block" if fp8_ran and p["quant"] == "fp8_block"
                                 else "transformers grouped_mm bf16")
        assert p["floor_us"] == pytest.approx(moe.block_floor(TINY, 3, p["experts_hit"], p["quant"] == "fp8_block").ms
                                              * 1e3)
        if p["impl"] == "transformers grouped_mm" and p["quant"] == "bf16":
            assert p["x_transformers"] == 1.0
    assert {p["runs"] for p in points if p["impl"] == "epmoe auto"} == {"reference"}  # auto on a CPU
    out = capsys.readouterr().out
    assert "epmoe triton" in out and "transformers eager" in out and "rows against transformers grouped_mm" in out
    assert len((tmp_path / "moe.md").read_text().splitlines()) == 2 + len(points)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "moe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_transformers_epmoe_runs_alone_checked_against_its_reference(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hf_peer, "transformers_version", lambda: None)
    assert moe.run([TINY], [2], ["bf16"], 1, 0, str(tmp_path), torch.device("cpu")) == 0
    result = json.loads((tmp_path / "moe.json").read_text())
    assert "transformers" in result["skipped"]
    assert {p["impl"] for p in result["points"]} <= {f"epmoe {n}" for n in moe.EPMOE_EXPERTS}
    for p in result["points"]:
        assert p["baseline"] is None and p["x_transformers"] is None and p["ok"], p
    out = capsys.readouterr().out
    assert "rel err vs epmoe reference" in out and "skipped: transformers: not installed" in out
    assert "no plot" in out and not (tmp_path / "moe.png").exists()


@pytest.mark.gpu
def test_bench_moe_on_a_gpu(tmp_path):
    pytest.importorskip("transformers")
    assert moe.main(["--shapes", "qwen3-30b-a3b", "--tokens", "1", "256", "--repeats", "3",
                     "--out", str(tmp_path)]) == 0
    points = json.loads((tmp_path / "moe.json").read_text())["points"]
    assert {p["impl"] for p in points} >= {"transformers grouped_mm", "transformers eager", "epmoe auto",
                                           "epmoe triton"}
    for p in points:
        assert p["ok"] and p["x_transformers"] is not None, p
        assert 0 < p["gemm_pct"] <= 100 and p["gpu_us"] > 0 and p["host_us"] > 0, p
