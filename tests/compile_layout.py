"""Compile the layout engine's kernels (epmoe/kernels/layout.py) for sm_90 without a GPU (ptxas ships with
triton) at the local dispatcher's shapes (K 1 to 8, L up to 256, checked ids or not) and gather_sum's
blocks, and the graph input/output kernels (epmoe/kernels/graph_io.py); fails on compiler errors and register
spills. Run by test_layout.py in a process without
TRITON_INTERPRET. Exit 3 = this Triton's compiler cannot be driven this way (skip)."""
import sys

import triton

from compile_hopper import compile_hopper, spill_bytes
from epmoe.kernels import graph_io, layout


def main() -> None:
    failures = []

    def check(name: str, kernel) -> None:
        spills = spill_bytes(kernel)
        print(f"{name}: spills {spills} B")
        if spills:
            failures.append(f"{name}: {spills} B of register spills")

    for K, L in [(1, 8), (2, 8), (6, 64), (8, 128), (8, 256)]:
        blocks = layout.layout_blocks(4096, K)
        BL = triton.next_power_of_2(L)
        for check_ids in (False, True):
            consts = dict(K=K, L=L, BLOCK_S=blocks.block_s, BLOCK_K=blocks.block_k, CHECK=check_ids)
            check(f"count K{K} L{L} check {check_ids}", compile_hopper(
                layout._count_kernel, dict(ids_ptr="*i64", table_ptr="*i32", bad_ptr="*i64", rows_ptr="*i32",
                                           P="i32", first="i32", E="i64"),
                dict(consts, BLOCK_L=BL), ["ids_ptr", "table_ptr", "rows_ptr"], 4, 1))
            check(f"place K{K} L{L} check {check_ids}", compile_hopper(
                layout._place_kernel, dict(ids_ptr="*i64", w_ptr="*bf16", start_ptr="*i32", pos_ptr="*i32",
                                           rows_ptr="*i32", w_rows_ptr="*fp32", P="i32", first="i32", E="i64"),
                dict(consts, HAS_W=True), ["ids_ptr", "start_ptr", "pos_ptr", "rows_ptr"], 4, 1))
        check(f"scan L{L}", compile_hopper(
            layout._scan_kernel, dict(table_ptr="*i32", counts_ptr="*i32", offsets_ptr="*i32", start_ptr="*i32",
                                      B="i32"),
            dict(L=L, BLOCK_T=max(1, layout.SCAN_SUM_STEP // BL), BLOCK_B=layout.SCAN_BLOCKS,
                 BLOCK_E=layout.SCAN_EXPERTS, BLOCK_L=BL), ["table_ptr"], layout.scan_warps(L), 1))
    for D, K in [(2048, 8), (7168, 8), (4096, 2), (100, 1)]:
        block_d = min(layout.GATHER_COLUMNS, triton.next_power_of_2(D))
        rows = max(1, layout.GATHER_ELEMENTS // block_d)
        for weighted in (False, True):
            check(f"gather_sum D{D} K{K} weighted {weighted}", compile_hopper(
                layout._gather_sum_kernel, dict(y_ptr="*bf16", pos_ptr="*i32", w_ptr="*bf16", out_ptr="*bf16",
                                                P="i32", D="i32"),
                dict(K=K, WEIGHTED=weighted, ROWS=rows, BLOCK_D=block_d), ["y_ptr", "out_ptr"], layout.GATHER_WARPS,
                1))
    for D, K, B in [(2048, 8, 4096), (7168, 8, 1), (4096, 2, 512), (100, 1, 3)]:
        rows, block_d, _ = graph_io._tiles(B, D)
        for ids, w in (("*i64", "*bf16"), ("*i32", "*fp32")):
            check(f"stage D{D} K{K} B{B} {ids} {w}", compile_hopper(
                graph_io._stage_kernel, dict(table_ptr="*i64", x_ptr="*bf16", ids_ptr=ids, w_ptr=w, B="i32", D="i32"),
                dict(K=K, K_BLOCK=triton.next_power_of_2(K), ROWS=rows, BLOCK_D=block_d), ["table_ptr", "x_ptr"],
                layout.GATHER_WARPS, 1))
        check(f"unstage D{D} B{B}", compile_hopper(
            graph_io._unstage_kernel, dict(counter_ptr="*i64", table_ptr="*i64", out_ptr="*bf16", D="i32"),
            dict(ROWS=rows, BLOCK_D=block_d), ["table_ptr", "out_ptr"], layout.GATHER_WARPS, 1))
    check("fetch", compile_hopper(graph_io._fetch_kernel, dict(ring_addr="i64", counter_ptr="*i64", table_ptr="*i64"),
                                  dict(RING=graph_io.IOTable.RING_ROWS), ["table_ptr"], 1, 1))
    if failures:
        print("\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
