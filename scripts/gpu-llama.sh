#!/usr/bin/env bash
# The Llama example on the GPU machine, SmolLM2-135M-Instruct Q4_1 GGUF (98 MB):
# the model travels in parts because one call carries at most 64 MiB, the working tree
# included (shared/device README).
#
# Here (no GPU):   bash scripts/gpu-llama.sh pack
#   builds `llama` and `llama_bench` (-p candle-flash-llama --features cuda), packs them (xz) with the first
#   part of the model into gpu-llama/p0/ and the rest in parts into gpu-llama/p1/, p2/, ...,
#   each small enough to travel beside the working tree, and the model's sha256 in the last.
# Device, one call per part but the last, right after one another:
#   bash scripts/gpu-llama.sh park   (with gpu-llama/p0 copied along), then p1, ...
#   parks the part (and the binaries) under /root/llama (kept while the machine stays warm).
# Device, last call (right after):  bash scripts/gpu-llama.sh run   (with gpu-llama/pN copied along)
#   reassembles and checks the model, then: the first forward of a fresh process (cold JIT cache
#   and warm), llama_bench single-sequence decode (eager vs CUDA graph, same run) in bf16 and
#   f32, quantized and dequantized weights, and the batched mode; logs under $OUT, a summary last.
#   LLAMA_RUNS="single batch first fp8" selects parts (default: first single batch); fp8: the
#   example with --dtype bf16 and --dtype fp8 on one prompt (tokens/s, logits compared).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-run}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
PARK=/root/llama

if [ "$what" = pack ]; then
  set -e
  [ -f "$MODEL" ] || bash scripts/fetch-model.sh
  # shellcheck disable=SC1091
  source .cuda/env.sh
  cargo build --release -p candle-flash-llama --features cuda --example llama --example llama_bench
  rm -rf gpu-llama /tmp/gpu-llama-bin && mkdir -p gpu-llama/p0 /tmp/gpu-llama-bin
  cp "${CARGO_TARGET_DIR:-target}"/release/examples/{llama,llama_bench} /tmp/gpu-llama-bin/
  strip /tmp/gpu-llama-bin/llama /tmp/gpu-llama-bin/llama_bench
  cp ../shared/device/cuda-libs.sh /tmp/gpu-llama-bin/
  tar -C /tmp/gpu-llama-bin -cf - . | xz -9 -T0 > gpu-llama/p0/bin.tar.xz
  # What one call may carry beside the working tree (tracked and untracked-not-ignored files).
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  room=$(( 60 * 1024 * 1024 - tree ))
  first=$(( room - $(stat -c %s gpu-llama/p0/bin.tar.xz) ))
  [ "$first" -gt 1000000 ] || { echo "the working tree ($tree bytes) leaves no room for the binaries"; exit 5; }
  size=$(stat -c %s "$MODEL")
  head -c "$first" "$MODEL" > gpu-llama/p0/part.00
  off=$first n=1
  while [ "$off" -lt "$size" ]; do
    d=gpu-llama/p$n; mkdir -p "$d"
    dd if="$MODEL" of="$d/part.$(printf %02d $n)" bs=1M iflag=skip_bytes,count_bytes skip="$off" count="$room" status=none
    off=$(( off + room )) n=$(( n + 1 ))
  done
  (cd "$(dirname "$MODEL")" && sha256sum "$(basename "$MODEL")") > "gpu-llama/p$(( n - 1 ))/model.sha256"
  du -sh gpu-llama/p*
  echo "park p0 .. p$(( n - 2 )) (one call each), then run with p$(( n - 1 ))"
  exit 0
fi

if [ "$what" = park ]; then
  mkdir -p "$PARK"
  # the one part carried with this call (whichever gpu-llama/pK it is)
  cp gpu-llama/p*/part.* "$PARK"/ && { cp gpu-llama/p*/bin.tar.xz "$PARK"/ 2>/dev/null; ls -la "$PARK"; }
  exit $?
fi

OUT=${OUT:-/tmp/candle-flash-out}
mkdir -p "$OUT"
if [ ! -f "$PARK/part.00" ]; then
  echo "part 0 is not parked (the machine was replaced): run 'park' again, then 'run' right after"
  exit 3
fi
mkdir -p models bin
cp gpu-llama/p*/part.* "$PARK"/
cat "$PARK"/part.* > "$MODEL"
(cd models && sha256sum -c ../gpu-llama/p*/model.sha256) || exit 4
tar -C bin -xJf "$PARK/bin.tar.xz"
# shellcheck disable=SC1091
source bin/cuda-libs.sh >/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
runs=${LLAMA_RUNS:-"first single batch"}
summary=()
failed=0
record() {
  summary+=("$(printf '%-30s rc=%-3s %s' "$1" "$2" "$3")")
  [ "$2" = 0 ] || failed=1
}

if [[ " $runs " == *" first "* ]]; then
  # The first forward of a fresh process: with the driver's JIT cache empty (candle's kernels
  # are PTX, compiled at load), then again in a new process with the cache filled.
  rm -rf "${CUDA_CACHE_PATH:-$HOME/.nv/ComputeCache}"
  for pass in cold warm; do
    log="$OUT/first_$pass.log"
    /usr/bin/time -v bin/llama --device cuda --model "$MODEL" --prompt "Gravity is" --max-tokens 32 > "$log" 2>&1
    record "llama example ($pass JIT cache)" $? "$(grep -E 'first|tokens/s|Elapsed' "$log" | tr '\n' ' ' | cut -c1-160)"
  done
fi

if [[ " $runs " == *" single "* ]]; then
  for cfg in "bf16 quantized" "f32 quantized" "bf16 dequantized"; do
    set -- $cfg
    log="$OUT/single_${1}_$2.log"
    bin/llama_bench --device cuda --dtype "$1" --weights "$2" --model "$MODEL" --attn flash \
      --prompts 128,1024 --decode-tokens 128 --repeats 3 > "$log" 2>&1
    record "single $1 $2" $? "$(grep -c '"attn"' "$log") rows"
    grep -E '^\|' "$log"
    grep -E 'first forward|greedy_tokens_equal_eager' "$log" | sed -E 's/.*"greedy_tokens_equal_eager":(true|false).*/greedy tokens graph == eager: \1/'
  done
fi

if [[ " $runs " == *" batch "* ]]; then
  log="$OUT/batch_bf16.log"
  bin/llama_bench --device cuda --dtype bf16 --model "$MODEL" --batch 1,8,32 --prompts 128 \
    --decode-tokens 64 --repeats 3 > "$log" 2>&1
  record "batch bf16 1,8,32" $? "$(grep -E '^\| 32 ' "$log")"
  grep -E '^\|' "$log"
fi

if [[ " $runs " == *" fp8 "* ]]; then
  # FP8 attention (--dtype fp8: e4m3 q/k/v per head, the rest bf16) against bf16 on one prompt:
  # tokens/s of both, and the next-token logits of the prompt compared (printed by the example)
  prompt="Explain in a few sentences why the sky is blue, and why sunsets are red instead."
  # (each twice: the first run of a configuration fills the driver's JIT cache)
  for dt in bf16 fp8 bf16 fp8; do
    log="$OUT/fp8_$dt.log"
    bin/llama --device cuda --dtype "$dt" --chat --model "$MODEL" --prompt "$prompt" --max-tokens 64 > "$log" 2>&1
    record "llama --dtype $dt" $? "$(grep -E 'tokens/s' "$log" | tr '\n' ' ' | cut -c1-160)"
  done
  tail -n 5 "$OUT/fp8_bf16.log" "$OUT/fp8_fp8.log"
fi

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $failed
