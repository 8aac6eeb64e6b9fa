#!/usr/bin/env bash
# Runs on the GPU machine, over binaries built by scripts/gpu-build.sh and carried
# in gpu-pack/: the test suite on CUDA, the limits, and every kernel under the sanitizers, with a
# summary last; exits non-zero when anything failed. Full logs go to $OUT.
#   bash scripts/gpu-run.sh [tests|big|sanitize|all]      (default: all)
#     tests     every test binary (parity with outputs NaN-poisoned, CPU vs CUDA, errors on CUDA,
#               concurrency, paged, ...), the fuzzer for a time budget, the parity matrix on the
#               sm_80 kernels (CANDLE_FLASH_DISABLE_SM90A=1)
#     big       tests/limits.rs with CANDLE_FLASH_BIG_TESTS=1: > 2^31 elements, 10^6 tokens,
#               out of memory (peak memory printed)
#     sanitize  tests/every_kernel.rs (each forward, backward, split-KV, combine, convert,
#               reduce; each head-dim tile and dtype) under memcheck and racecheck on both kernel
#               families, synccheck, initcheck (outputs not poisoned); memcheck on varlen parity
#               and on deliberately bad device seqlens
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
source scripts/device-prelude.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

summary=()
failed=0
# record NAME RC TEXT: one summary line; any non-zero status fails the run.
record() {
  summary+=("$(printf '%-18s rc=%-3s %s' "$1" "$2" "$3")")
  [ "$2" = 0 ] || failed=1
}
last_result() { grep -E "^test result" "$1" | tail -n 1; }

if [ "$what" = tests ] || [ "$what" = all ]; then
  log="$OUT/tests.log"
  : > "$log"
  # TESTS="errors fuzz": only those binaries (default: all).
  for t in gpu-bin/tests/*; do
    name=$(basename "$t")
    [ -z "${TESTS:-}" ] || [[ " $TESTS " == *" $name "* ]] || continue
    echo "=== $name" >> "$log"
    "$t" --test-threads=1 --nocapture >> "$log" 2>&1
    record "$name" $? "$(last_result "$log")"
  done
  # The fuzzer for a time budget (random shapes, strides, dtypes, options; CUDA vs CPU vs the
  # reference); its seed is printed, CANDLE_FLASH_SEED replays it.
  flog="$OUT/fuzz.log"
  CANDLE_FLASH_TEST_DEVICES=cuda CANDLE_FLASH_FUZZ_SECONDS=${FUZZ_SECONDS:-120} gpu-bin/tests/fuzz --nocapture > "$flog" 2>&1
  record fuzz $? "$(last_result "$flog") $(grep -E "^fuzz: " "$flog" | tail -n 1)"
  # The sm_80 (mma.sync) kernels, which Hopper otherwise skips for the sm_90a (wgmma) ones.
  plog="$OUT/parity_sm80.log"
  CANDLE_FLASH_DISABLE_SM90A=1 gpu-bin/tests/parity --test-threads=1 > "$plog" 2>&1
  record parity-sm80 $? "$(last_result "$plog")"
  # the plans with the switches that send calls to other kernels (tests/plans.rs reads them)
  qlog="$OUT/plans_switched.log"
  { CANDLE_FLASH_DISABLE_SM90A=1 gpu-bin/tests/plans --nocapture &&
    CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 CANDLE_FLASH_F32_SIMT=1 CANDLE_FLASH_DISABLE_TMA=1 gpu-bin/tests/plans --nocapture; } \
    > "$qlog" 2>&1
  record plans-switched $? "$(last_result "$qlog")"
  # the sm_90a kernels' cp.async fallback for every tile (forward K/V/Q, backward Q/dO)
  tlog="$OUT/parity_no_tma.log"
  { CANDLE_FLASH_DISABLE_TMA=1 gpu-bin/tests/parity --test-threads=1 &&
    CANDLE_FLASH_DISABLE_TMA=1 gpu-bin/tests/every_kernel wgmma_wide_prefill --test-threads=1; } > "$tlog" 2>&1
  record parity-no-tma $? "$(last_result "$tlog")"
  # a value head dim of its own on the SIMT kernels' narrow shape (no zero-padded copies)
  vlog="$OUT/value_head_dims_simt.log"
  { CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0 gpu-bin/tests/parity value_head_dims --test-threads=1 &&
    CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0 gpu-bin/tests/paged cuda_mm_prefix --test-threads=1; } > "$vlog" 2>&1
  record value-dims-simt $? "$(last_result "$vlog")"
  # the SIMT kernels on the decode shapes of wide heads, which the wide-head split kernel takes
  wlog="$OUT/wide_decode_simt.log"
  { CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 gpu-bin/tests/parity wide_ --test-threads=1 &&
    CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 gpu-bin/tests/variants value_as_a_view --test-threads=1 &&
    CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 gpu-bin/tests/paged cuda_ --test-threads=1; } > "$wlog" 2>&1
  record wide-decode-simt $? "$(last_result "$wlog")"
fi

if [ "$what" = big ] || [ "$what" = all ]; then
  blog="$OUT/limits_big.log"
  CANDLE_FLASH_BIG_TESTS=1 gpu-bin/tests/limits --test-threads=1 --nocapture > "$blog" 2>&1
  record limits-big $? "$(last_result "$blog")"
  grep -E "^(B=|S=|device filled|  )" "$blog" | head -n 30
fi

if [ "$what" = sanitize ] || [ "$what" = all ]; then
  # san NAME TOOL [ENV...] -- BINARY ARGS...: one compute-sanitizer run; its error summary and
  # the test result go to the summary.
  san() {
    local name=$1 tool=$2
    shift 2
    # SANITIZERS="memcheck racecheck ..." runs only the runs whose name starts with one of
    # these words (a device call lasts 10 minutes)
    if [ -n "${SANITIZERS:-}" ]; then
      local w keep=0
      for w in $SANITIZERS; do [[ "$name" == "$w"* ]] && keep=1; done
      [ "$keep" = 1 ] || return 0
    fi
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    local slog="$OUT/san_$name.log"
    env CANDLE_FLASH_TEST_DEVICES=cuda "${envs[@]}" timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool "$tool" \
      --error-exitcode 1 "$@" --test-threads=1 > "$slog" 2>&1
    local rc=$?
    record "san-$name" $rc "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$slog" | tail -n 1) $(last_result "$slog")"
  }
  san memcheck memcheck -- gpu-bin/tests/every_kernel
  san memcheck-sm80 memcheck CANDLE_FLASH_DISABLE_SM90A=1 -- gpu-bin/tests/every_kernel
  # racecheck: one process per test, each within SAN_TIMEOUT. All five in one process did not
  # finish in 280 s; alone (H100, 2026-11-24) they take 2-53 s, except decode (split-KV over 700
  # keys, every head-dim tile and dtype): ~155 s per kernel family.
  for t in prefill deterministic_backward decode varlen_with_empty_sequences long_queries_head_dim_64 simt_wide_head_dims wide_split_decode wgmma_wide_prefill; do
    san "racecheck-$t" racecheck -- gpu-bin/tests/every_kernel "$t" --exact
    san "racecheck-sm80-$t" racecheck CANDLE_FLASH_DISABLE_SM90A=1 -- gpu-bin/tests/every_kernel "$t" --exact
  done
  # synccheck: one process per test as well (all six in one process outgrew 570 s on the H200).
  for t in prefill deterministic_backward decode varlen_with_empty_sequences f32_simt_kernels long_queries_head_dim_64 simt_wide_head_dims wide_split_decode wgmma_wide_prefill; do
    san "synccheck-$t" synccheck -- gpu-bin/tests/every_kernel "$t" --exact
  done
  san initcheck initcheck CANDLE_FLASH_NO_POISON=1 -- gpu-bin/tests/every_kernel
  # Varlen with an empty sequence, GQA, window and ALiBi; and deliberately bad device seqlens
  # (not checked on the host by default: the kernels clamp them), which must never touch memory
  # outside the tensors.
  san memcheck-varlen memcheck -- gpu-bin/tests/parity varlen
  san memcheck-bad-seqlens memcheck -- gpu-bin/tests/errors bad_seqlens
  # GQA backward with 4096+ keys under a causal mask: one query head per CTA and the in-kernel
  # sums of the dK / dV partials (plan_bwd, kBwdGqaSplitKeys), through the crate.
  san memcheck-gqa-many-keys memcheck -- gpu-bin/tests/parity gqa_backward_many_keys
fi

echo
echo "==== summary ($(cat "$OUT/gpu.txt"))"
printf '%s\n' "${summary[@]}"
[ "$failed" = 0 ] && echo "ALL PASSED" || echo "SOME FAILED"
exit "$failed"
