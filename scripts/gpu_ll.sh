#!/usr/bin/env bash
# The `ll` dispatcher on a 2-GPU machine: emulated-rank tests on one GPU, the two 2-rank tests (eager;
# 100 CUDA-graph replays) each on its own with a time limit, then the benchmark.
# Usage (repo root): bash scripts/gpu_ll.sh [OUT_DIR]   (default: results/)
set -uo pipefail
OUT=${1:-results}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 240 python -m pytest -q tests/test_ll.py --durations=5 2>&1 | tee "$OUT/test_ll_emulated.txt" | tail -12
timeout 170 python -m pytest -q tests/test_ll_gpu.py -k test_gpus_eager --durations=3 2>&1 | tee "$OUT/test_ll_eager.txt" | tail -25
timeout 170 python -m pytest -q tests/test_ll_gpu.py -k test_gpus_graph --durations=3 2>&1 | tee "$OUT/test_ll_graph.txt" | tail -25
timeout 300 python -m epmoe.bench.dispatch_ll --out "$OUT" 2>&1 | tee "$OUT/bench_ll.txt" | tail -20
