"""Compile the `ht` kernels for sm_90 without a GPU (ptxas ships with triton), with the launch configs the
launchers pick on an H200 (132 SMs) for the benchmark shape (D 7168, K 8, L 128; bf16 and fp8) and a small
one; fails on compiler errors, register spills (the combine, compiled under the register cap ht_launch
gives it: more than COMBINE_SPILL_BYTES at its R), a combine at R 2 taking more registers than let its
programs share an SM, and on 16-byte vector accesses missing from the row copies of the benchmark
shape. Also compiles the combine at R 8. Run by test_ht_compile.py in a process without
TRITON_INTERPRET. Exit 3 = this Triton's compiler cannot be driven this way (skip)."""
import sys

import triton

from compile_hopper import compile_hopper, registers, spill_bytes
from epmoe.kernels.ht import combine, launch as ht_launch, layout, send
from epmoe.kernels.layout import SCAN_BLOCKS, SCAN_EXPERTS, SCAN_SUM_STEP, layout_blocks
from epmoe.kernels.sync import _barrier_kernel

SMS = 132
# spills the combine may have under its cap (80 registers, six programs an SM), by R: ptxas of triton 3.6
# (the GPU machine's) spills none at R 2 and 8 B at R 8, that of triton 3.9 none and 232 B (D 7168; R 8
# is untimed: no 8-GPU machine here)
COMBINE_SPILL_BYTES = {2: 32, 8: 256}


def check(tag, kernel, failures, vector, spill_limit=0):
    ptx = kernel.asm["ptx"]
    spills, v4 = spill_bytes(kernel), ptx.count("st.global.v4")
    print(f"{tag}: spills {spills} B, 16-byte stores {v4}")
    if spills > spill_limit:
        failures.append(f"{tag}: {spills} B of register spills")
    if vector and not v4:
        failures.append(f"{tag}: no 16-byte vector stores")


def main() -> None:
    failures = []
    # registers a combine thread may take
    fits = ht_launch.registers_per_thread(ht_launch.COMBINE_PER_SM, ht_launch.COMBINE_WARPS)
    for D, K, L, big in [(7168, 8, 128, True), (208, 3, 8, False)]:
        launch = ht_launch.gpu_launch(2 * D, SMS)  # bf16 rows
        G = -(-D // 128)
        for fp8 in (False, True):
            for dense in (False, True):
                dt = "fp8e4nv" if fp8 else "bf16"
                # as the launchers pass them: no slots or epoch in dense mode, no scales without fp8
                pointers = dict(slot_ptr="*i32", seq_ptr="*i64", recv_scale_peers="*i64")
                unused = (["slot_ptr", "seq_ptr"] if dense else []) + ([] if fp8 else ["recv_scale_peers"])
                check(f"dispatch_send D{D} {dt} dense {dense}", compile_hopper(
                    send._dispatch_send_kernel,
                    dict(x_ptr="*bf16", recv_x_peers="*i64", flag_peers="*i64", T="i32", rank="i32",
                         dense_parity="i32", C="i32", **{n: t for n, t in pointers.items() if n not in unused}),
                    dict(R=2, D=D, G=G, FP8=fp8, BLOCK_G=triton.next_power_of_2(G), ROWS=launch.rows(D),
                         PROGRAMS=launch.programs, DENSE=dense, **{n: None for n in unused}),
                    ["x_ptr"] if dense else ["x_ptr", "slot_ptr"], launch.num_warps, 1), failures, big)
        check(f"copy_rows D{D}", compile_hopper(
            send._copy_rows_kernel, dict(src_ptr="*bf16", dst_ptr="*bf16", T="i32"),
            dict(D=D, BLOCK_D=triton.next_power_of_2(D), ROWS=launch.rows(D), PROGRAMS=launch.programs),
            ["src_ptr", "dst_ptr"], launch.num_warps, 1), failures, big)
        chunk, rows = launch.combine_tiles(D)
        for R, remote, local in ((2, True, True), (2, False, True), (8, True, True)):
            # real ranks (2 and 8); the local half of emulated ones
            kernel = compile_hopper(
                combine._combine_kernel,
                dict(y_ptr="*bf16", pos_ptr="*i32", w_ptr="*fp32", count_ptr="*i32", slot_ptr="*i32", seq_ptr="*i64",
                     comb_ptr="*bf16", comb_peers="*i64", ready_ptr="*i64", ready_peers="*i64", control_ptr="*i32",
                     out_ptr="*bf16", T="i32", rank="i32", lag="i32", C="i32", NI="i32"),
                dict(R=R, D=D, K=K, BLOCK_K=triton.next_power_of_2(K), CHUNK=chunk, ROWS=rows,
                     REMOTE=remote, LOCAL=local, TIMEOUT_NS=60 * 10 ** 9, INTERPRET=False),
                ["y_ptr", "pos_ptr", "w_ptr", "comb_ptr", "out_ptr"], launch.combine_warps, 1,
                launch.combine_registers)
            tag = f"combine R{R} D{D} K{K} remote={remote} local={local}"
            check(tag, kernel, failures, big, COMBINE_SPILL_BYTES[R])
            regs = registers(kernel)
            print(f"{tag}: {regs} registers (cap {launch.combine_registers})")
            if big and remote and R == 2 and regs > fits:  # (the cap holds this: guards gpu_launch's cap)
                failures.append(f"{tag}: {regs} registers, more than {fits} ({ht_launch.COMBINE_PER_SM} programs "
                                "an SM)")
        blocks = layout_blocks(4096, K)
        common = dict(R=2, K=K, L=L, BLOCK_S=blocks.block_s, BLOCK_K=blocks.block_k)
        check(f"layout_count K{K} L{L}", compile_hopper(
            layout._layout_count_kernel, dict(ids_ptr="*i32", count_ptr="*i32", seq_ptr="*i64", table_ptr="*i32",
                                         flag_ptr="*i64", pairs_ptr="*i32", chunks_ptr="*i32", size_ptr="*i64",
                                         err_ptr="*i32", timeout_ns="i64", C="i32", NB="i32"),
            dict(common, BLOCK_L=triton.next_power_of_2(L), BLOCK_R=2, INTERPRET=False), ["ids_ptr", "table_ptr"],
            4, 1), failures, False)
        BL = triton.next_power_of_2(L)
        check(f"layout_scan L{L}", compile_hopper(
            layout._layout_scan_kernel,
            dict(table_ptr="*i32", count_ptr="*i32", seq_ptr="*i64", counts_ptr="*i32", offsets_ptr="*i32",
                 start_ptr="*i32", recv_counts_ptr="*i32", B="i32"),
            dict(R=2, L=L, BLOCK_T=max(1, SCAN_SUM_STEP // BL), BLOCK_B=SCAN_BLOCKS, BLOCK_E=SCAN_EXPERTS,
                 BLOCK_L=BL, BLOCK_R=2), ["table_ptr", "start_ptr"], 8, 1),
            failures, False)
        check(f"layout_place K{K} L{L}", compile_hopper(
            layout._layout_place_kernel,
            dict(ids_ptr="*i32", w_ptr="*fp32", count_ptr="*i32", seq_ptr="*i64", start_ptr="*i32", pos_ptr="*i32",
                 w_out_ptr="*fp32", rows_ptr="*i32", N="i32", C="i32", NB="i32"),
            common, ["ids_ptr", "w_ptr", "pos_ptr", "w_out_ptr", "rows_ptr"], 4, 1), failures, False)
        for dense in (False, True):
            check(f"number_block K{K} dense {dense}", compile_hopper(
                send._number_block_kernel, dict(ids_ptr="*i64", slot_ptr="*i32", table_ptr="*i32", seq_ptr="*i64",
                                             epoch_ptr="*i64", T="i32", NT="i32"),
                dict(R=2, K=K, L=L, BLOCK_T=send.NUMBER_BLOCK, BLOCK_R=2, DENSE=dense), ["ids_ptr", "slot_ptr"], 4, 1),
                failures, False)
            check(f"number_fix K{K} dense {dense}", compile_hopper(
                send._number_fix_kernel,
                dict(ids_ptr="*i64", w_ptr="*fp32", slot_ptr="*i32", table_ptr="*i32", seq_ptr="*i64",
                     epoch_ptr="*i64", done_ptr="*i32", recv_count_peers="*i64", pairs_peers="*i64",
                     chunks_peers="*i64", recv_ids_peers="*i64", recv_w_peers="*i64", flag_peers="*i64", T="i32",
                     NT="i32", rank="i32", chunks="i32", C="i32"),
                dict(R=2, K=K, L=L, BLOCK_K=triton.next_power_of_2(K), BLOCK_T=send.NUMBER_BLOCK, BLOCK_R=2,
                     BLOCK_NT=send.NUMBER_STEP, DENSE=dense), ["ids_ptr", "w_ptr", "slot_ptr", "table_ptr"], 4, 1),
                failures, False)
    compile_hopper(_barrier_kernel, dict(flag_peers="*i64", flag_ptr="*i64", err_ptr="*i32", timeout_ns="i64",
                                         target="i64", rank="i32"), dict(R=2, INTERPRET=False), [], 1, 1)
    compile_hopper(send._wait_kernel, dict(flag_ptr="*i64", seq_ptr="*i64", err_ptr="*i32", timeout_ns="i64",
                                        skip="i32"),
                   dict(R=2, PROGRAMS=ht_launch.gpu_launch(2 * 7168, SMS).programs, INTERPRET=False), [], 1, 1)
    if failures:
        print("\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
