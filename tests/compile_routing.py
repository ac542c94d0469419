"""Compile the routing kernel for sm_90 without a GPU (ptxas ships with triton), for each choice rule at
DeepSeek-V3's, Qwen3-MoE's and Mixtral's shapes, K = E and E = MAX_EXPERTS, with the launcher's
blocks; fails on compiler errors and register spills. Run by test_routing.py in a process without
TRITON_INTERPRET. Exit 3 = this Triton's compiler cannot be driven this way (skip)."""
import sys

import triton

from compile_hopper import compile_hopper, spill_bytes
from epmoe.kernels import routing

SIGNATURE = dict(logits_ptr="*bf16", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i32", T="i32", E="i32",
                 stride_t="i32", scale="fp32")


def main() -> None:
    failures = []
    # (E, K, sigmoid, bias, groups, topk_groups)
    for E, K, sigmoid, bias, groups, topk_groups in [(256, 8, True, True, 8, 4), (128, 8, False, False, 0, 0),
                                                     (8, 2, False, False, 0, 0), (160, 6, False, False, 8, 3),
                                                     (64, 64, True, False, 0, 0), (128, 128, True, False, 0, 0),
                                                     (4096, 8, True, True, 64, 8)]:
        launch = routing.route_launch(4096, E, K)
        constexprs = dict(K=K, SIGMOID=sigmoid, HAS_BIAS=bias, GROUPS=groups,
                          GROUP_SIZE=E // groups if groups else 1, TOPK_GROUPS=topk_groups, RENORMALIZE=True,
                          BLOCK_T=launch.block_t, BLOCK_E=launch.block_e,
                          BLOCK_G=triton.next_power_of_2(groups) if groups else 1,
                          BLOCK_K=triton.next_power_of_2(K))
        kernel = compile_hopper(routing._route_kernel, SIGNATURE, constexprs, ["logits_ptr"], launch.num_warps, 1)
        spills = spill_bytes(kernel)
        print(f"route E{E} K{K} sigmoid {sigmoid} groups {groups}: spills {spills} B")
        if spills:
            failures.append(f"route E{E} K{K}: {spills} B of register spills")
    if failures:
        print("\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
