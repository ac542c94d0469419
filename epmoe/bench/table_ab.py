"""Time the expert kernels under one launch table (or revision of the code) against another, on one GPU.

`epmoe bench experts` or `epmoe bench moe` runs again and again, each run in its own process with
`EPMOE_GEMM_TABLE` naming one of the two tables, in the order old new new old (old new per round, the
second round reversed, so that a drift of the machine's clock or temperature over the runs weighs on both
alike). Prints each point's median time under both tables and old / new (above 1: the new table is
faster), and the spread of the runs (the largest time over the smallest, of either table), which says how
far a ratio can be trusted; writes the runs' JSON and ab.json under --out.

    python -m epmoe.bench.table_ab --old OLD.json [--new NEW.json] [--rounds 2] [--out DIR] experts --tokens 16 128
    python -m epmoe.bench.table_ab --old OLD.json moe --quant bf16 --tokens 2048 4096
    python -m epmoe.bench.table_ab --old OLD.json --set down:group_m=4 experts --tokens 16
    python -m epmoe.bench.table_ab --old OLD.json --put 'down_fp8@16={"block_m": 16, ...}' moe --tokens 128
    python -m epmoe.bench.table_ab --old-code DIR moe --quant bf16 --tokens 4096

--old-code DIR compares code rather than tables: the old runs import the epmoe package in DIR (another
revision's: `git archive REV epmoe | tar -x -C DIR`) under that revision's own table for the GPU, the new
runs this checkout.

NEW defaults to the checkout's table for the GPU (epmoe/kernels/configs*.json, `configs.table_path`); with
--set, NEW is OLD with one field of every config in the entries whose key begins with a prefix set to a
value (JSON: true, 3), with --put, OLD with one bucket's config replaced (both: the settings first),
written to OUT/new.json. The bench's own arguments follow its name. `git show
main:epmoe/kernels/configs.json > old.json` makes OLD main's default table (on an H100: configs_h100.json).
Points timed: experts, the Triton bf16 and fp8 MLPs (and the batched layout's bf16 where the bench runs
it); moe, each epmoe row's GPU time (a row over tolerance is reported as such).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from .._table import format_table
from ..kernels import configs

BENCHES = {"experts": "experts.json", "moe": "moe.json"}
EXPERTS_TIMES = ("triton_bf16_ms", "triton_fp8_ms", "triton_bf16_bat_ms")


def schedule(rounds: int) -> list[str]:
    """The tables' order: old new, then new old, and so on (`rounds` of each)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [tag for r in range(rounds) for tag in (("old", "new") if r % 2 == 0 else ("new", "old"))]


def times(bench: str, result: dict) -> tuple[dict[str, float], list[str]]:
    """({point: ms}, [points over tolerance]) of one run's JSON."""
    got, bad = {}, []
    for p in result["points"]:
        if bench == "experts":
            for key in EXPERTS_TIMES:
                if key in p:
                    got[f"{p['shape']} t={p['tokens_per_expert']} {key[:-3]}"] = p[key]
        elif p["impl"].startswith("epmoe"):
            name = f"{p['shape']} T={p['T']} {p['quant']} {p['impl']}"
            got[name] = p["gpu_us"] / 1e3
            if not p["ok"]:
                bad.append(name)
    return got, bad


def derive(old: Path, settings: Sequence[str], out: Path, puts: Sequence[str] = ()) -> Path:
    """OLD's table with each setting `PREFIX:FIELD=VALUE` applied to every config of the entries whose key
    begins with PREFIX (VALUE in JSON), then each `KEY@BOUND=CONFIG` of `puts` replacing the config of the
    entry KEY's bucket BOUND with CONFIG (a JSON object), written to `out`; ValueError for a setting or put
    that is malformed or matches no entry or bucket."""
    table = json.loads(old.read_text())
    for setting in settings:
        prefix, sep, assignment = setting.partition(":")
        field, eq, value = assignment.partition("=")
        if not (sep and eq and prefix and field):
            raise ValueError(f"--set takes PREFIX:FIELD=VALUE (down:group_m=4), got {setting!r}")
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--set {setting!r}: the value is not JSON ({exc})") from exc
        keys = [key for key in table["tables"] if key.startswith(prefix)]
        if not keys:
            raise ValueError(f"--set {setting!r}: no entry of {old} begins with {prefix!r}")
        for key in keys:
            for _, cfg in table["tables"][key]:
                cfg[field] = value
    for put in puts:
        target, eq, value = put.partition("=")
        key, at, bound = target.partition("@")
        if not (eq and at and key and bound.isdigit()):
            raise ValueError(f"--put takes KEY@BOUND=CONFIG (down_fp8@16='{{\"block_m\": 16, ...}}'), got {put!r}")
        try:
            cfg = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--put {put!r}: the config is not JSON ({exc})") from exc
        if not isinstance(cfg, dict):
            raise ValueError(f"--put {put!r}: the config is not a JSON object")
        buckets = [entry for entry in table["tables"].get(key, ()) if entry[0] == int(bound)]
        if not buckets:
            raise ValueError(f"--put {put!r}: {old} has no entry {key!r} with a bucket {bound}")
        buckets[0][1] = cfg
    table["comment"] = f"{old} with " + ", ".join([*settings, *puts])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    return out


def compare(runs: list[tuple[str, dict[str, float]]]) -> list[dict]:
    """Per point timed in every run: the median ms under each table, old / new, and the runs' spread."""
    names = set.intersection(*(set(t) for _, t in runs))
    rows = []
    for name in sorted(names):
        by = {tag: [t[name] for g, t in runs if g == tag] for tag in ("old", "new")}
        every = by["old"] + by["new"]
        old, new = statistics.median(by["old"]), statistics.median(by["new"])
        rows.append({"point": name, "old_ms": old, "new_ms": new, "old_over_new": old / new,
                     "spread": max(every) / min(every)})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.table_ab", description=__doc__.split("\n\n")[0])
    old = p.add_mutually_exclusive_group(required=True)
    old.add_argument("--old", type=Path, help="the launch table to compare against")
    old.add_argument("--old-code", type=Path, metavar="DIR", help="a folder holding another revision's epmoe "
                     "package: the old runs import it, under its own launch table for the GPU")
    new = p.add_mutually_exclusive_group()
    new.add_argument("--new", type=Path, help="the launch table to try (default: the checkout's table for this "
                     "GPU, `configs.table_path`)")
    new.add_argument("--set", action="append", metavar="PREFIX:FIELD=VALUE", help="try OLD with FIELD=VALUE in "
                     "the configs of the entries whose key begins with PREFIX (repeatable)")
    p.add_argument("--put", action="append", metavar="KEY@BOUND=CONFIG", help="try OLD (with any --set) with the "
                   "config of entry KEY's bucket BOUND replaced by CONFIG, a JSON object (repeatable)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each table")
    p.add_argument("--out", type=Path, default=Path("table_ab"), help="folder for the runs' JSON and ab.json")
    p.add_argument("bench", choices=sorted(BENCHES))
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of `epmoe bench BENCH`")
    args = p.parse_args(argv)
    order = schedule(args.rounds)
    try:  # refuse a table that cannot serve every launch before any run
        if args.old_code:
            if args.set or args.put:
                raise ValueError("--set and --put derive NEW from the table --old names, not from --old-code")
            if not (args.old_code / "epmoe" / "__init__.py").is_file():
                raise ValueError(f"--old-code {args.old_code}: no epmoe package there")
        else:
            configs._table(args.old.resolve())
        if args.new and args.put:
            raise ValueError("--put derives NEW from OLD: give --new or --put, not both")
        new_table = (derive(args.old, args.set or [], args.out / "new.json", args.put or []) if args.set or args.put
                     else args.new or configs.table_path())
        configs._table(new_table.resolve())
    except ValueError as exc:
        p.error(str(exc))
    code = args.old_code.resolve() if args.old_code else None
    tables = {"old": None if code else args.old.resolve(), "new": new_table.resolve()}
    runs, bad = [], set()
    for i, tag in enumerate(order):
        folder = (args.out / f"{i}_{tag}").resolve()
        cmd = [sys.executable, "-m", "epmoe.cli", "bench", args.bench, *args.args, "--out", str(folder)]
        print(f"# run {i + 1}/{len(order)}, {tag}: {' '.join(cmd)}", flush=True)
        env = {k: v for k, v in os.environ.items() if k != configs.TABLE_ENV}
        cwd = None
        if tables[tag] is not None:
            env[configs.TABLE_ENV] = str(tables[tag])
        else:  # the other revision's package first on the path (`-m` puts the working folder first)
            env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
            cwd = code
        subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
        got, over = times(args.bench, json.loads((folder / BENCHES[args.bench]).read_text()))
        runs.append((tag, got))
        bad.update(f"{n} ({tag})" for n in over)
    rows = compare(runs)
    print(format_table(["point", "old ms", "new ms", "old/new", "spread"],
                       [[r["point"], f"{r['old_ms']:.4f}", f"{r['new_ms']:.4f}", f"{r['old_over_new']:.3f}",
                         f"{r['spread']:.3f}"] for r in rows]))
    if bad:
        print("over tolerance: " + ", ".join(sorted(bad)))
    (args.out / "ab.json").write_text(json.dumps({"tables": {k: v and str(v) for k, v in tables.items()},
                                                  "old_code": code and str(code), "order": order,
                                                  "bench": args.bench, "args": args.args, "rows": rows,
                                                  "over_tolerance": sorted(bad)}, indent=1) + "\n")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
