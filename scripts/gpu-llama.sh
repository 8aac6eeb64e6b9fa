#!/usr/bin/env bash
# The Llama example on the GPU machine (device tool), SmolLM2-135M-Instruct Q4_1 GGUF (98 MB):
# the model travels in two parts because one call carries at most 64 MiB (shared/device README).
#
# Here (no GPU):   bash scripts/gpu-llama.sh pack
#   builds `llama` and `llama_bench` with --features cuda,llama, packs them (xz) with part 0 of
#   the model into gpu-llama/a/ and part 1 into gpu-llama/b/, with the model's sha256.
# Device, call 1:  run(command="bash scripts/gpu-llama.sh park", carry=["gpu-llama/a"])
#   parks part 0 and the binaries under /root/llama (kept while the machine stays warm).
# Device, call 2 (right after):  run(command="bash scripts/gpu-llama.sh run", carry=["gpu-llama/b"])
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
  cargo build --release --features cuda,llama --example llama --example llama_bench
  rm -rf gpu-llama/a gpu-llama/b /tmp/gpu-llama-bin && mkdir -p gpu-llama/a gpu-llama/b /tmp/gpu-llama-bin
  cp "${CARGO_TARGET_DIR:-target}"/release/examples/{llama,llama_bench} /tmp/gpu-llama-bin/
  strip /tmp/gpu-llama-bin/llama /tmp/gpu-llama-bin/llama_bench
  cp ../shared/device/cuda-libs.sh /tmp/gpu-llama-bin/
  tar -C /tmp/gpu-llama-bin -cf - . | xz -9 -T0 > gpu-llama/a/bin.tar.xz
  (cd "$(dirname "$MODEL")" && sha256sum "$(basename "$MODEL")") > gpu-llama/b/model.sha256
  # Two parts: the first beside the binaries within 64 MiB, the rest alone.
  head -c 36000000 "$MODEL" > gpu-llama/a/part.00
  tail -c +36000001 "$MODEL" > gpu-llama/b/part.01
  du -sh gpu-llama/a gpu-llama/b
  exit 0
fi

if [ "$what" = park ]; then
  mkdir -p "$PARK"
  cp gpu-llama/a/part.00 gpu-llama/a/bin.tar.xz "$PARK"/ && ls -la "$PARK"
  exit $?
fi

OUT=${OUT:-/tmp/candle-flash-out}
mkdir -p "$OUT"
if [ ! -f "$PARK/part.00" ]; then
  echo "part 0 is not parked (the machine was replaced): run 'park' again, then 'run' right after"
  exit 3
fi
mkdir -p models bin
cat "$PARK/part.00" gpu-llama/b/part.01 > "$MODEL"
(cd models && sha256sum -c ../gpu-llama/b/model.sha256) || exit 4
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
