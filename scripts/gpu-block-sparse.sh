#!/usr/bin/env bash
# Device side: block-sparse attention on CUDA in one run. The block-mask tests (tests/block_sparse.rs)
# and the dense suites that share the kernels (parity, every_kernel, plans, the lib's unit tests),
# memcheck and racecheck on the block-mask kernels, then ours (examples/block_sparse_bench.rs)
# against FlexAttention (bench/flex_block_sparse.py) on the same patterns and the density sweep,
# and a table last (bench/plot_block_sparse.py, which also draws the density plot).
#   bash scripts/gpu-block-sparse.sh [tests|bench|all]      (default: all)
# BASE_BENCH=path: an older build's bench binary, timed beside this one on the dense grid.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
source scripts/device-prelude.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
summary=()
record() { summary+=("$(printf '%-22s rc=%-3s %s' "$1" "$2" "$3")"); }
last_result() { grep -E "^test result" "$1" | tail -n 1; }
T=gpu-bin/tests
if [ "$what" = tests ] || [ "$what" = all ]; then
  # (block_sparse: its CUDA tests; the CPU ones run everywhere)
  for t in "block_sparse cuda_" plans every_kernel parity candle_flash errors; do
    name=${t%% *}
    log="$OUT/$name.log"
    # shellcheck disable=SC2086
    CANDLE_FLASH_TEST_DEVICES=cuda timeout "${TEST_TIMEOUT:-400}" "$T/"$t --test-threads=1 > "$log" 2>&1
    record "$name" $? "$(last_result "$log")"
  done
  # the sanitizers on the block-mask kernels (outputs not poisoned under initcheck only)
  for tool in memcheck racecheck; do
    log="$OUT/block_sparse_$tool.log"
    CANDLE_FLASH_TEST_DEVICES=cuda timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$T/block_sparse" cuda_ --test-threads=1 > "$log" 2>&1
    record "block_sparse $tool" $? "$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)"
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  jsonl="$OUT/block-sparse.jsonl"
  : > "$jsonl"
  timeout 300 gpu-bin/block_sparse_bench --device cuda --iters "${ITERS:-10}" 2>>"$OUT/bench.err" | grep '^{' >> "$jsonl"
  record ours $? "$(wc -l < "$jsonl") rows"
  timeout 400 python3 bench/flex_block_sparse.py --iters "${ITERS:-10}" --dense 2>>"$OUT/flex.err" | grep '^{' >> "$jsonl"
  record flex $? "$(grep -c '"flex"' "$jsonl") rows"
  if [ -n "${BASE_BENCH:-}" ]; then
    # the dense kernels of another build and of this one, back to back, twice
    ab="$OUT/dense-ab.jsonl"
    : > "$ab"
    for round in 1 2; do
      for bin in "$BASE_BENCH" gpu-bin/bench; do
        tag=$([ "$bin" = gpu-bin/bench ] && echo new || echo base)
        timeout 120 "$bin" --device cuda --impl flash --mode fwd,bwd --hdim 64,128,256 --heads 16 --tokens 16384 \
          --seqlens 2048,8192 --causal both --dtype bf16 --iters 5 2>>"$OUT/bench.err" | grep '^{' |
          sed "s/^{/{\"tag\": \"$tag\", \"round\": $round, /" >> "$ab"
      done
    done
    python3 - "$ab" <<'EOF'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
best = collections.defaultdict(dict)
for r in rows:
    k = (r["mode"], r["d"], r["nq"], r["causal"])
    best[k][r["tag"]] = max(best[k].get(r["tag"], 0), r["tflops"])
print("dense A/B (TFLOP/s, best of 2 rounds): mode d N causal base new new/base")
for k, v in sorted(best.items()):
    if "base" in v and "new" in v:
        print(*k, f"{v['base']:.0f} {v['new']:.0f} {v['new'] / v['base']:.3f}")
EOF
  fi
  python3 bench/plot_block_sparse.py "$jsonl" --out "$OUT/block-sparse-density.png" > "$OUT/block-sparse.md" 2>&1
  cat "$OUT/block-sparse.md"
fi
printf '%s\n' "${summary[@]}"
