#!/usr/bin/env bash
# Every GPU test and benchmark of epmoe in one go, for a machine with 2 GPUs (or NPROC of them).
#
#   [NPROC=2] [STAGE_TIMEOUT=900] scripts/gpu_run.sh [OUT] [STAGES]
#
# PYTEST_WORKERS (default: none): run the test stages on that many pytest-xdist workers, which compile the
# kernels in parallel (the one-GPU stages are mostly compiles on a fresh machine; on one H100, 12 workers ran
# the one-GPU and unmarked tests in ~4 min), and tests/test_timing.py after them alone.
# NPROC (2 to 8, default 2): ranks of the multi-GPU tests (as EPMOE_GPU_RANKS), of check, demo and
# layer (--nproc) and of the dispatch benchmarks (--ranks); the EP4/EP8 runs of issue 6 set it.
# OUT: folder for logs and JSON (default ./results). STAGES: comma-separated subset of
#   env, tests (1-GPU tests), tests2 (2-GPU tests), unmarked (the tests marked neither, as README's test command
#   runs them on a GPU machine: ~6-9 min on an H100), check, demo, experts, moe, dispatch, ll, layer, gemm,
#   profile (scripts/moe_profile.py: the local block's kernels, one by one), soak (epmoe soak),
#   generate (`epmoe generate --bench`: transformers models, 4 layers), hfprofile (scripts/hf_profile.py),
#   host (scripts/host_profile.py: a replayed call at 256 tokens and an eager one at 16384),
#   decode (scripts/decode_sweep.py: the sweeps behind the table's decode-sized bf16 and fp8 buckets),
#   swap (scripts/decode_sweep.py --pool swap: both kernels' swap_ab tiles at decode sizes, against the table),
#   ab (epmoe.bench.table_ab: bench experts and bench moe under the launch table AB_OLD names against AB_NEW,
#   default the checkout's, or against AB_OLD with the settings AB_SET lists, e.g. "down:group_m=4", and the
#   buckets AB_PUT replaces, e.g. 'down_fp8@16={"block_m":16,...}' (JSON without spaces); or AB_OLD_CODE, a
#   folder with another revision's epmoe package (`git archive REV epmoe | tar -x -C DIR`), against this checkout;
#   AB_EXPERTS and AB_MOE: the benches' arguments),
#   hunt (scripts/fault_hunt.py: 1000 calls of the fp8 block at each decode-sized point of DeepSeek-V3 and one
#   of each other shape, back to back, in graphs and (DeepSeek-V3 256 and 512) eagerly, and 24 processes of 20
#   eager calls at DeepSeek-V3 256, every output checked;
#   memcheck on a few of Qwen3-30B-A3B's calls; a faulting kernel's GPU core dump read by cuda-gdb: its kernel,
#   exception and source line; HUNT_ARGS: the script's arguments instead, e.g.
#   "--points deepseek-v3:512 --set down:pdl=false")
# (gemm: `epmoe bench experts --tune`, the checked launch-config sweep behind the table) (default: all but
# profile, hfprofile, host, decode, swap and ab). Each stage runs on its own: a failing stage is recorded
# and the next one still runs.
# Uses the installed torch/triton with this checkout on PYTHONPATH (nothing is downloaded). Each stage
# is stopped after STAGE_TIMEOUT seconds (default 900). The exit code is the number of failed stages.
# Prints a table of stages last.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${1:-./results}"
STAGES="${2:-env,tests,tests2,unmarked,check,demo,experts,moe,generate,dispatch,ll,layer,gemm,soak,hunt}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
NPROC="${NPROC:-2}"
export EPMOE_GPU_RANKS="$NPROC"
PY="${PYTHON:-python3}"
LIMIT=(timeout --kill-after=30 "${STAGE_TIMEOUT:-900}")
EPMOE=("${LIMIT[@]}" "$PY" -m epmoe.cli)

declare -a NAMES RESULTS SECONDS_TAKEN

wanted() { [[ ",$STAGES," == *",$1,"* ]]; }

# stage NAME COMMAND...: run COMMAND if NAME is wanted, log to $OUT/NAME.log, record pass/fail and time.
stage() {
    local name="$1"; shift
    wanted "$name" || return 0
    echo "=== $name: $*"
    local t0=$SECONDS status=0
    "$@" 2>&1 | tee "$OUT/$name.log" || status=$?
    NAMES+=("$name"); SECONDS_TAKEN+=($((SECONDS - t0)))
    if [ "$status" -eq 0 ]; then RESULTS+=("pass"); else RESULTS+=("FAIL ($status)"); fi
}

env_report() {
    nvidia-smi -L || return 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
    git log -1 --oneline 2>/dev/null || true
}

host_profiles() {
    "${LIMIT[@]}" "$PY" scripts/host_profile.py --tokens 256 --top 25 || return 1
    "${LIMIT[@]}" "$PY" scripts/host_profile.py --tokens 16384 --calls 40 --top 25
}

decode_sweeps() {
    "${LIMIT[@]}" "$PY" scripts/decode_sweep.py --out "$OUT/decode_bf16" || return 1
    "${LIMIT[@]}" "$PY" scripts/decode_sweep.py --quant fp8_block --out "$OUT/decode_fp8" --points \
        qwen3-30b-a3b:128 qwen3-30b-a3b:256 qwen3-30b-a3b:512 deepseek-v2-lite:256 deepseek-v2-lite:512 \
        mixtral-8x7b:16 mixtral-8x7b:128 deepseek-v3:256 deepseek-v3:512 deepseek-v3:1024
}

swap_sweeps() {
    "${LIMIT[@]}" "$PY" scripts/decode_sweep.py --pool swap --quant fp8_block --out "$OUT/swap_fp8" --points \
        qwen3-30b-a3b:128 qwen3-30b-a3b:256 qwen3-30b-a3b:512 deepseek-v2-lite:256 deepseek-v2-lite:512 \
        deepseek-v3:256 || return 1
    "${LIMIT[@]}" "$PY" scripts/decode_sweep.py --pool swap --out "$OUT/swap_bf16" --points \
        qwen3-30b-a3b:128 qwen3-30b-a3b:256 deepseek-v2-lite:256 deepseek-v3:256
}

table_ab() {
    local old=() new=() setting put; [ -n "${AB_NEW:-}" ] && new=(--new "$AB_NEW")
    [ -n "${AB_OLD:-}" ] && old+=(--old "$AB_OLD")  # (both set: table_ab refuses)
    [ -n "${AB_OLD_CODE:-}" ] && old+=(--old-code "$AB_OLD_CODE")
    [ ${#old[@]} -gt 0 ] || { echo "ab: neither AB_OLD nor AB_OLD_CODE is set"; return 1; }
    for setting in ${AB_SET:-}; do new+=(--set "$setting"); done
    for put in ${AB_PUT:-}; do new+=(--put "$put"); done
    # shellcheck disable=SC2086  # the benches' arguments, word-split on purpose
    "${LIMIT[@]}" "$PY" -m epmoe.bench.table_ab "${old[@]}" "${new[@]}" --out "$OUT/ab_experts" experts \
        ${AB_EXPERTS:---tokens 16 32 64 128} || return 1
    # shellcheck disable=SC2086
    "${LIMIT[@]}" "$PY" -m epmoe.bench.table_ab "${old[@]}" "${new[@]}" --out "$OUT/ab_moe" moe \
        ${AB_MOE:---quant bf16 fp8_block --tokens 256 1024 2048 4096}
}

# A kernel that faults leaves a GPU core dump without memory contents (~150 MB, in a temporary folder, not
# $OUT); cuda-gdb names its kernel, the exception and the source line.
gpu_cores() {  # gpu_cores DIR: each core's exception and line
    local core
    for core in "$1"/core.*; do
        [ -f "$core" ] || continue
        echo "GPU core dump $core:"
        timeout 120 cuda-gdb -batch -ex "target cudacore $core" 2>&1 | grep -E "CUDA Exception|triggered at|^#0"
    done
}

fault_hunts() {  # HUNT_ARGS: one scripts/fault_hunt.py run with these arguments instead of the default runs
    local cores status=0
    cores="$(mktemp -d)"
    local hunt=("${LIMIT[@]}" env CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 "CUDA_COREDUMP_FILE=$cores/core.%p"
                CUDA_COREDUMP_GENERATION_FLAGS=skip_global_memory,skip_shared_memory,skip_local_memory,skip_abort
                "$PY" scripts/fault_hunt.py)
    if [ -n "${HUNT_ARGS:-}" ]; then
        eval "${hunt[*]} $HUNT_ARGS" || status=1
        gpu_cores "$cores"
        return "$status"
    fi
    "${hunt[@]}" --calls 1000 --points deepseek-v3:128 deepseek-v3:256 deepseek-v3:512 deepseek-v3:1024 \
        qwen3-30b-a3b:256 deepseek-v2-lite:256 mixtral-8x7b:64 || status=1
    "${hunt[@]}" --calls 1000 --points deepseek-v3:256 deepseek-v3:512 --eager || status=1
    # the H100 fault came mostly in a process's first calls: many short processes (~8 s each)
    # shellcheck disable=SC2046  # one point a word
    "${hunt[@]}" --calls 20 --eager --timeout 60 --points $(printf 'deepseek-v3:256 %.0s' $(seq 24)) || status=1
    if command -v compute-sanitizer >/dev/null; then
        "${LIMIT[@]}" "$PY" scripts/fault_hunt.py --points qwen3-30b-a3b:256 --eager --calls 8 --sync-every 1 \
            --wrap "compute-sanitizer --tool memcheck --print-limit 20" || status=1
    fi
    gpu_cores "$cores"
    return "$status"
}

pytest_gpu() {  # pytest_gpu MARKER_EXPRESSION JUNIT_NAME
    local status=0
    if [ -z "${PYTEST_WORKERS:-}" ]; then
        "${LIMIT[@]}" "$PY" -m pytest -q -m "$1" --junitxml="$OUT/$2.xml" tests || status=$?
        [ "$status" -eq 5 ] && { echo "no tests selected by -m '$1'"; return 0; }
        return "$status"
    fi
    # on pytest-xdist workers; test_timing's timer checks after them, alone on the GPU (they time it)
    "${LIMIT[@]}" "$PY" -m pytest -q -m "$1" -n "$PYTEST_WORKERS" --deselect tests/test_timing.py \
        --junitxml="$OUT/$2.xml" tests || status=$?
    [ "$status" -eq 5 ] && status=0
    local alone=0
    "${LIMIT[@]}" "$PY" -m pytest -q -m "$1" --junitxml="$OUT/$2_timing.xml" tests/test_timing.py || alone=$?
    [ "$alone" -eq 5 ] && alone=0
    [ "$status" -ne 0 ] && return "$status"
    return "$alone"
}

stage env      env_report
stage tests    pytest_gpu "gpu and not gpu2" tests_gpu1
stage tests2   pytest_gpu "gpu2" tests_gpu2
stage unmarked pytest_gpu "not gpu and not gpu2" tests_unmarked
stage check    "${EPMOE[@]}" check --device cuda --nproc "$NPROC"
stage demo     "${EPMOE[@]}" demo --device cuda --nproc "$NPROC"
stage experts  "${EPMOE[@]}" bench experts --out "$OUT"
stage moe      "${EPMOE[@]}" bench moe --repeats 60 --out "$OUT"
stage generate "${EPMOE[@]}" generate --preset qwen3-30b-a3b,deepseek-v2-lite --layers 4 --bench --out "$OUT"
stage hfprofile "${LIMIT[@]}" "$PY" scripts/hf_profile.py --preset qwen3-30b-a3b deepseek-v2-lite --out "$OUT"
stage host     host_profiles
stage dispatch "${EPMOE[@]}" bench dispatch --ranks "$NPROC" --out "$OUT"
stage ll       "${EPMOE[@]}" bench dispatch --mode ll --ranks "$NPROC" --out "$OUT"
stage layer    "${EPMOE[@]}" bench layer --device cuda --nproc "$NPROC" --out "$OUT"
stage gemm     "${EPMOE[@]}" bench experts --tune --out "$OUT"
stage profile  "${LIMIT[@]}" "$PY" scripts/moe_profile.py --tokens 256 4096 16384 --out "$OUT"
stage decode   decode_sweeps
stage swap     swap_sweeps
stage ab       table_ab
stage hunt     fault_hunts
stage soak     "${EPMOE[@]}" soak --device cuda --nproc "$NPROC" --out "$OUT"

{
    printf '%-10s %-12s %s\n' stage result seconds
    for i in "${!NAMES[@]}"; do
        printf '%-10s %-12s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}"
    done
} | tee "$OUT/summary.txt"
failed=$(grep -c FAIL "$OUT/summary.txt" || true)
echo "logs and JSON in $OUT; $failed failed stage(s)"
exit "$failed"
