#!/usr/bin/env bash
# Runs on the GPU machine (device tool), over binaries built by scripts/gpu-build.sh and carried
# in gpu-bin/: every test binary (parity on CUDA with outputs poisoned, CPU vs CUDA), one small
# case under compute-sanitizer, and a summary last. Full logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/candle-flash-out}
mkdir -p "$OUT"
if [ ! -d gpu-bin ]; then mkdir -p gpu-bin && tar -C gpu-bin -xJf gpu-pack/bin.tar.xz; fi
# shellcheck disable=SC1091
source gpu-bin/cuda-libs.sh >/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

summary=()
log="$OUT/tests.log"
: > "$log"
for t in gpu-bin/tests/*; do
  name=$(basename "$t")
  echo "=== $name" >> "$log"
  "$t" --test-threads=1 --nocapture >> "$log" 2>&1
  rc=$?
  result=$(grep -E "^test result" "$log" | tail -n 1)
  summary+=("$(printf '%-10s rc=%-3s %s' "$name" "$rc" "$result")")
done

# The fuzzer with a larger budget (random shapes, strides, dtypes, options; CUDA vs CPU vs the
# reference); its seed is printed, CANDLE_FLASH_SEED replays it.
echo "=== fuzz (400 cases)" >> "$log"
CANDLE_FLASH_FUZZ_CASES=400 gpu-bin/tests/fuzz --nocapture >> "$log" 2>&1
rc=$?
summary+=("$(printf '%-10s rc=%-3s %s %s' fuzz-400 "$rc" "$(grep -E "^test result" "$log" | tail -n 1)" "$(grep -E "^fuzz seed" "$log" | tail -n 1)")")

# The sm_80 (mma.sync) kernels, which Hopper otherwise skips for the sm_90a (wgmma) ones: the
# parity matrix once more with those turned off.
echo "=== parity (CANDLE_FLASH_DISABLE_SM90A=1)" >> "$log"
CANDLE_FLASH_DISABLE_SM90A=1 gpu-bin/tests/parity --test-threads=1 >> "$log" 2>&1
rc=$?
summary+=("$(printf '%-10s rc=%-3s %s' parity-sm80 "$rc" "$(grep -E "^test result" "$log" | tail -n 1)")")

# Under compute-sanitizer (memcheck): forward and backward, varlen with an empty sequence, GQA,
# window and ALiBi on CUDA; and deliberately bad device seqlens (not checked on the host by
# default: the kernels clamp them), which must never touch memory outside the tensors.
san="$OUT/sanitizer.log"
compute-sanitizer --tool memcheck --error-exitcode 1 gpu-bin/tests/parity varlen --test-threads=1 > "$san" 2>&1
san_rc=$?
summary+=("$(printf '%-10s rc=%-3s %s' sanitizer "$san_rc" "$(grep -E 'ERROR SUMMARY' "$san" | tail -n 1)")")
san2="$OUT/sanitizer_bad_seqlens.log"
compute-sanitizer --tool memcheck --error-exitcode 1 gpu-bin/tests/errors bad_seqlens --test-threads=1 --nocapture > "$san2" 2>&1
san_rc=$?
summary+=("$(printf '%-10s rc=%-3s %s %s' san-bad-sl "$san_rc" "$(grep -E 'ERROR SUMMARY' "$san2" | tail -n 1)" "$(grep -E '^test result' "$san2" | tail -n 1)")")

echo
echo "==== summary ($(cat "$OUT/gpu.txt"))"
printf '%s\n' "${summary[@]}"
