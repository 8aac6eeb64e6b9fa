#!/usr/bin/env bash
# Device side: the shapes of heads past 256 columns against PyTorch SDPA's backends that take
# them, in one run (for d > 256 PyTorch 2.11 has no fused backend: its unfused math backend is
# what a user gets): D = 512 prefill, MLA's absorbed (576, 512) decode and D = 512 decode (the
# forwards on the wide-head kernel, kernels/sm80/fwd_wide_split.cu; v a view of the latent cache,
# contiguous and paged; the same calls on the SIMT kernels with CANDLE_FLASH_DISABLE_WIDE_SPLIT=1;
# the backward on the SIMT kernels), and MLA's (192, 128) zero-padded onto the tensor-core
# kernels against the same call on the SIMT kernels (CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0). A table
# last. Usage: bash scripts/gpu-bench-wide.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-prelude.sh
dtype=${DTYPE:-bf16}
jsonl="$OUT/wide.jsonl"
: > "$jsonl"
ours() {  # ours TAG ARGS...: examples/bench.rs on these points (ENV=... before the call sets its env)
  local tag=$1
  shift
  gpu-bin/bench --device cuda --impl flash "$@" --dtype "$dtype" --iters "${ITERS:-5}" 2>>"$OUT/bench.err" | grep '^{' |
    sed "s/^{/{\"tag\": \"$tag\", /" >> "$jsonl"
}
torch() {  # torch TAG ARGS...: every SDPA backend on the same points
  local tag=$1
  shift
  python3 bench/sdpa.py --impl "${TORCH_IMPLS:-torch-flash,torch-cudnn,torch-efficient,torch-math}" "$@" --dtype "$dtype" \
    --iters "${ITERS:-5}" 2>>"$OUT/bench.err" | sed "s/^{/{\"tag\": \"$tag\", /" >> "$jsonl"
}
run() { ours "$@"; torch "$@"; }
# Gemma-4-like D = 512 prefill, B·N = 16k tokens, hidden 4096 (8 heads, 2 KV heads): the forward
# on the wide-head kernel, the backward on the SIMT kernels; the forward on the SIMT kernels too.
run d512 --mode fwd --hdim 512 --heads 8 --hkv 2 --tokens 16384 --seqlens 4096,16384 --causal both
run d512 --mode bwd --hdim 512 --heads 8 --hkv 2 --tokens 16384 --seqlens 4096 --causal both
CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 ITERS=2 ours d512-simt --mode fwd --hdim 512 --heads 8 --hkv 2 --tokens 16384 \
  --seqlens 4096 --causal false
# MLA decode (absorbed): 16 / 128 query heads over one 576-wide latent head, v its first 512 columns.
mla=(--mode fwd --nq 1 --hdim 576 --dv 512 --hkv 1 --causal false)
for b in 16 64; do
  ours mla-decode-paged "${mla[@]}" --heads 16,128 --batch $b --seqlens 4096,32768 --v-view --page-size 64
  ours mla-decode "${mla[@]}" --heads 16,128 --batch $b --seqlens 4096,32768 --v-view
  TORCH_IMPLS=torch-math torch mla-decode "${mla[@]}" --heads 16,128 --batch $b --seqlens 4096,32768
done
CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 ITERS=2 ours mla-decode-simt "${mla[@]}" --heads 16 --batch 16 --seqlens 32768 --v-view
# D = 512 decode (Gemma 4's global layers: 16 query / 4 KV heads here), v a tensor of its own.
dec=(--mode fwd --nq 1 --hdim 512 --heads 16 --hkv 4 --causal false --batch 16 --seqlens 4096,32768)
ours d512-decode "${dec[@]}"
TORCH_IMPLS=torch-math torch d512-decode "${dec[@]}"
CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 ITERS=2 ours d512-decode-simt "${dec[@]}"
# MLA prefill shape (192, 128): padded tensor-core kernels vs the SIMT kernels' narrow shape.
run mla-192 --mode fwd,bwd --hdim 192 --dv 128 --heads 16 --batch 1 --seqlens 4096 --causal false
CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0 ours mla-192-simt --mode fwd,bwd --hdim 192 --dv 128 --heads 16 --batch 1 \
  --seqlens 4096 --causal false
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)
torchv=$(python3 -c 'import torch; print(torch.__version__, "cuDNN", torch.backends.cudnn.version())')
echo "== $gpu, torch $torchv, $dtype"
python3 - "$jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("| shape | impl | mode | causal | b | h | nk | ms | TFLOP/s | K/V TB/s |")
print("|---|---|---|---|---|---|---|---|---|---|")
seen = set()
for r in rows:
    if "error" in r:  # once per shape and backend
        if (r["tag"], r["impl"]) not in seen:
            seen.add((r["tag"], r["impl"]))
            print(f"| {r['tag']} | {r['impl']} | | | | | | {r['error'][:60]} | | |")
        continue
    print(f"| {r['tag']} | {r['impl']} | {r['mode']} | {r['causal']} | {r['b']} | {r['h']} | {r['nk']} | {r['ms']:.3f} | "
          f"{r['tflops']:.1f} | {r.get('kv_tbps', 0):.2f} |")
PY
