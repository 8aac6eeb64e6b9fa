#!/usr/bin/env bash
# Device side: the shapes only the SIMT kernels run (kernels/simt/: head dims past 256, MLA's
# (576, 512) decode, v a tensor of its own here) against PyTorch SDPA's backends that take them,
# in one run (for d > 256 PyTorch 2.11 has no fused backend: its unfused math backend is what a
# user gets), and MLA's (192, 128)
# zero-padded onto the tensor-core kernels against the same call on the SIMT kernels
# (CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0). A table last. Usage: bash scripts/gpu-bench-wide.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-prelude.sh
dtype=${DTYPE:-bf16}
jsonl="$OUT/wide.jsonl"
: > "$jsonl"
run() {  # run TAG ARGS...: ours, then every SDPA backend, on the same points
  local tag=$1
  shift
  gpu-bin/bench --device cuda --impl flash "$@" --dtype "$dtype" --iters 5 2>>"$OUT/bench.err" | grep '^{' |
    sed "s/^{/{\"tag\": \"$tag\", /" >> "$jsonl"
  python3 bench/sdpa.py --impl "${TORCH_IMPLS:-torch-flash,torch-cudnn,torch-efficient,torch-math}" "$@" --dtype "$dtype" --iters 5 2>>"$OUT/bench.err" |
    sed "s/^{/{\"tag\": \"$tag\", /" >> "$jsonl"
}
# Gemma-3-like D = 512 prefill: 8 heads, 2 KV heads.
run d512 --mode fwd,bwd --hdim 512 --heads 8 --hkv 2 --batch 1 --seqlens 1024,4096 --causal both
# MLA decode (absorbed): 16 query heads over one 576-wide latent head, v 512 wide.
run mla-decode --mode fwd --nq 1 --hdim 576 --dv 512 --heads 16 --hkv 1 --batch 1,16 --seqlens 4096,32768 --causal false
# MLA prefill shape (192, 128): padded tensor-core kernels vs the SIMT kernels' narrow shape.
run mla-192 --mode fwd,bwd --hdim 192 --dv 128 --heads 16 --batch 1 --seqlens 4096 --causal false
CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0 gpu-bin/bench --device cuda --impl flash --mode fwd,bwd --hdim 192 --dv 128 --heads 16 \
  --batch 1 --seqlens 4096 --causal false --dtype "$dtype" --iters 5 2>>"$OUT/bench.err" | grep '^{' |
  sed 's/^{/{"tag": "mla-192-simt", /' >> "$jsonl"
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)
torchv=$(python3 -c 'import torch; print(torch.__version__, "cuDNN", torch.backends.cudnn.version())')
echo "== $gpu, torch $torchv, $dtype"
python3 - "$jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("| shape | impl | mode | causal | b | nk | ms | TFLOP/s | K/V TB/s |")
print("|---|---|---|---|---|---|---|---|---|")
seen = set()
for r in rows:
    if "error" in r:  # once per shape and backend
        if (r["tag"], r["impl"]) not in seen:
            seen.add((r["tag"], r["impl"]))
            print(f"| {r['tag']} | {r['impl']} | | | | | {r['error'][:60]} | | |")
        continue
    print(f"| {r['tag']} | {r['impl']} | {r['mode']} | {r['causal']} | {r['b']} | {r['nk']} | {r['ms']:.3f} | "
          f"{r['tflops']:.1f} | {r.get('kv_tbps', 0):.2f} |")
PY
