"""Compile the expert kernels for sm_90 without a GPU (ptxas ships with triton): the pointer kernel with
the launch config of every entry of every committed table (configs*.json), and the warp-specialized Gluon
kernel with those tables' entries and the tuner's candidates. Fails on compiler front-end errors, register
spills, shared memory past the limit and (warp-specialized kernel) wgmma that ptxas serializes. Run by test_triton_experts.py in a process
without TRITON_INTERPRET; the compiles run in parallel processes. Exit 3 = this Triton's compiler cannot
be driven this way (skip)."""
import dataclasses
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as exc:
    print(f"no ASTSource/GPUTarget: {exc}")
    sys.exit(3)

from epmoe.kernels.configs import SHARED_BYTES

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_hopper(fn, signature, constexprs, aligned, num_warps, num_stages, maxnreg=None, source=ASTSource):
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    names = fn.arg_names  # attributes are keyed by the kernel's parameter positions
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    try:
        src = source(fn, sig, constexprs, attrs)
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


def wgmma_serialized(kernel) -> bool:
    """Whether ptxas serializes the kernel's wgmma (its info C7514), from `ptxas -v` on the kernel's PTX
    with the ptxas this Triton uses for sm_90."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True).stderr
    return "C7514" in log


def barrier_inits_fenced(ptx: str) -> bool:
    """Whether a kernel's mbarrier inits reach the async proxy before a TMA copy, which completes on one of
    them (the CUDA programming guide's fence.proxy.async after the init): in the PTX's order, no copy after
    an init without a proxy fence between them."""
    pending = False  # an init that no fence has followed yet
    for line in ptx.splitlines():
        if "mbarrier.init" in line:
            pending = True
        elif "fence.proxy.async" in line:
            pending = False
        elif pending and "cp.async.bulk.tensor" in line and "mbarrier::complete_tx" in line:
            return False
    return True


def table_gpus() -> list[str]:
    """One GPU name per committed launch table: the tables whose configs are compiled (the default table
    among them: it lists the GPU it was tuned on)."""
    from epmoe.kernels import configs
    names = {path: name for name, path in sorted(configs.device_tables().items())}
    assert configs.TABLE_PATH in names, f"{configs.TABLE_PATH} lists no GPU: its configs would go uncompiled"
    return sorted(names.values())


def _pointer_config(op: str, dtype: str, bound: int, gather: bool | None, gpu: str):
    """(config, gather) the launcher takes on the GPU named `gpu` for rows-per-expert bucket `bound`: batched
    up to 64 rows, contiguous above (gate-up: through a row index, with the `_indexed` entry; gather: through
    a row index at any bound); a warp-specialized entry's `pointer_variant` (which serves fp32 and rows read
    through an index)."""
    from epmoe.kernels import configs
    fp8 = dtype == "fp8e4nv"
    gather = op == "gate_up" and bound > 64 if gather is None else gather
    element_size = 4 if dtype == "fp32" else 2
    if gather and bound <= configs.HAND_SET_ROWS:  # an `_indexed` table's own hand-set bucket
        cfg = next(c for b, c in configs._table(gpu=gpu)[configs.table_key(op, fp8, indexed=True)] if bound <= b)
    else:
        cfg = configs.gemm_config(op, fp8=fp8, rows_hint=bound, on_gpu=True, gpu=gpu, element_size=element_size,
                                  indexed=gather)
    return cfg.pointer_variant(1 if fp8 else element_size), gather


def _pointer_kernel(op: str, dtype: str, bound: int, quant_a: bool, gather: bool | None = None,
                    dependent: bool = False, gpu: str = "", swap: bool = False):
    """The pointer kernel as the launcher runs it on Hopper (`_pointer_config`; swap: with swap_ab set, else
    as the entry sets it); a gate-up lets its dependent start early, a dependent down waits for it."""
    from epmoe.kernels.grouped_gemm import GDC_NONE, GDC_TRIGGER, GDC_WAIT, _grouped_gemm_kernel
    fp8 = dtype == "fp8e4nv"
    gate = op == "gate_up"
    cfg, gather = _pointer_config(op, dtype, bound, gather, gpu)
    cfg = dataclasses.replace(cfg, swap_ab=cfg.swap_ab or swap)
    quant_out = gate and fp8 and cfg.block_n == 128
    a = "*bf16" if quant_a else f"*{dtype}"
    c = ("*fp8e4nv" if quant_out else "*fp32") if gate and fp8 else f"*{dtype}"
    signature = dict(
        a_ptr=a, a_scale_ptr="*fp32", a_rows_ptr="*i32", b_ptr=f"*{dtype}", b_scale_ptr="*fp32", c_ptr=c,
        c_scale_ptr="*fp32", row_scale_ptr="*fp32", index_ptr="*i32", L="i32", SLOT_ROWS="i32", R="i32", N="i32",
        K="i32", stride_bl="i64", stride_bsl="i32", stride_bsn="i32", G_A="i32", G_C="i32")
    if cfg.tma:  # TMA descriptors for B, and for A unless A is read through a row index
        signature["b_desc"] = f"tensordesc<{dtype}[{cfg.block_n}, {cfg.block_k}]>"
        if not gather:
            signature["a_desc"] = f"tensordesc<{a[1:]}[{cfg.block_m}, {cfg.block_k}]>"
    descriptors = {name: None for name in ("a_desc", "b_desc") if name not in signature}
    constexprs = dict(
        descriptors, TMA_A="a_desc" in signature, TMA_B="b_desc" in signature,
        BATCHED=bound <= 64 and not gather, GATHER=gather, GATE_UP=gate, FP8=fp8, QUANT_OUT=quant_out, HAS_ROW_SCALE=not gate,
        TILE_B_SCALE=fp8 and cfg.block_n <= 128, QUANT_A=quant_a, UPCAST=False, IEEE=dtype == "fp32",
        EVEN_K=True, L_POW2=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SCALE_GROUP=128, SWAP_AB=cfg.swap_ab,
        GDC=(GDC_TRIGGER if gate else GDC_WAIT if dependent else GDC_NONE).value)
    kernel = compile_hopper(_grouped_gemm_kernel, signature, constexprs,
                            ["a_ptr", "b_ptr", "c_ptr", "N", "K", "stride_bl"], cfg.num_warps, cfg.num_stages)
    return kernel, cfg


def _ws_kernel(op: str, fp8: bool, cfg, gather: bool = False, pipe_blocks: int = 0):
    """The warp-specialized kernel for one launch config as the launcher runs it (fp8 gate-up: h quantized
    in the epilogue for 128-column tiles, else float32 h; gather: A's rows through a row index; pipe_blocks:
    the pipelined fp8 loop's K blocks per iteration), with the most expert lanes its tile map takes (the
    most registers)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from epmoe.kernels import grouped_gemm_ws as ws
    dt, gdt = ("fp8e4nv", gl.float8e4nv) if fp8 else ("bf16", gl.bfloat16)
    gate = op == "gate_up"
    quant_out = gate and fp8 and cfg.block_n == 128
    c = "*fp8e4nv" if quant_out else ("*fp32" if gate and fp8 else "*bf16")
    a_block, b_block = [cfg.block_m, cfg.block_k], [cfg.block_n, cfg.block_k]
    a_layout = gl.NVMMASharedLayout.get_default_for(a_block, gdt)
    b_layout = gl.NVMMASharedLayout.get_default_for(b_block, gdt)
    out = torch.empty(1, 64, dtype=torch.float8_e4m3fn if quant_out else (
        torch.float32 if gate and fp8 else torch.bfloat16))
    a_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    tma_store = ws.uses_tma_store(cfg, a_dtype, out, gate, quant_out)
    store_rows = ws.uses_row_stores(cfg, a_dtype, out, gate, tma_store)
    c_block = ws.tma_store_block(cfg)
    c_desc = (f"tensordesc<bf16{c_block},{gl.NVMMASharedLayout.get_default_for(c_block, gl.bfloat16)!r}>"
              if tma_store else f"tensordesc<{dt}{b_block},{b_layout!r}>")
    signature = dict(
        a_desc=f"tensordesc<{dt}{a_block},{a_layout!r}>", b_desc=f"tensordesc<{dt}{b_block},{b_layout!r}>",
        c_desc=c_desc, a_ptr=f"*{dt}", a_rows_ptr="*i32", a_scale_ptr="*fp32", b_ptr=f"*{dt}", b_scale_ptr="*fp32",
        c_ptr=c,
        c_scale_ptr="*fp32", row_scale_ptr="*fp32",
        index_ptr="*i32", counter_ptr="*i32", L="i32", SLOT_ROWS="i32", R="i32", N="i32", K="i32", stride_bsl="i32",
        stride_bsn="i32",
        G_A="i32", G_C="i32")
    meta = ws.Meta(schedule=ws.SCHEDULES[cfg.warp_specialize], batched=False, gather=gather, gate_up=gate,
                   fp8=fp8, pipe_blocks=pipe_blocks, quant_out=quant_out, tma_store=tma_store, store_rows=store_rows,
                   has_row_scale=not gate, lanes=ws.MAX_EXPERTS, block_m=cfg.block_m, block_n=cfg.block_n,
                   block_k=cfg.block_k, group_m=cfg.group_m, stages=cfg.num_stages, claim=cfg.claim_tiles,
                   gdc_wait=cfg.pdl, swap=cfg.swap_ab)
    return compile_hopper(ws._ws_gemm_kernel, signature, dict(META=meta),
                          ["a_ptr", "a_scale_ptr", "b_ptr", "b_scale_ptr", "c_ptr", "index_ptr", "N", "K"],
                          cfg.num_warps, 1,
                          maxnreg=ws._MAX_REGISTERS, source=GluonASTSource)


def ws_jobs() -> list:
    """("ws", op, fp8, config, gather, pipe_blocks) of every warp-specialized launch config: the tuner's
    candidates and the table's entries, those of gate-ups through a row index (`_indexed`) with gather;
    a pipelined fp8 config once per K blocks per iteration it may run with (`grouped_gemm_ws.pipe_blocks`)."""
    from epmoe.kernels import grouped_gemm_ws as ws
    from epmoe.bench.experts_tune import INDEXED_CANDIDATES, WS_CANDIDATES, swap_candidates
    from epmoe.kernels import configs
    out = [(op, fp8, cfg, False) for (op, fp8), cands in WS_CANDIDATES.items() for cfg in cands]
    # the decode sweep's swapped tiles, the gate-ups' also through a row index
    out += [(op, fp8, cfg, gather) for op, fp8 in WS_CANDIDATES for cfg in swap_candidates(op, fp8)
            if cfg.warp_specialize for gather in ((False, True) if op == "gate_up" else (False,))]
    out += [("gate_up", fp8, cfg, True) for fp8, cands in INDEXED_CANDIDATES.items() for cfg in cands
            if cfg.warp_specialize]
    for table in (configs._table(gpu=gpu) for gpu in table_gpus()):
        for op in configs.OPS:
            for fp8 in (False, True):
                for indexed in ((False, True) if op == "gate_up" else (False,)):
                    for _, cfg in table[configs.table_key(op, fp8, indexed)]:
                        if cfg.warp_specialize and (op, fp8, cfg, indexed) not in out:
                            out.append((op, fp8, cfg, indexed))
    # the cooperative entries with claimed tiles, as tests/test_triton_experts.py runs them
    for op, fp8, cfg, gather in list(out):
        if cfg.warp_specialize == "cooperative" and (op, fp8, claimed := dataclasses.replace(
                cfg, claim_tiles=True), gather) not in out:
            out.append((op, fp8, claimed, gather))
    # every down both launched plainly and as the programmatic dependent of its gate-up (a table entry sets
    # pdl, and a down that does not follow its gate-up launches plainly with it)
    for op, fp8, cfg, gather in list(out):
        for pdl in ((False, True) if op == "down" else ()):
            if (job := (op, fp8, dataclasses.replace(cfg, pdl=pdl), gather)) not in out:
                out.append(job)
    return [("ws", op, fp8, cfg.to_dict(), gather, u) for op, fp8, cfg, gather in out
            for u in (sorted({ws.pipe_blocks(k, op == "gate_up") for k in range(1, 13)}) if fp8 and cfg.pipe_mma
                      else (0, ))]


# Table entries whose spills are measured and kept: under triton 3.6's ptxas the fp8 gate-up over rows read
# through an index with 128x128x128 tiles spills 24 B, and still ran 747 TFLOP/s on the H200 against 605 for
# the largest tile that does not spill (64x128x128; DeepSeek-V3, 128 rows per expert, `epmoe bench experts
# --tune`). (op, dtype, (block_m, block_n, block_k, num_warps, num_stages)) -> bytes allowed.
MEASURED_SPILLS_B = {("gate_up", "fp8e4nv", (128, 128, 128, 8, 3)): 24}


def pointer_jobs() -> list:
    """("pointer", op, dtype, bound, quant_a, gather, dependent, gpu, swap) of every pointer-kernel launch of
    every committed table, once per distinct kernel, and (swap) each bf16 and fp8 one of the hand-set buckets
    with swap_ab set."""
    jobs = []
    for gpu in table_gpus():
        jobs += [job + (gpu, swap) for job in _pointer_jobs(gpu)
                 for swap in ((False, True) if job[3] <= 64 and job[2] != "fp32" else (False,))]
    kernels = {}
    for job in jobs:
        _, op, dtype, bound, quant_a, gather, dependent, gpu, swap = job
        cfg, gathered = _pointer_config(op, dtype, bound, gather, gpu)
        kernels.setdefault((op, dtype, cfg, quant_a, gathered, bound <= 64 and not gathered, dependent,
                            swap or cfg.swap_ab), job)
    return list(kernels.values())


def _pointer_jobs(gpu: str) -> list:
    from epmoe.kernels import configs
    table = configs._table(gpu=gpu)
    jobs = [("pointer", op, dtype, bound, False, None, False) for op in configs.OPS
            for dtype in ("bf16", "fp32", "fp8e4nv")
            for bound, _ in table[configs.table_key(op, dtype == "fp8e4nv")]]
    # bf16 x quantized inside the fp8 gate-up kernel (batched layout, 128-deep K blocks; pointer entries only:
    # with a warp-specialized entry `gate_up` quantizes x first)
    # the downs as programmatic dependents of their gate-ups (`GemmConfig.pdl`)
    jobs += [job[:-1] + (True, ) for job in jobs if job[1] == "down" and job[2] != "fp32"]
    jobs += [("pointer", "gate_up", "fp8e4nv", bound, True, None, False)
             for bound, cfg in table[configs.table_key("gate_up", True)]
             if bound <= configs.HAND_SET_ROWS and cfg.block_k == 128 and cfg.warp_specialize is None]
    # the `_indexed` tables' own hand-set pointer entries, reading rows through the index
    jobs += [("pointer", "gate_up", dtype, bound, False, True, False) for dtype in ("bf16", "fp8e4nv")
             for bound, cfg in table.get(configs.table_key("gate_up", dtype == "fp8e4nv", True), ())
             if bound <= configs.HAND_SET_ROWS and cfg.warp_specialize is None]
    return jobs


def run_job(job) -> tuple[str, list[str]]:
    """(report line, failures) of one compile."""
    if job[0] == "ws":
        from epmoe.bench.experts_tune import describe
        from epmoe.kernels.configs import GemmConfig
        _, op, fp8, cfg, gather, pipe_blocks = job
        cfg = GemmConfig(**cfg)
        kernel = _ws_kernel(op, fp8, cfg, gather, pipe_blocks)
        tag = f"ws {op} {'fp8' if fp8 else 'bf16'}{' gather' if gather else ''} {describe(cfg)}"
        tag += f" {pipe_blocks} blocks an iteration" if pipe_blocks else ""
        tag += " tma-store" if "cp.async.bulk.tensor.2d.global.shared" in kernel.asm["ptx"] else ""
        serialized = wgmma_serialized(kernel)
        check_spills = True
        dependent = cfg.pdl
    else:
        _, op, dtype, bound, quant_a, gather, dependent, gpu, swap = job
        kernel, cfg = _pointer_kernel(op, dtype, bound, quant_a, gather, dependent, gpu, swap)
        tag = (f"{op} {dtype}{' (x quantized in kernel)' if quant_a else ''}{' gather' if gather else ''}"
               f"{' dependent' if dependent else ''} rows<={bound} {cfg}")
        serialized = False
        check_spills = dtype != "fp32"  # float32 is a correctness path, not a fast one
    spills, shared = spill_bytes(kernel), kernel.metadata.shared
    if job[0] != "ws":
        tiles = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
        spills = max(0, spills - MEASURED_SPILLS_B.get((op, dtype, tiles), 0))
    failures = []
    # a gate-up triggers its dependent once; a dependent down waits once in each partition (the loader's and
    # each consumer's) of the warp-specialized kernel
    partitions = 1 if job[0] != "ws" else 2 if cfg.warp_specialize == "cooperative" else 3
    for instruction, want in (("griddepcontrol.launch_dependents", int(op == "gate_up")),
                              ("griddepcontrol.wait", partitions if dependent else 0)):
        if (count := kernel.asm["ptx"].count(instruction)) != want:
            failures.append(f"{tag}: {count} {instruction}, {want} wanted")
    # a dependent warp-specialized down with static tiles prefetches its first tiles' weights before its wait
    prefetches = job[0] == "ws" and dependent and not cfg.claim_tiles and cfg.warp_specialize != "split"
    if ("prefetch.global.L2" in kernel.asm["ptx"]) != prefetches:
        failures.append(f"{tag}: L2 prefetch {'missing' if prefetches else 'present'}")
    if shared > SHARED_BYTES:
        failures.append(f"{tag}: {shared} B of shared memory")
    if spills and check_spills:
        failures.append(f"{tag}: {spills} B of register spills")
    if serialized:
        failures.append(f"{tag}: ptxas serializes its wgmma")
    if cfg.swap_ab and "wgmma" not in kernel.asm["ptx"]:  # the weights fill the wgmma's 64-row M side
        failures.append(f"{tag}: swap_ab without wgmma")
    if job[0] == "ws" and not barrier_inits_fenced(kernel.asm["ptx"]):  # (the pointer kernel's are Triton's)
        failures.append(f"{tag}: a TMA copy completes on an mbarrier before a proxy fence follows its init")
    return f"{tag}: shared {shared} B, spills {spills} B{', wgmma serialized' if serialized else ''}", failures


def main() -> None:
    try:
        import epmoe.kernels.grouped_gemm_ws  # noqa: F401
        jobs = ws_jobs()
    except ImportError as exc:
        print(f"no warp-specialized kernel with this Triton: {exc}")
        jobs = []
    jobs += pointer_jobs()
    failures = []
    with ProcessPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        for line, failed in pool.map(run_job, jobs):
            print(line, flush=True)
            failures += failed
    from epmoe.kernels.quant import _quantize_act_kernel
    compile_hopper(_quantize_act_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32", R="i32",
                                              D="i32", G="i32"),
                   dict(BLOCK_ROWS=16, GROUP=128, ROUND_FIRST=False), ["x_ptr", "q_ptr", "D"], 4, 1)
    if failures:
        print("\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
