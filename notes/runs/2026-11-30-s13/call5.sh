#!/usr/bin/env bash
# A/B/C of the combine: base (caa8138, int32 epochs), live (64-bit epoch kept in registers: 145 under triton
# 3.6), cap (live + maxnreg=128); then the exact ht GPU tests on cap
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 EPMOE_GPU_RANKS=2
NEW=$PWD
for v in base cap; do rm -rf /tmp/$v && mkdir /tmp/$v && cp -r epmoe tests scripts /tmp/$v; done
(cd /tmp/base && patch -R -p1 -s < $NEW/exp/int64.patch) || exit 1
(cd /tmp/cap && patch -p1 -s < $NEW/exp/cap.patch) || exit 1
mkdir -p $OUT/ab
for i in 1 2; do for v in cap base live; do dir=$NEW; [ $v != live ] && dir=/tmp/$v
  (cd $dir && PYTHONPATH=$dir timeout 100 python3 -m epmoe.cli bench dispatch --tokens 4096,8192 --out $OUT/ab/$v$i > $OUT/ab/$v$i.txt 2>&1)
  echo "$v$i rc $?"; grep -E "^[01] \| (4096|8192) " $OUT/ab/$v$i.txt | awk -F'|' '{print $1,$2,$3,$5,$8}' | tr -s ' ' | paste -sd';'; done; done
cd /tmp/cap && PYTHONPATH=/tmp/cap timeout 120 python3 -m pytest -q -m gpu2 tests/test_ht.py -k "gpu_exact" 2>&1 | tail -3 | tee $OUT/tests_cap.txt
