"""Plant small bugs in a scratch copy of epmoe and run the tests that should catch each one.

    python scripts/plant_bugs.py [--only NAME ...] [--no-baseline] [--keep]

Each mutation names a file and an exact source pattern (found exactly once, or it is reported as
TARGET NOT FOUND / AMBIGUOUS, never as caught), the text that replaces it, and the test runs that should
fail with it: pytest node ids or `-k` selections, and `epmoe check` cases. The package, the tests and
pyproject.toml are copied to a temporary folder; the worktree's files are never touched. The unmutated copy
runs every test first (the baseline: a run that fails without a bug proves nothing). A mutation is CAUGHT
when at least one of its runs fails (pytest exit code 1, or check's exit code 1); a run that errors
otherwise (collection error, time-out) is reported as such. Exit code 0 only if every mutation was caught.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    pattern: str  # exact source text, found exactly once
    replacement: str
    tests: tuple[str, ...] = ()  # pytest arguments, one run each ("file::test", or "file -k expr")
    check_cases: str = ""  # `epmoe check --nproc 2 --cases ...`, when set


MUTATIONS = [
    Mutation("combine drops the top-k weights", "epmoe/kernels/layout.py",
             "rows = rows * torch.where(take, weights_PK[:, k].float(), 0.0)[:, None]",
             "rows = rows * torch.where(take, 1.0, 0.0)[:, None]",
             ("tests/test_layer.py -k local_dispatcher",), "deepseek_v3"),
    Mutation("combine kernel drops the top-k weights", "epmoe/kernels/layout.py",
             "rows *= tl.load(w_ptr + p.to(tl.int64) * K + k, mask=pmask & take, other=0.0).to(tl.float32)[:, None]",
             "rows *= 1.0",
             ("tests/test_layout.py -k gather_sum",)),
    Mutation("combine skips the first batch row (pos > 0 for >= 0)", "epmoe/kernels/layout.py",
             "        take = pos >= 0\n        rows = torch.where(take[:, None]",
             "        take = pos > 0\n        rows = torch.where(take[:, None]",
             ("tests/test_layer.py -k local_dispatcher",), "one_expert"),
    Mutation("alltoall: destination-local ids off by one", "epmoe/dispatch/alltoall.py",
             "local_SK = ids_TK[send_token_S] - (send_rank_S * L).unsqueeze(1).to(torch.int32)",
             "local_SK = ids_TK[send_token_S] - (send_rank_S * L + 1).unsqueeze(1).to(torch.int32)",
             ("tests/test_multirank.py::test_dispatchers_gloo[2]",), "t0_on_rank0"),
    Mutation("allgather pads short ranks with expert 0 instead of -1", "epmoe/dispatch/allgather.py",
             "F_.pad(ids_TK.to(torch.int32), (0, 0, 0, pad), value=-1)",
             "F_.pad(ids_TK.to(torch.int32), (0, 0, 0, pad), value=0)",
             ("tests/test_multirank.py::test_dispatchers_gloo[2]",)),
    Mutation("expert offsets off by one", "epmoe/kernels/layout.py",
             "torch.cumsum(counts_L, 0, out=offsets_L1[1:])",
             "torch.cumsum(counts_L, 0, out=offsets_L1[1:]); offsets_L1[1:-1] += 1",
             ("tests/test_layer.py -k local_dispatcher",)),
    Mutation("graph replays keep an earlier call's ids past T", "epmoe/kernels/graph_io.py",
             "tl.store(ids_ptr + r.to(tl.int64)[:, None] * K + k[None, :], ids, mask=inside)",
             "tl.store(ids_ptr + r.to(tl.int64)[:, None] * K + k[None, :], ids, mask=mk)",
             ("tests/test_graph_io.py", "tests/test_local.py -k address_table")),
    Mutation("graph replays copy one row too few back", "epmoe/kernels/graph_io.py",
             "    m = (r < T)[:, None] & (c < D)[None, :]\n    dst",
             "    m = (r < T - 1)[:, None] & (c < D)[None, :]\n    dst",
             ("tests/test_graph_io.py", "tests/test_local.py -k address_table")),
    Mutation("routing renormalizes over the tokens, not the top-k", "epmoe/routing.py",
             "weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)",
             "weights_TK = weights_TK / weights_TK.sum(dim=0, keepdim=True).clamp_min(1e-20)",
             ("tests/test_routing.py -k oracle", "tests/test_layer.py -k oracle")),
    Mutation("routing kernel skips the renormalization", "epmoe/kernels/routing.py",
             "RENORMALIZE=renormalize,", "RENORMALIZE=False,",
             ("tests/test_routing.py -k kernel and random_logits",)),
    Mutation("weight quantizer: block amax without abs", "epmoe/quant.py",
             "scale = blocks.abs().amax(dim=(-3, -1))", "scale = blocks.amax(dim=(-3, -1))",
             ("tests/test_quant.py",)),
    Mutation("activation quantizer: group amax without abs", "epmoe/quant.py",
             "scale = groups.abs().amax(dim=-1)", "scale = groups.amax(dim=-1)",
             ("tests/test_quant.py",)),
    Mutation("Triton activation quantizer: amax without abs", "epmoe/kernels/quant.py",
             "tl.max(tl.abs(x), axis=1)", "tl.max(x, axis=1)",
             ("tests/test_quant.py -k triton",)),
    Mutation("layer forgets the routed scaling factor", "epmoe/layer.py",
             "out_TD.mul_(self.cfg.routed_scaling_factor)", "out_TD.mul_(1.0)",
             ("tests/test_layer.py -k local_dispatcher",), "deepseek_v3"),
    Mutation("reference experts skip the re-quantization of h", "epmoe/experts/reference.py",
             "h = dequantize_act_ref(*quantize_act_ref(h)) if fp8 else h.to(h_dtype).float()",
             "h = h if fp8 else h.to(h_dtype).float()",
             ("tests/test_experts_vs_oracle.py -k reference and fp8",)),
    Mutation("ll dispatch drops expert 0 (mask ids > 0)", "epmoe/kernels/ll.py",
             "valid = kmask & (ids >= 0) & (ids < E)", "valid = kmask & (ids > 0) & (ids < E)",
             ("tests/test_ll.py -k emulated_consecutive",)),
    Mutation("ll combine (source mode) ignores the top-k weights", "epmoe/kernels/ll.py",
             "w = tl.load(wloc_ptr + pid * K + ks, mask=valid, other=0.0)", "w = tl.where(valid, 1.0, 0.0)",
             ("tests/test_ll.py -k emulated_consecutive",)),
    Mutation("alltoall skips the config agreement", "epmoe/dispatch/alltoall.py",
             "        self.check_same_config(fingerprints)", "        pass",
             ("tests/test_multirank.py::test_dispatchers_gloo[2]",)),
    Mutation("grouped GEMM: each expert's last row masked off", "epmoe/kernels/grouped_gemm.py",
             "m_mask = offs_m < row_end", "m_mask = offs_m < row_end - 1",
             ("tests/test_experts_vs_oracle.py -k triton and fp32",)),
    Mutation("row-index gate-ups run every tuned entry on the pointer kernel", "epmoe/kernels/configs.py",
             "    if indexed and buckets is not tuned:", "    if indexed:",
             ("tests/test_triton_experts.py -k config_table_is_valid or row_index_launches",)),
]


@dataclass(frozen=True)
class RunResult:
    label: str
    failed: bool  # the run failed as a test failure (the bug caught)
    note: str  # "" for a clean pass or fail, else what went wrong


def copy_tree(dest: Path) -> None:
    for name in ("epmoe", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def environment(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
    env["PYTHONPATH"] = str(tree)
    env["TRITON_INTERPRET"] = "1"  # the CPU's way to run the kernels (tests/conftest.py sets it too)
    return env


def run_pytest(tree: Path, spec: str) -> RunResult:
    args = spec.split(" -k ", 1)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", args[0]]
    if len(args) == 2:
        cmd += ["-k", args[1]]
    try:
        r = subprocess.run(cmd, cwd=tree, env=environment(tree), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return RunResult(f"pytest {spec}", False, f"timed out after {RUN_TIMEOUT_S} s")
    notes = {0: "", 1: "", 5: "no test collected"}
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    note = notes.get(r.returncode, f"exit code {r.returncode}: {tail[0]}")
    return RunResult(f"pytest {spec}", r.returncode == 1, note)


def run_check(tree: Path, cases: str) -> RunResult:
    cmd = [sys.executable, "-m", "epmoe.cli", "check", "--device", "cpu", "--nproc", "2", "--cases", cases]
    label = f"epmoe check --nproc 2 --cases {cases}"
    try:
        r = subprocess.run(cmd, cwd=tree, env=environment(tree), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return RunResult(label, False, f"timed out after {RUN_TIMEOUT_S} s")
    if not any(line.endswith(" failed") for line in r.stdout.splitlines()):  # its "N passed, M failed" line
        return RunResult(label, False, f"exit code {r.returncode} before the summary: {r.stderr.strip()[-200:]}")
    return RunResult(label, r.returncode == 1, "")


def runs_of(m: Mutation, tree: Path) -> list[RunResult]:
    results = [run_pytest(tree, spec) for spec in m.tests]
    if m.check_cases:
        results.append(run_check(tree, m.check_cases))
    return results


def plant(m: Mutation, tree: Path) -> str | None:
    """Apply m to the scratch copy; the reason it cannot be applied, or None."""
    path = tree / m.path
    if not path.exists():
        return f"TARGET NOT FOUND: no file {m.path}"
    text = path.read_text()
    found = text.count(m.pattern)
    if found != 1:
        return f"TARGET NOT FOUND: {m.pattern!r} in {m.path}" if not found else \
            f"TARGET AMBIGUOUS: {m.pattern!r} found {found} times in {m.path}"
    path.write_text(text.replace(m.pattern, m.replacement))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="mutations whose name contains one of these words")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args(argv)
    todo = [m for m in MUTATIONS if args.only is None or any(w in m.name for w in args.only)]
    scratch = Path(tempfile.mkdtemp(prefix="epmoe_plant_"))
    tree = scratch / "tree"
    copy_tree(tree)
    print(f"scratch copy: {tree}", flush=True)
    rows, bad = [], 0
    try:
        if not args.no_baseline:
            specs = sorted({s for m in todo for s in m.tests})
            cases = sorted({c for m in todo if m.check_cases for c in m.check_cases.split(",")})
            baseline = [run_pytest(tree, s) for s in specs] + ([run_check(tree, ",".join(cases))] if cases else [])
            broken = [r for r in baseline if r.failed or r.note]
            for r in baseline:
                print(f"baseline: {'FAILS' if r.failed or r.note else 'passes'}  {r.label} {r.note}", flush=True)
            if broken:
                print("the unmutated tree fails: fix that first, a caught mutation means nothing now")
                return 1
        for m in todo:
            t0 = time.monotonic()
            original = (tree / m.path).read_text() if (tree / m.path).exists() else None
            problem = plant(m, tree)
            if problem is not None:
                rows.append((m, problem, []))
                bad += 1
                print(f"{problem}  ({m.name})", flush=True)
                continue
            try:
                results = runs_of(m, tree)
            finally:
                (tree / m.path).write_text(original)
            caught = [r for r in results if r.failed]
            verdict = "CAUGHT" if caught else "MISSED"
            bad += not caught
            rows.append((m, verdict, results))
            print(f"{verdict:7s} {m.name} ({m.path}, {time.monotonic() - t0:.0f} s)", flush=True)
            for r in results:
                print(f"          {'fails ' if r.failed else 'passes'} {r.label} {r.note}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    caught = sum(v == "CAUGHT" for _, v, _ in rows)
    print(f"\n{caught} of {len(rows)} planted bugs caught; {bad} missed or not planted")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
