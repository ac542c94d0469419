"""Compile the expert kernels for sm_90 with the table's launch configs, without a GPU (ptxas ships with
triton); fails on compiler front-end errors and on register spills. Run by test_triton_experts.py in a
process without TRITON_INTERPRET. Exit 3 = this Triton's compiler cannot be driven this way (skip)."""
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

from epmoe.kernels import configs
from epmoe.kernels.grouped_gemm import _grouped_gemm_kernel
from epmoe.kernels.quant import _quantize_act_kernel

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as exc:
    print(f"no ASTSource/GPUTarget: {exc}")
    sys.exit(3)

SMEM_LIMIT = 232448  # bytes of shared memory one H100/H200 block may use
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_hopper(fn, signature, constexprs, aligned, num_warps, num_stages, maxnreg=None):
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    names = fn.arg_names  # attributes are keyed by the kernel's parameter positions
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    try:
        src = ASTSource(fn, sig, constexprs, attrs)
    except TypeError as exc:
        print(f"ASTSource signature differs: {exc}")
        sys.exit(3)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))


def _resource_usage(kernel, key: str) -> int:
    """Sum of `key` (e.g. STACK, REG) over cuobjdump's resource usage of the kernel (0 without cuobjdump)."""
    if not CUOBJDUMP.exists():
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True,
                             text=True).stdout
    return sum(int(word.split(":")[1]) for word in out.split() if word.startswith(f"{key}:"))


def spill_bytes(kernel) -> int:
    """Stack bytes per thread (register spills)."""
    return _resource_usage(kernel, "STACK")


def registers(kernel) -> int:
    """Registers per thread (0 when cuobjdump is not available)."""
    return _resource_usage(kernel, "REG")


def main() -> None:
    failures = []
    variants = [(op, dtype, False) for op in configs.OPS for dtype in ("bf16", "fp32", "fp8e4nv")]
    variants.append(("gate_up", "fp8e4nv", True))  # bf16 x quantized inside the kernel (batched layout)
    for op, dtype, quant_a in variants:
        fp8 = dtype == "fp8e4nv"
        for bound, _ in configs._table()[configs.table_key(op, fp8)]:
            cfg = configs.gemm_config(op, fp8=fp8, rows_hint=bound, on_gpu=True,
                                      element_size=4 if dtype == "fp32" else 2)
            if quant_a and (bound > 64 or cfg.block_k != 128):
                continue
            gate = op == "gate_up"
            quant_out = gate and fp8 and cfg.block_n == 128
            a = "*bf16" if quant_a else f"*{dtype}"
            c = ("*fp8e4nv" if quant_out else "*fp32") if gate and fp8 else f"*{dtype}"
            signature = dict(
                a_ptr=a, a_scale_ptr="*fp32", a_rows_ptr="*i32", b_ptr=f"*{dtype}", b_scale_ptr="*fp32", c_ptr=c, c_scale_ptr="*fp32",
                row_scale_ptr="*fp32", index_ptr="*i32", L="i32", SLOT_ROWS="i32", R="i32", N="i32", K="i32",
                stride_bl="i64", stride_bsl="i32", stride_bsn="i32", G_A="i32", G_C="i32")
            gather = gate and bound > 64
            if cfg.tma:  # TMA descriptors for B, and for A unless A is read through a row index
                signature["b_desc"] = f"tensordesc<{dtype}[{cfg.block_n}, {cfg.block_k}]>"
                if not gather:
                    signature["a_desc"] = f"tensordesc<{a[1:]}[{cfg.block_m}, {cfg.block_k}]>"
            descriptors = {name: None for name in ("a_desc", "b_desc") if name not in signature}
            constexprs = dict(
                descriptors, TMA_A="a_desc" in signature, TMA_B="b_desc" in signature,
                BATCHED=bound <= 64, GATHER=gather, GATE_UP=gate, FP8=fp8, QUANT_OUT=quant_out, HAS_ROW_SCALE=not gate,
                TILE_B_SCALE=fp8 and cfg.block_n <= 128, QUANT_A=quant_a, UPCAST=False, IEEE=dtype == "fp32",
                EVEN_K=True, L_POW2=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, SCALE_GROUP=128)
            kernel = compile_hopper(_grouped_gemm_kernel, signature, constexprs,
                                    ["a_ptr", "b_ptr", "c_ptr", "N", "K", "stride_bl"],
                                    cfg.num_warps, cfg.num_stages)
            spills, shared = spill_bytes(kernel), kernel.metadata.shared
            tag = f"{op} {dtype}{' (x quantized in kernel)' if quant_a else ''} rows<={bound}"
            print(f"{tag} {cfg}: shared {shared} B, spills {spills} B")
            if shared > SMEM_LIMIT:
                failures.append(f"{tag}: {shared} B of shared memory")
            if spills and dtype != "fp32":  # float32 is a correctness path, not a fast one
                failures.append(f"{tag}: {spills} B of register spills")
    compile_hopper(_quantize_act_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32", R="i32",
                                              D="i32", G="i32"),
                   dict(BLOCK_ROWS=16, GROUP=128, ROUND_FIRST=False), ["x_ptr", "q_ptr", "D"], 4, 1)
    if failures:
        print("\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
