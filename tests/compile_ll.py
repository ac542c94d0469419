"""Compile the `ll` kernels for sm_90 without a GPU (ptxas ships with triton), with the launch settings
ll_launch picks on an H200 (132 SMs) for the DeepSeek-V3 and Qwen3 decode shapes (D 7168 fp8 and bf16,
D 2048 bf16; K 8, R 2); fails on compiler errors, register spills, and on 16-byte vector stores missing
from the row stores (dispatch into the peers' recv_x, combine_send into their comb, combine_recv's
output). Run by test_ll_compile.py in a process without TRITON_INTERPRET. Exit 3 = this Triton's
compiler cannot be driven this way (skip)."""
import sys

import torch

from compile_hopper import compile_hopper, spill_bytes
from epmoe.kernels import ll as k

SMS = 132


def check(tag, kernel, failures) -> None:
    spills, v4 = spill_bytes(kernel), kernel.asm["ptx"].count("st.global.v4")
    print(f"{tag}: spills {spills} B, 16-byte stores {v4}")
    if spills:
        failures.append(f"{tag}: {spills} B of register spills")
    if not v4:
        failures.append(f"{tag}: no 16-byte vector stores")


def main() -> None:
    failures = []
    ints = dict(rank="i32", R="i32", Tmax="i32", D="i32", K="i32")
    for D, quant in ((7168, True), (7168, False), (2048, False)):
        launch = k.ll_launch(D, 2, 128, torch.device("cpu"))
        tag = f"D{D} {'fp8' if quant else 'bf16'}"
        for reduce in (True, False):
            scale = dict(recv_scale_peers="*i64") if quant else {}
            wtab = dict(wtab_peers="*i64") if reduce else {}
            signature = dict(x_ptr="*bf16", ids_ptr="*i32", w_ptr="*fp32", T="i32", recv_x_peers="*i64", **scale,
                             idx_peers="*i64", **wtab, cnt_peers="*i64", src_tokens_peers="*i64", sig_peers="*i64",
                             cnt_ptr="*i32", sig_ptr="*i64", route_ptr="*i32", wloc_ptr="*fp32", counts_ptr="*i32",
                             err_ptr="*i32", E="i32", L="i32", M="i32", G="i32", sig_unit="i64", timeout_ns="i64",
                             **ints)
            nones = {n: None for n in ("recv_scale_peers", "wtab_peers") if n not in signature}
            for receive in (False, True):
                check(f"dispatch {tag} reduce={reduce} receive={receive}", compile_hopper(
                    k._dispatch_kernel, signature,
                    dict(nones, QUANT=quant, SEND_WEIGHTS=reduce, RECEIVE=receive, INTERPRET=False, BLOCK_K=8,
                         BLOCK_L=64, CHUNK=launch.send_chunk),
                    ["x_ptr", "ids_ptr", "w_ptr", "cnt_ptr", "sig_ptr", "route_ptr", "wloc_ptr", "counts_ptr", "D"],
                    launch.send_warps, 1), failures)
            signature = dict(y_ptr="*bf16", idx_ptr="*i32", src_tokens_ptr="*i32", comb_peers="*i64",
                             sig_peers="*i64", **ints, **(dict(wtab_ptr="*fp32") if reduce else {}))
            check(f"combine_send {tag} reduce={reduce}", compile_hopper(
                k._combine_send_kernel, signature,
                dict({} if reduce else dict(wtab_ptr=None), REDUCE=reduce, BLOCK_K=8, BLOCK_R=2,
                     CHUNK=launch.comb_chunk),
                ["y_ptr", "idx_ptr", "src_tokens_ptr", "D"], launch.comb_warps, 1), failures)
            check(f"combine_recv {tag} reduce={reduce}", compile_hopper(
                k._combine_recv_kernel,
                dict(comb_ptr="*bf16", route_ptr="*i32", wloc_ptr="*fp32", out_ptr="*bf16", T="i32", sig_ptr="*i64",
                     err_ptr="*i32", R="i32", K="i32", D="i32", sig_unit="i64", timeout_ns="i64"),
                dict(REDUCE=reduce, INTERPRET=False, BLOCK_K=8, BLOCK_R=2, CHUNK=launch.comb_chunk),
                ["comb_ptr", "route_ptr", "wloc_ptr", "out_ptr", "sig_ptr", "D"], launch.comb_warps, 1), failures)
    if failures:
        print("\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
