"""What the warp-specialized kernel's fp8 consumers spend on K-block scale loads and on the epilogue's stores at
decode sizes: timing-only copies of epmoe/kernels/grouped_gemm_ws.py whose outputs are wrong on purpose.

    python3 scripts/consumer_probe.py [--points qwen3-30b:16 dsv2-lite:16 mixtral-8x7b:16 qwen3-30b:64]
        [--rep-ms 40] [--rounds 3]

Variants: base (the kernel as it is), noscale (each K block's a_scale and b_scale not loaded: every scale 1),
nostore (the quantized h and its scales stored under a mask that is false at run time: the epilogue computes
them and issues the stores, no bytes move), both. Per point (mlp_parts' inputs, exactly t rows per expert,
the committed table's entries), the fp8 gate-up alone and the whole MLP (its down on the variant too), each
the median over rounds of `epmoe.timing.flushed_ms`, the variants alternating in each round's order.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
from pathlib import Path

import epmoe.kernels.grouped_gemm as gg
from epmoe.timing import flushed_ms
from mlp_parts import mlp_calls  # scripts/, on sys.path as the running script's folder

_SCALES = "return gl.load(a_scale_ptrs + g) * (gl.load(b_scale_at + g) * (kk < k_tiles).to(gl.float32))"
_NO_SCALES = "return gl.full_like(a_scale_ptrs, 1.0, dtype=gl.float32) * (kk < k_tiles).to(gl.float32)"
_STORES = ("            gl.store(c_scale_ptr + offs_m.to(gl.int64) * G_C + pid_n, scale, mask=m_mask)\n"
           "            _store_tile(c_ptr, q, row0 + ROW_OFF, row_end, pid_n * BLOCK_N, N, META)")
_NO_STORES = _STORES.replace("mask=m_mask)", "mask=m_mask & (offs_m < 0))").replace("row_end, pid_n", "-1, pid_n")


def variants() -> dict:
    """{name: module}: copies of grouped_gemm_ws with the edits above, imported from files beside it (the
    kernel's relative imports need the package; the files are removed once imported: Gluon keeps the
    source it read)."""
    path = Path(gg.__file__).with_name("grouped_gemm_ws.py")
    src = path.read_text()
    for old in (_SCALES, _STORES):
        if old not in src:
            raise SystemExit(f"grouped_gemm_ws.py changed: no {old.strip()[:60]!r}")
    sources = {"base": src, "noscale": src.replace(_SCALES, _NO_SCALES), "nostore": src.replace(_STORES, _NO_STORES),
               "both": src.replace(_SCALES, _NO_SCALES).replace(_STORES, _NO_STORES)}
    mods = {}
    for name, text in sources.items():
        copy = path.with_name(f"_probe_ws_{name}.py")
        copy.write_text(text)
        try:
            mods[name] = importlib.import_module(f"epmoe.kernels._probe_ws_{name}")
        finally:
            copy.unlink()
    return mods


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", nargs="+", default=["qwen3-30b:16", "dsv2-lite:16", "mixtral-8x7b:16", "qwen3-30b:64"],
                   help="shape:t (epmoe.bench.experts.SHAPES)")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    mods = variants()
    for point in args.points:
        shape, t = point.split(":")
        calls, _ = mlp_calls(shape, int(t), True, 131072)
        us = {name: {"gate_up": [], "mlp": []} for name in mods}
        for rnd in range(args.rounds):
            order = list(mods) if rnd % 2 == 0 else list(reversed(mods))
            for name in order:
                gg.grouped_gemm_ws = mods[name]  # the launcher's module for both GEMMs
                for part in ("gate_up", "mlp"):
                    us[name][part].append(flushed_ms(calls[part], rep_ms=args.rep_ms) * 1e3)
        base = {part: statistics.median(us["base"][part]) for part in ("gate_up", "mlp")}
        for name in mods:
            up, mlp = (statistics.median(us[name][part]) for part in ("gate_up", "mlp"))
            print(f"{shape} t={t} {name:8s} gate_up {up:7.1f} us ({up / base['gate_up']:.3f} of base)"
                  f"  mlp {mlp:7.1f} us ({mlp / base['mlp']:.3f})  rounds {[round(v, 1) for v in us[name]['gate_up']]}",
                  flush=True)


if __name__ == "__main__":
    main()
