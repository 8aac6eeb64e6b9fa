#!/bin/bash
# The fifteenth session's CTA order A/B (bench/NOTES.md "Fifteenth session"): bench/out_new3 (QueryBlockCta's
# swapped grid axes, heuristics.cuh mma_sync_heavy_first) against the head (bench/out_base).
set -u
OUT=${OUT:-/tmp}
K=bench/kernel_check.py
OUT= CF_BUILD_DIR=bench/out_new3 timeout 200 python3 $K --no-build > $OUT/check-new3.log 2>&1
tail -1 $OUT/check-new3.log
OUT= CANDLE_FLASH_DISABLE_SM90A=1 CF_BUILD_DIR=bench/out_new3 timeout 200 python3 $K --no-build --filter causal > $OUT/check-new3-sm80.log 2>&1
tail -1 $OUT/check-new3-sm80.log
for r in 1 2; do
  for b in base new3; do
    OUT= F32_TOKENS=16384 F32_DIMS=64,128,192,256 F32_NS=512,1024,2048,4096 F32_CAUSAL=1 \
      CF_BUILD_DIR=bench/out_$b timeout 120 python3 $K --no-build --filter no_case --f32-bench 2>&1 | grep -v decode | sed "s/^/$b /" >> $OUT/f32-ab4.log
    OUT= F32_TOKENS=16384 F32_DIMS=256 F32_NS=512,2048 F32_CAUSAL=0 \
      CF_BUILD_DIR=bench/out_$b timeout 60 python3 $K --no-build --filter no_case --f32-bench 2>&1 | grep -v decode | sed "s/^/$b /" >> $OUT/f32-ab4.log
    OUT= F32_DET=1 F32_TOKENS=16384 F32_DIMS=64,256 F32_NS=1024,4096 F32_CAUSAL=1 \
      CF_BUILD_DIR=bench/out_$b timeout 60 python3 $K --no-build --filter no_case --f32-bench 2>&1 | grep -v decode | sed "s/^/det-$b /" >> $OUT/f32-ab4.log
  done
done
grep -E "^(det-)?(base|new3) [0-9]" $OUT/f32-ab4.log | sort -k5,5n -k6,6n -k4,4n -k1,1 -s | awk '{print $1,$2,$3,$4,$5,$6,$8,$10,$13,$15}' > $OUT/f32-ab4-sorted.txt
OUT= CANDLE_FLASH_DISABLE_SM90A=1 ROUNDS=2 POINTS="bf16,64,1,1024;bf16,64,1,4096;bf16,128,1,1024;bf16,128,1,4096;bf16,128,1,16384;bf16,256,1,2048;bf16,256,1,512" \
  DIMS=64,128,256 timeout 200 python3 bench/grid.py base=bench/out_base new3=bench/out_new3 > $OUT/sm80-bf16-ab4.log 2>&1
OUT= ROUNDS=1 POINTS="bf16,64,1,2048;bf16,128,1,2048;bf16,256,1,4096" \
  DIMS=64,128,256 timeout 100 python3 bench/grid.py base=bench/out_base new3=bench/out_new3 > $OUT/sm90-bf16-ab4.log 2>&1
cat $OUT/f32-ab4-sorted.txt
tail -8 $OUT/sm80-bf16-ab4.log
tail -4 $OUT/sm90-bf16-ab4.log
