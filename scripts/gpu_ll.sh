#!/usr/bin/env bash
# The `ll` dispatcher on a 2-GPU machine: tests (emulated ranks on one GPU, 2 real ranks, 100 graph
# replays), then the benchmark. Usage: bash scripts/gpu_ll.sh [OUT_DIR]   (default: results/)
set -uo pipefail
OUT=${1:-results}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 420 python -m pytest -q -x tests/test_ll.py 2>&1 | tee "$OUT/test_ll.txt" | tail -25
timeout 240 python -m epmoe.bench.dispatch_ll --out "$OUT" 2>&1 | tee "$OUT/bench_ll.txt" | tail -20
